"""One engine process as the server sees it: spawn it, talk to it, look into it, stop it.

Two one-way pipes per process. The server keeps no copy of the engine's writing end, so the
engine's death is an end-of-file on the reader at once, whatever killed it. A reader thread and a
writer thread do the blocking pipe calls, so the event loop never waits on the engine; both end
when the process does. Every wait here has a deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import tempfile
import threading
import time
from collections.abc import Callable

from strata.server.protocol import EngineOptions, Shutdown

_POLL_S = 0.5


def _engine_entry(inbox, outbox, opts: EngineOptions) -> None:  # runs in the engine process
    from strata.server.worker import main

    main(inbox, outbox, opts)


class EngineProcess:
    def __init__(self, opts: EngineOptions, on_message: Callable[[EngineProcess, object], None],
                 on_exit: Callable[[EngineProcess], None]):
        self.opts = opts
        self.started = time.monotonic()
        self._on_message, self._on_exit = on_message, on_exit
        self._sendq: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        ctx = mp.get_context("spawn")
        to_engine_r, self._to_engine = ctx.Pipe(duplex=False)
        self._from_engine, from_engine_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_engine_entry, args=(to_engine_r, from_engine_w, opts),
                                name=f"strata-engine-{opts.start}", daemon=True)
        self.proc.start()
        to_engine_r.close()
        from_engine_w.close()
        self.pid: int = self.proc.pid or 0
        self._threads = [
            threading.Thread(target=self._read, name=f"engine-{self.pid}-reader", daemon=True),
            threading.Thread(target=self._write, name=f"engine-{self.pid}-writer", daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def stacks_file() -> str:
        fd, path = tempfile.mkstemp(prefix="strata-stacks-", suffix=".txt")
        os.close(fd)
        return path

    @property
    def alive(self) -> bool:
        return self.proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def send(self, msg: object) -> None:
        """Never blocks: the writer thread delivers it (or drops it once the engine is gone)."""
        self._sendq.put(msg)

    def stop(self, graceful: bool = True, wait: float = 5.0) -> int | None:
        """Shutdown (graceful), then SIGTERM, then SIGKILL, each waited on at most `wait` s."""
        if graceful and self.proc.is_alive():
            self.send(Shutdown())
            self.proc.join(wait)
        for signal_it in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                signal_it()
                self.proc.join(wait)
        self._closed.set()
        for t in self._threads:  # both see the closed pipe or the flag within a poll
            if t is not threading.current_thread():
                t.join(2 * _POLL_S + 1)
        for conn in (self._to_engine, self._from_engine):
            conn.close()
        try:
            os.unlink(self.opts.stacks_path)
        except OSError:
            pass
        return self.proc.exitcode

    def _read(self) -> None:
        conn = self._from_engine
        try:
            while not self._closed.is_set():
                if conn.poll(_POLL_S):
                    self._on_message(self, conn.recv())
        except Exception:  # EOF: the engine ended; or a message that does not unpickle
            pass
        self._on_exit(self)

    def _write(self) -> None:
        while not self._closed.is_set():
            try:
                msg = self._sendq.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            try:
                self._to_engine.send(msg)  # blocks only while the pipe is full of unread input
            except (OSError, ValueError):
                return


def exit_text(code: int | None) -> str:
    """An exit status in words: "exit code 1", "killed by SIGKILL"."""
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
