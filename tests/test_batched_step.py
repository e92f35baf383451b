"""The batched decode step (B sequences of one KV pool, padded to the next batch size) gives each
sequence the logits it gets decoded alone, for every architecture's mixer (GQA, sinks and
windows, the hybrids' recurrent state, MLA's latents), KV type and expert plan; padded rows
write no sequence's rows and are never counted."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_offload import offload

from strata.engine.batch_step import BatchStep, padded_size
from strata.engine.sampling import SamplingParams, sample
from strata.kernels.tuning import MIXED_STEP_ROWS
from strata.model.parts import Segment
from strata.runtime.kv_slots import KVSlots

# prompts of different lengths (the rows of one batch sit at different positions)
PROMPTS = [[5, 311, 17], [902, 64], [64, 1000, 3, 250, 777], [41, 8, 8, 900], [7],
           [12, 13, 14, 15, 16, 17]]
STEPS = 4  # decode steps after the prompts


def pool_for(engine, slots: int, capacity: int = 32, block: int | None = None) -> KVSlots:
    m = engine.model
    return KVSlots(m.cfg, m.device, slots, capacity, m.kv_dtype, block)


def prefill(engine, prompt: list[int], kv) -> torch.Tensor:  # noqa: ANN001
    return engine.model.forward(torch.tensor(prompt), [Segment(kv, len(prompt))])


def alone(engine, prompt: list[int], fed: list[int]) -> np.ndarray:
    """The sequence decoded by itself (the one-sequence decode step) over a cache of its own,
    fed the tokens `fed` -> logits [len(fed), V]."""
    kv = engine.model.new_cache(64)
    prefill(engine, prompt, kv)
    return np.stack([engine.model.decode(t, kv)[0].float().cpu().numpy().copy() for t in fed])


def batched(engine, step: BatchStep, prompts: list[list[int]], steps: int,
            seeds: list[int] | None = None) -> tuple[list[list[int]], list[np.ndarray]]:
    """Every prompt prefilled into the pool, then `steps` batched decode steps; tokens greedy
    (or sampled with each sequence's seed) -> (tokens fed per sequence, logits [steps, V])."""
    caches = [step.pool.take() for _ in prompts]
    last = [prefill(engine, p, kv)[0] for p, kv in zip(prompts, caches, strict=True)]
    gens = [torch.Generator().manual_seed(s) for s in seeds] if seeds else None
    params = SamplingParams(temperature=0.8 if seeds else 0.0, max_tokens=steps)
    fed, logits = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(steps):
        toks = [sample(row, params, gens[i] if gens else None) for i, row in enumerate(last)]
        out = step(toks, caches)
        for i, t in enumerate(toks):
            fed[i].append(t)
            logits[i].append(out[i].float().cpu().numpy().copy())
        last = list(out.clone())
    return fed, [np.stack(x) for x in logits]


def assert_close(ours: np.ndarray, ref: np.ndarray) -> None:
    """float32 bounds: the two paths sum attention in another order."""
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-4 * max(1.0, np.abs(ref).max()))
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_batch_sizes_pad_to_the_next() -> None:
    assert [padded_size(n) for n in (1, 2, 3, 4, 5, 8, 9, 16)] == [1, 2, 4, 4, 8, 8, 16, 16]
    with pytest.raises(ValueError, match="at most 16"):
        padded_size(17)


# the architectures' mixers: GQA with q/k norms, sinks with sliding windows, the hybrid's
# recurrent state beside gated attention, MLA's latent rows; glm4moe's dense first layers and
# sigmoid routing
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "qwen35moe", "deepseek2", "glm4moe"])
@pytest.mark.parametrize("n", [3, 5])  # padded to 4 and 8
@pytest.mark.parametrize("block", [None, 3])  # a slot a sequence; blocks of 3 rows (paged)
def test_batched_step_gives_each_sequence_its_logits_alone(synth, arch, n, block):
    engine = offload(synth(arch, "Q4_K_M"), expert_cache="0", miss="cpu")
    # (a pool of 4 / 8 slots: n sequences run padded to its size)
    step = BatchStep(engine.model, pool_for(engine, padded_size(n), block=block), "eager")
    prompts = PROMPTS[:n]
    fed, logits = batched(engine, step, prompts, STEPS)
    for p, f, got in zip(prompts, fed, logits, strict=True):
        assert_close(got, alone(engine, p, f))
    assert step.steps["rows"] == n * STEPS
    assert step.steps["padded"] == (padded_size(n) - n) * STEPS


