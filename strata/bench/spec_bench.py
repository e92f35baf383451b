"""strata bench-spec: decode through verify windows timed against plain decode on one engine,
with drafts whose acceptance the run fixes.

A random model's acceptance of any real drafter means nothing, so the drafts replay the
model's own greedy answer (ForcedDrafter): each window's first `accept` drafts are the tokens
plain greedy decode gave, the rest are wrong, and the verifier is told to accept exactly those
(SpecDecoder.forced): a window's work is then a real acceptance's (the forward of its T+1
tokens, the rollback of the rest), and the count holds even after a near-tie flipped by a
window's rounding has moved the windows' answer off the replayed one. One run of a test:

    prompt   the same random tokens (seeded), run into a fresh KV cache (untimed)
    plain    gen_len greedy decode steps (the decode step, its CUDA graphs where built): the
             answer, and the baseline's seconds
    windows  the same answer again through SpecDecoder.step (--spec T windows, adaptive as in
             use: a window that accepts nothing shrinks, low acceptance turns windows off for a
             while), drafts from ForcedDrafter; timed from the first decode step to the last token.
             Each run starts as a fresh decoder (SpecDecoder.reset(costs=True)): what an earlier
             run learnt of the windows' cost would start this one's windows off (as a server's
             later requests do), and the runs would time plain decode

The two answers are compared: greedy is exact under windows where a window's arithmetic agrees
with a single token's (docs/spec.md); elsewhere (CUDA's fused kernels round a window's tokens
otherwise than a decode step's) a random model's near-ties may flip: the result says from which
token the answers differ (the forced acceptance keeps the timed count either way). Decode is
greedy in both, so both read the experts a random model's looping greedy output routes to (the
cache flattered alike).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from strata.bench.runner import ExpertCounters
from strata.engine.generator import Engine
from strata.engine.sampling import SamplingParams
from strata.errors import StrataError


class ForcedDrafter:
    """Replays the target's greedy answer: a window's first `accept` drafts right, the rest
    wrong (the right token + 1), so every full window accepts exactly `accept`."""

    name = "forced"
    from_context = True

    def __init__(self, prompt_len: int, answer: list[int], accept: int, n_vocab: int):
        self.prompt_len, self.answer, self.accept, self.n_vocab = (prompt_len, answer, accept,
                                                                   n_vocab)

    def propose(self, context: list[int], n: int) -> list[int]:
        at = len(context) - self.prompt_len  # the answer's next position
        return [t if i < self.accept else (t + 1) % self.n_vocab
                for i, t in enumerate(self.answer[at:at + n])]


@dataclass
class SpecResult:
    window: int  # --spec T
    accept: int  # drafts each window accepts (ForcedDrafter)
    prompt_len: int
    gen_len: int
    runs: int
    plain_tok_s: float  # medians of the runs
    spec_tok_s: float
    plain_tok_s_all: list[float]
    spec_tok_s_all: list[float]
    windows: int  # of the last run
    drafted: int
    accepted: int
    plain_steps: int  # decode steps without a window in the last spec run
    same_until: int  # tokens of the windows' answer equal to plain decode's (gen_len: all)
    # with experts offloaded, the last run's expert work per decoded token, {"plain": ...,
    # "windows": ...} (ExpertCounters.per_token): what the windows' union of experts costs
    traffic: dict | None = None

    @property
    def ratio(self) -> float:
        return self.spec_tok_s / self.plain_tok_s

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def to_dict(self) -> dict:
        return asdict(self) | {"ratio": self.ratio, "acceptance": self.acceptance}


def _sync(engine: Engine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def _expert_stats(engine: Engine) -> object | None:
    """The offloaded experts' counters (OffloadStats), None with every expert resident."""
    return getattr(getattr(engine.model, "experts", None), "stats", None)


class _Decode:
    """One timed decode after an untimed prompt: the seconds from the first decode step to the
    last token, and (counted=True, experts offloaded) the experts' work per decoded token."""

    def __init__(self, engine: Engine, prompt: list[int], n: int, counted: bool):
        self.engine, self.prompt, self.n = engine, prompt, n
        self.stats = _expert_stats(engine) if counted else None
        self.per_token: dict | None = None

    def start(self) -> list[int]:
        """A fresh KV cache with the prompt in it -> [the first answer token]."""
        kv = self.kv = self.engine.model.new_cache(len(self.prompt) + self.n + 1)
        logits = self.engine.run_prompt(self.prompt, kv)[0]
        _sync(self.engine)
        self.before = ExpertCounters.of(self.stats) if self.stats is not None else None
        self.t0 = time.perf_counter()
        return [int(torch.argmax(logits))]

    def stop(self) -> float:
        _sync(self.engine)
        seconds = time.perf_counter() - self.t0
        if self.before is not None:
            c = ExpertCounters(len(self.before.hits))
            c.add(ExpertCounters.of(self.stats), self.before)
            self.per_token = c.per_token(self.n - 1)
        return seconds


