"""Prompt chunks replayed from CUDA graphs (strata.engine.chunk_graph): a chunk padded up to its
bucket gives the plain forward's logits and KV rows; the graphs are captured once per bucket and
replayed; the cases that need the host run eagerly, each said once; the memory plan counts the
graphs' pool as a line of its own. On the CPU the padded passes run uncaptured over the same
static buffers; on CUDA the graphs against the eager forward."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
from test_offload import offload

import strata.model.parts.attention as attention
from strata.config import EngineConfig, ModelConfig
from strata.engine.chunk_graph import (
    ChunkGraphs,
    blocked,
    bucket_of,
    buckets_for,
    graph_pool_bytes,
    plan_buckets,
)
from strata.engine.memory_plan import make_plan
from strata.errors import StrataError
from strata.experts.layout import expert_layouts
from strata.gguf import open_model
from strata.kernels.gpu.chunk_attention import chunk_attention
from strata.kernels.tuning import PROMPT_GRAPH_BUCKETS
from strata.model.layers import attention as reference_attention
from strata.model.parts import Segment
from strata.yarn import Yarn

LENGTHS = (1, 7, 16, 100, 128, 300, 513)  # below, at and past buckets; one past 512
PREFIX = 37  # tokens before a chunk that starts later


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1024, (n,), generator=g).tolist()


# ---- the buckets and the padding --------------------------------------------------------------


def test_a_chunk_takes_the_smallest_bucket_that_holds_it():
    b = (16, 32, 64)
    assert [bucket_of(n, b) for n in (1, 15, 16, 17, 64, 65)] == [16, 16, 16, 32, 64, None]
    assert buckets_for(4096) == PROMPT_GRAPH_BUCKETS  # up to the plan's largest chunk
    assert buckets_for(300) == (16, 32, 64, 128, 256, 512)  # (512 holds a whole chunk)
    assert buckets_for(16) == (16,) and buckets_for(1) == (16,)
    assert list(PROMPT_GRAPH_BUCKETS) == sorted(set(PROMPT_GRAPH_BUCKETS))


def cpu_graphs(synth, buckets=(16, 32, 64)):  # noqa: ANN001, ANN201
    """A CPU offload engine with every expert in a slot, its prompt chunks on the fused chunk
    path's torch forms (as on CUDA with --kernels fused), and ChunkGraphs running its padded
    passes uncaptured."""
    # (one thread: the padded and plain passes' matmuls then sum in nearly the same order, which
    # the first-layer check below relies on; on two, torch splits 16 and 7 rows differently)
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cpu", expert_cache="24", threads=1)
    model = engine.model
    model.fused_attention = True
    return engine, ChunkGraphs(model, buckets, mode="eager")


def run_chunks(model, chunks: list[list[int]], graphs):  # noqa: ANN001, ANN201
    """The chunks in turn into one new cache, through `graphs` (None: the plain forward) ->
    ([last logits of each chunk], the cache)."""
    model.chunks = graphs
    kv = model.new_cache(256)
    out = [model.forward(torch.tensor(c), [Segment(kv, len(c))]).clone() for c in chunks]
    return out, kv


@pytest.mark.parametrize("lengths", [(1,), (7, 16), (16, 33, 1), (PREFIX, 64), (5, 7, 9, 11)])
def test_padded_chunks_equal_the_plain_forward(synth, monkeypatch, lengths):
    """Chunks padded to their bucket (after the real tokens) at start 0 and later: each chunk's
    last logits and every real KV row are the plain forward's to float32 rounding (the
    attention in float32 here: bf16's rounding would differ with the padded row count), the
    first layer's rows to a few float32 roundings (the BLAS may take another kernel for 1 row
    than for 16: 6 epsilons on one Intel machine); the cache counts the real tokens only."""
    monkeypatch.setattr(attention, "attention_bf16", lambda q, k, v: reference_attention(
        q, k.float(), v.float(), k.shape[0] - q.shape[0]))
    engine, graphs = cpu_graphs(synth)
    assert graphs.why is None
    tokens = prompt(sum(lengths))
    chunks, at = [], 0
    for n in lengths:
        chunks.append(tokens[at:at + n])
        at += n
    ref, ref_kv = run_chunks(engine.model, chunks, None)
    ours, kv = run_chunks(engine.model, chunks, graphs)
    assert kv.length == ref_kv.length == len(tokens)
    for a, b in zip(ours, ref, strict=True):
        assert a.shape == b.shape == (1, engine.config.n_vocab)
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    rows = slice(0, len(tokens))
    mine, theirs = kv.store[:, :, rows], ref_kv.store[:, :, rows]
    # the embeddings' layer: no padding row leaks in, so equal to a few float32 roundings
    first, eps = theirs[:, 0], torch.finfo(torch.float32).eps
    assert float((mine[:, 0] - first).abs().max()) <= 16 * eps * float(first.abs().max())
    assert float((mine - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())
    assert graphs.steps["warm"] == len(lengths) and graphs.steps["replayed"] == 0


def test_padding_rows_are_written_past_the_end_and_then_overwritten(synth):
    """A chunk of 7 in bucket 16 writes rows 7..15 (the padding's keys); the next chunk writes
    its own rows over them, and the cache's length never counts them."""
    engine, graphs = cpu_graphs(synth)
    model = engine.model
    model.chunks = graphs
    kv = model.new_cache(256)
    kv.store.fill_(float("nan"))
    model.forward(torch.tensor(prompt(7)), [Segment(kv, 7)])
    assert kv.length == 7
    assert not kv.store[:, :, :16].isnan().any()  # real and padded rows written
    assert kv.store[:, :, 16:].isnan().all()
    model.forward(torch.tensor(prompt(3, 1)), [Segment(kv, 3)])
    assert kv.length == 10  # (its own padding reaches row 22)
    assert not kv.store[:, :, :23].isnan().any() and kv.store[:, :, 23:].isnan().all()


# ---- when the chunks run eagerly ----------------------------------------------------------------


def test_the_eager_cases_are_named_once(synth):
    mf = open_model(synth("qwen3moe", "Q4_K_M"))
    cfg = ModelConfig.from_model(mf)
    cuda = EngineConfig(device="cuda", kernels="fused", kv_type="f16")
    assert blocked(cfg, cuda) is None
    for change, words in ((dict(prompt_graphs="off"), "--prompt-graphs off"),
                          (dict(device="cpu"), "the CPU device"),
                          (dict(offload="off"), "--offload off"),
                          (dict(kernels="exact"), "--kernels exact"),
                          (dict(kv_type="f32"), "--kv-type f32"),
                          (dict(kv_type="q8_0"), "--kv-type q8_0")):
        assert words in blocked(cfg, dataclasses.replace(cuda, **change)), change
    # (YaRN's chunks run on the fused kernels: its frequency table, its q/k scale in the norms)
    assert blocked(dataclasses.replace(cfg, yarn=Yarn(4.0, 8)), cuda) is None
    other = ModelConfig.from_model(open_model(synth("deepseek2", "Q8_0")))
    assert "latent cache" in blocked(other, cuda)
    # (a hybrid's Gated DeltaNet layers keep the padding out of their state: captured)
    for arch in ("qwen35moe", "qwen3next"):
        assert blocked(ModelConfig.from_model(open_model(synth(arch, "Q8_0"))), cuda) is None
    # (gpt-oss's sinks and windows run on the fused chunk path: its chunks are captured)
    assert blocked(ModelConfig.from_model(open_model(synth("gpt-oss", "Q8_0"))), cuda) is None


def test_each_chunk_that_needs_the_host_runs_eagerly(synth):
    engine, graphs = cpu_graphs(synth)
    model = engine.model
    kv = model.new_cache(256)
    one = [Segment(kv, 5)]
    tokens = torch.tensor(prompt(5))
    assert graphs.eager_reason(tokens, one, False) == ""
    assert graphs.eager_reason(tokens, one, True) == "every position's logits"
    other = model.new_cache(16)
    assert graphs.eager_reason(torch.tensor(prompt(6)), [Segment(kv, 5), Segment(other, 1)],
                               False) == "several sequences"
    assert "longer than 64" in graphs.eager_reason(torch.tensor(prompt(65)), [Segment(kv, 65)],
                                                   False)
    kv.limit = 20  # (the plan's rows: a bucket of 16 at 5 would pass them)
    kv.length = 5
    assert "padding past" in graphs.eager_reason(tokens, one, False)
    kv.limit, kv.length = None, 0
    model.hidden_hook = lambda segments, h: None
    assert "hook" in graphs.eager_reason(tokens, one, False)
    model.hidden_hook = None
    model.layers[1].ffn.hook = lambda *a: a[1]
    assert "hook" in graphs.eager_reason(tokens, one, False)
    model.layers[1].ffn.hook = None
    # such a chunk runs the plain forward, counted by its reason
    model.chunks = graphs
    model.forward(torch.tensor(prompt(65)), [Segment(model.new_cache(128), 65)])
    assert graphs.steps["eager"] == 1 and "1 longer than 64 tokens" in graphs.line()


def test_a_cache_with_experts_outside_vram_runs_eagerly(synth, caplog):
    caplog.set_level(logging.INFO, logger="strata")
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cpu", expert_cache="5")
    graphs = ChunkGraphs(engine.model, (16,), mode="eager")
    assert "outside VRAM" in graphs.why and "prompt graphs: off" in caplog.text
    assert graphs(torch.tensor(prompt(3)), [Segment(engine.model.new_cache(16), 3)]) is None


def test_the_flag_is_parsed_and_checked(synth):
    from strata.cli.engine_flags import engine_config
    from strata.cli.main import build_parser

    args = build_parser("generate").parse_args(["generate", "m.gguf", "--prompt-graphs", "off"])
    assert args.prompt_graphs == "off"
    assert engine_config(args).prompt_graphs == "off"
    with pytest.raises(SystemExit):
        build_parser("generate").parse_args(["generate", "m.gguf", "--prompt-graphs", "maybe"])
    with pytest.raises(StrataError, match="--prompt-graphs maybe"):
        offload(synth("qwen3moe", "Q4_K_M"), "cpu", prompt_graphs="maybe")
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cpu")
    assert engine.model.chunks.why == "the CPU device"  # built, off, with its reason


# ---- the memory plan -----------------------------------------------------------------------------


def plan(synth, **kw):  # noqa: ANN001, ANN003, ANN201
    mf = open_model(synth("qwen3moe", "Q4_K_M"))
    cfg = ModelConfig.from_model(mf)
    layouts = expert_layouts(mf, cfg)
    kw = {"device": "cuda", "kernels": "fused", "kv_type": "f16", "ctx": 256,
          "vram_budget_gib": 2.0, **kw}
    return cfg, layouts, make_plan(mf, cfg, EngineConfig(**kw), layouts)


def test_the_plan_counts_the_graphs_pool_as_a_line(synth):
    cfg, layouts, whole = plan(synth)
    assert whole.slots_per_layer == [cfg.n_experts] * cfg.n_layers  # every expert in a slot
    b = whole.prompt_buckets
    assert b == buckets_for(whole.chunk) and whole.prompt_graphs > 0
    # one pool, the largest pass's, and each bucket's static buffers
    assert whole.prompt_graphs >= graph_pool_bytes(cfg, layouts, b[-1], whole.prompt_weights)
    lines = "\n".join(whole.lines())
    assert f"chunks padded to {', '.join(map(str, b))} tokens" in lines
    assert whole.left == (whole.budget - whole.context - whole.dense - whole.kv
                          - whole.workspace - whole.activations - whole.staging - whole.ring
                          - whole.cache - whole.prompt_graphs)
    for kw, why in ((dict(prompt_graphs="off"), "--prompt-graphs off"),
                    (dict(kv_type="f32"), "--kv-type f32"),
                    (dict(expert_cache="20"), "experts outside VRAM"),
                    (dict(device="cpu"), "the CPU device")):
        _, _, other = plan(synth, **kw)
        assert other.prompt_graphs == 0 and other.prompt_buckets == (), kw
        assert f"prompt graphs         0 B (none: {why}" in "\n".join(other.lines()), kw


def test_the_buckets_are_limited_to_what_the_plan_leaves(synth):
    cfg, layouts, whole = plan(synth)
    ec = EngineConfig(device="cuda", kernels="fused", kv_type="f16")
    slots = whole.slots_per_layer
    full = plan_buckets(cfg, ec, layouts, slots, whole.chunk, whole.prompt_weights, 1 << 40)
    assert full[1] == whole.prompt_buckets
    room = graph_pool_bytes(cfg, layouts, 64, whole.prompt_weights) + (1 << 20)
    n, some, w, _ = plan_buckets(cfg, ec, layouts, slots, whole.chunk, whole.prompt_weights,
                                 room)
    assert some == (16, 32, 64) and n <= room and w == 0  # (no --spec: no windows)
    none = plan_buckets(cfg, ec, layouts, slots, whole.chunk, whole.prompt_weights, 1024)
    assert none[:3] == (0, (), 0) and "too little room" in none[3]


# ---- the parts the graphs need ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,start", [(5, 0), (16, 9), (7, 40)])
def test_chunk_attention_reads_the_length_from_the_device(dtype, t, start):
    """chunk_attention over a whole storage with garbage past its length equals the causal
    attention over the rows up to it, q rounded to the cache's type (its torch form here;
    test_flash_chunk_attention_equals_its_torch_form checks flash against it on CUDA)."""
    g = torch.Generator().manual_seed(t + start)
    cap, h, hkv, hd = 64, 8, 2, 32
    q = torch.randn(t, h, hd, generator=g)
    k = torch.randn(cap, hkv, hd, generator=g).to(dtype)
    v = torch.randn(cap, hkv, hd, generator=g).to(dtype)
    n = start + t
    k[n:], v[n:] = float("nan"), float("nan")  # never read
    out = chunk_attention(q, k, v, torch.tensor([n]), hd ** -0.5)
    ref = reference_attention(q.to(dtype).float(), k[:n].float(), v[:n].float(), start)
    assert out.shape == (t, h * hd) and torch.allclose(out, ref, atol=1e-5)
    # gpt-oss's window and sinks: the reference's sink attention over the same rounded rows
    from strata.model.parts.sink_attention import sink_attention

    sinks = torch.randn(h, generator=g)
    out = chunk_attention(q, k, v, torch.tensor([n]), hd ** -0.5, 6, sinks)
    ref = sink_attention(q.to(dtype).float(), k[:n], v[:n], start, sinks, 6, hd ** -0.5)
    assert torch.allclose(out, ref, atol=1e-5)


def test_grouped_path_dequantizes_only_the_routed_experts(monkeypatch):
    """moe_forward_grouped hands dequantize_slots -1 for every expert no pair routes to (and
    for those without a slot): the launches over the fixed grid skip them."""
    import numpy as np
    from test_moe_grouped import CASES, make_layer

    import strata.kernels.gpu.moe_grouped as mg

    seen = []
    real = mg.dequantize_slots

    def spy(w, slots, qtype, n_cols, out):  # noqa: ANN001, ANN202
        seen.append(slots.clone())
        return real(w, slots, qtype, n_cols, out)

    monkeypatch.setattr(mg, "dequantize_slots", spy)
    layer = make_layer(CASES["Q4_K/Q4_K/Q6_K"], 9, np.random.default_rng(3), "cpu")
    mg.moe_forward_grouped(**layer)
    routed = torch.zeros(layer["slot_of_expert"].shape[0], dtype=torch.bool)
    routed[layer["ids"].reshape(-1)] = True
    want = torch.where(routed, layer["slot_of_expert"], -1)
    assert len(seen) == 3 and all(torch.equal(s, want) for s in seen)
    assert (want < 0).sum() > (layer["slot_of_expert"] < 0).sum()  # (some resident unused)


# ---- CUDA: the graphs against the eager forward --------------------------------------------


def cuda_engine(synth, **kw):  # noqa: ANN001, ANN003, ANN201
    return offload(synth("qwen3moe", "Q4_K_M"), "cuda", expert_cache="24", kernels="fused",
                   kv_type="f16", **kw)


def through(model, chunks: list[list[int]], graphs):  # noqa: ANN001, ANN201
    """run_chunks, then the cache's rows to the host and the cache dropped (its storage back to
    the pool: the next cache gets it, and with it the captured graphs)."""
    out, kv = run_chunks(model, chunks, graphs)
    rows = kv.store[:, :, : kv.length].float().cpu()
    return [o.float().cpu() for o in out], rows


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_yarn_chunks_through_graphs_give_the_reference_logits(synth, tmp_path, arch):
    """A qwen3moe file with YaRN RoPE (factor 4 over 8 tokens: every position interpolated),
    and gpt-oss (YaRN, sinks, a window of 16 on every other layer, biased experts): prompts of
    37 and 200 tokens, eagerly, captured and replayed from the prompt graphs, give the CPU
    reference path's logits within bf16 rounding."""
    from dataclasses import replace

    from strata.cli.logits import compute_logits
    from strata.engine.generator import Engine
    from strata.synth.presets import get_preset
    from strata.synth.recipes import Recipe
    from strata.synth.writer import write_model

    path = tmp_path / "yarn.gguf"
    preset = get_preset("tiny", arch)
    if arch == "qwen3moe":
        preset = replace(preset, yarn_factor=4.0, yarn_orig_ctx=8)
    write_model(path, preset, Recipe("Q4_K_M" if arch == "qwen3moe" else "MXFP4"), 0)
    engine = offload(path, "cuda", expert_cache=str(preset.n_layers * preset.n_experts),
                     kernels="fused", kv_type="f16")
    graphs = engine.model.chunks
    assert graphs.why is None and engine.config.yarn is not None
    reference = Engine.load(path)
    for n in (37, 200):
        tokens = prompt(n, 2)
        ref = torch.from_numpy(compute_logits(reference, tokens))[-1:]
        for _ in range(3):  # (a bucket's first chunk runs eagerly, then is captured)
            out, _ = run_chunks(engine.model, [tokens], graphs)
            p, q = torch.log_softmax(ref, -1), torch.log_softmax(out[0].float().cpu(), -1)
            assert float((p.exp() * (p - q)).sum(-1).max()) < 2e-3, n
    assert graphs.steps["warm"] == graphs.steps["captured"] == 2
    assert graphs.steps["replayed"] == 4


@pytest.mark.cuda
def test_graphs_give_the_eager_logits_and_rows(synth):
    """Prompts of 1 .. 513 tokens, at start 0 and after a first chunk of PREFIX, through the
    graphs and eagerly: where the chunk fills its bucket (the same kernels over the same
    shapes) the logits and KV rows are bit-equal; elsewhere the padded rows change the
    matmuls' row counts (and so their bf16 kernels' tiles): within bf16 rounding (KL 1e-3, the
    rows 2e-2 of their scale); a chunk of one token runs eagerly on the decode GEMVs, which
    round its activations to 8 bits (--kernels fused) where the padded bucket's matmuls do not:
    within that rounding's bound (KL 2e-3, as the decode step's test; 1.6e-3 seen on an H100).
    Each bucket is captured once, every later chunk replayed."""
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch._grouped_mm reads its groups on the host here: the buckets stop "
                    "below the grouped MoE path")
    engine = cuda_engine(synth)
    model = engine.model
    graphs = model.chunks
    assert graphs.why is None and graphs.graphs and max(graphs.buckets) >= 1024
    tokens = prompt(PREFIX + max(LENGTHS), 1)
    cases = [[tokens[:n]] for n in LENGTHS] + [[tokens[:PREFIX], tokens[PREFIX:PREFIX + n]]
                                                for n in LENGTHS]
    used = set()
    for chunks in cases:
        ref, ref_rows = through(model, chunks, None)
        ours, rows = through(model, chunks, graphs)
        exact = all(bucket_of(len(c), graphs.buckets) == len(c) for c in chunks)
        used.update(bucket_of(len(c), graphs.buckets) for c in chunks)
        lens = [len(c) for c in chunks]
        if exact:
            assert all(torch.equal(a, b) for a, b in zip(ours, ref, strict=True)), lens
            assert torch.equal(rows, ref_rows), lens
            continue
        bound = 2e-3 if 1 in lens and model.experts.fused.x8 else 1e-3
        for a, b in zip(ours, ref, strict=True):
            p, q = torch.log_softmax(b, -1), torch.log_softmax(a, -1)
            assert float((p.exp() * (p - q)).sum(-1).max()) < bound, lens
        assert float((rows - ref_rows).abs().max()) < 2e-2 * float(ref_rows.abs().max()), lens
    n_chunks = sum(len(c) for c in cases)
    assert graphs.steps["captured"] == graphs.steps["warm"] == len(used)
    assert graphs.steps["replayed"] == n_chunks - len(used) and graphs.steps["eager"] == 0
    st = model.experts.stats
    # the real tokens' pairs only: padding is neither counted as hits nor as routed
    pairs = 2 * sum(len(c) for cs in cases for c in cs) * engine.config.n_experts_used
    assert st.hits.sum() == pairs * engine.config.n_layers
    assert st.routed.sum() == pairs * engine.config.n_layers


