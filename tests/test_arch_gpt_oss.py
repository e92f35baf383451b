"""gpt-oss against references nobody here wrote: HF transformers' GptOss built from the same
dequantized weights, and llama.cpp (llama-cpp-python) reading the same file; incremental decode
against a full forward; the offload runtime's paths and the decode step against the reference.
Prompts run past the tiny preset's sliding window (16 tokens).

llama.cpp runs with its attention in float32 here (an F32 KV cache, no flash attention), as
Strata's reference path does: with its default f16 cache, one prompt in a few moves by a KL of
~0.3 at some position, on F16 files too. It still rounds activations to 8 bits (q8_0) inside
its MXFP4 dot products; on this model (the clamped SwiGLU's activations reach tens) that moves
logits past test_llama_cpp's quantized bound, so the MXFP4 test rounds Strata's expert inputs
the same way (q8_0, as ggml's quantize_row_q8_0) and holds the result to the F16 bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from interpreted import every_case
from test_decode_step import forward_then_decode

from strata.cli.logits import compute_logits
from strata.config import ModelConfig
from strata.engine.generator import Engine
from strata.gguf import open_model
from strata.quant import QType

from hf_reference import hf_gpt_oss_logits, kl_per_position

N_TOKENS = 40  # > 2 x the tiny preset's window of 16


def prompt(seed: int, n: int = N_TOKENS, vocab: int = 1024) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def test_config_reads_what_llama_cpp_reads(synth):
    cfg = ModelConfig.from_model(open_model(synth("gpt-oss", "F16")))
    assert (cfg.arch, cfg.sliding_window, cfg.attn_sinks, cfg.moe_bias) == (
        "gpt-oss", 16, True, True)
    assert cfg.expert_act == "swiglu_oai" and cfg.rope_style == "neox" and cfg.qkv_bias
    assert (cfg.yarn.factor, cfg.yarn.orig_ctx) == (32.0, 4096)
    from strata.arch.gpt_oss import is_sliding

    assert [is_sliding(cfg, i) for i in range(4)] == [True, False, True, False]


@pytest.mark.parametrize("recipe", ["F16", "MXFP4"])
def test_matches_hf_transformers(synth, recipe):
    path = synth("gpt-oss", recipe)
    tokens = prompt(0)
    ours = compute_logits(Engine.load(path), tokens)
    theirs = hf_gpt_oss_logits(path, tokens)
    assert kl_per_position(theirs, ours).max() < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_mxfp4_experts_are_mxfp4(synth):
    mf = open_model(synth("gpt-oss", "MXFP4"))
    assert mf.tensors["blk.0.ffn_gate_exps.weight"].qtype == QType.MXFP4
    assert mf.tensors["blk.0.ffn_down_exps.bias"].qtype == QType.F32


def test_incremental_decode_equals_full_forward(synth):
    engine = Engine.load(synth("gpt-oss", "MXFP4"))
    tokens = prompt(1)
    full = compute_logits(engine, tokens)
    step = forward_then_decode(engine.model, tokens, 5)  # (one token at a time past the window)
    assert kl_per_position(full, step).max() < 1e-8
    assert (full.argmax(-1) == step.argmax(-1)).all()


def test_harmony_template_renders_with_reasoning_effort(synth):
    engine = Engine.load(synth("gpt-oss", "MXFP4"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "greet"},
            {"role": "user", "content": "Again"}]
    text = engine.chat.render(msgs, True, reasoning_effort="high")
    assert "Reasoning: high" in text and text.endswith("<|start|>assistant")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>" in text
    assert "<|start|>assistant<|channel|>final<|message|>Hello.<|end|>" in text
    assert "Reasoning: medium" in engine.chat.render(msgs[:2], True)  # the template's default
    ids = engine.chat.encode(msgs[:2], True, reasoning_effort="low")
    tok = engine.tokenizer
    assert ids[0] == tok.token_id("<|start|>") and tok.decode(ids).endswith("<|start|>assistant")
    assert ids.count(tok.token_id("<|message|>")) == 3  # system, developer, user: one token each
    assert tok.eos_id == tok.token_id("<|return|>")
    # generation stops at <|return|> and <|call|>, not at the <|end|> of an analysis message
    assert {tok.token_id("<|return|>"), tok.token_id("<|call|>")} <= tok.stop_ids
    assert tok.token_id("<|end|>") not in tok.stop_ids


def test_reasoning_effort_of_a_chat_request_reaches_the_template(synth):
    """The server's path: a request's reasoning_effort goes into its template arguments, which
    chat.encode hands the file's template (server/batching.py)."""
    from strata.server.validation import parse_chat

    engine = Engine.load(synth("gpt-oss", "MXFP4"))
    req = parse_chat({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                      "reasoning_effort": "low"}, 64)
    text = engine.tokenizer.decode(engine.chat.encode(req.messages, True, **req.template_kwargs))
    assert "Reasoning: low" in text


