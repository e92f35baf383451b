"""Fault injection for the watchdog and restart tests: `STRATA_FAULT`, read here and nowhere else.

    STRATA_FAULT=ACTION@STAGE[:N][*K]

    ACTION  stall   stop making progress there: sleep forever, report nothing
            crash   exit there at once with os._exit(CRASH_EXIT_CODE), no cleanup
    STAGE   load     at the start of loading the model
            prefill  before the first forward pass that holds a request's prompt
            decode   before a request's Nth decode step (N >= 1, default 1); decode step 1 is
                     the first forward pass after the prompt's, so max_tokens must be > N
    K       how many engine starts arm the fault (default 1)

The server process parses the variable once at startup (a bad value is a one-line error) and hands
the fault to the engine processes it starts: engine starts 1..K are armed, later ones are not. An
armed engine fires it at most once, at the first point that matches. So with the default K = 1 the
first engine stalls or crashes once, and the engine the supervisor starts in its place serves the
next request. `crash@load*5` makes the first five starts crash, for the give-up path.
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
ACTIONS = ("stall", "crash")
STAGES = ("load", "prefill", "decode")
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
        elif m["step"] is not None and m["stage"] != "decode":
            why = "only decode takes a step number (:N)"
        elif m["step"] is not None and int(m["step"]) < 1:
            why = "decode steps count from 1"
        elif m["starts"] is not None and int(m["starts"]) < 1:
            why = "*K must be at least 1"
        if why:
            raise StrataError(f"{ENV_VAR}={text}: {why}")
        return cls(m["action"], m["stage"], int(m["step"] or 1), int(m["starts"] or 1))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Fault | None:
        text = (os.environ if environ is None else environ).get(ENV_VAR, "").strip()
        return cls.parse(text) if text else None

    def armed_for(self, start: int) -> bool:
        """Whether engine start number `start` (1 = the first) carries this fault."""
        return start <= self.starts

    def __str__(self) -> str:
        step = f":{self.step}" if self.stage == "decode" else ""
        return f"{self.action}@{self.stage}{step}*{self.starts}"


class FaultTrigger:
    """The engine side: fires an armed fault once, at the first matching point."""

    def __init__(self, fault: Fault | None):
        self.fault = fault
        self.fired = False

    def at(self, stage: str, step: int = 0) -> None:
        """Called at every injection point; `step` is a decode step number (1, 2, ...)."""
        f = self.fault
        if f is None or self.fired or f.stage != stage or (stage == "decode" and step != f.step):
            return
        self.fired = True
        if f.action == "crash":
            os._exit(CRASH_EXIT_CODE)
        while True:  # stall: no progress, no messages, until the supervisor stops the process
            time.sleep(3600)