@pytest.mark.cuda
def test_generate_replays_the_graphs_and_keeps_its_text(synth):
    """generate's prompt through the graphs, then decode steps: the same greedy text as with
    --prompt-graphs off (a 128-token prompt: its bucket's kernels are the eager ones)."""
    from strata.engine.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8)
    ids = prompt(128, 2)
    off = list(cuda_engine(synth, prompt_graphs="off").generate(ids, params))
    engine = cuda_engine(synth)
    first = list(engine.generate(ids, params))
    second = list(engine.generate(ids, params))
    assert first == second == off
    assert engine.model.chunks.steps["replayed"] == 1  # the second prompt's chunk


@pytest.mark.cuda
def test_capture_failure_falls_back_to_eager(synth, monkeypatch, caplog):
    """A capture that raises leaves the chunk's warm pass as its result, says why once, and
    every later chunk runs eagerly: the eager forward's logits within the padding's bf16
    rounding (test_graphs_give_the_eager_logits_and_rows' bound)."""
    engine = cuda_engine(synth)
    model = engine.model
    graphs = model.chunks  # (kept: run_chunks sets model.chunks, None for the eager reference)
    assert graphs.why is None and graphs.graphs and bucket_of(20, graphs.buckets) is not None

    def fail(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("injected capture failure")

    chunks = [prompt(20)]
    ref, _ = through(model, chunks, None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", fail)
    ours, _ = through(model, chunks, graphs)  # (the warm pass is the chunk itself)
    again, _ = through(model, chunks, graphs)
    assert graphs._failed and "capture failed" in caplog.text
    assert graphs.steps["warm"] == 1 and graphs.steps["captured"] == 0
    assert graphs.eager["capture failed"] == 1
    p = torch.log_softmax(ref[0], -1)
    for o in (ours[0], again[0]):
        q = torch.log_softmax(o, -1)
        assert float((p.exp() * (p - q)).sum(-1).max()) < 1e-3


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("t,start", [(16, 0), (128, 300), (7, 1000)])
@pytest.mark.parametrize("window,sinks", [(0, False), (128, True), (0, True)])
def test_flash_chunk_attention_equals_its_torch_form(dtype, t, start, window, sinks):
    """Flash attention over the storage (seqused_k on the device) against the torch form over
    the same rounded values: fp32 sums in both, within the half type's rounding of p; with
    gpt-oss's left window (flash's) and sinks (folded in from flash's log-sum-exp), at gpt-oss's
    head size."""
    g = torch.Generator().manual_seed(t)
    cap, h, hkv, hd = 2048, 32, 4, 64 if sinks else 128
    q = torch.randn(t, h, hd, generator=g).cuda()
    k = torch.randn(cap, hkv, hd, generator=g).to(dtype).cuda()
    v = torch.randn(cap, hkv, hd, generator=g).to(dtype).cuda()
    k[start + t:], v[start + t:] = float("nan"), float("nan")  # past the length: never read
    # (a sink near the log of the keys a row attends to takes a share of the weight like
    # theirs: its fold moves the output by far more than the rounding bound below)
    keys = min(window, start + t) if window else start + t
    s = math.log(keys) + torch.randn(h, generator=g) if sinks else None
    n = torch.tensor([start + t], device="cuda")
    out = chunk_attention(q, k, v, n, hd ** -0.5, window, None if s is None else s.cuda())
    ref = chunk_attention(q.cpu(), k.cpu(), v.cpu(), n.cpu(), hd ** -0.5, window, s)
    tol = 2e-2 if dtype == torch.bfloat16 else 5e-3  # (flash rounds p to the type for p.V)
    assert torch.isfinite(out).all() and float((out.cpu() - ref).abs().max()) < tol
    if sinks:  # (the sinks move the output past the bound: the fold is not a no-op)
        plain = chunk_attention(q.cpu(), k.cpu(), v.cpu(), n.cpu(), hd ** -0.5, window)
        assert float((plain - ref).abs().max()) > 2 * tol


def test_the_device_counters_count_the_real_rows_and_outlive_a_reset():
    """count_on_device with a live mask counts the real rows' pairs only; a reset zeroes the
    device counters in place (captured graphs write into them: a new tensor would leave the
    graphs counting into freed memory)."""
    from strata.experts.stats import OffloadStats

    st = OffloadStats(2, 4)
    cpu = torch.device("cpu")
    with torch.inference_mode():  # (as a forward makes it: an inference tensor)
        counter = st.routed_on_device(cpu)
        st.count_on_device(1, torch.tensor([[0, 3], [3, 2], [1, 1]]),
                           torch.tensor([1, 1, 0], dtype=torch.int32))
    assert st.routed[1].tolist() == [1, 0, 1, 2]
    st.reset()
    assert st.routed_on_device(cpu) is counter and not counter.any()
    assert st.routed.sum() == 0
