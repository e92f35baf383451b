"""qwen35moe (Qwen3.5/3.6-MoE) and qwen3next (Qwen3-Next): hybrid Gated DeltaNet / gated full
attention. Strata's float32 reference path equals transformers' own models built from the same
dequantized weights and llama.cpp's logits (through llama-cpp-python); incremental decode, with
the recurrent state carried, equals the full prompt; the chunked delta rule equals the recurrent
one; the offload paths equal the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.cli.logits import compute_logits
from strata.cli.main import main
from strata.config import EngineConfig, ModelConfig, kv_bytes
from strata.engine.generator import Engine
from strata.engine.sampling import SamplingParams
from strata.errors import StrataError
from strata.gguf import open_model
from strata.model.parts.delta_net import delta_chunked, delta_recurrent
from strata.model.transformer import Segment

from gguf_edit import rewrite
from hf_reference import hf_hybrid_logits, kl_per_position

ARCHS = ["qwen35moe", "qwen3next"]
TOKENS = [5, 311, 17, 902, 64, 64, 1000, 3, 250, 777, 41, 8]


def assert_same(ours: np.ndarray, ref: np.ndarray) -> None:
    assert kl_per_position(ref, ours).max() < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.fixture(scope="module", params=ARCHS)
def f32(request, synth):
    path = synth(request.param, "F32")
    return path, compute_logits(Engine.load(path), TOKENS)


def test_config_reads_the_hybrid_layout(synth):
    cfg = ModelConfig.from_model(open_model(synth("qwen35moe", "F32")))
    assert (cfg.n_layers, cfg.n_nextn, cfg.full_attn_interval) == (4, 1, 2)
    assert [cfg.is_linear(i) for i in range(4)] == [True, False, True, False]
    assert (cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state, cfg.ssm_conv) == (4, 8, 32, 4)
    assert cfg.rope_dim == 16 and cfg.attn_gate and cfg.qk_norm and cfg.d_shared == 256
    assert cfg.ssm_layout == "qwen35"
    nxt = ModelConfig.from_model(open_model(synth("qwen3next", "F32")))
    assert nxt.ssm_layout == "next" and nxt.n_nextn == 0
    # the plan counts the 2 full-attention layers' KV and each linear layer's conv + S
    per_layer = (2 * 4 + 8) * 32 * 3 + 8 * 32 * 32
    assert kv_bytes(cfg, 10) == 2 * 2 * 10 * cfg.kv_dim * 4 + 2 * 4 * per_layer


def test_mtp_block_is_read_and_kept(synth):
    engine = Engine.load(synth("qwen35moe", "F32"))
    (block,) = engine.model.w.mtp
    assert {"nextn.eh_proj.weight", "nextn.enorm.weight", "attn_q.weight",
            "ffn_gate_exps.weight"} <= set(block)


def test_reference_matches_transformers(f32):
    path, ours = f32
    assert_same(ours, hf_hybrid_logits(path, TOKENS))


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_reference_matches_transformers_on_the_same_dequantized_weights(synth, arch):
    path = synth(arch, "Q4_K_M")
    assert_same(compute_logits(Engine.load(path), TOKENS), hf_hybrid_logits(path, TOKENS))





def llama_logits(path, tokens: list[int]) -> np.ndarray:
    lc = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    model = lc.Llama(str(path), logits_all=True, n_ctx=64, n_threads=2, verbose=False)
    model.eval(tokens)
    out = np.array(model.scores[: len(tokens)], dtype=np.float32)
    model.close()
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_f16_file_matches_llama_cpp(synth, arch):
    path = synth(arch, "F16")
    ours = compute_logits(Engine.load(path), TOKENS)
    theirs = llama_logits(path, TOKENS)
    assert kl_per_position(theirs, ours).max() < 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


# (not Q8_0: both tiny Q8_0 files route a position of layer 0 on a near tie, qwen3next's
# position 5 by 0.003 and qwen35moe's position 1 by 0.0014 of probability; llama.cpp's 8-bit
# activations pick the other expert there, a KL of 0.1-0.5 that says nothing about the layers)
@pytest.mark.parametrize("arch,recipe", [("qwen35moe", "Q4_K_M"), ("qwen3next", "Q4_K_M")])
def test_quantized_file_agrees_with_llama_cpp(synth, arch, recipe):
    path = synth(arch, recipe)
    ours = compute_logits(Engine.load(path), TOKENS)
    theirs = llama_logits(path, TOKENS)
    kl = kl_per_position(theirs, ours)  # (llama.cpp rounds activations to 8 bits)
    assert kl.mean() < 2e-2 and kl.max() < 1e-1, kl
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.75


def test_incremental_decode_equals_the_full_prompt(f32):
    path, ref = f32
    model = Engine.load(path).model
    kv = model.new_cache(len(TOKENS))
    rows = [model.forward(torch.tensor([t]), [Segment(kv, 1)])[0] for t in TOKENS]
    assert_same(torch.stack(rows).numpy(), ref)


def test_prompt_in_two_chunks_equals_one(f32):
    path, ref = f32
    model = Engine.load(path).model
    kv = model.new_cache(len(TOKENS))
    a = model.forward(torch.tensor(TOKENS[:5]), [Segment(kv, 5)], all_logits=True)
    b = model.forward(torch.tensor(TOKENS[5:]), [Segment(kv, 7)], all_logits=True)
    assert_same(torch.cat([a, b]).numpy(), ref)


@pytest.mark.parametrize("recipe", ["F32", "Q4_K_M"])
def test_fused_qkv_and_z_equal_the_two_products(synth, recipe):
    """A linear layer's qkv and z projections as one matrix (weights.fuse_qkvz, as CUDA loads
    them): each a row view of it, and the logits of a prompt and of a decode token after it
    as with the two products."""
    from strata.model.weights import fuse_qkvz

    path = synth("qwen35moe", recipe)
    ref = compute_logits(Engine.load(path), TOKENS)
    model = Engine.load(path).model
    deltas = [lw.delta for lw in model.w.layers if lw.delta is not None]
    assert deltas
    for dw in deltas:
        fuse_qkvz(dw)
        raw = (lambda w: w if isinstance(w, torch.Tensor) else w.raw)  # noqa: E731
        assert dw.qkvz is not None and raw(dw.qkv).data_ptr() == raw(dw.qkvz).data_ptr()
        assert raw(dw.z).data_ptr() > raw(dw.qkv).data_ptr()
    kv = model.new_cache(len(TOKENS))
    head = model.forward(torch.tensor(TOKENS[:-1]), [Segment(kv, len(TOKENS) - 1)],
                         all_logits=True)
    last = model.forward(torch.tensor(TOKENS[-1:]), [Segment(kv, 1)])
    got = torch.cat([head, last]).numpy()
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_two_sequences_in_one_batch_keep_their_own_state(f32):
    path, ref = f32
    model = Engine.load(path).model
    kv1, kv2 = model.new_cache(), model.new_cache()
    model.forward(torch.tensor(TOKENS[:6]), [Segment(kv1, 6)])
    out = model.forward(torch.tensor([TOKENS[6], *TOKENS[:3]]), [Segment(kv1, 1),
                                                                 Segment(kv2, 3)])
    assert_same(out.numpy(), ref[[6, 2]])


def test_truncating_a_hybrid_cache_restarts_it(f32):
    path, ref = f32
    engine = Engine.load(path)
    kv = engine.model.new_cache()
    engine.model.forward(torch.tensor(TOKENS), [Segment(kv, len(TOKENS))])
    kv.truncate(4)  # the recurrent state cannot be rewound: all of it goes
    assert kv.length == 0 and not kv.state.ssm.any() and not kv.state.conv.any()
    out = engine.model.forward(torch.tensor(TOKENS[:4]), [Segment(kv, 4)])
    assert_same(out.numpy(), ref[[3]])


# lengths: one token, fewer than a chunk, exactly one, one more, several and a tail
@pytest.mark.parametrize("T", [1, 5, 16, 17, 50])
@pytest.mark.parametrize("heads,dk,dv", [(3, 8, 8), (2, 16, 4)])
def test_chunked_delta_rule_equals_recurrent(T, heads, dk, dv):
    g = torch.Generator().manual_seed(T * 7 + heads)
    q = torch.nn.functional.normalize(torch.randn(T, heads, dk, generator=g), dim=-1) * dk ** -.5
    k = torch.nn.functional.normalize(torch.randn(T, heads, dk, generator=g), dim=-1)
    v = torch.randn(T, heads, dv, generator=g)
    decay = -torch.rand(T, heads, generator=g) * 2  # log decays in (-2, 0]
    beta = torch.rand(T, heads, generator=g)
    s0 = torch.randn(heads, dk, dv, generator=g)
    o_r, s_r = delta_recurrent(q, k, v, decay, beta, s0)
    o_c, s_c = delta_chunked(q, k, v, decay, beta, s0, chunk=16)
    torch.testing.assert_close(o_c, o_r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_c, s_r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_offload_paths_equal_the_reference(synth, arch):
    path = synth(arch, "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)
    for cache, miss in [("0", "cpu"), ("3", "cpu"), ("0", "dma")]:
        engine = Engine.load(path, config=EngineConfig(
            offload="on", debug=True, cpu_kernels="torch", kernels="exact", expert_cache=cache,
            miss=miss, stream_min=1 << 20))
        assert_same(compute_logits(engine, TOKENS), ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_streamed_prompt_chunks_equal_the_reference(synth, arch, device):
    """Prompt chunks of 5 tokens (each carrying the recurrent state to the next) whose missed
    experts stream through the ring."""
    path = synth(arch, "Q4_K_M")
    ref = compute_logits(Engine.load(path, config=EngineConfig(prefill="off")), TOKENS)
    engine = Engine.load(path, config=EngineConfig(
        device=device, offload="on", debug=True, cpu_kernels="torch", kernels="exact",
        expert_cache="3", prefill="5", stream_min=2))
    assert_same(compute_logits(engine, TOKENS), ref)
    assert engine.model.experts.stats.streamed.sum() > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_offload_decode_equals_reference_decode(synth, arch):
    path = synth(arch, "Q4_K_M")
    params = SamplingParams(temperature=0, max_tokens=8)
    ref = list(Engine.load(path).generate(TOKENS[:4], params))
    engine = Engine.load(path, config=EngineConfig(offload="on", cpu_kernels="torch",
                                                   kernels="exact", expert_cache="3"))
    assert list(engine.generate(TOKENS[:4], params)) == ref


def test_generate_runs_a_tiny_file_end_to_end(synth, capsys):
    path = synth("qwen35moe", "Q4_K_M")
    assert main(["generate", str(path), "--prompt", "Hello", "-n", "6", "--temperature",
                 "0"]) == 0


def test_info_shows_the_layer_kinds(synth, capsys):
    assert main(["info", str(synth("qwen35moe", "Q4_K_M"))]) == 0
    out = capsys.readouterr().out
    assert "linear attention x2, full attention x2" in out and "mtp" in out.lower()


def test_fourth_rope_section_is_refused(synth, tmp_path):
    from gguf import GGUFValueType

    bad = rewrite(synth("qwen35moe", "F32"), tmp_path / "bad.gguf", meta={
        "qwen35moe.rope.dimension_sections": ([3, 3, 0, 2], GGUFValueType.ARRAY)})
    with pytest.raises(StrataError, match="qwen35moe.rope.dimension_sections"):
        ModelConfig.from_model(open_model(bad))


def test_value_heads_not_a_multiple_of_key_heads_are_refused(synth, tmp_path):
    bad = rewrite(synth("qwen3next", "F32"), tmp_path / "bad.gguf",
                  meta={"qwen3next.ssm.time_step_rank": 6})
    with pytest.raises(StrataError, match="qwen3next.ssm.time_step_rank is 6"):
        ModelConfig.from_model(open_model(bad))


# ---- the decode step (static buffers; CUDA graphs on the GPU) -----------------------------------

PROMPT = 4  # tokens of TOKENS run as the prompt; the rest go through decode steps


def step_engine(path, device: str, **kw) -> Engine:
    kw = dict(cpu_kernels="torch", kernels="exact") | kw
    return Engine.load(path, config=EngineConfig(device=device, offload="on", debug=True, **kw))


def decoded_logits(engine: Engine, tokens: list[int]) -> np.ndarray:
    """Teacher-forced: the prompt, then one decode step per remaining token."""
    kv = engine.model.new_cache(len(tokens))
    engine.run_prompt(tokens[:PROMPT], kv)
    out = [engine.model.decode(t, kv).float().cpu().numpy().copy() for t in tokens[PROMPT:]]
    return np.concatenate(out)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cache,miss", [("0", "cpu"), ("3", "dma"), ("32", "cpu")])
def test_decode_step_gives_reference_logits(synth, arch, cache, miss, device):
    """The StaticStep branches of GatedDeltaNet (conv window and S updated in place) and
    GatedAttention (partial RoPE through qk_rope_store, the gate) equal the reference."""
    path = synth(arch, "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)[PROMPT:]
    engine = step_engine(path, device, expert_cache=cache, miss=miss)
    step = engine.model.step
    assert_same(decoded_logits(engine, TOKENS), ref)
    n = len(TOKENS) - PROMPT
    assert step.steps["eager"] + step.steps["replayed"] == n
    if device == "cuda":  # captured at the second step, replayed after
        assert not step._failed and step._captured is not None
        assert step.steps["replayed"] == n - 1


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_consecutive_requests_replay_graphs_from_a_fresh_state(synth, arch):
    """A second request gets the pooled KV storage and recurrent state back, zeroed: the same
    graphs replay and the same text comes out."""
    engine = step_engine(synth(arch, "Q4_K_M"), "cuda", expert_cache="5")
    params = SamplingParams(temperature=0, max_tokens=8)
    first = list(engine.generate(TOKENS[:4], params))
    graphs = engine.model.step._captured
    assert graphs is not None
    assert list(engine.generate(TOKENS[:4], params)) == first
    assert engine.model.step._captured is graphs


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ARCHS)
def test_fused_kernels_decode_within_the_quantized_bound(synth, arch):
    """--kernels fused on the GPU (bf16 prompt attention, fused GEMVs on 8-bit activations)
    stays near the float32 reference."""
    path = synth(arch, "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)[PROMPT:]
    engine = step_engine(path, "cuda", kernels="fused", expert_cache="5")
    kl = kl_per_position(ref, decoded_logits(engine, TOKENS))
    assert kl.mean() < 2e-2 and kl.max() < 1e-1, kl


def test_chat_template_renders_and_generates(synth):
    path = synth("qwen3next", "Q4_K_M")
    assert main(["generate", str(path), "--chat", "Hello there", "-n", "4",
                 "--temperature", "0"]) == 0


_DELTA_STEP = """
    import torch
    from strata.kernels.gpu import delta_ops
    from strata.model.parts.delta_net import delta_recurrent
    g = torch.Generator().manual_seed(seed % 2**31)
    # (key heads, value heads, head dim, conv kernel, tiled): a dim not a power of two, dv over
    # two column blocks, one key head per value head, a kernel of 1 (no window)
    for hk, hv, dk, K, tiled in [(2, 6, 24, 4, True), (2, 6, 24, 4, False), (3, 3, 40, 2, True),
                                 (1, 2, 8, 1, False)]:
        C = (2 * hk + hv) * dk
        x, w = torch.randn(C, generator=g), torch.randn(C, K, generator=g)
        window = torch.randn(K - 1, C, generator=g)
        want_win = torch.cat([window, x[None]])[1:]
        want_y = torch.nn.functional.silu((torch.cat([window, x[None]]).T * w).sum(-1))
        y = delta_ops.conv_step(x, window, w)
        assert torch.allclose(y, want_y, atol=1e-5), (hk, hv, "conv")
        assert torch.equal(window, want_win), (hk, hv, "window")
        dec = -torch.rand(hv, generator=g)
        beta = torch.rand(hv, generator=g)
        S = torch.randn(hv, dk, dk, generator=g)
        # the reference: the model's own recurrent rule on the normed, shared heads
        key = hk * dk
        q = torch.nn.functional.normalize(y[:key].view(hk, dk), dim=-1, eps=0) * dk ** -0.5
        k = torch.nn.functional.normalize(y[key:2 * key].view(hk, dk), dim=-1, eps=0)
        r = hv // hk
        q, k = ((t.repeat(r, 1) if tiled else t.repeat_interleave(r, 0)) for t in (q, k))
        o_ref, S_ref = delta_recurrent(q[None], k[None], y[2 * key:].view(1, hv, dk), dec[None],
                                       beta[None], S.clone())
        S0 = S.clone()
        o = delta_ops.delta_step(y, dec, beta, S, hk, tiled, 0.0)
        assert torch.allclose(o, o_ref[0], atol=1e-4), (hk, hv, tiled, "out")
        assert torch.allclose(S, S_ref, atol=1e-4), (hk, hv, tiled, "state")
        # the gates from their logits inside the same launch: as delta_gates' then the step
        ba = 12 * torch.randn(2 * hv, generator=g)
        a, dt = -torch.rand(hv, generator=g) * 8, torch.randn(hv, generator=g)
        b2, g2 = delta_ops.delta_gates(ba[None], a, dt)
        S1, S2 = S0.clone(), S0.clone()
        o1 = delta_ops.delta_step(y, g2[0], b2[0], S1, hk, tiled, 0.0)
        o2 = delta_ops.delta_step(y, None, None, S2, hk, tiled, 0.0, gates=(ba, a, dt))
        assert torch.equal(o1, o2) and torch.equal(S1, S2), (hk, hv, tiled, "gates")
    print("ok")
