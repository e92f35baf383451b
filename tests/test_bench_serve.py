"""`strata bench-serve` against a real `strata serve` on a tiny model: every request streams its
tokens, the figures add up, and the percentiles are numpy's."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from strata.bench.serve_load import Level, Result, percentile
from strata.server.testing import ServerProcess

KEY = "sk-bench"


def test_percentile_is_numpys_linear() -> None:
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 10, 101):
        xs = rng.random(n).tolist()
        for p in (0, 1, 37.5, 50, 99, 100):
            assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)), abs=1e-12)
    assert percentile([], 50) == 0.0


def test_summary_counts_only_finished_requests() -> None:
    ok = Result(True, 8, 5, ttft=0.1, e2e=0.5, gaps=[0.1] * 4)
    bad = Result(False, 8, error="HTTP 500: b'x'")
    s = Level(2, None, 1.0, [ok, ok, bad]).summary()
    assert (s["requests"], s["failed"], s["output_tokens"]) == (3, 1, 10)
    assert s["output_tok_s"] == pytest.approx(10.0)
    assert s["tpot_p50_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4 tokens
    assert s["errors"] == ["HTTP 500: b'x'"]


@pytest.mark.slow
def test_bench_serve_against_strata_serve(synth, tmp_path) -> None:
    args = ["--api-key", KEY, "--batch", "4", "--queue", "16", "--watchdog", "60"]
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), args,
                       log_path=tmp_path / "server.log") as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        out = tmp_path / "serve.json"
        r = subprocess.run([sys.executable, "-m", "strata", "bench-serve", "--url", s.url,
                            "--api-key", KEY, "-c", "1,3", "--requests", "6", "--prompt-len",
                            "12", "--output-len", "9", "--warmup", "4", "--json", str(out)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        report = json.loads(out.read_text())
        levels = report["levels"]
        # 4 warm-up requests and the first level's 6, one at a time: the first and the tenth
        assert report["first_ttft_ms"] > 0 and report["tenth_ttft_ms"] > 0
        assert f"the tenth: {report['tenth_ttft_ms']:.0f} ms" in r.stdout
        assert [lv["concurrency"] for lv in levels] == [1, 3]
        for lv in levels:
            assert lv["failed"] == 0 and lv["requests"] == 6
            # ignore_eos: every request decodes exactly --output-len tokens of a 12-token prompt
            assert lv["output_tokens"] == 6 * 9 and lv["prompt_tokens"] == 6 * 12
            assert 0 < lv["ttft_p50_ms"] <= lv["ttft_p99_ms"] <= lv["e2e_p99_ms"]
            assert 0 < lv["itl_p50_ms"] <= lv["itl_p99_ms"]
        assert "| 3 | 6 |" in r.stdout  # the table's row for 3 clients
        # by default (one warm-up request, no --requests) a first level of 1 client takes 9, so
        # the first request after load and the tenth are compared
        r = subprocess.run([sys.executable, "-m", "strata", "bench-serve", "--url", s.url,
                            "--api-key", KEY, "-c", "1", "--prompt-len", "12", "--output-len",
                            "3", "--json", str(out)], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr + r.stdout
        report = json.loads(out.read_text())
        assert report["levels"][0]["requests"] == 9 and report["tenth_ttft_ms"] > 0
        # a wrong key: every request fails, said in the table, exit 1
        r = subprocess.run([sys.executable, "-m", "strata", "bench-serve", "--url", s.url,
                            "--api-key", "wrong", "-c", "1", "--requests", "1", "--warmup", "0"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "401" in r.stderr  # /tokenize is refused first


def test_bench_serve_flags_refused_in_one_line() -> None:
    for argv, what in ((["-c", "0"], "--concurrency"), (["--prompt-len", "0"], "--prompt-len"),
                       (["--request-rate", "-1"], "--request-rate"),
                       (["--temperature", "-1"], "--temperature"),
                       (["--url", "ftp://x"], "--url")):
        r = subprocess.run([sys.executable, "-m", "strata", "bench-serve", *argv],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert what in r.stderr and r.stderr.count("\n") == 1, r.stderr