def last_row(engine, tokens: list[int]) -> np.ndarray:
    """The logits of the last of `tokens` through the plain forward over a cache of its own."""
    kv = engine.model.new_cache(64)
    return prefill(engine, tokens, kv)[0].float().cpu().numpy().copy()


# GQA with q/k norms, sinks with sliding windows, MLA's latent rows (stored for every row
# before any attends, as GQA's pool rows)
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "deepseek2"])
@pytest.mark.parametrize("block", [None, 4])  # a slot a sequence; blocks of 4 rows (paged)
# steps of 16 rows past the slots (the head over the last rows only), and within them
@pytest.mark.parametrize("slots", [3, 16])
def test_prompt_chunks_in_the_batched_step_give_the_plain_forwards_logits(synth, arch, block,
                                                                         slots):
    """Steps of decoding sequences beside prompt chunks (takes > 1): each sequence's last
    row's logits are those of its tokens through the plain forward on a cache of its own, for
    a prompt's first chunk, a chunk after a prompt prefilled before it, and chunks across block
    boundaries; the rows are counted and padded to the next size, past the pool's slots too."""
    engine = offload(synth(arch, "Q4_K_M"), expert_cache="0", miss="cpu")
    pool = pool_for(engine, slots, block=block)
    step = BatchStep(engine.model, pool, "eager")
    caches = [pool.take() for _ in range(3)]
    seqs = [list(PROMPTS[0]), [], list(PROMPTS[1])]  # (the third's prompt goes on in chunks)
    for p, kv in zip(seqs, caches, strict=True):
        if p:
            prefill(engine, p, kv)
    # (tokens each sequence takes a step: one decodes; a prompt from 0, then on past row 8; a
    # prompt from row 2 across row 4, then decoding) -> 1 + 6 + 5 = 12 rows at size 16, then
    # 1 + 9 + 1 = 11
    rounds = [[[3], [64, 1000, 3, 250, 777, 41], [8, 8, 900, 7, 12]],
              [[99], [13, 14, 15, 16, 17, 5, 311, 17, 902], [250]]]
    for fed in rounds:
        out = step([t for f in fed for t in f], caches, [len(f) for f in fed])
        assert out.shape == (3, engine.config.n_vocab)
        for i, f in enumerate(fed):
            seqs[i] += f
            assert caches[i].length == len(seqs[i])
            assert_close(out[i].float().cpu().numpy()[None], last_row(engine, seqs[i])[None])
    assert step.steps["rows"] == 23 and step.steps["padded"] == 2 * 16 - 23
    assert step._rows[16].logits.shape[0] == min(16, slots)
    pool.check_integrity()


def test_a_mixed_steps_host_layers_may_stream_their_misses(synth):
    """A step of 32 rows is a pass past --stream-min here: its host layers take the executor's
    streamed path (the ring), and the logits stay the plain forward's."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), expert_cache="0", miss="cpu", stream_min=2)
    assert engine.model.experts.choose(0, 32, engine.config.n_experts_used) == "streamed"
    pool = pool_for(engine, 2, capacity=64, block=4)
    step = BatchStep(engine.model, pool, "eager")
    a, b = pool.take(), pool.take()
    prefill(engine, PROMPTS[0], a)
    chunk = list(range(100, 131))
    out = step([3] + chunk, [a, b], [1, 31])  # 32 rows
    assert_close(out[0].float().numpy()[None], last_row(engine, PROMPTS[0] + [3])[None])
    assert_close(out[1].float().numpy()[None], last_row(engine, chunk)[None])


def test_a_chunk_that_starts_inside_a_shared_block_copies_it(synth):
    """A prompt's chunk whose first row lies in a block the prefix index holds too (copy on
    write) and whose rows cross into the next blocks: the block is copied before the step
    writes, the index's rows stay as they were, and both sequences of the step get the plain
    forward's logits; the pool's accounting holds."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), expert_cache="5", miss="cpu")
    pool = pool_for(engine, 2, block=4)
    step = BatchStep(engine.model, pool, "eager")
    first = [5, 311, 17, 902, 64, 1000, 3, 250, 777, 41]
    done = pool.take()
    prefill(engine, first, done)
    pool.keep(first, done)  # (a finished sequence's blocks, indexed for later prompts)
    pool.give(done)
    ids = first[:6] + [8, 8, 900, 7, 12]
    kv = pool.take()
    assert pool.lookup(ids, kv) == 6  # block 0 shared, block 1's first 2 rows copied
    shared = kv.table[0]
    kv.truncate(2)  # (as a rolled-back window would): its next row is inside the shared block
    index_rows = pool.store[:, :, shared * 4:(shared + 1) * 4].clone()
    other = pool.take()
    prefill(engine, PROMPTS[3], other)
    out = step([3] + ids[2:9], [other, kv], [1, 7])  # rows 2..8 of kv: blocks 0, 1 and 2
    assert kv.table[0] != shared and pool.refs[shared] == 1 and len(kv.table) == 3
    assert torch.equal(pool.store[:, :, shared * 4:(shared + 1) * 4], index_rows)
    assert_close(out[1].float().cpu().numpy()[None], last_row(engine, ids[:9])[None])
    assert_close(out[0].float().cpu().numpy()[None], last_row(engine, PROMPTS[3] + [3])[None])
    pool.check_integrity()
    pool.give(kv)
    pool.give(other)
    pool.check_integrity()