"""


_DELTA_GLUE = """
    import torch
    import torch.nn.functional as F
    from strata.kernels.gpu import delta_ops
    from strata.kernels.torch_ops import rms_norm
    g = torch.Generator().manual_seed(seed % 2**31)
    for t, hv, dv in [(1, 32, 128), (5, 6, 24), (3, 1, 40)]:  # qwen3.6's heads; odd sizes
        ba = 12 * torch.randn(t, 2 * hv, generator=g)  # (past softplus's threshold of 20 too)
        a, dt = -torch.rand(hv, generator=g) * 8, torch.randn(hv, generator=g)
        beta, lg = delta_ops.delta_gates(ba, a, dt)
        assert torch.allclose(beta, torch.sigmoid(ba[:, :hv]), atol=1e-6), (t, hv, "beta")
        want = a * F.softplus(ba[:, hv:] + dt)
        assert torch.allclose(lg, want, rtol=1e-5, atol=1e-5), (t, hv, "g")
        o, z = torch.randn(t * hv, dv, generator=g), torch.randn(t * hv, dv, generator=g)
        w = torch.rand(dv, generator=g) + 0.5
        out = delta_ops.gated_norm(o, z, w, 1e-6)
        want = rms_norm(o, w, 1e-6) * F.silu(z)
        assert torch.allclose(out, want, rtol=1e-5, atol=1e-5), (t, hv, dv, "gated norm")
    print("ok")
