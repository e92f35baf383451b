"""`GET /metrics`: Prometheus text format, written by hand (a dozen series need no library).

strata_spec_*: verify windows (--spec): drafted and accepted tokens, the acceptance by position in
the window, and the decode rate of steps with windows and of plain ones (a batch's windows run
in one step: each counts as a window).

strata_expert_cache_hit_rate is 0 while the engine has no expert cache (the reference executor,
--offload off, has none); with the offload runtime it is the executor's stats.hit_rate.
"""

from __future__ import annotations

from collections import Counter

from strata.server.protocol import StepDone

_EMA = 0.2  # weight of the newest step in the tokens-per-second gauges


class Metrics:
    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.cancelled = 0
        self.forward_passes = 0
        self.forward_seconds = 0.0
        self.prompt_tok_s = 0.0
        self.decode_tok_s = 0.0
        self.cache_hit_rate: float | None = None
        self.stalls = 0
        self.crashes = 0
        self.spec_windows = 0
        self.spec_drafted_at: list[int] = []  # by position in the window
        self.spec_accepted_at: list[int] = []
        self.spec_tok_s = {"window": 0.0, "plain": 0.0}

    def request(self, endpoint: str, status: int) -> None:
        self.requests[(endpoint, status)] += 1

    def tokens(self, prompt: int, completion: int, cached: int = 0) -> None:
        self.prompt_tokens += prompt
        self.completion_tokens += completion
        self.cached_tokens += cached

    def step(self, s: StepDone) -> None:
        self.forward_passes += 1
        self.forward_seconds += s.seconds
        if s.seconds > 0:  # a step with a prompt in it counts as prompt processing
            if s.prompt_tokens:
                self.prompt_tok_s = _ema(self.prompt_tok_s, s.prompt_tokens / s.seconds)
            elif s.decode_tokens:
                self.decode_tok_s = _ema(self.decode_tok_s, s.decode_tokens / s.seconds)
                kind = "window" if s.drafted else "plain"
                self.spec_tok_s[kind] = _ema(self.spec_tok_s[kind], s.decode_tokens / s.seconds)
        for drafted, accepted in s.each_window():
            self.spec_windows += 1
            grow = drafted - len(self.spec_drafted_at)
            self.spec_drafted_at += [0] * max(grow, 0)
            self.spec_accepted_at += [0] * max(grow, 0)
            for i in range(drafted):
                self.spec_drafted_at[i] += 1
                self.spec_accepted_at[i] += i < accepted
        if s.cache_hit_rate is not None:
            self.cache_hit_rate = s.cache_hit_rate

    def render(self, *, running: int, queued: int, loaded: bool, restarts: int) -> str:
        out: list[str] = []

        def series(name: str, kind: str, help_text: str, values: list[tuple[str, float]]) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")
            for labels, value in values:
                out.append(f"{name}{labels} {value:g}")

        series("strata_requests_total", "counter", "generation requests by endpoint and status",
               [(f'{{endpoint="{e}",status="{s}"}}', n)
                for (e, s), n in sorted(self.requests.items())])
        series("strata_requests_cancelled_total", "counter",
               "requests whose client went away before the end", [("", self.cancelled)])
        series("strata_prompt_tokens_total", "counter", "prompt tokens of finished requests",
               [("", self.prompt_tokens)])
        series("strata_prompt_tokens_cached_total", "counter",
               "prompt tokens whose keys and values came from the prefix cache",
               [("", self.cached_tokens)])
        series("strata_completion_tokens_total", "counter", "tokens generated",
               [("", self.completion_tokens)])
        series("strata_prompt_tokens_per_second", "gauge",
               "prompt processing rate, recent forward passes", [("", self.prompt_tok_s)])
        series("strata_decode_tokens_per_second", "gauge",
               "decode rate summed over the batch, recent forward passes",
               [("", self.decode_tok_s)])
        series("strata_forward_passes_total", "counter", "engine forward passes (steps)",
               [("", self.forward_passes)])
        series("strata_forward_seconds_total", "counter", "time spent in forward passes",
               [("", self.forward_seconds)])
        series("strata_requests_running", "gauge", "requests in the engine's batch",
               [("", running)])
        series("strata_queue_depth", "gauge", "requests waiting for a batch slot", [("", queued)])
        series("strata_expert_cache_hit_rate", "gauge",
               "expert cache hit rate; 0 while the engine has no expert cache",
               [("", self.cache_hit_rate or 0.0)])
        series("strata_spec_windows_total", "counter", "verify windows run (--spec)",
               [("", self.spec_windows)])
        series("strata_spec_drafted_tokens_total", "counter", "tokens drafted into verify windows",
               [("", sum(self.spec_drafted_at))])
        series("strata_spec_accepted_tokens_total", "counter", "drafted tokens accepted",
               [("", sum(self.spec_accepted_at))])
        series("strata_spec_acceptance", "gauge",
               "drafted tokens accepted, by position in the window (0: the first draft)",
               [(f'{{position="{i}"}}', a / d) for i, (a, d) in
                enumerate(zip(self.spec_accepted_at, self.spec_drafted_at, strict=True))])
        series("strata_spec_decode_tokens_per_second", "gauge",
               "decode rate summed over the batch, recent steps with verify windows and "
               "without",
               [(f'{{step="{k}"}}', v) for k, v in self.spec_tok_s.items()])
        series("strata_engine_loaded", "gauge", "1 when the engine has a model loaded",
               [("", int(loaded))])
        series("strata_engine_restarts_total", "counter", "engine processes started again",
               [("", restarts)])
        series("strata_engine_stalls_total", "counter", "watchdog stalls (reports written)",
               [("", self.stalls)])
        series("strata_engine_crashes_total", "counter", "engine processes that died",
               [("", self.crashes)])
        return "\n".join(out) + "\n"


def _ema(old: float, new: float) -> float:
    return old + _EMA * (new - old) if old else new
