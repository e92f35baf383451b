"""The engine process: load the model, then serve Submit/Cancel messages with a BatchRunner.

Started by the supervisor (engine_process.py) with the spawn method; it owns torch and the model,
the server process does not. It reports progress on every stage (loading, each step, every layer
at most once a second) and writes every thread's stack to `stacks_path` on SIGUSR1, so that a
stalled engine can still be looked into. It exits when the server goes away or says Shutdown.
"""

from __future__ import annotations

import faulthandler
import inspect
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

from strata.errors import StrataError
from strata.logs import StderrHandler
from strata.server.faults import FaultTrigger
from strata.server.protocol import (
    EngineOptions,
    Loaded,
    LoadFailed,
    Progress,
    Shutdown,
    Stalled,
    Submit,
)

_HEARTBEAT_S = 1.0  # the most often a long forward pass reports which layer it is in
_stack_file: Any = None  # kept open for faulthandler for the life of the process


class Outbox:
    """Engine -> server messages; the engine ends when the server is gone.

    Inside `step()` the messages wait and go in one write, as a list, when the step ends (its
    Deltas, Finished and StepDone: one pickle, one pipe write and one wake of the server's
    loop, not one per sequence). Progress and Stalled go at once (with what waited before
    them): the watchdog and a stall report must see what the engine was doing when it stuck."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self.held: list[object] | None = None  # inside step(): the messages waiting

    def send(self, msg: object) -> None:
        if self.held is None:
            self._write(msg)
        elif isinstance(msg, (Progress, Stalled)):
            held, self.held = self.held, []
            self._write([*held, msg] if held else msg)
        else:
            self.held.append(msg)

    @contextmanager
    def step(self) -> Iterator[None]:
        self.held = []
        try:
            yield
        finally:
            held, self.held = self.held, None
            if held:
                self._write(held if len(held) > 1 else held[0])

    def _write(self, msg: object) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            sys.exit(0)


class LayerProgress:
    """Wraps the model's expert executor: a forward pass reports its layer now and then, so a long
    prompt on a big model is progress, not a stall. Everything else goes to the executor."""

    def __init__(self, inner: Any, n_layers: int, send: Any, runner: Any = None):
        self.inner, self.n_layers, self.send, self.runner = inner, n_layers, send, runner
        self.last = time.monotonic()

    def run(self, layer: int, *args: Any) -> Any:
        now = time.monotonic()
        if now - self.last >= _HEARTBEAT_S and self.runner is not None:
            self.last = now
            stage = self.runner.stage
            state = {**self.runner.state(), "layer": layer}
            self.send(Progress(stage, f"{stage}: layer {layer + 1} of {self.n_layers}",
                               state=state))
        return self.inner.run(layer, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def main(inbox: Connection, outbox: Connection, opts: EngineOptions) -> None:
    global _stack_file
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which stops us
    _setup_logging()
    if hasattr(signal, "SIGUSR1"):  # not on Windows: stall reports there come without stacks
        _stack_file = open(opts.stacks_path, "w")  # noqa: SIM115 (open for the process's life)
        faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)
    faulthandler.enable(file=sys.stderr)  # a fatal signal prints the stacks to the log
    out = Outbox(outbox)
    faults = FaultTrigger(opts.fault)
    out.send(Progress("loading", "starting the engine", 0.0))
    faults.at("load")
    from strata.server.batching import BatchRunner  # torch: after the load fault, which is fast

    try:
        engine = _load(opts, out)
    except StrataError as e:
        out.send(LoadFailed(str(e)))
        return
    runner = BatchRunner(engine, out.send, faults, opts.prefix_cache_bytes,
                         opts.prompt_while_decoding)
    if opts.warmup:  # (server.warmup's passes, or over the batch's KV pool where it has one)
        out.send(Progress("loading", "warming up: kernels and decode graphs", 0.95))
        logging.getLogger("strata").info("warm-up: kernels built and decode graphs captured in "
                                         f"{runner.warm_up():.1f} s")
    experts = engine.model.experts
    engine.model.experts = LayerProgress(experts, engine.config.n_layers, out.send, runner)
    cfg = engine.config
    out.send(Loaded(str(engine.path), cfg.context_length, cfg.n_vocab, opts.engine.device,
                    engine.load_s, executor_info(experts)))
    _serve(inbox, runner, out)


def _setup_logging() -> None:
    """The engine's own log lines (memory plan, arena, cache) go to the server's stderr."""
    handler = StderrHandler(f"strata engine {os.getpid()}: %(message)s")
    root = logging.getLogger("strata")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def executor_info(ex: Any) -> dict[str, Any]:
    """The expert executor, its cache and its CPU pool, in words, for /health and reports."""
    import torch

    info: dict[str, Any] = {"executor": type(ex).__name__, "expert_cache": None, "cpu_pool": None}
    cache = getattr(ex, "cache", None)
    if cache is not None:
        info["expert_cache"] = (f"{cache.capacity} slots, {cache.nbytes / 2**20:.0f} MiB on "
                                f"{cache.device}")
    pool = getattr(ex, "pool", None)
    if pool is not None:
        threads = torch.get_num_threads()
        info["cpu_pool"] = f"{getattr(pool, 'kind', '?')} kernels, {threads} threads"
    if torch.cuda.is_available() and getattr(ex, "device", None) is not None:
        info["gpu"] = torch.cuda.get_device_name()
    return info


def _load(opts: EngineOptions, out: Outbox) -> Any:
    from strata.engine.generator import Engine

    path = opts.model
    if path is None:
        from strata.demo import demo_model

        out.send(Progress("loading", "the built-in demo model", 0.0))
        path = str(demo_model())
    out.send(Progress("loading", f"loading {path} on {opts.engine.device}", 0.05))
    kwargs = {}
    if "progress" in inspect.signature(Engine.load).parameters:  # a per-stage hook, when present
        kwargs["progress"] = lambda what, frac: out.send(Progress("loading", what, frac))
    return Engine.load(path, config=opts.engine, **kwargs)


def _serve(inbox: Connection, runner: Any, out: Outbox) -> None:
    """Read every message that has arrived, then run one step; block (1 s at a time) when idle."""
    while True:
        timeout = 0.0 if runner.active else 1.0
        try:
            while inbox.poll(timeout):
                msg = inbox.recv()
                if isinstance(msg, Shutdown):
                    return
                if isinstance(msg, Submit):  # what a stall report says the engine was doing
                    out.send(Progress("request", f"tokenizing and checking {msg.rid}",
                                      state=runner.state()))
                runner.handle(msg)
                if isinstance(msg, Submit) and not runner.active:
                    out.send(Progress("idle", "no requests", state=runner.state()))
                timeout = 0.0
        except (EOFError, OSError):
            return  # the server is gone
        if runner.active:
            with out.step():
                runner.step()
            if not runner.active:
                out.send(Progress("idle", "no requests", state=runner.state()))