def test_the_head_over_the_last_rows_takes_unsummed_expert_rows(synth):
    """On CUDA a static step's experts may leave each row's K pair outputs unsummed ([B, K, D])
    for the next residual step to add; past the slots the head picks each sequence's last row
    of x and of those rows first. Here the CPU's summed output is handed on split in two rows
    a token: the logits stay those of the summed form."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), expert_cache="24")
    pool = pool_for(engine, 2, block=4)
    step = BatchStep(engine.model, pool, "eager")
    caches = [pool.take(), pool.take()]
    prefill(engine, PROMPTS[0], caches[0])
    want = step([3, 64, 1000, 3, 250], caches, [1, 4]).clone()  # 5 rows at size 8
    for kv in caches:
        kv.truncate(kv.length - (1 if kv is caches[0] else 4))
    real, split = step._experts, []

    def unsummed(i, h, ids, wts, sum_pairs):  # noqa: ANN001, ANN202
        out = real(i, h, ids, wts, sum_pairs)
        split.append(sum_pairs)
        return out if sum_pairs else torch.stack([out / 2, out / 2], dim=1)  # [B, 2, D]

    step._experts = unsummed
    got = step([3, 64, 1000, 3, 250], caches, [1, 4])
    assert split and not any(split) and step._rows[8].last_only
    assert_close(got.float().numpy(), want.float().numpy())


def test_takes_are_checked_and_a_hybrid_pool_refuses_several_tokens(synth):
    """A hybrid's recurrent state moves one token a step: a sequence taking more is refused
    with the reason, its cache untouched; takes must match the tokens; a sequence appears
    once."""
    engine = offload(synth("qwen35moe", "Q4_K_M"), expert_cache="0", miss="cpu")
    pool = pool_for(engine, 2)
    step = BatchStep(engine.model, pool, "eager")
    kv = pool.take()
    prefill(engine, PROMPTS[0], kv)
    with pytest.raises(ValueError, match="recurrent state .* one token a step"):
        step([1, 2], [kv], [2])
    assert kv.length == len(PROMPTS[0])
    with pytest.raises(ValueError, match="3 tokens for 1 sequences taking"):
        step([1, 2, 3], [kv], [2])
    with pytest.raises(ValueError, match="appears twice"):
        step([1, 2], [kv, kv])
    assert step([1], [kv], [1]).shape == (1, engine.config.n_vocab)
    assert kv.length == len(PROMPTS[0]) + 1


@pytest.mark.parametrize("kv_type", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("block", [None, 4])
def test_batched_step_over_reduced_kv_types(synth, kv_type, block):
    engine = offload(synth("qwen3moe", "Q4_K_M"), expert_cache="24", kv_type=kv_type)
    step = BatchStep(engine.model, pool_for(engine, 3, block=block), "eager")
    assert step.pool.store.dtype == engine.model.kv_dtype
    fed, logits = batched(engine, step, PROMPTS[:3], STEPS)
    for p, f, got in zip(PROMPTS[:3], fed, logits, strict=True):
        assert_close(got, alone(engine, p, f))


@pytest.mark.parametrize("cache", ["0", "5", "24"])  # host layers, some hits, all resident
def test_expert_counts_are_the_real_rows_only(synth, cache):
    engine = offload(synth("qwen2moe", "Q4_K_M"), expert_cache=cache, miss="cpu")
    step = BatchStep(engine.model, pool_for(engine, 4), "eager")
    st = engine.model.experts.stats
    caches = [step.pool.take() for _ in range(3)]
    for p, kv in zip(PROMPTS[:3], caches, strict=True):
        prefill(engine, p, kv)
    before = st.hits.sum() + st.cpu.sum() + st.streamed.sum()
    step([1, 2, 3], caches)  # 3 rows at batch size 4
    st.settle()
    pairs = st.hits.sum() + st.cpu.sum() + st.streamed.sum() - before
    assert pairs == 3 * engine.config.n_layers * engine.config.n_experts_used
    assert (len(step.plans[4].pieces) == 1) == (cache == "24")
    step([4, 5, 6, 7, 8], caches[:2], [1, 4])  # 5 rows of 2 sequences at batch size 8
    st.settle()
    pairs = st.hits.sum() + st.cpu.sum() + st.streamed.sum() - before
    assert pairs == 8 * engine.config.n_layers * engine.config.n_experts_used
    assert step.steps["rows"] == 8 and step.steps["padded"] == 1 + 3


def test_sampled_text_is_the_same_batched_and_alone(synth):
    """Each sequence samples with its own generator: the same seed gives the same tokens
    whatever ran beside it."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), expert_cache="5", miss="cpu")
    step = BatchStep(engine.model, pool_for(engine, 8), "eager")
    seeds = [11, 12, 13, 14, 15]
    fed, _ = batched(engine, step, PROMPTS[:5], 6, seeds)
    for i in range(5):
        solo, _ = batched(engine, step, PROMPTS[i:i + 1], 6, seeds[i:i + 1])
        assert solo[0] == fed[i]


