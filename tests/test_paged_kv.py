"""Paged KV blocks of one pool (strata.runtime.kv_slots, paged_kv): the plain forward over a
paged cache gives the logits of a cache of its own; blocks are accounted (free + used == total,
refcounts == holders) through growth, sharing, copy on write, cancel and a full pool; a prompt
that starts like a finished one shares its blocks and gets identical logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_offload import offload

from strata.errors import StrataError
from strata.model.parts import Segment
from strata.runtime.kv_slots import KVSlots, PoolFull

PROMPT = [5, 311, 17, 902, 64, 64, 1000, 3, 250, 777, 41]


@pytest.fixture(scope="module")
def engine(synth):
    return offload(synth("qwen3moe", "Q4_K_M"), expert_cache="24")


def pool_for(engine, slots: int = 3, capacity: int = 16, block: int = 4, **kw) -> KVSlots:
    m = engine.model
    return KVSlots(m.cfg, m.device, slots, capacity, kw.get("dtype", m.kv_dtype), block)


def run(engine, tokens: list[int], kv) -> np.ndarray:  # noqa: ANN001
    """tokens through the plain forward -> every position's logits [n, V]"""
    out = engine.model.forward(torch.tensor(tokens), [Segment(kv, len(tokens))],
                               all_logits=True)
    return out.float().numpy()


def test_plain_forward_over_blocks_is_the_plain_cache(engine):
    pool = pool_for(engine)
    kv = pool.take()
    ref_kv = engine.model.new_cache(16)
    for part in (PROMPT[:5], PROMPT[5:6], PROMPT[6:]):  # chunks across block edges
        np.testing.assert_allclose(run(engine, part, kv), run(engine, part, ref_kv), atol=1e-5)
    assert kv.length == len(PROMPT) and len(kv.table) == 3  # 11 rows in blocks of 4
    assert pool.used_blocks == 3 and len(pool.free_blocks) == pool.n_blocks - 3
    pool.check_integrity()


def test_blocks_are_accounted_and_cancel_frees_them_at_once(engine):
    pool = pool_for(engine)
    a, b = pool.take(), pool.take()
    run(engine, PROMPT, a)
    run(engine, PROMPT[:3], b)
    assert pool.used_blocks == 3 + 1
    assert len(pool.free_blocks) + pool.used_blocks == pool.n_blocks
    pool.check_integrity()
    pool.give(a)  # (a cancel: its blocks free now, not when the cache is collected)
    assert pool.used_blocks == 1 and pool.used == 1
    pool.check_integrity()
    del b  # a dropped cache gives its blocks back too
    assert pool.used_blocks == 0 and pool.used == 0
    pool.check_integrity()


def test_a_full_pool_refuses_and_touches_no_other_sequence(engine):
    pool = pool_for(engine, slots=2, capacity=8, block=4)  # 4 blocks in all
    a, b = pool.take(), pool.take()
    run(engine, PROMPT[:8], a)  # a holds 2 blocks
    run(engine, PROMPT[:5], b)  # b 2
    rows_a = pool.store[:, :, : 4 * 4].clone()
    with pytest.raises(PoolFull):
        pool.take()  # no slot
    with pytest.raises(StrataError, match="holds 8"):
        run(engine, PROMPT[5:9], b)  # past a sequence's rows: refused, before any write
    assert b.length == 5 and len(b.table) == 2
    assert torch.equal(pool.store[:, :, : 4 * 4], rows_a)
    pool.check_integrity()