"""


def test_delta_glue_kernels_under_the_interpreter():
    """The gates (beta, the log decay) and the gated output norm in a launch each equal their
    torch forms, on the CPU under Triton's interpreter."""
    from interpreted import fresh_seed, run_interpreted

    run_interpreted(_DELTA_GLUE, fresh_seed(), timeout=300)


def test_delta_step_kernels_under_the_interpreter():
    """The decode step's conv and delta-rule Triton kernels (kernels/gpu/delta_ops.py) equal the
    reference rule, run on the CPU by Triton's interpreter."""
    from interpreted import fresh_seed, run_interpreted

    run_interpreted(_DELTA_STEP, fresh_seed(), timeout=600)


def test_delta_step_torch_path_equals_the_reference():
    from strata.kernels.gpu import delta_ops

    g = torch.Generator().manual_seed(3)
    hk, hv, dk = 2, 4, 16
    y = torch.randn((2 * hk + hv) * dk, generator=g)
    dec, beta = -torch.rand(hv, generator=g), torch.rand(hv, generator=g)
    S = torch.randn(hv, dk, dk, generator=g)
    key = hk * dk
    q = torch.nn.functional.normalize(y[:key].view(hk, dk), dim=-1, eps=0) * dk ** -0.5
    k = torch.nn.functional.normalize(y[key:2 * key].view(hk, dk), dim=-1, eps=0)
    q, k = q.repeat(2, 1), k.repeat(2, 1)
    o_ref, s_ref = delta_recurrent(q[None], k[None], y[2 * key:].view(1, hv, dk), dec[None],
                                   beta[None], S.clone())
    S0 = S.clone()
    o = delta_ops.delta_step(y, dec, beta, S, hk, True, 0.0)
    torch.testing.assert_close(o, o_ref[0])
    torch.testing.assert_close(S, s_ref)
    # gates= (their logits, a, dt_bias): the torch path computes them as delta_gates does
    ba, a, dt = torch.randn(2 * hv, generator=g), -torch.rand(hv, generator=g), torch.randn(hv)
    b2, g2 = delta_ops.delta_gates(ba[None], a, dt)
    S1, S2 = S0.clone(), S0.clone()
    o1 = delta_ops.delta_step(y, g2[0], b2[0], S1, hk, True, 0.0)
    o2 = delta_ops.delta_step(y, None, None, S2, hk, True, 0.0, gates=(ba, a, dt))
    assert torch.equal(o1, o2) and torch.equal(S1, S2)
    with pytest.raises(ValueError, match="gates or g and beta"):
        delta_ops.delta_step(y, g2[0], b2[0], S2, hk, True, 0.0, gates=(ba, a, dt))


