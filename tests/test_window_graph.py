"""Verify windows through the prompt graphs (strata.engine.chunk_graph): a window of n tokens
wanting every position's logits runs unpadded in a graph of its own size, giving the plain
forward's logits [n, V] and KV rows and counting its rows once; what needs the host stays
eager; the memory plan counts the windows' rows. On the CPU the passes run uncaptured over the
same static buffers; on CUDA the graphs against the eager forward."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_chunk_graph import PREFIX, cuda_engine, plan, prompt
from test_offload import offload
from test_spec import ReplayDrafter, StuckEvent

import strata.model.parts.attention as attention_part
from strata.config import EngineConfig
from strata.engine.chunk_graph import (
    ChunkGraphs,
    bucket_of,
    graph_pool_bytes,
    plan_buckets,
    window_static_bytes,
    window_tokens,
)
from strata.engine.sampling import SamplingParams
from strata.engine.spec import SpecDecoder
from strata.kernels.tuning import WINDOW_GRAPH_MAX
from strata.model.layers import attention as reference_attention
from strata.model.parts import Segment
from strata.runtime.waits import StallError

SIZES = (1, 2, 4, 5, 11, 16)  # the decode kernel's sizes (<= 4), past them, the largest


def cpu_windows(synth, windows: int = WINDOW_GRAPH_MAX, **kw):  # noqa: ANN001, ANN003, ANN201
    """A CPU offload engine with every expert in a slot on the fused chunk path's torch forms
    (as on CUDA with --kernels fused), and ChunkGraphs serving windows, uncaptured."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cpu", expert_cache="24", **kw)
    model = engine.model
    model.fused_attention = True
    return engine, ChunkGraphs(model, (16, 32, 64), mode="eager", windows=windows)


def window(model, start: list[int], tokens: list[int], graphs):  # noqa: ANN001, ANN201
    """A prompt chunk `start` (plain forward; none where empty), then one window of `tokens`
    with every position's logits through `graphs` (None: the plain forward) -> (logits [n, V],
    the cache, the hits [L] and routed pairs [L, E] the window counted)."""
    model.chunks = None
    kv = model.new_cache(256)
    if start:
        model.forward(torch.tensor(start), [Segment(kv, len(start))])
    model.chunks = graphs
    st = model.experts.stats
    hits, routed = st.hits.copy(), st.routed.copy()
    logits = model.forward(torch.tensor(tokens), [Segment(kv, len(tokens))], all_logits=True)
    return logits.clone(), kv, st.hits - hits, st.routed - routed


