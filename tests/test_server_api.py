"""`strata serve` end to end with real clients (the openai package and httpx) on a tiny model.

One server for the module: 127.0.0.1, a port the OS picks, an API key, batch 4 and queue 8.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from strata.server.testing import ServerProcess

KEY = "sk-strata-test"
MODEL = "tiny"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(synth, tmp_path_factory):
    args = ["--model-name", MODEL, "--api-key", KEY, "--batch", "4", "--queue", "8",
            "--max-tokens", "256", "--max-body", "65536", "--watchdog", "60", "--prefill", "4",
            "--report-dir", str(tmp_path_factory.mktemp("reports")),
            "--prefix-cache", "0"]  # (the tests count forward passes; test_prefix_cache reuses)
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), args, log_path=log) as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        yield s


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def _post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=60)


def _metrics(server) -> dict[str, float]:
    status, text = server.get("/metrics")
    assert status == 200
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0) + s.value
    return out


HI = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    h = server.health()
    for key in ("status", "model", "loaded", "engine_pid", "uptime_s", "restarts", "last_stall"):
        assert key in h
    assert (h["status"], h["model"], h["loaded"], h["restarts"]) == ("ok", MODEL, True, 0)


def test_chat_plain_and_streamed_agree(client):
    kw = dict(model=MODEL, messages=HI, max_tokens=6, seed=11, temperature=1.0,
              extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**kw)
    choice = plain.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert plain.usage.completion_tokens == 6 and plain.usage.prompt_tokens > 0
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-2].choices[0].finish_reason == "length"


def test_template_arguments_reach_the_chat_template(client):
    def prompt_tokens(**extra) -> int:
        r = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1, **extra)
        return r.usage.prompt_tokens

    plain = prompt_tokens()
    no_thinking = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert no_thinking > plain  # the qwen template adds an empty <think></think>
    assert prompt_tokens(reasoning_effort="low") == plain  # passed on; this template ignores it


def test_completions_plain_streamed_and_stop(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, seed=5, temperature=0.9,
              extra_body={"ignore_eos": True})
    full = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    assert streamed == full and len(full) >= 4
    stop = full[len(full) // 2:len(full) // 2 + 2]
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert (cut.text, cut.finish_reason) == (full[:full.find(stop)], "stop")


def test_metrics_scrape(client, server):
    before = _metrics(server)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, seed=1,
                              extra_body={"ignore_eos": True})
    after = _metrics(server)
    assert after["strata_completion_tokens_total"] - before["strata_completion_tokens_total"] == 3
    assert after["strata_requests_total"] > before.get("strata_requests_total", 0)
    for name in ("strata_queue_depth", "strata_decode_tokens_per_second",
                 "strata_expert_cache_hit_rate", "strata_engine_restarts_total",
                 "strata_engine_stalls_total"):
        assert name in after


def _error(resp, status, param=None, code=None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def test_client_errors(client, server):
    chat = {"model": MODEL, "messages": HI, "max_tokens": 4}
    _error(_post(server, "/v1/chat/completions", {**chat, "temperature": 9}), 400, "temperature")
    err = _error(_post(server, "/v1/chat/completions", {**chat, "n": 3, "logprobs": True}), 400)
    assert "n=3" in err["message"] and "logprobs=True" in err["message"]
    long_prompt = {"model": MODEL, "prompt": [7] * 4090, "max_tokens": 16}
    err = _error(_post(server, "/v1/completions", long_prompt), 400, "prompt",
                 "context_length_exceeded")
    assert "4096" in err["message"]
    _error(_post(server, "/v1/chat/completions", chat, key=None), 401)
    _error(_post(server, "/v1/chat/completions", chat, key="wrong"), 401)
    _error(_post(server, "/v1/chat/completions", {**chat, "model": "gpt-9"}), 404, "model")
    _error(httpx.get(server.url + "/v1/nothing", timeout=10), 404)
    _error(_post(server, "/v1/completions", {"prompt": "x" * 70000}), 413)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="bad", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=HI, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model=MODEL, messages=HI, max_tokens=2,
                                       tools=[{"type": "function", "function": {
                                           "name": "f", "parameters": "an object"}}])


def test_concurrent_requests_match_serial_runs(client, server):
    def one(i: int) -> tuple[str, int]:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Story number {i}"}],
            max_tokens=4, seed=100 + i, temperature=1.0, extra_body={"ignore_eos": True})
        return r.choices[0].message.content, r.usage.prompt_tokens

    passes0 = _metrics(server)["strata_forward_passes_total"]
    serial = [one(i) for i in range(8)]
    passes1 = _metrics(server)["strata_forward_passes_total"]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(one, range(8), timeout=180))
    passes2 = _metrics(server)["strata_forward_passes_total"]
    assert together == serial
    # alone: the prompt in chunks of 4 (--prefill 4), then 3 decode passes
    assert passes1 - passes0 == sum(-(-n // 4) + 3 for _, n in serial)
    assert passes2 - passes1 < passes1 - passes0  # together: requests shared forward passes


def test_disconnect_mid_stream_frees_the_slot(client, server):
    before = _metrics(server)["strata_requests_cancelled_total"]
    body = {"model": MODEL, "prompt": "Keep going", "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert server.health()["running"] == 1
    # the connection is closed here, long before 200 tokens
    server.wait_health(lambda h: h["running"] == 0, timeout=60, what="a freed slot")
    deadline = time.monotonic() + 30
    while _metrics(server)["strata_requests_cancelled_total"] == before:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    r = client.completions.create(model=MODEL, prompt="Still here?", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_disconnect_while_waiting_for_a_whole_answer(server):
    before = _metrics(server)["strata_requests_cancelled_total"]
    # the server's most tokens (--max-tokens 256) and a client that waits a quarter of a second
    # for the whole answer (the tiny model's 200 tokens sometimes came within the 1 s it waited)
    body = {"model": MODEL, "prompt": "Long answer", "max_tokens": 256, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.25,
                   headers={"Authorization": f"Bearer {KEY}"})
    deadline = time.monotonic() + 30
    while _metrics(server)["strata_requests_cancelled_total"] == before:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    server.wait_health(lambda h: h["running"] == 0, timeout=60, what="a freed slot")



def test_killed_engine_is_restarted(server, client):
    """Last in the module: it kills the shared server's engine (by the pid /health gives)."""
    pid = server.health()["engine_pid"]
    os.kill(pid, signal.SIGKILL)
    h = server.wait_health(lambda h: h["status"] == "ok" and h["restarts"] == 1,
                           what="a restart after a kill")
    assert h["engine_pid"] != pid
    assert "killed by SIGKILL" in server.log()
    r = client.completions.create(model=MODEL, prompt="Back again", max_tokens=2)
    assert r.usage.completion_tokens >= 1 or r.choices[0].finish_reason == "stop"


def test_serves_on_the_offload_runtime(synth, tmp_path):
    """The engine child on the offload runtime (host arena, 3 cache slots, CPU misses): requests
    are served, batched, and /metrics reports the expert cache's hit rate."""
    args = ["--model-name", MODEL, "--offload", "on", "--expert-cache", "3", "--miss", "cpu",
            "--cpu-kernels", "torch", "--batch", "2", "--report-dir", str(tmp_path)]
    with ServerProcess(synth("qwen3moe", "IQ2_XS-MIX"), args,
                       log_path=tmp_path / "server.log") as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)
        with ThreadPoolExecutor(2) as pool:
            replies = list(pool.map(lambda seed: c.chat.completions.create(
                model=MODEL, messages=HI, max_tokens=6, seed=seed), (1, 2)))
        assert all(r.usage.completion_tokens > 0 for r in replies)
        rate = _metrics(s)["strata_expert_cache_hit_rate"]
        assert 0 < rate < 1  # 3 slots for 24 experts: some hits, some misses
        assert "memory plan on cpu" in s.log() and "2 sequences" in s.log()