@pytest.mark.parametrize("preset,arch,layers,full,nextn", [
    ("qwen3.6-35b-a3b", "qwen35moe", 40, 10, 1), ("qwen3.5-122b-a10b", "qwen35moe", 48, 12, 1),
    ("qwen3-next-80b-a3b", "qwen3next", 48, 12, 0)])
def test_real_presets_have_the_models_shapes(preset, arch, layers, full, nextn):
    from dataclasses import replace

    from strata.config_hybrid import layer_kinds
    from strata.synth.presets import get_preset
    from strata.synth.recipes import Recipe
    from strata.synth.writer import config_of, plan_tensors

    p = get_preset(preset, None)
    cfg = config_of(p)
    assert (cfg.arch, cfg.n_layers, cfg.n_kv_layers, cfg.n_nextn) == (arch, layers, full, nextn)
    assert layer_kinds(cfg) == f"linear attention x{layers - full}, full attention x{full}"
    assert cfg.rope_dim == 64 and cfg.head_dim == 256 and cfg.ssm_state == 128
    gib = sum(t.nbytes for t in plan_tensors(p, Recipe("Q4_K_M"))) / 2**30
    # Q4_K_M of 35B / 80B / 122B parameters: about 4.5-5 bits a weight (MTP blocks included)
    assert {"qwen3.6-35b-a3b": 18 < gib < 24, "qwen3.5-122b-a10b": 62 < gib < 80,
            "qwen3-next-80b-a3b": 42 < gib < 52}[preset], gib
    few = config_of(replace(p, n_layers=4))  # --layers 4: three linear layers, one full
    assert layer_kinds(few) == "linear attention x3, full attention x1" and few.n_nextn == nextn


