"""Cancellation and churn in the batch: requests submitted and cancelled between any two steps,
over a small pool whose prefix index must give blocks back, beside verify windows and a hybrid's
recurrent state, and end to end with clients that drop their streams. After each: the pool's
accounting holds (KVSlots.check_integrity) and a greedy request's text is its text alone."""

from __future__ import annotations

import json
import random
import socket
import threading

import httpx
import pytest

from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.server.batching import BatchRunner
from strata.server.faults import FaultTrigger
from strata.server.protocol import Delta, Failed, Finished, Submit
from strata.server.testing import ServerProcess

BASE = list(range(5, 70))  # token ids: prompts that start alike share the pool's blocks


def _engine(path, batch: int, **kw) -> Engine:  # noqa: ANN001
    return Engine.load(path, config=EngineConfig(device="cpu", offload="on", cpu_kernels="torch",
                                                 kernels="exact", sequences=batch, **kw))


def _greedy(rid: str, prompt: list[int], n: int) -> Submit:
    return Submit(rid, None, prompt, {"temperature": 0.0}, n, n, ignore_eos=True)


def _texts(sent: list) -> dict[str, str]:
    out: dict[str, str] = {}
    for m in sent:
        if isinstance(m, (Delta, Finished)):
            out[m.rid] = out.get(m.rid, "") + m.text
    return out


def _alone(eng: Engine, prompt: list[int], n: int) -> str:
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None), prompt_while_decoding=16)
    runner.submit(_greedy("alone", prompt, n))
    while runner.active:
        runner.step()
    return _texts(sent)["alone"]


def _churn(eng: Engine, seed: int, steps: int, most: int = 16) -> tuple[BatchRunner, dict, list]:
    """Random submits and cancels between steps (the server's engine loop does the same: all
    messages that arrived, then one step), the pool checked after every one."""
    rng, sent, subs = random.Random(seed), [], {}
    runner = BatchRunner(eng, sent.append, FaultTrigger(None), prefix_cache_bytes=1 << 30,
                         prompt_while_decoding=16)
    for step in range(steps):
        for _ in range(rng.choice([0, 0, 1, 2])):
            k = rng.randrange(3)
            prompt = (BASE[:rng.randint(2, 60)] if k == 0 else
                      BASE[:rng.randint(17, 48)] + [rng.randint(5, 300) for _ in range(5)]
                      if k == 1 else [7, 8, 9, 10] * rng.randint(2, 8))
            rid = f"r{step}-{len(subs)}"
            subs[rid] = (prompt, rng.randint(1, most))
            runner.submit(_greedy(rid, *subs[rid]))
        for rid in list(runner.seqs):
            if rng.random() < 0.1:
                runner.cancel(rid)
        runner.pool.check_integrity()
        if runner.active:
            runner.step()
            runner.pool.check_integrity()
    while runner.active:
        runner.step()
    return runner, subs, sent


def _check_churn(eng: Engine, runner: BatchRunner, subs: dict, sent: list) -> None:
    runner.pool.check_integrity()
    assert runner.pool.used == 0
    done = {m.rid: m for m in sent if isinstance(m, Finished)}
    failed = {m.rid: m for m in sent if isinstance(m, Failed)}
    texts = _texts(sent)
    assert sum(m.finish_reason == "cancelled" for m in done.values()) > 3
    assert any(m.status == 429 for m in failed.values())  # (a full pool refused some)
    for rid, (prompt, n) in subs.items():
        if rid in failed:
            assert failed[rid].status in (400, 429), failed[rid]
        elif done[rid].finish_reason != "cancelled":
            assert texts.get(rid, "") == _alone(eng, prompt, n), rid


def test_submits_and_cancels_between_steps_over_a_small_pool(synth):
    # (not covered elsewhere) 2 slots of 96 rows, prefix sharing on: the index fills the pool
    # and gives blocks back; cancels mid-prompt, mid-decode and of sharers; every step checked
    eng = _engine(synth("qwen3moe", "Q4_K_M"), 2, ctx=96)
    runner, subs, sent = _churn(eng, 0, 80)
    assert len(runner.pool.index) > 0 and not runner.pool.free_blocks  # eviction was needed
    _check_churn(eng, runner, subs, sent)