try:
    import llama_cpp
except ImportError:  # (the tests below it skip; the rest of the file runs)
    llama_cpp = None
needs_llama = pytest.mark.skipif(llama_cpp is None, reason="llama-cpp-python is not installed")


@needs_llama
def test_gpt4o_pre_tokenizer_matches_llama_cpp(synth):
    path = synth("gpt-oss", "MXFP4")
    text = ("Hello World's HTTPServer isn't 12345 tokens; CamelCaseWords\n\n  don't "
            "ÉCOLE été 3.14159/2  \tend")
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False).tokenize(
        text.encode(), add_bos=False, special=False)
    assert Engine.load(path).tokenizer.encode(text) == theirs


def llama_logits(path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits with an F32 KV cache, in a process of its own (llama_worker)."""
    from llama_worker import llama_scores

    return llama_scores(path, [tokens], type_k=0, type_v=0,  # (0: GGML_TYPE_F32)
                        flash_attn=False)[0]


@needs_llama
@pytest.mark.parametrize("recipe", ["F32", "F16"])
def test_float_weights_match_llama_cpp(synth, recipe):
    path = synth("gpt-oss", recipe)
    tokens = prompt(0)
    ours = compute_logits(Engine.load(path), tokens)
    theirs = llama_logits(path, tokens)
    assert kl_per_position(theirs, ours).max() < (1e-4 if recipe == "F32" else 1e-3)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def q8_0(x: torch.Tensor) -> torch.Tensor:
    """x rounded as ggml's quantize_row_q8_0 does (32 values a block, d = amax / 127 kept in
    f16, codes rounded half away from zero), back to float32."""
    b = x.reshape(-1, 32)
    d = b.abs().amax(1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.sign(b * inv) * torch.floor((b * inv).abs() + 0.5)
    return (codes * d.half().float()).reshape(x.shape)


@needs_llama
@pytest.mark.parametrize("seed", [0, 1])
def test_mxfp4_experts_match_llama_cpp(synth, monkeypatch, seed):
    import strata.experts.reference as reference
    from strata.kernels.torch_ops import glu

    def rounded_mlp(h, w_gate, w_up, w_down, b_gate, b_up, b_down, act):  # noqa: ANN001, ANN202
        x = q8_0(h)
        return q8_0(glu(x @ w_gate.T + b_gate, x @ w_up.T + b_up, act)) @ w_down.T + b_down

    # MXFP4 experts, the rest F32 (MXFP4's recipe puts attention at Q8_0: more rounding)
    path = synth("gpt-oss", "F32,blk.*.ffn_*_exps.weight=MXFP4")
    monkeypatch.setattr(reference, "expert_mlp", rounded_mlp)
    tokens = prompt(seed)
    ours = compute_logits(Engine.load(path), tokens)
    theirs = llama_logits(path, tokens)
    assert kl_per_position(theirs, ours).max() < 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
# ---- the offload runtime on the CPU (as tests/test_offload.py runs qwen3moe) -------------------


@pytest.fixture(scope="module")
def mxfp4(synth):
    path = synth("gpt-oss", "MXFP4")
    tokens = prompt(2)
    return path, tokens, compute_logits(Engine.load(path), tokens)


def offload(path, device: str = "cpu", **kw) -> Engine:
    from strata.config import EngineConfig

    kw.setdefault("cpu_kernels", "torch")
    kw.setdefault("kernels", "exact")
    return Engine.load(path, config=EngineConfig(device=device, offload="on", debug=True, **kw))


def assert_same(ours: np.ndarray, ref: np.ndarray) -> None:
    assert kl_per_position(ref, ours).max() < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


# cache: none, one slot in all, a few, every expert of every layer (4 layers x 8)
@pytest.mark.parametrize("cache", ["0", "1", "5", "32"])
@pytest.mark.parametrize("miss", ["cpu", "dma"])
def test_offload_paths_give_reference_logits(mxfp4, cache, miss):
    path, tokens, ref = mxfp4
    engine = offload(path, expert_cache=cache, miss=miss, stream_min=1 << 20)
    assert_same(compute_logits(engine, tokens), ref)
    st = engine.model.experts.stats
    assert st.hits.sum() + st.cpu.sum() + st.streamed.sum() == len(tokens) * 4 * 2
    if miss == "cpu" and cache != "32":
        assert st.cpu.sum() > 0


def test_offload_prompt_ring_and_decode(mxfp4):
    """Prompt chunks streamed through the ring, then decode steps on the miss paths."""
    path, tokens, ref = mxfp4
    engine = offload(path, expert_cache="3", stream_min=2, prefill="8")
    assert_same(compute_logits(engine, tokens), ref)
    assert engine.model.step is not None  # the decode step, eager on the CPU: the parts' paths
    assert_same(forward_then_decode(engine.model, tokens, 18), ref)


def test_ggml_cpu_misses_with_biases(synth, monkeypatch):
    """ggml's CPU kernels run the biased experts (add, swiglu_oai) on q8_0-rounded inputs (its
    MXFP4 dot products' partner): equal to the reference with that rounding (q8_0 above)."""
    pytest.importorskip("ggml", reason="ggml-python not installed")
    import strata.experts.reference as reference
    from strata.kernels.torch_ops import glu

    def rounded_mlp(h, w_gate, w_up, w_down, b_gate, b_up, b_down, act):  # noqa: ANN001, ANN202
        x = q8_0(h)
        return q8_0(glu(x @ w_gate.T + b_gate, x @ w_up.T + b_up, act)) @ w_down.T + b_down

    path = synth("gpt-oss", "F32,blk.*.ffn_*_exps.weight=MXFP4")
    tokens = prompt(3)
    engine = offload(path, expert_cache="0", miss="cpu", cpu_kernels="ggml", stream_min=1 << 20)
    assert engine.model.experts.pool.kind == "ggml"
    ours = compute_logits(engine, tokens)
    assert engine.model.experts.stats.cpu.sum() == len(tokens) * 4 * 2
    monkeypatch.setattr(reference, "expert_mlp", rounded_mlp)
    ref = compute_logits(Engine.load(path), tokens)
    assert kl_per_position(ref, ours).max() < 1e-3
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