@pytest.mark.parametrize("arch", ARCHS)
def test_a_second_turn_continues_the_cache_and_its_state(synth, arch):
    """As strata chat does: the next prompt extends what the cache holds, and only its new
    tokens run; the answer equals a fresh run of the whole prompt."""
    engine = Engine.load(synth(arch, "Q4_K_M"))
    params = SamplingParams(temperature=0, max_tokens=4)
    kv = engine.model.new_cache(64)
    first = list(engine.generate(TOKENS[:5], params, kv=kv))
    assert kv.length == 5 + len(first) - 1  # (the last token sampled is not in it)
    prompt = TOKENS[:5] + first + [41, 8]
    again = list(engine.generate(prompt, params, kv=kv))
    assert again == list(engine.generate(prompt, params))


_CHUNK_SCAN = """
    import torch
    from strata.model.parts.delta_net import delta_chunked, delta_recurrent
    g = torch.Generator().manual_seed(seed % 2**31)
    # (tokens, heads, dk, dv, chunk): one chunk and a tail; several chunks, dv over two blocks
    # of 32 and a masked third
    for T, H, dk, dv, chunk in [(20, 2, 16, 16, 16), (50, 1, 32, 72, 16)]:
        q = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(T, H, dk, generator=g), dim=-1)
        v = torch.randn(T, H, dv, generator=g)
        dec, beta = -torch.rand(T, H, generator=g), torch.rand(T, H, generator=g)
        s0 = torch.randn(H, dk, dv, generator=g)
        o_r, s_r = delta_recurrent(q, k, v, dec, beta, s0)
        o_k, s_k = delta_chunked(q, k, v, dec, beta, s0, chunk=chunk, kernel=True)
        assert torch.allclose(o_k, o_r, atol=1e-4), (T, (o_k - o_r).abs().max())
        assert torch.allclose(s_k, s_r, atol=1e-4), (T, (s_k - s_r).abs().max())
    print("ok")
"""