def test_churn_beside_verify_windows(synth):
    # (not covered elsewhere) the same churn with --spec 4 --draft ngram: cancels between
    # windows of several sequences leave the pool whole and the others' greedy text unchanged
    eng = _engine(synth("qwen3moe", "Q4_K_M"), 3, ctx=96, spec=4, draft="ngram")
    eng.spec.timed = False
    runner, subs, sent = _churn(eng, 1, 80, most=40)
    assert eng.spec.stats.windows > 0
    _check_churn(eng, runner, subs, sent)


def test_a_hybrid_cancelled_mid_prompt_leaves_a_clean_slot(synth):
    # (not covered elsewhere) qwen35moe: a prompt cancelled after one chunk beside a decoding
    # request; the decoding one and the next request in its slot give their text alone
    eng = _engine(synth("qwen35moe", "Q4_K_M"), 2, prefill="16")
    sent: list = []
    runner = BatchRunner(eng, sent.append, FaultTrigger(None), prompt_while_decoding=16)
    runner.submit(_greedy("a", BASE[:8], 12))
    runner.step()
    runner.submit(_greedy("b", BASE[:60], 8))
    runner.step()
    assert not runner.seqs["b"].prefilled and runner.seqs["b"].kv.length > 0
    runner.cancel("b")
    runner.submit(_greedy("c", BASE[10:20], 6))  # (takes b's slot)
    while runner.active:
        runner.step()
    runner.pool.check_integrity()
    assert runner.pool.used == 0
    texts = _texts(sent)
    assert texts["a"] == _alone(eng, BASE[:8], 12)
    assert texts["c"] == _alone(eng, BASE[10:20], 6)


# --- end to end -------------------------------------------------------------------------------
REF = {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}


def _dropped_stream(server: ServerProcess, body: dict, events: int) -> None:
    """A streamed completion whose client reads `events` data lines, then closes the socket."""
    data = json.dumps({**body, "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
        got = b""
        while got.count(b"data:") < events or (not events and b"\r\n\r\n" not in got):
            more = c.recv(65536)
            if not more:
                break
            got += more


def two_whole_slots_together(url: str) -> None:
    """Two completions that each need a whole slot of a `--batch 2 --ctx 256` server (200
    prompt tokens and 50 more) both run, at once: every block the requests before them held has
    come back to the pool."""
    full = {"prompt": list(range(5, 205)), "max_tokens": 50, "ignore_eos": True}
    got: list[httpx.Response] = []
    pair = [threading.Thread(target=lambda: got.append(httpx.post(url, json=full, timeout=60)))
            for _ in range(2)]
    for t in pair:
        t.start()
    for t in pair:
        t.join(60)
    assert [r.status_code for r in got] == [200, 200], [r.text for r in got]
    assert all(r.json()["usage"]["completion_tokens"] == 50 for r in got)


@pytest.mark.slow
def test_dropped_streams_under_a_full_queue(synth, tmp_path):
    # (end to end; test_hostile_requests covers streams dropped alone) --batch 2 --queue 1:
    # streams dropped in a chunked prompt beside a decoding request, after 1-2 tokens, and while
    # queued, with more requests refused (429); then nothing runs, no restart, the greedy text
    # is unchanged and two requests that each need a whole slot run together
    args = ["--offload", "on", "--batch", "2", "--queue", "1", "--ctx", "256", "--prefill", "16",
            "--prompt-while-decoding", "16", "--max-tokens", "200", "--cpu-kernels", "torch",
            "--miss", "cpu", "--report-dir", str(tmp_path)]
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), args, log_path=tmp_path / "log") as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        url = s.url + "/v1/completions"
        want = httpx.post(url, json=REF, timeout=60).json()["choices"][0]["text"]
        long = {"prompt": list(range(5, 205)), "max_tokens": 30}
        codes: list[int] = []
        work = [threading.Thread(target=lambda: codes.append(
            httpx.post(url, json={**REF, "max_tokens": 40}, timeout=60).status_code))]
        work += [threading.Thread(target=_dropped_stream, args=(s, long, i % 3))
                 for i in range(6)]
        work += [threading.Thread(target=lambda: codes.append(
            httpx.post(url, json=REF, timeout=60).status_code)) for _ in range(4)]
        for t in work:
            t.start()
        for t in work:
            t.join(60)
        assert set(codes) <= {200, 429} and 429 in codes, codes
        s.wait_health(lambda h: h["running"] == 0 and h["queued"] == 0, timeout=30,
                      what="every dropped stream cancelled")
        assert httpx.post(url, json=REF, timeout=60).json()["choices"][0]["text"] == want
        two_whole_slots_together(url)
        assert s.health()["restarts"] == 0 and "Traceback" not in s.log(), s.log()[-3000:]
