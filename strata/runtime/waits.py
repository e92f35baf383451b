"""Bounded waits: every wait on the GPU, a copy or a worker has a deadline and a stage name.

The engine records what it is doing (`progress.stage`, layer, chunk, position) as it goes; a wait
that runs past its deadline raises StallError with that context and what was awaited. The
server's watchdog reads the same progress record.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from strata import env

DEFAULT_TIMEOUT_S = env.wait_timeout_s()
# (kept here, not in kernels/tuning.py: the runtime sits below the kernels) a wait polls its
# event this long before it sleeps (a decode step waits ~50 times a token, mostly for less),
# then sleeps at most WAIT_SLEEP_MAX_US at a time: with a 1 ms cap a 2.8 ms wait (the H200's
# all-resident decode step, which the server's one sampling wait a step spans) could end up to
# 0.75 ms late (the back-off's arithmetic, not timed; bench: none)
WAIT_SPIN_US = 2000
WAIT_SLEEP_MAX_US = 250


@dataclass
class Progress:
    stage: str = "idle"
    layer: int = -1
    chunk: int = -1
    position: int = 0
    steps: int = 0  # increases with every finished forward pass
    last_wait: str = ""
    updated: float = 0.0

    def at(self, stage: str, layer: int = -1, chunk: int | None = None,
           position: int | None = None) -> None:
        self.stage, self.layer = stage, layer
        if chunk is not None:
            self.chunk = chunk
        if position is not None:
            self.position = position
        self.updated = time.monotonic()

    def describe(self) -> str:
        where = f"stage {self.stage!r}"
        if self.layer >= 0:
            where += f", layer {self.layer}"
        if self.chunk >= 0:
            where += f", prompt chunk {self.chunk}"
        return where + f", position {self.position}"


PROGRESS = Progress()  # one engine per process


class StallError(RuntimeError):
    """A bounded wait ran past its deadline."""


def wait_event(event: torch.cuda.Event, what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait for a CUDA event without blocking inside the driver, up to timeout_s."""
    PROGRESS.last_wait = what
    start = time.monotonic()
    deadline, spin_until = start + timeout_s, start + WAIT_SPIN_US * 1e-6
    delay = 50e-6
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            raise StallError(f"waited {timeout_s:.0f} s for {what} ({PROGRESS.describe()}); "
                             "the GPU never signalled it")
        if now > spin_until:  # spin first (a sleep costs ~60 us), then back off to the cap
            time.sleep(delay)
            delay = min(delay * 2, WAIT_SLEEP_MAX_US * 1e-6)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device` without a host sync: through pinned memory, whose block
    the caching host allocator keeps until the copy has run. (Itself on the CPU.)"""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def to_host(t: torch.Tensor, what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.Tensor:
    """Copy a small device tensor to the host with a bounded wait (a plain .cpu() could block
    forever inside the driver)."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(t.device))
    wait_event(ev, what, timeout_s)
    return out
