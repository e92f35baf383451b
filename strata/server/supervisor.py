"""The supervisor: starts the engine process, watches its progress, reports and restarts it.

    loading --Loaded--> ready --(no progress for --watchdog s while requests run)--> stall
       |                  |                                                          |
       |                  +--(process died)--> crash ------------------------------- +
       +--(over --load-timeout)--> stall            report, stop, requests get 503
                                                    more than --max-restarts failures within
                                                    --restart-window s? failed (stays up, /health
                                                    says why) : start the engine again

Everything here runs on the event loop; the blocking parts (the report, stopping the process)
run in worker threads, each with a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from strata.server import stall_report
from strata.server.config import ServeConfig
from strata.server.engine_process import EngineProcess
from strata.server.errors import APIError
from strata.server.faults import FaultPlan
from strata.server.metrics import Metrics
from strata.server.protocol import (
    EngineOptions,
    Finished,
    Loaded,
    LoadFailed,
    Progress,
    Stalled,
    StepDone,
)
from strata.server.scheduler import Scheduler

log = logging.getLogger("strata.serve")
_TICK_S = 0.25
_RESTART_DELAY_S = 0.5


def load_chat(model_path: str, seconds: float = 5.0) -> Any:
    """ChatTemplate of a model file (its first shard holds the metadata), `seconds` a render."""
    from strata.gguf import GGUFFile
    from strata.tokenizer import ChatTemplate, Tokenizer
    from strata.tokenizer.chat import TemplateLimits

    meta = GGUFFile(model_path).metadata
    tok = Tokenizer.from_metadata(meta, source=model_path)
    return ChatTemplate.from_metadata(meta, tok, source=model_path,
                                      limits=TemplateLimits(seconds=seconds))


class Supervisor:
    def __init__(self, cfg: ServeConfig, fault: FaultPlan | None, metrics: Metrics):
        self.cfg, self.fault, self.metrics = cfg, fault, metrics
        self.scheduler = Scheduler(cfg.batch, cfg.queue, self.send, self._work_started)
        self.engine: EngineProcess | None = None
        self.state = "starting"  # loading, ready, restarting, failed, stopped
        self.reason = ""  # why failed
        self.starts = 0
        self.restarts = 0
        self.failures: deque[float] = deque()
        self.last_stall: dict[str, Any] | None = None
        self.loaded: Loaded | None = None
        self.progress: Progress | None = None
        self.recent: deque[str] = deque(maxlen=20)
        self.last_progress = time.monotonic()
        self.began = time.monotonic()
        self.chat: Any = None  # strata.tokenizer.ChatTemplate, once the engine has loaded
        self._chat_loading: asyncio.Future | None = None  # its load, under way or done
        self.chat_path: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    # --- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._start_engine()
        self._spawn(self._watch())

    async def close(self) -> None:
        self.state = "stopped"
        for t in self._tasks:
            t.cancel()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.stop, True, 3.0)

    def _start_engine(self) -> None:
        self.starts += 1
        armed = self.fault.armed_for(self.starts) if self.fault else None
        opts = EngineOptions(self.cfg.model, self.cfg.engine_config(), self.cfg.batch,
                             EngineProcess.stacks_file(), armed, self.starts,
                             int(self.cfg.prefix_cache * (1 << 30)), bool(self.cfg.warmup),
                             self.cfg.prompt_while_decoding)
        self.loaded, self.progress = None, Progress("loading", "starting the engine process", 0.0)
        self.state, self.last_progress = "loading", time.monotonic()
        self.engine = EngineProcess(opts, self._from_thread(self._on_message),
                                    self._from_thread(self._on_exit))
        fault = f" (STRATA_FAULT {armed} armed)" if armed else ""
        log.info("starting the engine (pid %d, start #%d)%s", self.engine.pid, self.starts, fault)

    # --- what the server asks --------------------------------------------------------------
    def send(self, msg: object) -> None:
        if self.engine is not None:
            self.engine.send(msg)

    def check_ready(self) -> None:
        """Raise the 503 that explains why requests cannot run now."""
        if self.state == "ready":
            return
        if self.state == "failed":
            raise APIError(503, f"the engine is down: {self.reason}", code="engine_failed")
        what = "loading the model" if self.state == "loading" else "restarting the engine"
        raise APIError(503, f"the server is {what}; retry shortly", code="engine_unavailable",
                       retry_after=5)

    def health(self) -> dict[str, Any]:
        p = self.progress
        h: dict[str, Any] = {
            "status": {"ready": "ok"}.get(self.state, self.state),
            "model": self.cfg.served_name,
            "loaded": self.state == "ready",
            "engine_pid": self.engine.pid if self.engine and self.engine.alive else None,
            "uptime_s": round(time.monotonic() - self.began, 1),
            "restarts": self.restarts,
            "last_stall": self.last_stall,
            "running": len(self.scheduler.running),
            "queued": len(self.scheduler.waiting),
        }
        if self.state == "loading" and p is not None and self.engine is not None:
            h["load"] = {"stage": p.detail, "progress": p.fraction,
                         "elapsed_s": round(time.monotonic() - self.engine.started, 1)}
        if self.state == "failed":
            h["reason"] = self.reason
        if self.loaded is not None:
            h["context_length"] = self.loaded.context_length
            h["device"] = self.loaded.device
            h["engine"] = dict(self.loaded.info)  # executor, expert cache, CPU pool
        return h

    # --- engine events (on the loop) -------------------------------------------------------
    def _on_message(self, eng: EngineProcess, msg: object) -> None:
        if isinstance(msg, list):  # a step's messages, in one write (worker.Outbox)
            for m in msg:
                self._on_message(eng, m)
            return
        if eng is not self.engine or self.state not in ("loading", "ready"):
            return  # a stopped (or stopping) engine's last words
        self.last_progress = time.monotonic()
        if isinstance(msg, Progress):
            self.progress = msg
            self.recent.append(f"{time.strftime('%H:%M:%S')} {msg.stage}: {msg.detail}")
            if msg.stage == "loading":
                log.info("engine pid %d: %s", eng.pid, msg.detail)
        elif isinstance(msg, StepDone):
            self.metrics.step(msg)
        elif isinstance(msg, Loaded):
            self.loaded, self.state = msg, "ready"
            self.progress = Progress("idle", f"loaded in {msg.load_s:.1f} s, waiting for requests")
            self.recent.append(f"{time.strftime('%H:%M:%S')} loaded (engine pid {eng.pid})")
            log.info("engine pid %d: loaded %s on %s in %.1f s (context %d); serving as %r",
                     eng.pid, msg.model_path, msg.device, msg.load_s, msg.context_length,
                     self.cfg.served_name)
            self.scheduler.engine_ready()
            self._chat_loading = self._spawn(self._load_chat(msg.model_path))
        elif isinstance(msg, Stalled):
            p = self.progress or Progress("unknown", "")
            self.progress = Progress(p.stage, p.detail, p.fraction, msg.state)
            what = f"a bounded wait in the engine ran out: {msg.message}"
            self._spawn(self._recover("stall", what))
        elif isinstance(msg, LoadFailed):
            self._give_up(f"the model did not load: {msg.message}")
            self._spawn(asyncio.to_thread(eng.stop, False))
        else:
            if isinstance(msg, Finished):
                self.metrics.tokens(msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens)
                self.metrics.cancelled += msg.finish_reason == "cancelled"
            self.scheduler.on_message(msg)

    async def loaded_chat(self) -> Any:
        """The chat template (and tokenizer) of this process, waiting for a load under way (it
        starts when the engine reports it has loaded); None where it failed to load."""
        if self._chat_loading is not None and not self._chat_loading.done():
            await asyncio.shield(self._chat_loading)
        return self.chat

    async def _load_chat(self, model_path: str) -> None:
        """The model's tokenizer and chat template, here in the server process, so that chat
        requests render (bounded, off the event loop) without the engine; until they are loaded,
        or if they fail to, the engine renders."""
        if self.chat is not None and self.chat_path == model_path:
            return
        try:
            self.chat = await asyncio.to_thread(load_chat, model_path, self.cfg.template_timeout)
            self.chat_path = model_path
        except Exception as e:  # the engine loaded the same file: it renders instead
            log.warning("chat template not loaded in the server process (%s: %s); the engine "
                        "renders chat requests", type(e).__name__, e)

    def _on_exit(self, eng: EngineProcess) -> None:
        if eng is self.engine and self.state in ("loading", "ready"):
            self._spawn(self._recover("crash", None))

    def _work_started(self) -> None:
        self.last_progress = time.monotonic()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(_TICK_S)
            try:
                await self._check()
            except Exception:  # the watchdog must outlive any bug in what it calls
                log.exception("the watchdog hit an error; it keeps watching")

    async def _check(self) -> None:
        eng, now = self.engine, time.monotonic()
        if eng is None or self.state not in ("loading", "ready"):
            return
        if not eng.alive:
            await self._recover("crash", None)
        elif self.state == "loading" and now - eng.started > self.cfg.load_timeout:
            await self._recover("stall", f"the model did not load within --load-timeout "
                                f"{self.cfg.load_timeout:g} s")
        elif (self.state == "ready" and self.scheduler.running
              and now - self.last_progress > self.cfg.watchdog):
            await self._recover("stall", f"no progress for {now - self.last_progress:.1f} s "
                                f"(--watchdog {self.cfg.watchdog:g}) while "
                                f"{len(self.scheduler.running)} request(s) ran")

    # --- stall and crash -------------------------------------------------------------------
    async def _recover(self, kind: str, what: str | None) -> None:
        eng = self.engine
        if eng is None or self.state not in ("loading", "ready"):
            return
        self.state = "restarting"
        self.scheduler.ready = False
        try:
            summary, path = await self._report_and_stop(kind, what, eng)
        except Exception as e:  # never leave the server without an engine because of a report
            log.exception("handling the engine's %s failed", kind)
            summary, path = f"engine {kind} ({type(e).__name__} while reporting it)", None
            self.scheduler.engine_lost(APIError(503, f"the {summary}; retry shortly",
                                                code=f"engine_{kind}", retry_after=5))
        await self._restart_or_give_up(summary, path)

    async def _report_and_stop(self, kind: str, what: str | None,
                               eng: EngineProcess) -> tuple[str, str | None]:
        p = self.progress or Progress("unknown", "")
        info = stall_report.ReportInput(
            kind, what or "", eng.pid, eng.opts.start,
            self.loaded.model_path if self.loaded else eng.opts.model or "the demo model",
            self.cfg.device, time.monotonic() - eng.started, p.stage, p.detail, dict(p.state),
            time.monotonic() - self.last_progress, list(self.recent),
            dict(self.loaded.info) if self.loaded else {},
            str(eng.opts.fault) if eng.opts.fault else None)
        path = await asyncio.to_thread(stall_report.report_and_stop, eng, info,
                                       self.cfg.report_dir)
        summary = f"{info.what}, during {p.stage}: {p.detail or '-'}"
        top = stall_report.top_frame(info.stacks)
        log.error("engine pid %d: %s%s; report: %s", eng.pid, summary,
                  f"; main thread at {top}" if top else "", path)
        if kind == "stall":
            self.metrics.stalls += 1
            self.last_stall = {"report": str(path), "stage": p.stage, "detail": p.detail,
                               "engine_pid": eng.pid, "time": time.time()}
        else:
            self.metrics.crashes += 1
        see = f"; report: {path}" if path else ""
        self.scheduler.engine_lost(APIError(
            503, f"the engine {'stalled' if kind == 'stall' else 'crashed'}: {summary}; it is "
                 f"being restarted, retry shortly{see}", code=f"engine_{kind}", retry_after=5))
        return summary, path

    async def _restart_or_give_up(self, summary: str, path: str | None) -> None:
        see = f"; report: {path}" if path else ""
        now = time.monotonic()
        stage = self.progress.stage if self.progress is not None else ""
        if stage != "request":  # a request that stalled the checks is no engine failure:
            self.failures.append(now)  # it cannot make the server give up for good
        while self.failures and now - self.failures[0] > self.cfg.restart_window:
            self.failures.popleft()
        if len(self.failures) > self.cfg.max_restarts:
            self._give_up(f"{len(self.failures)} engine failures within "
                          f"{self.cfg.restart_window:g} s (--max-restarts {self.cfg.max_restarts});"
                          f" the last: {summary}{see}")
            return
        await asyncio.sleep(_RESTART_DELAY_S * len(self.failures))
        if self.state == "restarting":
            self.restarts += 1
            self._start_engine()

    def _give_up(self, reason: str) -> None:
        self.state, self.reason = "failed", reason
        log.error("not restarting the engine: %s. The server stays up; /health says why. Fix the "
                  "cause and restart the server.", reason)
        self.scheduler.engine_lost(APIError(503, f"the engine is down: {reason}",
                                            code="engine_failed"))

    # --- plumbing --------------------------------------------------------------------------
    def _from_thread(self, fn: Any) -> Any:
        def call(*args: Any) -> None:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(fn, *args)
                except RuntimeError:
                    pass  # the loop is shutting down
        return call

    def _spawn(self, coro: Any) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

