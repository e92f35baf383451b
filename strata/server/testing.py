"""A real `strata serve` in a subprocess, for tests: it listens on 127.0.0.1 only, on a port the OS
picks, and every wait for it has a deadline.

    with ServerProcess(model, ["--watchdog", "3"], env={"STRATA_FAULT": "crash@decode:1"}) as s:
        s.wait_health(lambda h: h["status"] == "ok")
        httpx.get(s.url + "/health")
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

_LISTENING = re.compile(r"listening on http://127\.0\.0\.1:(\d+)/")


class ServerProcess:
    def __init__(self, model: str | Path | None, args: list[str] | None = None,
                 env: dict[str, str] | None = None, start_timeout: float = 60.0,
                 log_path: str | Path | None = None):
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="strata-serve-", suffix=".log")[1])
        cmd = [sys.executable, "-m", "strata", "serve", *([str(model)] if model else []),
               "--host", "127.0.0.1", "--port", "0", *(args or [])]
        # one torch thread unless the caller says otherwise: a busy 2-core test machine slows to
        # a crawl when the engine's OpenMP threads spin against the test's own processes
        full_env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if not (env or {}).get("STRATA_FAULT"):
            full_env.pop("STRATA_FAULT", None)
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=full_env)
        self.port = self._wait_port(start_timeout)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_port(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _LISTENING.search(self.log())
            if m:
                return int(m.group(1))
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"strata serve did not start listening:\n{self.log()}")

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, Any]:
        """GET path -> (status, parsed JSON or text)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                status, body = r.status, r.read()
        except urllib.error.HTTPError as e:
            status, body = e.code, e.read()
        try:
            return status, json.loads(body)
        except ValueError:
            return status, body.decode(errors="replace")

    def health(self) -> dict[str, Any]:
        return self.get("/health")[1]

    def wait_health(self, ok: Callable[[dict[str, Any]], bool], timeout: float = 120.0,
                    what: str = "the expected /health") -> dict[str, Any]:
        """Poll /health until ok(health) holds; fail with the log after `timeout` seconds."""
        deadline, h = time.monotonic() + timeout, {}
        while time.monotonic() < deadline:
            try:
                h = self.health()
                if ok(h):
                    return h
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {what} within {timeout} s; last {h}\n--- log ---\n{self.log()}")

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        self._log.close()
        return self.proc.returncode