def test_a_full_pool_of_blocks_refuses(engine):
    pool = pool_for(engine, slots=2, capacity=8, block=4)
    a, b = pool.take(), pool.take()
    run(engine, PROMPT[:8], a)
    run(engine, PROMPT[:4], b)
    pool.refs[pool.free_blocks[-1]] += 1  # one free block taken elsewhere
    held = pool.free_blocks.pop()
    with pytest.raises(PoolFull, match="blocks"):
        b.reserve(6)
    assert len(b.table) == 1 and b.length == 4  # as it was
    pool.unref(held)
    b.reserve(6)
    assert len(b.table) == 2


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2"])  # key/value rows; MLA's latents
def test_prefix_reuse_gives_identical_logits_and_shares_blocks(synth, arch):
    engine = offload(synth(arch, "Q4_K_M"), expert_cache="24")
    pool = pool_for(engine, block=4)
    first = pool.take()
    run(engine, PROMPT, first)
    pool.keep(PROMPT, first)
    pool.give(first)
    assert pool.used_blocks == 3  # the index holds the finished sequence's blocks
    pool.check_integrity()
    prompt = PROMPT[:10] + [9, 9]  # the same first 10 tokens
    kv = pool.take()
    reused = pool.lookup(prompt, kv)
    assert reused == 10  # two full blocks shared, 2 rows of the third copied
    assert kv.table[:2] == [0, 1] and pool.refs[0] == pool.refs[1] == 2
    assert kv.table[2] not in (0, 1, 2) and pool.refs[kv.table[2]] == 1
    got = run(engine, prompt[reused:], kv)
    fresh = run(engine, prompt, engine.model.new_cache(16))[reused:]
    # (float32 bounds: the rest runs as a chunk of its own, MLA's in its absorbed form)
    np.testing.assert_allclose(got, fresh, atol=1e-5 * max(1.0, np.abs(fresh).max()))
    assert (got.argmax(-1) == fresh.argmax(-1)).all()
    pool.check_integrity()
    other = pool.take()  # a third prompt reads the shared blocks, written by nobody
    assert pool.lookup(PROMPT[:9], other) == 8
    run(engine, PROMPT[8:9], other)
    pool.check_integrity()


def test_copy_on_write_of_a_shared_block(engine):
    pool = pool_for(engine, block=4)
    a = pool.take()
    run(engine, PROMPT[:8], a)
    pool.keep(PROMPT[:8], a)
    b = pool.take()
    assert pool.lookup(PROMPT[:8] + [1], b) == 8
    before = pool.store.clone()
    b.truncate(6)  # (as a rollback would) then a write into the shared second block
    run(engine, [7, 7], b)
    assert b.table[1] != a.table[1]  # copied before the write
    assert torch.equal(pool.store[:, :, 4:8], before[:, :, 4:8])  # a's rows as they were
    pool.check_integrity()


def test_the_index_gives_blocks_back_when_the_pool_runs_out(engine):
    pool = pool_for(engine, slots=2, capacity=8, block=4)
    a = pool.take()
    run(engine, PROMPT[:8], a)
    pool.keep(PROMPT[:8], a)
    pool.give(a)
    b, c = pool.take(), pool.take()
    run(engine, PROMPT[3:11], b)  # other tokens: nothing shared
    run(engine, [1, 2, 3, 4, 5, 6, 7, 8], c)  # the index's blocks evicted for it
    assert not pool.index and pool.used_blocks == 4
    pool.check_integrity()


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_reduced_kv_types_over_blocks(synth, kv_type):
    engine = offload(synth("qwen3moe", "Q4_K_M"), expert_cache="24", kv_type=kv_type)
    pool = pool_for(engine)
    kv, ref = pool.take(), engine.model.new_cache(16)
    for part in (PROMPT[:6], PROMPT[6:]):
        np.testing.assert_allclose(run(engine, part, kv), run(engine, part, ref), atol=1e-5)
    assert pool.block_bytes * pool.n_blocks < pool.nbytes  # (+ the scratch row)