def _plain(run: _Decode) -> tuple[list[int], float]:
    """n greedy decode steps after the prompt -> (the answer, decode seconds)."""
    out = run.start()
    while len(out) < run.n:
        out.append(int(torch.argmax(run.engine.model.decode(out[-1], run.kv)[0])))
    return out, run.stop()


def _windows(run: _Decode) -> tuple[list[int], float]:
    """The same answer through the engine's SpecDecoder -> (the answer, decode seconds)."""
    spec, n = run.engine.spec, run.n
    spec.reset(costs=True)  # (each run as a fresh decoder's: not the windows an earlier run paused)
    greedy = SamplingParams(temperature=0.0, max_tokens=n)
    out = run.start()
    while len(out) < n:
        out += spec.step(list(run.prompt) + out, run.kv, greedy, None, n - len(out))
    return out[:n], run.stop()


def run_spec_bench(engine: Engine, prompt_len: int, gen_len: int, accepts: list[int],
                   runs: int = 3, seed: int = 0) -> list[SpecResult]:
    """Per `accept` of `accepts`: a warm-up and `runs` measured runs of plain decode and of
    windows (engine.spec: an engine loaded with --spec T), medians of their decode tok/s."""
    spec = engine.spec
    if spec is None:
        raise StrataError("bench-spec needs an engine loaded with --spec T")
    if gen_len < 2 or prompt_len < 1:
        raise StrataError("bench-spec: give -p >= 1 and -n >= 2")
    bad = [a for a in accepts if not 0 <= a <= spec.limit]
    if bad:
        raise StrataError(f"--accept {bad[0]}: give 0 .. --spec {spec.limit} drafts a window")
    vocab = engine.config.n_vocab
    prompt = np.random.default_rng(seed).integers(0, vocab, prompt_len).tolist()
    answer, _ = _plain(_Decode(engine, prompt, gen_len, False))  # (also a warm-up)
    out = []
    for accept in accepts:
        spec.drafter = ForcedDrafter(prompt_len, answer, accept, vocab)
        spec.forced = accept
        plain, windows, same = [], [], gen_len
        for r in range(runs + 1):  # (run 0: the warm-up, not counted)
            a, b = (_Decode(engine, prompt, gen_len, r == runs) for _ in range(2))
            got, plain_s = _plain(a)
            ours, spec_s = _windows(b)
            if got != answer:
                raise StrataError(f"bench-spec: plain greedy decode gave another answer on a "
                                  f"later run (from token {_first_diff(got, answer)}): this "
                                  "configuration's decode is not deterministic")
            same = min(same, _first_diff(ours, answer))
            if r:
                plain.append((gen_len - 1) / plain_s)
                windows.append((gen_len - 1) / spec_s)
        st = spec.stats
        out.append(SpecResult(spec.limit, accept, prompt_len, gen_len, runs,
                              statistics.median(plain), statistics.median(windows), plain,
                              windows, st.windows, st.drafted, st.accepted, st.plain_steps,
                              same, a.per_token and {"plain": a.per_token,
                                                     "windows": b.per_token}))
    spec.forced = None
    return out


def _first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def markdown(results: list[SpecResult]) -> str:
    head = ("| --spec | drafts accepted a window | windows | acceptance | plain tok/s | "
            "windows tok/s | x plain | answer as plain |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [f"| {r.window} | {r.accept} | {r.windows} (+ {r.plain_steps} plain steps) | "
             f"{100 * r.acceptance:.1f}% | {r.plain_tok_s:.1f} | {r.spec_tok_s:.1f} | "
             f"{r.ratio:.2f} | "
             + ("yes |" if r.same_until == r.gen_len else f"to token {r.same_until} |")
             for r in results]
    out = "\n".join([head, *lines])
    counted = [r for r in results if r.traffic]
    if counted:  # the experts' work per decoded token, plain -> through windows
        out += ("\n\n| --spec | drafts accepted | hit rate | MB copied / token | "
                "CPU pairs / token | CPU pool ms / token |\n| --- | --- | --- | --- | --- | --- |")
        for r in counted:
            p, w = r.traffic["plain"], r.traffic["windows"]
            out += (f"\n| {r.window} | {r.accept} | {100 * p['hit_rate']:.1f}% -> "
                    f"{100 * w['hit_rate']:.1f}% | {p['h2d_mb']:.1f} -> {w['h2d_mb']:.1f} | "
                    f"{p['cpu_pairs']:.1f} -> {w['cpu_pairs']:.1f} | {p['cpu_ms']:.2f} -> "
                    f"{w['cpu_ms']:.2f} |")
    return out
