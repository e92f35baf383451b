"""Admission and routing in the server process: a bounded queue in front of the engine's batch.

At most `batch` requests are in the engine at once (it runs them together); up to `queue` more
wait here, and one more gets HTTP 429. Each request is a Job with its own event queue: the engine's
messages for it (Accepted, Delta, Finished, Failed) or an APIError when the engine is lost. All of
this runs on the event loop; nothing here blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import deque
from collections.abc import Callable

from strata.server.errors import APIError
from strata.server.protocol import Cancel, Failed, Finished, Submit

_ids = itertools.count(1)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{os.getpid():x}{next(_ids):06x}{int(time.time() * 1000) % 0xFFFF:04x}"


class Job:
    def __init__(self, submit: Submit):
        self.submit = submit
        self.rid = submit.rid
        self.state = "queued"  # queued -> running -> done
        self.events: asyncio.Queue = asyncio.Queue()
        self.created = time.monotonic()
        self.checked = self.created  # when the client's connection was last looked at

    async def next(self, timeout: float) -> object | None:
        """The next event, or None if none comes within `timeout` seconds."""
        if not self.events.empty():  # (a step's events come together: no timed wait for them)
            return self.events.get_nowait()
        try:
            return await asyncio.wait_for(self.events.get(), max(timeout, 0.0))
        except asyncio.TimeoutError:
            return None


class Scheduler:
    def __init__(self, batch: int, queue: int, send: Callable[[object], None],
                 on_busy: Callable[[], None]):
        self.batch, self.queue = batch, queue
        self._send, self._on_busy = send, on_busy
        self.waiting: deque[Job] = deque()
        self.running: dict[str, Job] = {}
        self.ready = False

    def submit(self, job: Job) -> None:
        if len(self.running) >= self.batch and len(self.waiting) >= self.queue:
            raise APIError(429, f"the server is busy: {len(self.running)} requests running and "
                           f"{len(self.waiting)} waiting (--batch {self.batch}, --queue "
                           f"{self.queue}); retry later", code="queue_full", retry_after=1)
        self.waiting.append(job)
        self._dispatch()

    def cancel(self, job: Job) -> bool:
        """The client went away: drop a waiting job (True); ask the engine to drop a running one
        (its slot frees when the engine confirms, so the batch never holds more than `batch`)."""
        if job.state == "queued":
            try:
                self.waiting.remove(job)
            except ValueError:
                pass
            job.state = "done"
            return True
        if job.state == "running":
            self._send(Cancel(job.rid))
        return False

    def on_message(self, msg: object) -> None:
        job = self.running.get(getattr(msg, "rid", ""))
        if job is None:
            return
        job.events.put_nowait(msg)
        if isinstance(msg, (Finished, Failed)):
            job.state = "done"
            del self.running[job.rid]
            self._dispatch()

    def engine_ready(self) -> None:
        self.ready = True
        self._dispatch()

    def engine_lost(self, error: APIError) -> None:
        """Every running and waiting request gets `error`; nothing is left hanging."""
        self.ready = False
        for job in [*self.running.values(), *self.waiting]:
            job.state = "done"
            job.events.put_nowait(error)
        self.running.clear()
        self.waiting.clear()

    def _dispatch(self) -> None:
        while self.ready and self.waiting and len(self.running) < self.batch:
            job = self.waiting.popleft()
            if not self.running:
                self._on_busy()  # the watchdog's clock starts with the work
            job.state = "running"
            self.running[job.rid] = job
            self._send(job.submit)