@pytest.mark.parametrize("ctx", [100, 4096])
def test_the_plan_counts_the_batch_pool_whole(synth, ctx):
    """--batch 3: the memory plan's KV line counts the pool the server allocates (each
    sequence's rows rounded up to whole blocks, and the scratch row), not just ctx rows each."""
    from strata.config import EngineConfig, ModelConfig
    from strata.engine.memory_plan import make_plan
    from strata.experts.layout import expert_layouts
    from strata.gguf import open_model
    from strata.runtime.kv_slots import POOL_BLOCK

    mf = open_model(synth("qwen3moe", "Q4_K_M"))
    cfg = ModelConfig.from_model(mf)
    plan = make_plan(mf, cfg, EngineConfig(sequences=3, ctx=ctx, vram_budget_gib=4),
                     expert_layouts(mf, cfg))
    pool = KVSlots(cfg, torch.device("cpu"), 3, plan.ctx, torch.float32, POOL_BLOCK)
    assert plan.ctx == ctx and pool.nbytes <= plan.kv
    one = make_plan(mf, cfg, EngineConfig(ctx=ctx, vram_budget_gib=4), expert_layouts(mf, cfg))
    assert plan.kv > 3 * one.kv  # (the rounding and the scratch row on top of 3 caches)


def test_the_plan_counts_the_served_prompts_scratch(synth):
    """--batch 3 planned for CUDA with the prompt graphs: the KV line holds the pool and the
    plain scratch prompts run in (PREFILL_SCRATCH_ROWS rows, or the chunk where smaller) and
    says so; one sequence, or --prompt-graphs off, plans none."""
    from strata.config import EngineConfig, ModelConfig
    from strata.engine.memory_plan import make_plan
    from strata.experts.layout import expert_layouts
    from strata.gguf import open_model
    from strata.kernels.tuning import PREFILL_SCRATCH_ROWS
    from strata.runtime.kv_cache import KVCache
    from strata.runtime.kv_slots import POOL_BLOCK

    mf = open_model(synth("qwen3moe", "Q4_K_M"))
    cfg = ModelConfig.from_model(mf)

    def plan(**kw):  # noqa: ANN003, ANN202
        ec = EngineConfig(device="cuda", vram_budget_gib=4, kv_type="f16", ctx=512, **kw)
        return make_plan(mf, cfg, ec, expert_layouts(mf, cfg))

    served = plan(sequences=3)
    rows = min(served.chunk, PREFILL_SCRATCH_ROWS)
    assert served.prefill_rows == rows and served.prompt_buckets
    assert f"+ {rows} rows that prompts run in" in "\n".join(served.lines())
    pool = KVSlots(cfg, torch.device("cpu"), 3, served.ctx, torch.float16, POOL_BLOCK)
    scratch = KVCache(cfg.n_kv_layers, cfg.n_kv_heads, cfg.head_dim, torch.device("cpu"), rows,
                      dtype=torch.float16)
    assert pool.nbytes + scratch.nbytes <= served.kv
    assert served.kv - plan(sequences=3, prompt_graphs="off").kv == scratch.nbytes
    assert plan(sequences=1).prefill_rows == 0
    assert plan(sequences=3, prompt_graphs="off").prefill_rows == 0


@pytest.mark.parametrize("block", [None, 4], ids=["rows", "paged"])
def test_a_taken_slot_starts_with_a_zero_recurrent_state(synth, block):
    """A hybrid's slot given back and taken again (by the next request) starts from a zero
    conv and delta-rule state, not the last holder's: a stale state would go on into the new
    sequence's first tokens, which no accounting check sees."""
    import gc

    from strata.config import ModelConfig
    from strata.gguf import open_model

    cfg = ModelConfig.from_model(open_model(synth("qwen35moe", "Q8_0")))
    pool = KVSlots(cfg, torch.device("cpu"), 1, 16, torch.float32, block)
    kv = pool.take()
    kv.state.conv.fill_(3.0)
    kv.state.ssm.fill_(-2.0)
    assert pool.conv.abs().sum() > 0 and pool.ssm.abs().sum() > 0  # (it writes the pool's own)
    del kv
    gc.collect()
    kv = pool.take()  # the one slot again
    assert kv.slot == 0 and not kv.state.conv.any() and not kv.state.ssm.any()
    pool.check_integrity()