def test_chunk_scan_kernel_under_the_interpreter():
    """The chunked rule with its scan over chunks in one Triton launch equals the recurrent
    rule, run on the CPU by Triton's interpreter."""
    from interpreted import fresh_seed, run_interpreted

    run_interpreted(_CHUNK_SCAN, fresh_seed(), timeout=600)


SM90_SHARED = 232448  # bytes of shared memory a block may take on sm_90 (H100, H200)


@pytest.mark.parametrize("preset", ["qwen3.6-35b-a3b", "qwen3.5-122b-a10b", "qwen3-next-80b-a3b"])
def test_delta_kernels_compile_for_sm90_within_its_shared_memory(preset):
    """Without a GPU: the Gated DeltaNet kernels compile for sm_90 at the real models' head
    widths with the launch options delta_ops gives them, and each fits a block's shared memory
    (the chunk scan's default 3-stage pipeline took 256 KiB at dk 128 and failed to launch on an
    H200; the interpreter runs neither Triton's compiler nor its limits)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels import tuning
    from strata.kernels.gpu import delta_kernels as dk
    from strata.synth.presets import get_preset

    p = get_preset(preset, None)
    d = p.ssm_state
    target = GPUTarget("cuda", 90, 32)
    sig = {n: "*fp32" for n in ("u0", "w", "inner", "qg", "kg", "dend", "state", "out")}
    sig.update(n="i32", DK="constexpr", DV="constexpr", L="constexpr", BV="constexpr")
    scan = triton.compile(ASTSource(dk._chunk_scan_kernel, sig, constexprs=dict(
        DK=d, DV=d, L=tuning.DELTA_CHUNK, BV=tuning.CHUNK_SCAN_BV)), target=target,
        options={"num_stages": tuning.CHUNK_SCAN_STAGES})
    bv, warps = tuning.DELTA_STEP_TILE
    sig = {n: "*fp32" for n in ("x", "g", "beta", "state", "out")}
    sig.update(eps="fp32", scale="fp32", **dict.fromkeys(
        ("HK", "R", "DK", "DV", "TILED", "BK", "BV"), "constexpr"))
    step = triton.compile(ASTSource(dk._delta_step_kernel, sig, constexprs=dict(
        HK=p.ssm_groups, R=p.ssm_heads // p.ssm_groups, DK=d, DV=d, TILED=True, BK=d, BV=bv)),
        target=target, options={"num_warps": warps})
    # the decode step's form: the gates from their logits in the same launch
    step_gates = triton.compile(ASTSource(dk._delta_step_kernel, sig | {
        "a": "*fp32", "dt_bias": "*fp32", "GATES": "constexpr", "HV": "constexpr"},
        constexprs=dict(HK=p.ssm_groups, R=p.ssm_heads // p.ssm_groups, DK=d, DV=d, TILED=True,
                        BK=d, BV=bv, GATES=True, HV=p.ssm_heads)),
        target=target, options={"num_warps": warps})
    sig = {"x": "*fp32", "window": "*fp32", "w": "*fp32", "y": "*fp32", "C": "i32",
           "K": "constexpr", "BLOCK": "constexpr"}
    conv = triton.compile(ASTSource(dk._conv_step_kernel, sig, constexprs=dict(
        K=p.ssm_conv, BLOCK=tuning.CONV_STEP_BLOCK)), target=target)
    sig = {"ba": "*fp32", "a": "*fp32", "dt_bias": "*fp32", "beta": "*fp32", "g": "*fp32",
           "HV": "i32", "BLOCK": "constexpr"}
    gates = triton.compile(ASTSource(dk._gates_kernel, sig, constexprs=dict(
        BLOCK=triton.next_power_of_2(p.ssm_heads))), target=target)
    sig = {"o": "*fp32", "z": "*fp32", "w": "*fp32", "out": "*fp32", "DV": "i32", "eps": "fp32",
           "BLOCK": "constexpr"}
    norm = triton.compile(ASTSource(dk._gated_norm_kernel, sig, constexprs=dict(
        BLOCK=triton.next_power_of_2(d))), target=target)
    for name, k in (("chunk scan", scan), ("delta step", step),
                    ("delta step with its gates", step_gates), ("conv step", conv),
                    ("gates", gates), ("gated norm", norm)):
        assert k.asm["cubin"], name
        assert k.metadata.shared <= SM90_SHARED, (name, k.metadata.shared)


_STEP_INTERPRETED = """
    from strata.cli.logits import compute_logits
    from strata.config import EngineConfig
    from strata.engine.generator import Engine
    tokens = {tokens}
    ref = compute_logits(Engine.load({path!r}), tokens)[4:]
    e = Engine.load({path!r}, config=EngineConfig(offload="on", cpu_kernels="torch",
                                                  kernels="exact", expert_cache="0"))
    kv = e.model.new_cache(len(tokens))
    e.run_prompt(tokens[:4], kv)
    out = np.concatenate([e.model.decode(t, kv).numpy().copy() for t in tokens[4:]])
    assert np.abs(out - ref).max() < 1e-3 * np.abs(ref).max(), np.abs(out - ref).max()
    assert (out.argmax(-1) == ref.argmax(-1)).all()
    print("ok")