# ---- the decode step's static paths (eager on the CPU, CUDA graphs on a GPU) ------------------


# (T, H, Hkv, hd, capacity, window, n_splits): one token and a few, windows shorter and longer
# than a split, sinks on every case (None: attention_splits)
SINK_CASES = [(1, 4, 2, 16, 37, 0, None), (1, 4, 2, 16, 37, 5, None), (3, 8, 2, 64, 300, 16, 4),
              (2, 4, 4, 32, 260, 128, 8), (1, 64, 8, 64, 600, 128, None)]


def check_sink_decode(device: str, seed: int) -> None:
    """decode_attention with window and sinks equals sink_attention, over a cache whose rows past
    the length are NaN, for lengths below, at and past the window."""
    from strata.kernels.gpu import decode_ops as ops
    from strata.model.parts.sink_attention import sink_attention

    g = torch.Generator().manual_seed(seed)
    for t, h, hkv, hd, cap, window, splits in SINK_CASES:
        sinks = torch.randn(h, generator=g).to(device)
        q = torch.randn(t, h, hd, generator=g).to(device)
        for n in sorted({t, window, window + 1, cap - 3, cap} - {0}):
            if n < t:
                continue
            k, v = (torch.randn(cap, hkv, hd, generator=g).to(device) for _ in range(2))
            kc, vc = k.clone(), v.clone()
            kc[n:], vc[n:] = float("nan"), float("nan")
            out = ops.decode_attention(q, kc, vc, torch.tensor([n], device=device), hd ** -0.5,
                                       n_splits=splits, window=window, sinks=sinks)
            ref = sink_attention(q, k[:n], v[:n], n - t, sinks, window, hd ** -0.5)
            err = float((out - ref).abs().max() / ref.abs().max())
            assert err < 1e-5, (t, h, hkv, hd, window, n, err)


