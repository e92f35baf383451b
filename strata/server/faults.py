"""Fault injection for the watchdog and restart tests: `STRATA_FAULT`, read here and nowhere else.

    STRATA_FAULT=ACTION@STAGE[:N][*K][,ACTION@STAGE[:N][*K]...]

    ACTION  stall    stop making progress there: sleep forever, report nothing
            crash    exit there at once with os._exit(CRASH_EXIT_CODE), no cleanup
            timeout  raise the engine's StallError there, as a bounded wait that ran out does
                     (runtime/waits.py); prefill, decode and verify only
    STAGE   load     at the start of loading the model
            prefill  before the first forward pass that holds a request's prompt
            decode   before a request's Nth decode step (N >= 1, default 1); decode step 1 is
                     the first forward pass after the prompt's, so max_tokens must be > N
            verify   inside the engine's Nth verify window (--spec; N >= 1, default 1), before
                     its forward: timeout makes the window's GPU work never finish, so its
                     bounded wait runs out (after STRATA_WAIT_TIMEOUT) and names the window
    K       how many engine starts arm the fault (default 1)

The server process parses the variable once at startup (a bad value is a one-line error) and hands
each engine process the faults armed for it: engine starts 1..K arm a fault, later ones do not. An
engine fires at most one fault, once: the first armed one, in the order written, that matches. So
with the default K = 1 the first engine stalls or crashes once and the engine the supervisor starts
in its place serves the next request; `crash@load*5` makes the first five starts crash; and
`crash@decode:1,timeout@decode:1*2` crashes the first engine and stalls the second.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from strata.errors import StrataError

ENV_VAR = "STRATA_FAULT"
CRASH_EXIT_CODE = 86
ACTIONS = ("stall", "crash", "timeout")
STAGES = ("load", "prefill", "decode", "verify")
_STEPPED = ("decode", "verify")  # the stages that take a step number
_SYNTAX = re.compile(r"(?P<action>\w+)@(?P<stage>\w+)(?::(?P<step>\d+))?(?:\*(?P<starts>\d+))?")


@dataclass(frozen=True)
class Fault:
    action: str
    stage: str
    step: int = 1  # decode only: the request's decode step it fires before
    starts: int = 1  # engine starts 1..starts are armed

    @classmethod
    def parse(cls, text: str) -> Fault:
        m = _SYNTAX.fullmatch(text.strip())
        why = None
        if not m:
            why = "expected ACTION@STAGE[:N][*K], e.g. stall@decode:3"
        elif m["action"] not in ACTIONS:
            why = f"unknown action {m['action']!r} (choose from {', '.join(ACTIONS)})"
        elif m["stage"] not in STAGES:
            why = f"unknown stage {m['stage']!r} (choose from {', '.join(STAGES)})"
        elif m["action"] == "timeout" and m["stage"] == "load":
            why = "timeout fires in a forward pass: use it at prefill or decode"
        elif m["step"] is not None and m["stage"] not in _STEPPED:
            why = "only decode and verify take a step number (:N)"
        elif m["step"] is not None and int(m["step"]) < 1:
            why = "decode steps count from 1"
        elif m["starts"] is not None and int(m["starts"]) < 1:
            why = "*K must be at least 1"
        if why:
            raise StrataError(f"{ENV_VAR}={text}: {why}")
        return cls(m["action"], m["stage"], int(m["step"] or 1), int(m["starts"] or 1))

    def armed_for(self, start: int) -> bool:
        """Whether engine start number `start` (1 = the first) carries this fault."""
        return start <= self.starts

    def __str__(self) -> str:
        step = f":{self.step}" if self.stage in _STEPPED else ""
        return f"{self.action}@{self.stage}{step}*{self.starts}"


@dataclass(frozen=True)
class FaultPlan:
    """The faults of STRATA_FAULT, in the order written."""

    faults: tuple[Fault, ...]

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        return cls(tuple(Fault.parse(part) for part in text.split(",")))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultPlan | None:
        text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        return cls.parse(text) if text else None

    def armed_for(self, start: int) -> FaultPlan | None:
        """The faults engine start number `start` (1 = the first) carries, if any."""
        armed = tuple(f for f in self.faults if f.armed_for(start))
        return FaultPlan(armed) if armed else None

    def __str__(self) -> str:
        return ",".join(str(f) for f in self.faults)


class FaultTrigger:
    """The engine side: fires the first armed fault that matches, once."""

    def __init__(self, plan: FaultPlan | None):
        self.faults = plan.faults if plan is not None else ()
        self.fired = False

    def at(self, stage: str, step: int = 0, window: object = None) -> None:
        """Called at every injection point; `step` is a decode step or verify window number
        (1, 2, ...); window: the verify window's LayerMarks (strata.engine.spec)."""
        if self.fired:
            return
        for f in self.faults:
            if f.stage == stage and (stage not in _STEPPED or step == f.step):
                self.fired = True
                if f.action == "timeout" and window is not None:
                    window.never_finish()
                    return
                self._fire(f)

    @staticmethod
    def _fire(f: Fault) -> None:
        if f.action == "crash":
            os._exit(CRASH_EXIT_CODE)
        if f.action == "timeout":
            from strata.runtime.waits import StallError  # torch: only in the engine process

            raise StallError(f"STRATA_FAULT {f}: an injected wait timeout (a real one names "
                             "what it waited for, and where)")
        while True:  # stall: no progress, no messages, until the supervisor stops the process
            time.sleep(3600)