def test_batch_sizes_end_at_the_pool_slots_or_the_mixed_rows(synth):
    """A hybrid's sizes end at the pool's slots (a padded row writes a free slot's state);
    without recurrent state they go on to MIXED_STEP_ROWS, for steps with a prompt's chunk."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), expert_cache="24")
    assert MIXED_STEP_ROWS == 32
    assert BatchStep(engine.model, pool_for(engine, 6), "eager").sizes == (1, 2, 4, 6, 8, 16, 32)
    assert BatchStep(engine.model, pool_for(engine, 16), "eager").sizes == (1, 2, 4, 8, 16, 32)
    assert BatchStep(engine.model, pool_for(engine, 1), "eager").sizes == (1, 2, 4, 8, 16, 32)
    hybrid = offload(synth("qwen35moe", "Q4_K_M"), expert_cache="0", miss="cpu")
    assert BatchStep(hybrid.model, pool_for(hybrid, 6), "eager").sizes == (1, 2, 4, 6)
    assert BatchStep(hybrid.model, pool_for(hybrid, 1), "eager").rows_max == 1


def test_padded_rows_of_a_hybrid_write_a_free_slots_state(synth):
    """A free slot's recurrent state takes a padded row's update; a sequence that takes the
    slot later starts from zeros and decodes as alone."""
    engine = offload(synth("qwen35moe", "Q4_K_M"), expert_cache="0", miss="cpu")
    pool = pool_for(engine, 4)
    step = BatchStep(engine.model, pool, "eager")
    caches = [pool.take() for _ in range(3)]
    for p, kv in zip(PROMPTS[:3], caches, strict=True):
        prefill(engine, p, kv)
    step([1, 2, 3], caches)  # padded to 4: the fourth row moves slot 3's state
    assert pool.ssm[:, 3].abs().sum() > 0
    kv = pool.take()
    assert kv.slot == 3 and pool.ssm[:, 3].abs().sum() == 0 and pool.conv[:, 3].abs().sum() == 0
    prefill(engine, PROMPTS[3], kv)
    got = np.stack([engine.model.decode(t, kv)[0].float().cpu().numpy().copy() for t in (5, 6)])
    assert_close(got, alone(engine, PROMPTS[3], [5, 6]))


def test_padded_rows_write_no_sequence_rows(synth):
    engine = offload(synth("qwen3moe", "Q4_K_M"), expert_cache="24")
    pool = pool_for(engine, 4)
    step = BatchStep(engine.model, pool, "eager")
    caches = [pool.take() for _ in range(3)]
    for p, kv in zip(PROMPTS[:3], caches, strict=True):
        prefill(engine, p, kv)
    free_rows = pool.store[:, :, 3 * pool.capacity: 4 * pool.capacity].clone()
    rows = [kv.store[:, :, : kv.length].clone() for kv in caches]
    step([1, 2, 3], caches)  # padded to 4: the fourth row writes the scratch row only
    assert torch.equal(pool.store[:, :, 3 * pool.capacity: 4 * pool.capacity], free_rows)
    for kv, old in zip(caches, rows, strict=True):
        assert torch.equal(kv.store[:, :, : old.shape[2]], old)  # rows before the new one kept
        assert kv.length == old.shape[2] + 1


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen35moe", "deepseek2"])
def test_one_sequence_step_over_a_paged_cache(synth, arch):
    """The one-sequence decode step reads a paged cache through its block table."""
    engine = offload(synth(arch, "Q4_K_M"), expert_cache="5", miss="cpu")
    pool = pool_for(engine, 2, block=3)
    kv = pool.take()
    prefill(engine, PROMPTS[2], kv)
    fed = [3, 99, 4, 250, 8]
    got = np.stack([engine.model.decode(t, kv)[0].float().cpu().numpy().copy() for t in fed])
    assert_close(got, alone(engine, PROMPTS[2], fed))
    assert len(kv.table) == 4 and pool.used_blocks == 4  # 10 rows in blocks of 3
    pool.give(kv)
    assert pool.used_blocks == 0 and pool.used == 0
    pool.check_integrity()


def test_the_step_refuses_caches_of_another_pool(synth):
    engine = offload(synth("qwen3moe", "Q4_K_M"), expert_cache="24")
    step = BatchStep(engine.model, pool_for(engine, 2), "eager")
    with pytest.raises(ValueError, match="its own KV pool"):
        step([1], [engine.model.new_cache(8)])


def test_the_plan_counts_the_batched_step_at_every_size(synth):
    """--batch 3 planned for CUDA: the memory plan's batched-step line holds every size's
    static buffers as BatchStep builds them (past the slots, logits for the last rows only),
    an estimate of its graphs' activations and the row indices by the context, so the plan
    stays a cap; no line for one sequence or on the CPU; a hybrid's sizes end at the slots."""
    from strata.config import EngineConfig, ModelConfig
    from strata.engine.batch_step import rows_bytes
    from strata.engine.memory_plan import make_plan, step_bytes
    from strata.experts.layout import expert_layouts
    from strata.gguf import open_model

    path = synth("qwen3moe", "Q4_K_M")
    mf = open_model(path)
    cfg = ModelConfig.from_model(mf)

    def plan(**kw):  # noqa: ANN003, ANN202
        ec = EngineConfig(**{"device": "cuda", "vram_budget_gib": 4, "ctx": 512} | kw)
        return make_plan(mf, cfg, ec, expert_layouts(mf, cfg))

    served = plan(sequences=3)
    fixed, row, sizes = step_bytes(cfg, 3)
    assert served.batch_sizes == sizes == (1, 2, 3, 4, 8, 16, 32)
    assert served.batch_step == fixed + 512 * row > 0 and served.left >= 0
    assert any(line.startswith("  batched step") and "1, 2, 3, 4, 8, 16, 32 rows" in line
               for line in served.lines())
    for other in (plan(sequences=1), plan(sequences=3, device="cpu"),
                  plan(sequences=3, decode_step="off")):
        assert other.batch_step == 0 and not any("batched step" in line
                                                 for line in other.lines())
    hybrid = open_model(synth("qwen35moe", "Q4_K_M"))
    hcfg = ModelConfig.from_model(hybrid)
    assert step_bytes(hcfg, 3)[2] == (1, 2, 3)
    engine = offload(path, expert_cache="24")
    step = BatchStep(engine.model, pool_for(engine, 3, capacity=512, block=16), "eager")
    for size in sizes:
        b = step._buffers(size)
        device = (b.inputs, b.valid, b.x, b.h, b.ids, b.wts, b.moe_out, b.carry, b.cpu_out,
                  b.staged_table, b.last, b.logits)
        assert sum(t.nbytes for t in device) == rows_bytes(cfg, size, 3)
        assert b.table.nbytes <= 8 * size * 512 // 16  # (a context row's share, counted by row)


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["5", "24"])
def test_batched_step_graphs_per_size_on_cuda(synth, cache):
    """Graphs per batch size: eager, captured, then replayed; each sequence's logits as alone."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cuda", expert_cache=cache, miss="cpu")
    step = BatchStep(engine.model, pool_for(engine, 5), "graphs")
    for n in (3, 5):
        fed, logits = batched(engine, step, PROMPTS[:n], STEPS)
        for p, f, got in zip(PROMPTS[:n], fed, logits, strict=True):
            ref = alone(engine, p, f)
            np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * max(1, np.abs(ref).max()))
    assert not step._failed and step.steps["captured"] >= 2 and step.steps["replayed"] > 0


@pytest.mark.cuda
def test_prompt_chunks_in_the_batched_steps_graphs_on_cuda(synth):
    """Mixed steps on CUDA graphs (eager, captured, replayed at the size past the pool's slots,
    the head over each sequence's last row): two decoding sequences beside a prompt's chunks of
    10 tokens; each last row near the plain forward's (the prompt path's kernels round
    differently: a relative bound, not the decode step's)."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cuda", expert_cache="24")
    pool = pool_for(engine, 3, capacity=64, block=4)
    step = BatchStep(engine.model, pool, "graphs")
    caches = [pool.take() for _ in range(3)]
    seqs = [list(PROMPTS[0]), list(PROMPTS[2]), []]
    for p, kv in zip(seqs[:2], caches[:2], strict=True):
        prefill(engine, p, kv)
    for r in range(4):  # 12 rows a step: size 16
        fed = [[3 + r], [17 + r], list(range(100 + 10 * r, 110 + 10 * r))]
        out = step([t for f in fed for t in f], caches, [len(f) for f in fed])
        for i, f in enumerate(fed):
            seqs[i] += f
            ref = torch.from_numpy(last_row(engine, seqs[i]))
            got = out[i].float().cpu()
            assert float((got - ref).norm() / ref.norm()) < 3e-2, (r, i)
    assert not step._failed and step.steps["captured"] >= 1 and step.steps["replayed"] >= 1
    pool.check_integrity()


@pytest.mark.cuda
def test_one_sequence_graphs_serve_every_paged_cache_on_cuda(synth):
    """The one-sequence step's graphs are captured once for the pool: two sequences in other
    blocks replay them, each with its logits alone."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cuda", expert_cache="24")
    pool = pool_for(engine, 2, block=4)
    caches = [pool.take(), pool.take()]
    for p, kv in zip(PROMPTS[:2], caches, strict=True):
        prefill(engine, p, kv)
    fed = [3, 99, 4, 250]
    got = [[], []]
    for t in fed:
        for i, kv in enumerate(caches):
            got[i].append(engine.model.decode(t, kv)[0].float().cpu().numpy().copy())
    step = engine.model.step
    assert not step._failed and step.steps["captured"] == 1 and step.steps["replayed"] > 0
    for p, g in zip(PROMPTS[:2], got, strict=True):
        ref = alone(engine, p, fed)
        np.testing.assert_allclose(np.stack(g), ref, rtol=0, atol=2e-3 * max(1, np.abs(ref).max()))


def test_plans_per_batch_size():
    """A resident layer stays in the piece only at the sizes the fused kernels cover (e.g.
    --kernels exact: up to 4 tokens); a layer with misses waits on the host at every size."""
    step = BatchStep.__new__(BatchStep)
    step.cuda = True
    step.ex = SimpleNamespace(fused=SimpleNamespace(covers=lambda i, t: i != 3 and t <= 4))
    step._base_paths = ["resident", "gathered", "none", "host", "resident"]
    assert step._paths(4) == ["resident", "host_hits", "none", "host", "resident"]
    assert step._paths(8) == ["host", "host", "none", "host", "host"]
    step.cuda = False
    step._base_paths = ["resident", "host", "none"]
    assert step._paths(16) == ["resident", "host", "none"]