"""


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_step_kernels_under_the_interpreter(synth, arch):
    """The whole decode step with its Triton kernels (delta_ops' conv and delta steps,
    decode_ops' partial-RoPE store and attention) on the CPU under Triton's interpreter."""
    from interpreted import fresh_seed, run_interpreted

    body = _STEP_INTERPRETED.format(tokens=TOKENS, path=str(synth(arch, "F32")))
    run_interpreted(body, fresh_seed(), timeout=600)


def split_qwen3next(src, dst):
    """src (qwen3next, F32, ssm_in) rewritten as newer converters write it: ssm_in's per-key-head
    q, k, v, z rows taken apart into attn_qkv [q all | k all | v all] and attn_gate [z all]."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    meta = {n: r.fields[f"qwen3next.{n}"].contents() for n in (
        "ssm.group_count", "ssm.time_step_rank", "ssm.state_size")}
    hk, hv, dk = meta["ssm.group_count"], meta["ssm.time_step_rank"], meta["ssm.state_size"]
    w = GGUFWriter(dst, "qwen3next")
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        data = np.asarray(t.data)
        if not t.name.endswith("ssm_in.weight"):
            w.add_tensor(t.name, data, raw_shape=data.shape)
            continue
        blocks = data.reshape(hk, -1, data.shape[-1])  # [Hk, 2dk + 2r dk, D]
        r_dk = (hv // hk) * dk
        q, k = blocks[:, :dk], blocks[:, dk:2 * dk]
        v, z = blocks[:, 2 * dk:2 * dk + r_dk], blocks[:, 2 * dk + r_dk:]
        flat = [x.reshape(-1, data.shape[-1]) for x in (q, k, v, z)]
        p = t.name.removesuffix("ssm_in.weight")
        w.add_tensor(p + "attn_qkv.weight", np.ascontiguousarray(np.concatenate(flat[:3])))
        w.add_tensor(p + "attn_gate.weight", np.ascontiguousarray(flat[3]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_qwen3next_with_split_projections_reads_the_same(synth, tmp_path):
    src = synth("qwen3next", "F32")
    split = split_qwen3next(src, tmp_path / "split.gguf")
    cfg = ModelConfig.from_model(open_model(split))
    assert cfg.ssm_layout == "next-split"
    ref = compute_logits(Engine.load(src), TOKENS)
    ours = compute_logits(Engine.load(split), TOKENS)
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    theirs = llama_logits(split, TOKENS)  # (llama.cpp reads both layouts)
    assert kl_per_position(theirs, ours).max() < 1e-4


def test_float_ssm_matrices_keep_the_other_matrices_in_their_blocks(synth):
    """qwen35moe's ssm_alpha / ssm_beta / ssm_conv1d are F32 matrices (read as they are, no
    kernel needed): they no longer make the plan hold every dense matrix as float32 on CUDA
    (an H200 run of qwen3.6-35b-a3b planned 7.49 GiB of float32 dense weights)."""
    pytest.importorskip("triton")
    from strata.engine.memory_plan import fused_dense
    from strata.kernels.gpu.formats import FLOAT_TYPES

    mf = open_model(synth("qwen35moe", "Q4_K_M"))
    cfg = ModelConfig.from_model(mf)
    assert any(ref.qtype in FLOAT_TYPES and len(ref.shape) == 2
               for name, ref in mf.tensors.items() if "ssm_alpha" in name)
    assert fused_dense(mf, cfg, EngineConfig(device="cuda"))
    assert not fused_dense(mf, cfg, EngineConfig(device="cuda", kernels="off"))
