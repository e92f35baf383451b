"""Verify windows in the server: `strata serve --spec` (one decoding sequence a step), its
/metrics, and a window whose GPU work never finishes (STRATA_FAULT timeout@verify)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.server.batching import BatchRunner
from strata.server.faults import FaultPlan, FaultTrigger
from strata.server.metrics import Metrics
from strata.server.protocol import Delta, Finished, StepDone, Submit
from strata.server.testing import ServerProcess


def _run(engine: Engine, prompt: str, n: int) -> tuple[str, list[StepDone]]:
    sent: list = []
    runner = BatchRunner(engine, sent.append, FaultTrigger(None))
    runner.submit(Submit("r1", None, prompt, {"temperature": 0.0}, n, n, ignore_eos=True))
    while runner.active:
        runner.step()
    done = [m for m in sent if isinstance(m, Finished)]
    assert len(done) == 1 and done[0].completion_tokens == n
    return "".join(m.text for m in sent if isinstance(m, Delta)) + done[0].text, \
        [m for m in sent if isinstance(m, StepDone)]


def test_batch_runner_windows_same_text_and_metrics(synth):
    f = synth("qwen3moe", "Q4_K_M")
    plain, _ = _run(Engine.load(f, config=EngineConfig(device="cpu")), "hello world", 30)
    eng = Engine.load(f, config=EngineConfig(device="cpu", spec=3, draft=str(f)))
    eng.spec.timed = False  # (the windows counted below: not by this machine's load)
    eng.spec.new_sequence(None)
    text, steps = _run(eng, "hello world", 30)
    assert text == plain
    windows = [s for s in steps if s.drafted]
    assert windows and all(s.decode_tokens == s.accepted + 1 for s in windows)
    m = Metrics()
    for s in steps:
        m.step(s)
    out = m.render(running=0, queued=0, loaded=True, restarts=0)
    assert f"strata_spec_windows_total {len(windows)}" in out
    assert f"strata_spec_drafted_tokens_total {sum(s.drafted for s in windows)}" in out
    assert f"strata_spec_accepted_tokens_total {sum(s.accepted for s in windows)}" in out
    assert 'strata_spec_acceptance{position="0"} 1' in out  # the file drafting for itself
    assert 'strata_spec_decode_tokens_per_second{step="window"}' in out


def test_verify_fault_syntax():
    plan = FaultPlan.parse("timeout@verify:2*3")
    assert str(plan) == "timeout@verify:2*3"


@pytest.mark.slow
def test_serve_spec_and_verify_window_stall(synth, tmp_path):
    """`strata serve --spec 3`: the first engine's first window's GPU work never finishes: its
    bounded wait runs out (STRATA_WAIT_TIMEOUT 2 s) and the stall is reported at once, naming
    the window; the engine started again decodes through windows, and /metrics counts them."""
    f = synth("qwen3moe", "Q4_K_M")
    args = ["--model-name", "tiny", "--watchdog", "60", "--report-dir", str(tmp_path),
            "--spec", "3", "--draft", str(f)]
    env = {"STRATA_FAULT": "timeout@verify:1", "STRATA_WAIT_TIMEOUT": "2"}
    with ServerProcess(f, args, env=env, log_path=tmp_path / "server.log") as s:
        def complete() -> httpx.Response:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 12, "ignore_eos": True,
                    "temperature": 0}
            return httpx.post(s.url + "/v1/completions", json=body, timeout=120)

        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        r = complete()
        assert r.status_code == 503 and "verify window of 4 tokens" in r.text, r.text
        h = s.wait_health(lambda h: h["status"] == "ok" and h["restarts"] == 1,
                          what="a restart after the window's stall")
        text = Path(h["last_stall"]["report"]).read_text()
        assert "verify window of 4 tokens at position" in text
        assert "the GPU never finished layer 0" in text
        r = complete()
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
        metrics = s.get("/metrics")[1]
        assert "strata_spec_windows_total" in metrics
        windows = next(line for line in metrics.splitlines()
                       if line.startswith("strata_spec_windows_total"))
        assert int(windows.split()[1]) > 0