@pytest.mark.parametrize("at", [0, PREFIX])
def test_windows_equal_the_plain_forward(synth, at):
    """Windows of several sizes at start 0 and later: every position's logits and every KV row
    equal the plain forward's (the same shapes: no padding), the cache advances by n and the
    routed experts count n * K pairs per layer, as the plain forward's; each size made once."""
    engine, graphs = cpu_windows(synth)
    model, k = engine.model, engine.config.n_experts_used
    assert graphs.why is None and graphs.windows == WINDOW_GRAPH_MAX
    head = prompt(at, 3)
    for n in SIZES:
        tokens = prompt(n, n)
        ref, ref_kv, ref_hits, ref_routed = window(model, head, tokens, None)
        ours, kv, hits, routed = window(model, head, tokens, graphs)
        assert ours.shape == ref.shape == (n, engine.config.n_vocab)
        assert float((ours - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), n
        assert kv.length == ref_kv.length == at + n
        rows = slice(0, at + n)
        mine, theirs = kv.store[:, :, rows], ref_kv.store[:, :, rows]
        assert float((mine - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max()), n
        assert (hits == ref_hits).all() and (hits[graphs.routed] == n * k).all(), n
        assert (routed == ref_routed).all() and (routed.sum(1)[graphs.routed] == n * k).all()
    assert graphs.window_steps["warm"] == len(SIZES) and graphs.steps["eager"] == 0
    assert sorted(graphs._windows) == sorted(SIZES)  # one per size, sharing one logits buffer
    assert all(b.logits.data_ptr() == graphs._window_logits.data_ptr()
               for b in graphs._windows.values())


def test_a_window_overwrites_the_rows_a_rejected_one_left(synth):
    """A window rolled back (KVCache.truncate) and the next one from the same start: its rows
    and logits are the plain forward's, the stale rows written over."""
    engine, graphs = cpu_windows(synth)
    model = engine.model
    head, first, second = prompt(9, 1), prompt(5, 2), prompt(3, 4)
    _, kv, _, _ = window(model, head, first, graphs)
    kv.truncate(9)
    ours = model.forward(torch.tensor(second), [Segment(kv, 3)], all_logits=True)
    model.chunks = None
    kv2 = model.new_cache(256)
    model.forward(torch.tensor(head), [Segment(kv2, 9)])
    ref = model.forward(torch.tensor(second), [Segment(kv2, 3)], all_logits=True)
    assert float((ours - ref).abs().max()) <= 1e-5 * float(ref.abs().max())
    assert kv.length == kv2.length == 12
    mine, theirs = kv.store[:, :, :12], kv2.store[:, :, :12]
    assert float((mine - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


def test_windows_that_need_the_host_run_eagerly(synth):
    """Past the largest window size, with no windows planned, with a hook on the hidden
    states (an MTP drafter's) or the routing, and on a hybrid's cache: eagerly, counted by
    their reason."""
    engine, graphs = cpu_windows(synth, windows=5)
    model = engine.model
    kv = model.new_cache(64)
    assert graphs.eager_reason(torch.tensor(prompt(5)), [Segment(kv, 5)], True) == ""
    six = torch.tensor(prompt(6))
    assert graphs.eager_reason(six, [Segment(kv, 6)], True) == \
        "every position's logits of more than 5 tokens"
    assert graphs.eager_reason(six, [Segment(kv, 6)], False) == ""  # (a chunk of 6: bucket 16)
    none = ChunkGraphs(model, (16,), mode="eager")
    assert none.eager_reason(six, [Segment(kv, 6)], True) == "every position's logits"
    model.hidden_hook = lambda segments, h: None
    model.chunks = graphs
    model.forward(torch.tensor(prompt(3)), [Segment(kv, 3)], all_logits=True)
    model.hidden_hook = None
    assert graphs.eager["a hook on the hidden states or the routing"] == 1
    model.forward(six, [Segment(kv, 6)], all_logits=True)
    assert graphs.eager["every position's logits of more than 5 tokens"] == 1
    assert graphs.window_steps["warm"] == 0 and graphs.steps["eager"] == 2
    kv.state = object()  # (a hybrid's recurrent state beside the KV rows)
    assert "hybrid" in graphs.eager_reason(torch.tensor(prompt(2)), [Segment(kv, 2)], True)
    kv.state = None
    assert "verify windows: 0 replayed" in graphs.line() and "2 eager" in graphs.line()


def test_greedy_with_spec_same_through_the_window_graphs(synth):
    """--spec 4 with drafts that are right and wrong by turns: the same greedy text with the
    windows through the graphs as eagerly and as without windows, every window through a
    graph of its size."""
    params = SamplingParams(temperature=0, max_tokens=24)
    ids = prompt(12, 5)
    engine, graphs = cpu_windows(synth, windows=window_tokens(4), spec=4, draft="ngram")
    model = engine.model
    model.chunks, spec, engine.spec = None, engine.spec, None
    plain = list(engine.generate(ids, params))  # (no --spec: plain decode steps)
    engine.spec = spec
    texts = {}
    for name, chunks in (("eager", None), ("graphs", graphs)):
        model.chunks = chunks
        engine.spec = SpecDecoder(model, ReplayDrafter(ids, plain), 4, timed=False)
        texts[name] = list(engine.generate(ids, params))
        st = engine.spec.stats
        assert st.windows > 0 and 0 < st.accepted < st.drafted, name
    assert texts["graphs"] == texts["eager"] == plain
    assert graphs.window_steps["warm"] == engine.spec.stats.windows
    assert graphs.eager.get("every position's logits of more than 5 tokens", 0) == 0


def test_a_replayed_window_stall_is_still_the_verify_window(synth):
    """A window through the graphs whose GPU work never finishes: the bounded wait raises
    naming the verify window and its size, and says its marks follow the whole graph."""
    engine, graphs = cpu_windows(synth, spec=4, draft="ngram")
    model = engine.model
    model.chunks = graphs
    StuckEvent.made, StuckEvent.done = 0, 1
    engine.spec = SpecDecoder(model, engine.spec.drafter, 4, timeout_s=0.05, event=StuckEvent,
                              timed=False)
    engine.spec.drafter.propose = lambda ctx, n: [1, 2, 3]
    with pytest.raises(StallError, match=r"verify window of 4 tokens at position \d+: waited "
                       r"0 s; the GPU never finished layer 1 \(every layer and the head ran as "
                       r"one graph.*stage 'verify window'"):
        list(engine.generate(prompt(5), SamplingParams(temperature=0, max_tokens=8)))
    assert graphs.window_steps["warm"] == 1


# ---- the memory plan -----------------------------------------------------------------------------


def test_the_plan_counts_the_windows_rows(synth):
    """With --spec T the prompt graphs' line holds the windows of up to min(T + 1, 16) tokens:
    their static rows and a pool at least the largest window's pass with every row's logits;
    where the windows do not fit beside the smallest bucket, the buckets are planned alone."""
    assert [window_tokens(s) for s in (0, 1, 4, 15, 16, 64)] == [0, 2, 5, 16, 16, 16]
    cfg, layouts, bare = plan(synth)
    _, _, spec = plan(synth, spec=4)
    assert bare.window_graphs == 0 and spec.window_graphs == 5
    assert spec.prompt_buckets == bare.prompt_buckets
    extra = window_static_bytes(cfg, 5)
    assert extra >= 4 * 5 * cfg.n_vocab
    assert spec.prompt_graphs >= bare.prompt_graphs + extra
    pool = graph_pool_bytes(cfg, layouts, 5, spec.prompt_weights, logit_rows=5)
    assert spec.prompt_graphs >= pool + extra
    assert "verify windows of 1-5 tokens" in "\n".join(spec.lines())
    assert "verify windows" not in "\n".join(bare.lines())
    _, _, most = plan(synth, spec=40)
    assert most.window_graphs == WINDOW_GRAPH_MAX
    ec = EngineConfig(device="cuda", kernels="fused", kv_type="f16", spec=40)
    slots, w = bare.slots_per_layer, bare.prompt_weights
    # the room of the chunks' graphs without windows: the windows take it from the largest
    # buckets, kept while any bucket fits beside them
    some = plan_buckets(cfg, ec, layouts, slots, bare.chunk, w, bare.prompt_graphs)
    assert some[2] == WINDOW_GRAPH_MAX and some[0] <= bare.prompt_graphs
    assert 0 < len(some[1]) < len(bare.prompt_buckets)
    assert some[1] == bare.prompt_buckets[:len(some[1])]
    # the room of bucket 16 alone: the windows left out, the bucket kept
    alone = plan_buckets(cfg, dataclasses.replace(ec, spec=0), layouts, slots, 16, w, 1 << 40)
    assert alone[1] == (16,)
    squeezed = plan_buckets(cfg, ec, layouts, slots, bare.chunk, w, alone[0])
    assert squeezed[:3] == alone[:3] == (alone[0], (16,), 0)
    both = plan_buckets(cfg, ec, layouts, slots, bare.chunk, w, 1 << 40)
    assert both[1] == bare.prompt_buckets and both[2] == WINDOW_GRAPH_MAX
    assert both[0] >= bare.prompt_graphs + window_static_bytes(cfg, WINDOW_GRAPH_MAX)


# ---- CUDA: the graphs against the eager forward --------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("at", [0, PREFIX])
def test_window_graphs_give_the_eager_logits_and_rows(synth, at):
    """Windows of 1 .. 16 tokens on CUDA, twice each: captured once per size, replayed the
    second time, and equal to the eager window within bf16 rounding of the paths' own (the
    graph's experts take the resident device path, the eager pass the planned one: KL below
    1e-3 per row, KV rows within 2e-2 of their scale); every real row's pairs counted once."""
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch._grouped_mm reads its groups on the host here")
    engine = cuda_engine(synth, spec=WINDOW_GRAPH_MAX)
    model = engine.model
    graphs = model.chunks
    assert graphs.why is None and graphs.graphs and graphs.windows == WINDOW_GRAPH_MAX
    head = prompt(at, 3)
    k = engine.config.n_experts_used
    sizes = range(1, WINDOW_GRAPH_MAX + 1)

    def run(tokens, chunks):  # noqa: ANN001, ANN202
        # (the rows to the host and the cache dropped: its storage back to the pool, so the
        # next cache gets it, and with it the captured graphs)
        logits, kv, hits, routed = window(model, head, tokens, chunks)
        rows = kv.store[:, :, : kv.length].float().cpu()
        return logits.float().cpu(), rows, int(hits.sum()), int(routed.sum())

    pairs = k * len(graphs.routed)
    for _ in range(2):
        for n in sizes:
            tokens = prompt(n, n)
            ref, ref_rows, _, _ = run(tokens, None)
            ours, rows, hits, routed = run(tokens, graphs)
            assert ours.shape == (n, engine.config.n_vocab)
            assert hits == routed == n * pairs, n  # (the window's rows, each once)
            p, q = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
            assert float((p.exp() * (p - q)).sum(-1).max()) < 1e-3, n
            assert float((rows - ref_rows).abs().max()) < 2e-2 * float(ref_rows.abs().max()), n
    w = graphs.window_steps
    assert w["captured"] == w["warm"] == len(sizes) and w["replayed"] == len(sizes)


@pytest.mark.cuda
def test_spec_greedy_text_through_window_graphs_is_the_plain_text(synth):
    """--spec 4 on CUDA with --kernels fused, drafts right and wrong by turns: the windows
    replayed from their graphs give the greedy text of the same windows run eagerly (the
    graphs' own check) and of no --spec at all."""
    params = SamplingParams(temperature=0, max_tokens=32)
    ids = prompt(16, 6)
    plain = list(cuda_engine(synth).generate(ids, params))
    engine = cuda_engine(synth, spec=4, draft="ngram")
    graphs = engine.model.chunks
    assert graphs.windows == 5
    texts = []
    for windows in (0, 5):  # eagerly, then through the graphs
        graphs.windows = windows
        engine.spec = SpecDecoder(engine.model, ReplayDrafter(ids, plain), 4, timed=False)
        texts.append(list(engine.generate(ids, params)))
        assert engine.spec.stats.windows > 0
    assert texts[1] == texts[0]
    assert texts[1] == plain
    w = graphs.window_steps
    assert w["replayed"] > 0 and w["captured"] == w["warm"] <= 5
    assert set(graphs.eager) == {"every position's logits"}  # (the eager run's windows only)


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_a_hybrids_chunks_and_windows_through_the_graphs(synth, monkeypatch, arch):
    """A hybrid (Gated DeltaNet layers beside gated full attention): its prompt chunks take the
    padded buckets (the padding kept out of the recurrent state: it neither decays nor writes
    S, and the conv window stops at the last real row), its verify windows the graphs' static
    buffers (never padded; the recurrent layers token by token, each token's state kept). Each
    chunk's last logits, a window's every position's, the KV rows, the recurrent state after
    each chunk and window and the state kept after each of a window's tokens equal the plain
    forward's, and a rollback after either gives the same state."""
    from strata.config import ModelConfig
    from strata.engine.chunk_graph import blocked
    from strata.engine.spec import rollback
    from strata.gguf import open_model

    # (the attention in float32: bf16's rounding would differ with the padded row count)
    monkeypatch.setattr(attention_part, "attention_bf16", lambda q, k, v: reference_attention(
        q, k.float(), v.float(), k.shape[0] - q.shape[0]))
    path = synth(arch, "Q4_K_M")
    cfg = ModelConfig.from_model(open_model(path))
    ec = EngineConfig(device="cuda", offload="on", kernels="fused", spec=4, kv_type="f16")
    assert blocked(cfg, ec) is None
    # (one thread: the padded and plain passes' matmuls sum in the same order)
    engine = offload(path, "cpu", expert_cache=str(cfg.n_layers * cfg.n_experts), threads=1)
    model = engine.model
    model.fused_attention = True  # (the fused forms, torch's here, as a graph's)
    graphs = ChunkGraphs(model, (16, 32, 64), mode="eager", windows=5)
    assert graphs.why is None and graphs.prompt_why is None
    # chunks of 13 (bucket 16) then 2 (a window of K-1 = 3 reaching into the last chunk's rows,
    # bucket 16), 33 then 1 (64, 16), 16 then 20 (a full bucket, then 32)
    for n, heads in ((1, (13, 2)), (3, (33, 1)), (5, (16, 20))):
        tokens = prompt(n, n)
        runs = []
        for g in (None, graphs):
            model.chunks = g
            kv = model.new_cache(128)
            last, states, at = [], [], 0
            for i, m in enumerate(heads):
                chunk = prompt(sum(heads), 3)[at:at + m]
                at += m
                last.append(model.forward(torch.tensor(chunk), [Segment(kv, m)]).clone())
                states.append((kv.state.conv.clone(), kv.state.ssm.clone()))
                assert kv.length == at, (g, i)
            kv.open_window(n)
            logits = model.forward(torch.tensor(tokens), [Segment(kv, n)], all_logits=True)
            kv.state.stop_recording()
            st = kv.state
            runs.append((last, states, logits.clone(), kv, st.conv.clone(), st.ssm.clone(),
                         st.window.conv.clone(), st.window.ssm.clone()))
        (ref_last, ref_states, ref, ref_kv, *ref_state), (last, states, ours, kv, *state) = runs
        for a, b in zip(last, ref_last, strict=True):
            assert a.shape == b.shape == (1, cfg.n_vocab)
            assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max()), n
        for mine, theirs in zip(states, ref_states, strict=True):
            for a, b in zip(mine, theirs, strict=True):
                assert float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1e-6), n
        assert ours.shape == ref.shape == (n, cfg.n_vocab)
        assert float((ours - ref).abs().max()) <= 1e-5 * float(ref.abs().max()), n
        assert kv.length == ref_kv.length == sum(heads) + n
        rows = slice(0, sum(heads) + n)
        mine, theirs = kv.store[:, :, rows], ref_kv.store[:, :, rows]
        assert float((mine - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max()), n
        for a, b in zip(state, ref_state, strict=True):
            assert float((a - b).abs().max()) <= 1e-5 * max(float(b.abs().max()), 1e-6), n
        rollback(model, kv, sum(heads) + 1)
        rollback(model, ref_kv, sum(heads) + 1)
        assert torch.allclose(kv.state.ssm, ref_kv.state.ssm, rtol=1e-5, atol=1e-6)
    # the memory plan: the chunks' buckets and the windows, one pool (a Gated DeltaNet
    # layer's activations and states counted where they are the larger)
    from strata.engine.memory_plan import make_plan
    from strata.experts.layout import expert_layouts

    mf = open_model(path)
    layouts = expert_layouts(mf, cfg)
    whole = make_plan(mf, cfg, dataclasses.replace(ec, ctx=256, vram_budget_gib=2.0), layouts)
    assert whole.slots_per_layer == [cfg.n_experts] * cfg.n_layers
    assert whole.prompt_buckets and whole.window_graphs == window_tokens(4) == 5
    top = max(whole.prompt_buckets)
    assert whole.prompt_graphs >= graph_pool_bytes(cfg, layouts, top, whole.prompt_weights)
    plain = dataclasses.replace(cfg, ssm_heads=0)  # (the same shapes without the delta term)
    assert graph_pool_bytes(cfg, layouts, top, whole.prompt_weights) > graph_pool_bytes(
        plain, layouts, top, whole.prompt_weights)
    assert "verify windows of 1-5 tokens" in "\n".join(whole.lines())
    assert graphs.window_steps["warm"] == 3 and graphs.steps["warm"] == 6
    assert graphs.steps["eager"] == 0 and not graphs.eager
    assert "6 run to capture" in graphs.line() and "verify windows: 0 replayed, 3 run" in \
        graphs.line()


def test_a_windows_state_storage_stays_put(synth):
    """The per-token recurrent states of a verify window (the addresses a window's graph writes
    through, _state_key) keep their storage: with window_tokens (ChunkGraphs.windows) a state
    sized for the largest window at its first window, of whatever size, so a later larger one
    does not move it; from a model's cache pool a new request's state takes the storage of the
    one before it. Without either, a window grows it as before."""
    from strata.config import ModelConfig
    from strata.gguf import open_model
    from strata.runtime.delta_state import DeltaState
    from strata.runtime.kv_cache import KVPool

    cfg = ModelConfig.from_model(open_model(synth("qwen35moe", "Q4_K_M")))
    cpu, pool = torch.device("cpu"), KVPool()

    def ptrs(st):  # noqa: ANN001, ANN202
        return st._spare[0].data_ptr(), st._spare[1].data_ptr()

    st = DeltaState(cfg, cpu, pool, window_tokens=5)
    st.open_window(0, 2)
    first = ptrs(st)
    assert st.window.conv.shape[0] == 2 and st._spare[0].shape[0] == 5
    for n in (5, 1, 3):
        st.open_window(0, n)
        assert ptrs(st) == first and st.window.ssm.shape[0] == n
    del st  # (its storages back in the pool, not freed)
    assert {first[0], first[1]} <= {t.data_ptr() for t in pool.free}
    again = DeltaState(cfg, cpu, pool, window_tokens=5)
    again.open_window(0, 4)
    assert ptrs(again) == first
    plain = DeltaState(cfg, cpu)
    plain.open_window(0, 2)
    assert plain._spare[0].shape[0] == 2
    plain.open_window(0, 3)
    assert plain._spare[0].shape[0] == 3


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_a_hybrids_graphs_on_cuda(synth, arch, monkeypatch):
    """On CUDA with --spec 4: a hybrid's prompts of 9 .. 300 tokens padded into their buckets,
    twice each (captured, then replayed), against the eager forward: the last logits within
    bf16 rounding (KL below 1e-3); the recurrent state after the prompt as near the state of
    the engine's own float32 chunked rule (fla off: delta_ops.chunk_scan, "ieee" dots) as the
    eager forward's is (fla's kernels take TF32 dots, and the padded chunk's shape picks other
    tiles: up to ~1.5% of the state's scale apart on an H100 past one chunk of 64), so padding
    that wrote or decayed the state would fail it; its windows of 1 .. 5 tokens, twice each
    (captured, then replayed), against the same windows run eagerly: every row's logits within
    the paths' own rounding (KL below 1e-3 a row), the recurrent state after the window and each
    token's kept state within 1e-3 of their scale; then greedy text through --spec with drafts
    right and wrong by turns is the text without --spec up to a near-tie: plain steps run the
    decode step's 8-bit-activation GEMVs (--kernels fused) and windows the prompt path's float
    activations, so the two may part only where the eager forward's two tokens lie within TIE
    of each other and of its top log-probability."""
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("torch._grouped_mm reads its groups on the host here")
    path = synth(arch, "Q4_K_M")
    engine = offload(path, "cuda", expert_cache="auto", kernels="fused", kv_type="f16", spec=4,
                     draft="ngram")
    model, graphs = engine.model, engine.model.chunks
    assert graphs.why is None and graphs.prompt_why is None and graphs.buckets
    assert graphs.windows == 5 and graphs.graphs
    from strata.kernels.gpu import delta_ops

    def forward(tokens, chunks):  # noqa: ANN001, ANN202
        model.chunks = chunks
        kv = model.new_cache(512)
        out = model.forward(torch.tensor(tokens), [Segment(kv, len(tokens))])
        return [t.float().cpu() for t in (out, kv.state.ssm, kv.state.conv)]

    fla = delta_ops.fla_rule
    for _ in range(2):
        for n in (9, 37, 100, 300):
            tokens = prompt(n, 5)
            with monkeypatch.context() as m:
                m.setattr(delta_ops, "fla_rule", lambda: None)
                _, *exact = forward(tokens, None)
            ref, *ref_state = forward(tokens, None)
            ours, *state = forward(tokens, graphs)
            p, q = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
            assert float((p.exp() * (p - q)).sum(-1).max()) < 1e-3, n
            for a, b, x in zip(state, ref_state, exact, strict=True):
                scale = float(x.abs().max())
                if fla() is None:  # (the same kernels on both paths: rounding apart)
                    assert float((a - b).abs().max()) <= 1e-3 * scale, n
                ours_err, eager_err = (float((y - x).abs().max()) for y in (a, b))
                assert ours_err <= 2 * eager_err + 1e-3 * scale, (n, ours_err, eager_err, scale)
    used = {bucket_of(n, graphs.buckets) for n in (9, 37, 100, 300)}
    assert graphs.steps["captured"] == graphs.steps["warm"] == len(used)
    assert graphs.steps["replayed"] == 8 - len(used) and graphs.steps["eager"] == 0
    head = prompt(9, 3)

    def run(tokens, chunks):  # noqa: ANN001, ANN202
        model.chunks = None
        kv = model.new_cache(64)
        model.forward(torch.tensor(head), [Segment(kv, len(head))])
        model.chunks = chunks
        kv.open_window(len(tokens))
        logits = model.forward(torch.tensor(tokens), [Segment(kv, len(tokens))], all_logits=True)
        kv.state.stop_recording()
        st = kv.state
        return [t.float().cpu() for t in (logits, st.ssm, st.window.ssm, st.conv)]

    for _ in range(2):
        for n in range(1, 6):
            tokens = prompt(n, n)
            ref, *ref_state = run(tokens, None)
            ours, *state = run(tokens, graphs)
            p, q = torch.log_softmax(ref, -1), torch.log_softmax(ours, -1)
            assert float((p.exp() * (p - q)).sum(-1).max()) < 1e-3, n
            for a, b in zip(state, ref_state, strict=True):
                assert float((a - b).abs().max()) <= 1e-3 * float(b.abs().max()), n
    # (every size captured, then replayed; a window whose recurrent state's per-token buffers
    # moved would be captured again under the new addresses: each run's cache takes them from
    # the model's pool, test_a_windows_state_storage_stays_put, but the pool can hand a run
    # another free one of that size)
    w = graphs.window_steps
    assert w["captured"] == w["warm"] >= 5 and w["replayed"] >= 1
    assert w["captured"] + w["replayed"] == 10
    params = SamplingParams(temperature=0, max_tokens=24)
    ids = prompt(16, 6)
    model.chunks, engine.spec = graphs, None
    plain = list(engine.generate(ids, params))
    engine.spec = SpecDecoder(model, ReplayDrafter(ids, plain), 4, timed=False)
    drafted = list(engine.generate(ids, params))
    assert engine.spec.stats.windows > 0
    k = next((i for i, (a, b) in enumerate(zip(plain, drafted, strict=True)) if a != b), None)
    if k is not None:  # (a flip between near-tied tokens, or a fault)
        model.chunks = None
        kv = model.new_cache(64)
        seq = ids + plain[:k]
        lp = torch.log_softmax(model.forward(torch.tensor(seq), [Segment(kv, len(seq))],
                                             all_logits=True)[-1].float(), -1)
        a, b, top = float(lp[plain[k]]), float(lp[drafted[k]]), float(lp.max())
        assert abs(a - b) < TIE and min(a, b) > top - TIE, (k, a, b, top)


# log-probability units: on an H100 qwen3next's random weights parted where the eager forward
# held the two tokens 0.16 apart at its top (bench/2026-12-06-h100-mx8.md); a fault in a window
# or its rollback parts texts at tokens far from the top
TIE = 0.25
