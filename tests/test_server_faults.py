"""The supervisor end to end: injected stalls and crashes (STRATA_FAULT), a full
queue, and the give-up path. Each server here is a real `strata serve` subprocess whose engine is
a real child process; waits poll /health with generous deadlines."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from strata.server.testing import ServerProcess

pytestmark = pytest.mark.slow
MODEL = "tiny"


def _client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _complete(server: ServerProcess, max_tokens: int = 3) -> httpx.Response:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=120)


def _ok(h: dict) -> bool:
    return h["status"] == "ok"


def test_stall_reports_restarts_and_queue_full(synth, tmp_path):
    args = ["--model-name", MODEL, "--watchdog", "4", "--batch", "1", "--queue", "1",
            "--report-dir", str(tmp_path)]
    env = {"STRATA_FAULT": "stall@decode:2"}
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), args, env=env,
                       log_path=tmp_path / "server.log") as s:
        s.wait_health(_ok, what="a loaded engine")
        results: dict[str, httpx.Response] = {}

        def send(name: str) -> None:
            results[name] = _complete(s, max_tokens=8)

        stalled = threading.Thread(target=send, args=("stalled",))
        stalled.start()
        s.wait_health(lambda h: h["running"] == 1, what="the request in the batch")
        queued = threading.Thread(target=send, args=("queued",))
        queued.start()
        s.wait_health(lambda h: h["queued"] == 1, what="a queued request")
        full = _complete(s)  # batch 1 stalled + queue 1 full
        assert full.status_code == 429, full.text
        assert full.json()["error"]["code"] == "queue_full" and "Retry-After" in full.headers
        stalled.join(120)
        queued.join(120)

        err = results["stalled"]
        assert err.status_code == 503 and err.headers["Retry-After"], err.text
        message = err.json()["error"]["message"]
        assert "stalled" in message and "decode step 2" in message
        report = Path(re.search(r"report: (\S+)", message).group(1))
        assert report.parent == tmp_path and re.fullmatch(r"strata-stall-\d+-[\d-]+\.txt",
                                                          report.name)
        text = report.read_text()
        assert "no progress for" in text and "stage:       decode" in text
        assert "decode step 2" in text and "memory:" in text
        assert 'faults.py", line' in text and 'batching.py", line' in text  # the stack
        assert results["queued"].status_code == 503

        h = s.wait_health(_ok, what="the restarted engine")
        assert h["restarts"] == 1 and h["last_stall"]["report"] == str(report)
        assert "no progress for" in s.log() and str(report) in s.log()
        again = _complete(s)
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["completion_tokens"] == 3


def test_injected_crash_then_engine_timeout(synth, tmp_path):
    """Start 1 crashes at its first decode step; start 2 gives up a bounded wait there (the
    engine's StallError), which is reported as a stall at once; start 3 serves."""
    args = ["--model-name", MODEL, "--watchdog", "60", "--report-dir", str(tmp_path)]
    env = {"STRATA_FAULT": "crash@decode:1,timeout@decode:1*2"}
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), args, env=env,
                       log_path=tmp_path / "server.log") as s:
        s.wait_health(_ok, what="a loaded engine")
        client = _client(s)
        with pytest.raises(openai.APIError, match="crashed"):  # an SSE error event mid-stream
            for _ in client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                    stream=True, extra_body={"ignore_eos": True}):
                pass
        s.wait_health(lambda h: _ok(h) and h["restarts"] == 1, what="a restart after a crash")
        report = next(tmp_path.glob("strata-crash-*.txt")).read_text()
        assert "exit code 86" in report and "stage:       decode" in report

        started = time.monotonic()
        r = _complete(s, max_tokens=4)
        assert r.status_code == 503 and "a bounded wait in the engine ran out" in r.text, r.text
        assert time.monotonic() - started < 30  # reported at once, not after --watchdog 60
        h = s.wait_health(lambda h: _ok(h) and h["restarts"] == 2, what="a restart after a stall")
        text = Path(h["last_stall"]["report"]).read_text()
        assert "injected wait timeout" in text and 'batching.py", line' in text
        assert _complete(s).status_code == 200


def test_gives_up_after_max_restarts(synth, tmp_path):
    args = ["--model-name", MODEL, "--max-restarts", "1", "--restart-window", "300",
            "--report-dir", str(tmp_path)]
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), args, env={"STRATA_FAULT": "crash@load*9"},
                       log_path=tmp_path / "server.log") as s:
        h = s.wait_health(lambda h: h["status"] == "failed", what="the give-up state")
        assert "2 engine failures" in h["reason"] and "--max-restarts 1" in h["reason"]
        assert h["restarts"] == 1 and h["loaded"] is False
        r = _complete(s)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_failed"
        assert s.get("/health")[0] == 503 and s.proc.poll() is None  # up, and says why


def test_model_that_does_not_load(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF but not really")
    with ServerProcess(bad, ["--report-dir", str(tmp_path)], log_path=tmp_path / "server.log") as s:
        h = s.wait_health(lambda h: h["status"] == "failed", what="a failed load")
        assert "did not load" in h["reason"] and "broken.gguf" in h["reason"]
        assert h["restarts"] == 0


def test_load_progress_then_load_timeout(tmp_path, synth):
    args = ["--model-name", MODEL, "--load-timeout", "2", "--max-restarts", "0",
            "--report-dir", str(tmp_path)]
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), args, env={"STRATA_FAULT": "stall@load"},
                       log_path=tmp_path / "server.log") as s:
        h = s.wait_health(lambda h: h["status"] == "loading", what="loading")
        assert h["loaded"] is False and h["load"]["stage"] and "elapsed_s" in h["load"]
        r = _complete(s)
        assert r.status_code == 503 and r.headers["Retry-After"]
        h = s.wait_health(lambda h: h["status"] == "failed", what="the load timeout")
        assert h["last_stall"]["stage"] == "loading" and "--load-timeout 2" in h["reason"]
        report = Path(h["last_stall"]["report"]).read_text()
        assert "did not load within --load-timeout 2" in report and 'faults.py", line' in report
        assert "starting the engine" in s.log()
