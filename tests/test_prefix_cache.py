"""Prompt prefix reuse (strata.server.prefix_cache): the rows a cached prefix gives are the rows a
fresh prompt computes, the budget and the LRU order hold, and through `strata serve` a chat's next
turn reuses its history (usage.prompt_tokens_details.cached_tokens) with the same text."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.model.parts import Segment
from strata.server.prefix_cache import PrefixCache
from strata.server.testing import ServerProcess

PROMPT = [5, 17, 300, 4, 88, 901, 12, 12, 640, 33, 7, 250]


@pytest.fixture(scope="module")
def engine(synth):
    return Engine.load(synth("qwen3moe", "Q4_K_M"), config=EngineConfig(prefill="off"))


def run(engine, ids, kv=None):
    """Feed ids into kv (a fresh cache when None): (all their logits [T, V], kv)."""
    m = engine.model
    kv = kv if kv is not None else m.new_cache(64)
    logits = m.forward(torch.tensor(ids), [Segment(kv, len(ids))], all_logits=True)
    return logits.numpy(), kv


def test_reused_rows_give_the_fresh_logits(engine) -> None:
    cache = PrefixCache(1 << 30)
    first, kv = run(engine, PROMPT[:8])
    cache.store(PROMPT[:8], kv)
    fresh, _ = run(engine, PROMPT)
    kv2 = engine.model.new_cache(64)
    n = cache.lookup(PROMPT, kv2)
    assert n == 8 and kv2.length == 8 and cache.hits == 1 and cache.reused_tokens == 8
    rest, _ = run(engine, PROMPT[8:], kv2)
    np.testing.assert_allclose(rest, fresh[8:], rtol=0, atol=2e-5)
    assert (rest.argmax(-1) == fresh[8:].argmax(-1)).all()
    # the whole prompt cached: its last token is still computed (its logits are needed)
    full_kv = run(engine, PROMPT)[1]
    cache.store(PROMPT, full_kv)
    kv3 = engine.model.new_cache(64)
    assert cache.lookup(PROMPT, kv3) == len(PROMPT) - 1
    last, _ = run(engine, PROMPT[-1:], kv3)
    np.testing.assert_allclose(last, fresh[-1:], rtol=0, atol=2e-5)
    # a prompt that differs from the first token on: nothing reused
    assert cache.lookup([6, *PROMPT[1:]], engine.model.new_cache(64)) == 0


def test_budget_prefixes_and_lru(engine) -> None:
    _, kv = run(engine, PROMPT)
    row_bytes = kv.store[:, :, :1].numel() * kv.store.element_size()
    cache = PrefixCache(20 * row_bytes)
    cache.store(PROMPT[:4], kv)
    cache.store(PROMPT[:10], kv)  # holds the 4-token entry: it goes
    assert [len(e.tokens) for e in cache.entries.values()] == [10]
    cache.store(PROMPT[:6], kv)  # already held by the 10-token entry: nothing new
    assert [len(e.tokens) for e in cache.entries.values()] == [10]
    other, kv_o = run(engine, [9, 9, 9, 9, 9, 9])
    cache.store([9] * 6, kv_o)
    assert cache.nbytes == 16 * row_bytes <= cache.max_bytes
    cache.lookup(PROMPT, engine.model.new_cache(64))  # the 10-token entry: now the newest
    _, kv_b = run(engine, [3] * 8)
    cache.store([3] * 8, kv_b)  # 24 rows > 20: the least recently used ([9] * 6) goes
    assert sorted(len(e.tokens) for e in cache.entries.values()) == [8, 10]
    assert cache.nbytes == 18 * row_bytes
    assert PrefixCache(0).lookup(PROMPT, engine.model.new_cache(64)) == 0
    off = PrefixCache(0)
    off.store(PROMPT, kv)
    assert not off.entries
    assert not PrefixCache.usable(object())


@pytest.mark.slow
def test_a_chats_next_turn_reuses_its_history(synth, tmp_path) -> None:
    """The second turn repeats the first's messages and answer: its prompt's first rows come
    from the cache (usage says how many), and its text is the text without the cache."""
    turn1 = [{"role": "user", "content": "Name a colour."}]
    texts = {}
    for cache_gib in ("1", "0"):
        args = ["--prefix-cache", cache_gib, "--batch", "2", "--watchdog", "60"]
        with ServerProcess(synth("qwen3moe", "Q4_K_M"), args,
                           log_path=tmp_path / f"server-{cache_gib}.log") as s:
            s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")

            def chat(messages):  # noqa: ANN001, ANN202
                r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
                    "messages": messages, "max_tokens": 12, "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()

            a = chat(turn1)
            answer = a["choices"][0]["message"]["content"]
            b = chat([*turn1, {"role": "assistant", "content": answer},
                      {"role": "user", "content": "Another one."}])
            cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            if cache_gib == "1":
                assert 0 < cached < b["usage"]["prompt_tokens"]
                status, metrics = s.get("/metrics")
                assert f"strata_prompt_tokens_cached_total {cached}" in metrics
            else:
                assert cached == 0
            texts[cache_gib] = (answer, b["choices"][0]["message"]["content"])
    assert texts["1"] == texts["0"]


def test_caches_with_more_than_rows_are_not_kept(synth) -> None:
    """A hybrid model's cache carries recurrent state that no row prefix can restore, and a
    q8_0 cache its scales: neither is stored nor filled."""
    hybrid = Engine.load(synth("qwen35moe", "Q4_K_M"), config=EngineConfig(prefill="off"))
    _, kv = run(hybrid, PROMPT)
    assert kv.state is not None and not PrefixCache.usable(kv)
    cache = PrefixCache(1 << 30)
    cache.store(PROMPT, kv)
    assert not cache.entries
    q8 = Engine.load(synth("qwen3moe", "Q4_K_M"), config=EngineConfig(kv_type="q8_0"))
    assert not PrefixCache.usable(q8.model.new_cache(8))
