"""The batch's KV pool and batched decode step, for BatchRunner (batching.py): built where the
engine has a decode step (the offload runtime) and --batch is 2..16, and warmed up at load.

    pool   strata.runtime.kv_slots.KVSlots: blocks of KV_BLOCK rows, --batch sequences of the
           planned context (the memory plan counts --batch caches of --ctx rows)
    step   strata.engine.batch_step.BatchStep over it: CUDA graphs per batch size
"""

from __future__ import annotations

import time

import torch

from strata.engine.batch_step import BATCH_SIZES, BatchStep
from strata.runtime.kv_slots import POOL_BLOCK, KVSlots

KV_BLOCK = POOL_BLOCK  # rows a block of the batch's KV pool (the unit of prefix sharing)
WARM_PROMPT = 32  # the warm-up's prompt tokens (over 4: the prompt path)


def batched(engine) -> tuple[KVSlots | None, BatchStep | None]:  # noqa: ANN001 (an Engine)
    """The KV pool and the batched decode step for --batch N (2..16) where the engine has a
    decode step, else (None, None): each sequence a cache of its own, the plain forward for
    several at once."""
    model, ec = engine.model, getattr(engine, "engine_config", None)
    n = getattr(ec, "sequences", 1)
    if getattr(model, "step", None) is None or not 1 < n <= BATCH_SIZES[-1]:
        return None, None
    capacity = (model.kv_limit or model.step.kv_capacity or ec.ctx
                or getattr(model, "plan_ctx", None) or min(engine.config.context_length, 4096))
    pool = KVSlots(model.cfg, model.device, n, capacity, model.kv_dtype, KV_BLOCK)
    mode = "graphs" if ec.decode_step == "graphs" else "eager"
    return pool, BatchStep(model, pool, mode)


def warm_up(engine, pool: KVSlots, step: BatchStep) -> float:  # noqa: ANN001 (an Engine)
    """A prompt, three decode steps of one sequence (eager, capture, replay: its graphs read
    the pool's blocks, so every later request replays them) and three batched steps at each
    batch size, over the pool; then the pool empty again and the expert counters at zero.
    -> seconds"""
    t0 = time.perf_counter()
    ids = engine.tokenizer.encode("Strata warms up its kernels and decode graphs. " * 8)
    ids = (ids * (WARM_PROMPT // max(len(ids), 1) + 1))[:WARM_PROMPT]
    caches = [pool.take() for _ in range(pool.n_slots)]
    if pool.capacity >= len(ids) + 4 + 3 * len(step.sizes):
        engine.run_prompt(ids, caches[0])
        for t in ids[:3]:
            engine.model.decode(t, caches[0])
        for kv in caches[1:]:
            engine.run_prompt(ids[:4], kv)
        for size in step.sizes:
            n = min(size, len(caches))
            for t in ids[:3]:
                step([t] * n, caches[:n])
    for kv in caches:
        pool.give(kv)
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)
    stats = getattr(engine.model.experts, "stats", None)
    if hasattr(stats, "reset"):
        stats.reset()
    return time.perf_counter() - t0
