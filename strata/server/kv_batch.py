"""The batch's KV pool and batched decode step, for BatchRunner (batching.py): built where the
engine has a decode step (the offload runtime) and --batch is 2..16, and warmed up at load.

    pool   strata.runtime.kv_slots.KVSlots: blocks of KV_BLOCK rows, --batch sequences of the
           planned context (the memory plan counts --batch caches of --ctx rows)
    step   strata.engine.batch_step.BatchStep over it: CUDA graphs per batch size
    scratch  a plain KVCache of the plan's prefill rows (CUDA, where the prompt graphs run): a
           prompt that fits runs its chunks there on the prompt graphs (which take no paged
           cache), and each chunk's rows are copied into its blocks of the pool (to_pool; a
           prefix it shares comes in first, from_pool)
"""

from __future__ import annotations

import time

import torch

from strata.engine.batch_step import BATCH_SIZES, BatchStep
from strata.model.transformer import Segment
from strata.runtime.kv_cache import KVCache
from strata.runtime.kv_slots import POOL_BLOCK, KVSlots

KV_BLOCK = POOL_BLOCK  # rows a block of the batch's KV pool (the unit of prefix sharing)
WARM_PROMPT = 32  # the warm-up's prompt tokens (over 4: the prompt path)
WARM_BUCKETS = 512  # prompt graphs captured at load up to this bucket (the longer ones at use)
# (sequences, tokens each) of the plain forwards the warm-up runs over several prompts at once:
# the eager prompt path's kernels at the tl.dot and the grouped MoE path's sizes (Qwen3-30B-A3B:
# 128 and 512 tokens); on the H200 a server warmed without them took 0.85 s for the first
# prompts that arrived together (bench/2026-12-02-h200-serve-pairs.md)
WARM_TOGETHER = ((2, 64), (4, 128))


def batched(engine, mode: str | None = None,  # noqa: ANN001 (an Engine)
            ) -> tuple[KVSlots | None, BatchStep | None]:
    """The KV pool and the batched decode step for --batch N (2..16) where the engine has a
    decode step, else (None, None): each sequence a cache of its own, the plain forward for
    several at once. mode: the step's ("graphs" or "eager"; None: as the engine's decode step)."""
    model, ec = engine.model, getattr(engine, "engine_config", None)
    n = getattr(ec, "sequences", 1)
    if getattr(model, "step", None) is None or not 1 < n <= BATCH_SIZES[-1]:
        return None, None
    capacity = (model.kv_limit or model.step.kv_capacity or ec.ctx
                or getattr(model, "plan_ctx", None) or min(engine.config.context_length, 4096))
    pool = KVSlots(model.cfg, model.device, n, capacity, model.kv_dtype, KV_BLOCK)
    if mode is None:
        mode = "graphs" if ec.decode_step == "graphs" else "eager"
    return pool, BatchStep(model, pool, mode)


def prefill_scratch(engine, pool: KVSlots | None) -> KVCache | None:  # noqa: ANN001 (an Engine)
    """The plain cache a --batch pool's prompts run in on the prompt graphs, or None where
    there are none (CPU, no prompt graphs, a hybrid or MLA model, a pool of whole slots, no
    rows in the plan)."""
    model = engine.model
    chunks, rows = getattr(model, "chunks", None), getattr(model, "prefill_rows", 0)
    if (pool is None or not pool.paged or pool.store is None or not rows or chunks is None
            or chunks.why is not None or not chunks.buckets):
        return None
    cfg = model.cfg
    kv = KVCache(cfg.n_kv_layers, cfg.n_kv_heads, cfg.head_dim, model.device, rows,
                 dtype=model.kv_dtype)
    kv.limit = rows  # (a chunk padded past it runs eagerly: the scratch never grows)
    return kv


def to_pool(scratch: KVCache, kv, start: int, end: int) -> None:  # noqa: ANN001 (PagedKVCache)
    """Rows start .. end-1 of the scratch into the paged cache's rows (its blocks reserved,
    shared ones copied first); every layer's keys and values in one copy each."""
    kv.reserve(end)
    kv.own(start, end)
    rows, pool = kv.rows(start, end), kv.slots
    pool.store[:, :, rows] = scratch.store[:, :, start:end]
    if scratch.quantized:
        pool.scales[:, :, rows] = scratch.scales[:, :, start:end]


def from_pool(kv, scratch: KVCache) -> None:  # noqa: ANN001 (a PagedKVCache)
    """The scratch holds the paged cache's rows so far (a prefix shared with an earlier
    request): its length then that cache's."""
    n, pool = kv.length, kv.slots
    if n:
        rows = kv.rows(0, n)
        scratch.store[:, :, :n] = pool.store[:, :, rows]
        if scratch.quantized:
            scratch.scales[:, :, :n] = pool.scales[:, :, rows]
    scratch.length = n


def warm_up(engine, pool: KVSlots, step: BatchStep,  # noqa: ANN001 (an Engine)
            scratch: KVCache | None = None) -> float:
    """A prompt, three decode steps of one sequence (eager, capture, replay: its graphs read
    the pool's blocks, so every later request replays them) and three batched steps at each
    batch size, over the pool (past its slots the first sequence takes the rows the others
    leave, as a prompt's chunk beside them); plain forwards of several prompts at once
    (WARM_TOGETHER); with a scratch, a prompt of each bucket up to WARM_BUCKETS tokens there
    (each bucket's graph captured); then the pool empty again and the expert counters at zero.
    -> seconds"""
    t0 = time.perf_counter()
    text = engine.tokenizer.encode("Strata warms up its kernels and decode graphs. " * 8)

    def tokens(n: int) -> list[int]:  # n tokens of the warm-up's text, repeated as needed
        return (text * (n // max(len(text), 1) + 1))[:n]

    ids = tokens(WARM_PROMPT)
    caches = [pool.take() for _ in range(pool.n_slots)]
    extra = step.rows_max - min(step.rows_max, pool.n_slots)  # (rows past the slots at most)
    if pool.capacity >= len(ids) + 4 + 3 * len(step.sizes) + 3 * extra:
        engine.run_prompt(ids, caches[0])
        for t in ids[:3]:
            engine.model.decode(t, caches[0])
        for kv in caches[1:]:
            engine.run_prompt(ids[:4], kv)
        for size in step.sizes:
            n = min(size, len(caches))
            start = caches[0].length
            for t in ids[:3]:
                step([t] * size, caches[:n], [1 + size - n] + [1] * (n - 1))
            if size > n:  # (one row a step kept, as the others: the rest written again)
                caches[0].truncate(start + 3)
    for kv in caches:
        pool.give(kv)
    for n, length in WARM_TOGETHER:
        if pool.capacity < length + 1:
            continue
        group = [pool.take() for _ in range(min(n, pool.n_slots))]
        engine.model.forward(torch.tensor(tokens(length) * len(group)),
                             [Segment(kv, length) for kv in group])
        for kv in group:
            pool.give(kv)
    if scratch is not None:  # (a bucket's first pass runs eagerly, its second is captured)
        buckets = [b for b in engine.model.chunks.buckets if b <= min(WARM_BUCKETS,
                                                                       scratch.capacity)]
        for b in buckets:
            for _ in range(2):
                scratch.length = 0
                engine.model.forward(torch.tensor(tokens(b)), [Segment(scratch, b)])
        scratch.length = 0
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)
    stats = getattr(engine.model.experts, "stats", None)
    if hasattr(stats, "reset"):
        stats.reset()
    return time.perf_counter() - t0