def test_decode_attention_with_window_and_sinks(device):
    check_sink_decode(device, 0)


@pytest.mark.parametrize("kv", ["fp32", "bf16"])
def test_window_and_sink_kernels_compile_for_sm90(kv):
    """Without a GPU: Triton compiles both attention kernels with a window and sinks for sm_90
    (as tests/test_decode_ops.py does for the plain ones)."""
    triton = pytest.importorskip("triton", reason="triton is not installed")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import decode_kernels as dk
    from strata.kernels.gpu import decode_ops as ops

    target = GPUTarget("cuda", 90, 32)
    i32 = dict.fromkeys(("T", "H", "S", "RB", "stride_qt", "stride_qh", "stride_kr",
                         "stride_kh", "stride_vr", "stride_vh", "stride_ksr", "stride_ksh",
                         "stride_vsr", "stride_vsh"), "i32")
    const = dict(HD=64, G=8, MIN_CHUNK=ops.ATTN_MIN_CHUNK, BLOCK_M=ops.ATTN_BLOCK_M,
                 BLOCK_N=32, BLOCK_D=64, STAGES=2, Q8=False, WINDOW=128)
    sig = {"q": "*fp32", "kc": f"*{kv}", "vc": f"*{kv}", "ks": f"*{kv}", "vs": f"*{kv}",
           "length": "*i64", "part_o": "*fp32", "part_ml": "*fp32", "scale": "fp32", **i32,
           **dict.fromkeys(const, "constexpr")}
    split = triton.compile(ASTSource(dk._attn_split_kernel, sig, constexprs=const),
                           target=target, options={"num_warps": 8})
    assert split.asm["cubin"]
    const = dict(HD=64, MIN_CHUNK=ops.ATTN_MIN_CHUNK, BLOCK_N=32, BLOCK_S=16, BLOCK_D=64,
                 WINDOW=128, HAS_SINKS=True)
    sig = {"part_o": "*fp32", "part_ml": "*fp32", "length": "*i64", "out": "*fp32",
           "T": "i32", "H": "i32", "S": "i32", "stride_ot": "i32", "sinks": "*fp32",
           **dict.fromkeys(const, "constexpr")}
    reduce = triton.compile(ASTSource(dk._attn_reduce_kernel, sig, constexprs=const),
                            target=target, options={"num_warps": 4})
    assert reduce.asm["cubin"]


@every_case  # (test_attention_variants_under_the_interpreter has windows and sinks)
def test_decode_attention_kernels_with_window_and_sinks_interpreted():
    """The Triton kernels (window start, sinks) on the CPU under Triton's interpreter."""
    pytest.importorskip("triton", reason="triton is not installed")
    from interpreted import fresh_seed, run_interpreted

    run_interpreted("""
        sys.path.insert(0, "tests")
        from test_arch_gpt_oss import check_sink_decode
        check_sink_decode("cpu", seed)
        print("ok")
    """, fresh_seed(), timeout=600)


@pytest.mark.parametrize("cache", ["0", "5", "32"])  # 4 layers x 8 experts: none, some, all
@pytest.mark.parametrize("miss", ["cpu", "dma"])
def test_decode_step_gives_reference_logits(mxfp4, cache, miss, device):
    path, tokens, ref = mxfp4
    engine = offload(path, device=device, expert_cache=cache, miss=miss)
    step = engine.model.step
    assert step is not None and step.graphs == (device == "cuda")
    kv = engine.model.new_cache(len(tokens))
    engine.run_prompt(tokens[:4], kv)
    out = [engine.model.decode(t, kv).float().cpu().numpy().copy() for t in tokens[4:]]
    assert_same(np.concatenate(out), ref[4:])  # 36 steps, past the window of 16
    if device == "cuda":
        assert not step._failed and step._captured is not None


