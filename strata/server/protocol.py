"""Messages between the server process and the engine process (pickled over two pipes).

Server -> engine: Submit, Cancel, Shutdown.
Engine -> server: Progress while loading and at every step (and every layer, at most once a
second), then Loaded or LoadFailed; per request Accepted, Delta..., then Finished or Failed;
StepDone after each forward pass; Stalled when a bounded wait inside the engine ran out. Every
other message counts as progress for the watchdog. A step's messages after its Progress come in
one list (worker.Outbox), in order.

This module imports nothing heavy: the server process never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.kernels.tuning import PREFILL_WHILE_DECODING


@dataclass(frozen=True)
class Submit:
    rid: str
    messages: list[dict[str, Any]] | None  # chat: rendered with the model's chat template
    prompt: str | list[int] | None  # completions: text or token ids
    sampling: dict[str, Any]  # SamplingParams fields except max_tokens
    max_tokens: int | None  # None: the server's limit, cut to what the context has room for
    max_tokens_limit: int
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # generate through stop tokens (benchmarks, tests)
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    where: str = ""  # the request field the prompt came from ("messages" once rendered here)
    keep_special: bool = False  # text with control tokens (a call format that uses them)
    prefix: str = ""  # written after the rendered messages: the start of a call tool_choice forces
    grammar: str | None = None  # response_format: the grammar every sampled token must follow


@dataclass(frozen=True)
class Cancel:
    rid: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class Progress:
    """stage: "loading", "prompt", "decode" or "idle"; detail: one line for logs and reports.

    state: what a stall report needs: requests [(rid, position, decode_step)], layer, kv_bytes,
    gpu memory, expert cache / pool state where the engine has them."""

    stage: str
    detail: str
    fraction: float | None = None
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Loaded:
    model_path: str
    context_length: int
    n_vocab: int
    device: str
    load_s: float
    info: dict[str, Any] = field(default_factory=dict)  # executor, expert cache, memory


@dataclass(frozen=True)
class LoadFailed:
    message: str  # a StrataError's one line: the file or setting is wrong, restarting won't help


@dataclass(frozen=True)
class Accepted:
    rid: str
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Delta:
    rid: str
    text: str
    completion_tokens: int


@dataclass(frozen=True)
class Finished:
    rid: str
    finish_reason: str  # "stop", "length" or "cancelled"
    prompt_tokens: int
    completion_tokens: int
    text: str = ""  # what the stop-string hold-back released at the end
    cached_tokens: int = 0  # prompt tokens whose KV rows came from the prefix cache


@dataclass(frozen=True)
class Failed:
    rid: str
    status: int
    message: str
    param: str | None = None
    code: str | None = None


@dataclass(frozen=True)
class Stalled:
    """The engine gave up a bounded wait (runtime/waits.py): a stall, reported at once."""

    message: str
    state: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class StepDone:
    prompt_tokens: int  # prompt tokens this forward pass processed
    decode_tokens: int  # sequences that decoded one token
    seconds: float
    active: int
    cache_hit_rate: float | None = None  # None while the engine has no expert cache
    drafted: int = 0  # the step's verify windows' drafted tokens (--spec), 0 without one
    accepted: int = 0  # of them, accepted
    # each window's (drafted, accepted): several where a batch's windows ran in one forward;
    # empty with one window (drafted, accepted) or none
    windows: tuple[tuple[int, int], ...] = ()

    def each_window(self) -> tuple[tuple[int, int], ...]:
        """(drafted, accepted) of each of the step's verify windows."""
        return self.windows or (((self.drafted, self.accepted),) if self.drafted else ())


@dataclass(frozen=True)
class EngineOptions:
    """What the supervisor hands a new engine process."""

    model: str | None  # None: the built-in demo model
    engine: Any  # strata.config.EngineConfig (device, offload, expert cache, ...)
    max_batch: int
    stacks_path: str  # faulthandler writes every thread's stack here on SIGUSR1
    fault: Any = None  # faults.FaultPlan: the faults armed in this start
    start: int = 1
    prefix_cache_bytes: int = 0  # host bytes of finished requests' KV rows kept for reuse
    warmup: bool = True  # run the first passes at load (strata.server.warmup)
    # the most prompt tokens a step takes while others decode (--prompt-while-decoding)
    prompt_while_decoding: int = PREFILL_WHILE_DECODING