def test_routing_trace_and_pin_see_the_router_bias(mxfp4):
    from strata.model.parts.routing import RoutingPin, RoutingTrace, attach

    path, tokens, ref = mxfp4
    engine = Engine.load(path)
    trace = RoutingTrace()
    with attach(engine.model, trace):
        assert_same(compute_logits(engine, tokens), ref)
    assert min(m.min() for m in trace.margins().values()) >= 0
    with attach(engine.model, RoutingPin(trace.ids())):
        assert_same(compute_logits(engine, tokens), ref)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_type", ["f32", "f16"])
@pytest.mark.parametrize("cache", ["3", "32"])
def test_cuda_fused_kernels_and_graphs_within_rounding(mxfp4, kv_type, cache):
    """--kernels fused on CUDA: the dense weights' fused kernels, the experts on the fused MoE
    kernels with their biases and the clamped SwiGLU (every layer covered: none on the torch
    paths), decode steps captured as CUDA graphs over the static cache (f16: rounded keys and
    values): the logits move by rounding, not more. The experts' MXFP4 kernels take 8-bit
    activations (tuning.MXFP4_X8), as llama.cpp's MXFP4 GEMVs do: on an H100 a position's KL
    to the float32 reference was 1e-3 typically and 0.116 at most (bench/2026-12-06-h100-mx8.md),
    where llama.cpp's own is 2e-2 on average and up to 1e-1 (test_llama_cpp.py); a wrong
    scale or nibble order moves every position by orders more."""
    path, tokens, ref = mxfp4
    engine = offload(path, "cuda", expert_cache=cache, kv_type=kv_type, kernels="fused")
    ex = engine.model.experts
    assert all(ex.fused.covered) and sorted(ex.fused.biases) == list(range(len(ex.fused.covered)))
    assert "host" not in ex.decode_paths(engine.model.cfg.n_experts_used,
                                         [True] * len(ex.fused.covered))
    step = engine.model.step
    assert step is not None and step.graphs
    kv = engine.model.new_cache(len(tokens))
    engine.run_prompt(tokens[:4], kv)
    out = np.concatenate([engine.model.decode(t, kv).float().cpu().numpy().copy()
                          for t in tokens[4:]])
    kl = kl_per_position(ref[4:], out)
    assert np.median(kl) < 2e-3 and kl.mean() < 1e-2 and kl.max() < 0.25, kl
    assert (out.argmax(-1) == ref[4:].argmax(-1)).mean() >= 0.9
    assert not step._failed and step.steps["replayed"] >= len(tokens) - 5


@pytest.mark.parametrize("meta,shapes,says", [
    ({"gpt-oss.rope.scaling.type": "linear"}, {}, "gpt-oss.rope.scaling.type is 'linear'"),
    ({"gpt-oss.attention.sliding_window": None}, {}, "gpt-oss.attention.sliding_window"),
    ({}, {"blk.1.ffn_up_exps.bias": [128, 16]}, "tensor blk.1.ffn_up_exps.bias has shape"),
])
def test_bad_gpt_oss_files_are_refused_in_one_line(synth, tmp_path, meta, shapes, says):
    from strata.errors import StrataError

    from gguf_edit import rewrite

    bad = rewrite(synth("gpt-oss", "F16"), tmp_path / "bad.gguf", meta=meta,
                  tensor_shapes=shapes)
    with pytest.raises(StrataError) as err:
        ModelConfig.from_model(open_model(bad))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_plan_counts_the_experts_biases_on_cuda(synth):
    """On CUDA the fused kernels read the experts' biases from a device copy (FusedHits): the
    memory plan counts its bytes with the dense weights (planned without a GPU)."""
    from dataclasses import replace

    from strata.config import EngineConfig
    from strata.engine.memory_plan import make_plan
    from strata.experts.layout import expert_layouts

    mf = open_model(synth("gpt-oss", "MXFP4"))
    cfg = ModelConfig.from_model(mf)
    layouts = expert_layouts(mf, cfg)
    ec = EngineConfig(device="cuda", vram_budget_gib=2, ctx=256)
    bare = [replace(lay, bias=None) for lay in layouts]
    biases = sum(b.gate.nbytes + b.up.nbytes + b.down.nbytes
                 for b in (lay.bias for lay in layouts))
    assert biases > 0
    assert make_plan(mf, cfg, ec, layouts).dense - make_plan(mf, cfg, ec, bare).dense == biases
