"""gpt-oss against references nobody here wrote: HF transformers' GptOss built from the same
dequantized weights, and llama.cpp (llama-cpp-python) reading the same file; incremental decode
against a full forward; the prompts run past the tiny preset's sliding window (16 tokens).

llama.cpp rounds activations inside its dot products (to f16 for F16 weights, to 8 bits for
MXFP4 / Q8_0), so a token whose router has a near-tie between its K-th and (K+1)-th expert may
route differently there, which is neither engine's error (one such flip moves a position's KL to
~0.3). The llama.cpp tests therefore run a prompt whose every routing has a clear margin on the
reference path (chosen by seed below), and hold the rest to the bounds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.cli.logits import compute_logits
from strata.config import ModelConfig
from strata.engine.generator import Engine
from strata.gguf import open_model
from strata.model.parts import Segment
from strata.quant import QType

from hf_reference import hf_gpt_oss_logits, kl_per_position

N_TOKENS = 40  # > 2 x the tiny preset's window of 16


def prompt(seed: int, n: int = N_TOKENS, vocab: int = 1024) -> list[int]:
    return np.random.default_rng(seed).integers(3, vocab, n).tolist()


def routing_margin(engine: Engine, tokens: list[int]) -> float:
    """The smallest gap, over every routed layer and token, between the K-th and (K+1)-th
    router logit (biases included) on the reference path."""
    gaps = []
    model = engine.model

    def hook(layer, r, router, k, norm_topk):
        bias = model.layers[layer].ffn.lw.router_bias
        top = (r.h @ router.T + bias).topk(k + 1, dim=-1).values  # [T, K+1]
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))
        return r

    for layer in model.layers:
        layer.ffn.hook = hook
    try:
        compute_logits(engine, tokens)
    finally:
        for layer in model.layers:
            layer.ffn.hook = None
    return min(gaps)


def clear_prompt(engine: Engine, margin: float, n: int = 20) -> list[int]:
    """The first prompt of n tokens (past the window) whose every routing has this margin."""
    for seed in range(200):
        tokens = prompt(seed, n)
        if routing_margin(engine, tokens) > margin:
            return tokens
    raise AssertionError(f"no prompt routes with a margin of {margin}")


def test_config_reads_what_llama_cpp_reads(synth):
    cfg = ModelConfig.from_model(open_model(synth("gpt-oss", "F16")))
    assert (cfg.arch, cfg.sliding_window, cfg.attn_sinks, cfg.moe_bias) == (
        "gpt-oss", 16, True, True)
    assert cfg.expert_act == "swiglu_oai" and cfg.rope_style == "neox" and cfg.qkv_bias
    assert (cfg.rope_yarn.factor, cfg.rope_yarn.orig_ctx) == (32.0, 4096)
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
    model = engine.model
    kv = model.new_cache(len(tokens))
    steps = [model.forward(torch.tensor(tokens[:5]), [Segment(kv, 5)], all_logits=True)]
    # one token at a time, past the window (the logits of a decode step are its own buffer)
    steps += [model.decode(t, kv).clone() for t in tokens[5:]]
    step = torch.cat(steps).numpy()
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


llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")


def test_gpt4o_pre_tokenizer_matches_llama_cpp(synth):
    path = synth("gpt-oss", "MXFP4")
    text = ("Hello World's HTTPServer isn't 12345 tokens; CamelCaseWords\n\n  don't "
            "ÉCOLE été 3.14159/2  \tend")
    theirs = llama_cpp.Llama(str(path), vocab_only=True, verbose=False).tokenize(
        text.encode(), add_bos=False, special=False)
    assert Engine.load(path).tokenizer.encode(text) == theirs


def llama_logits(path, tokens: list[int]) -> np.ndarray:
    model = llama_cpp.Llama(str(path), logits_all=True, n_ctx=64, n_threads=2, verbose=False)
    model.eval(tokens)
    out = np.array(model.scores[: len(tokens)], dtype=np.float32)
    model.close()
    return out


def test_float32_matches_llama_cpp_on_any_prompt(synth):
    path = synth("gpt-oss", "F32")  # llama.cpp computes in float32 too: no margin needed
    tokens = prompt(0)
    ours = compute_logits(Engine.load(path), tokens)
    theirs = llama_logits(path, tokens)
    assert kl_per_position(theirs, ours).max() < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_f16_matches_llama_cpp(synth):
    path = synth("gpt-oss", "F16")
    engine = Engine.load(path)
    tokens = clear_prompt(engine, 0.01)  # f16 rounding: measured to matter below ~0.002
    ours = compute_logits(engine, tokens)
    theirs = llama_logits(path, tokens)
    assert kl_per_position(theirs, ours).max() < 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_mxfp4_experts_match_llama_cpp(synth):
    # MXFP4 experts, the rest F32 (MXFP4's recipe puts attention at Q8_0, which adds its own
    # 8-bit rounding of the activations and so more near-ties)
    path = synth("gpt-oss", "F32,blk.*.ffn_*_exps.weight=MXFP4")
    engine = Engine.load(path)
    tokens = clear_prompt(engine, 0.025)
    ours = compute_logits(engine, tokens)
    theirs = llama_logits(path, tokens)
    kl = kl_per_position(theirs, ours)
    assert kl.mean() < 2e-2 and kl.max() < 1e-1, kl  # test_llama_cpp's quantized bound
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.75


@pytest.mark.parametrize("preset,experts", [("gpt-oss-20b", 32), ("gpt-oss-120b", 128)])
def test_real_shapes_plan_with_fewer_layers(preset, experts):
    from dataclasses import replace

    from strata.synth.presets import get_preset
    from strata.synth.recipes import Recipe
    from strata.synth.writer import config_of, plan_tensors

    p = replace(get_preset(preset, "gpt-oss"), n_layers=2)
    planned = {t.name: t for t in plan_tensors(p, Recipe("MXFP4"))}
    assert planned["blk.1.ffn_gate_exps.weight"].shape == (experts, 2880, 2880)
    assert planned["blk.1.ffn_gate_exps.weight"].qtype == QType.MXFP4  # 2880 = 90 blocks of 32
    assert planned["blk.1.ffn_gate_exps.bias"].qtype == QType.F32
    assert config_of(p).sliding_window == 128 and "blk.2.attn_q.weight" not in planned


def test_info_shows_windows_and_mxfp4(synth):
    from strata.cli.info import describe

    mf = open_model(synth("gpt-oss", "MXFP4"))
    text = "\n".join(describe(mf, ModelConfig.from_model(mf)))
    assert "sliding window 16: 0, 2; full attention: 1, 3" in text and "sinks" in text
    assert "MXFP4/MXFP4/MXFP4" in text and "yarn x32 of 4096" in text


# ---- the offload runtime on the CPU (as tests/test_offload.py runs qwen3moe) -------------------


@pytest.fixture(scope="module")
def mxfp4(synth):
    path = synth("gpt-oss", "MXFP4")
    tokens = prompt(2)
    return path, tokens, compute_logits(Engine.load(path), tokens)


def offload(path, **kw) -> Engine:
    from strata.config import EngineConfig

    kw.setdefault("cpu_kernels", "torch")
    kw.setdefault("kernels", "exact")
    return Engine.load(path, config=EngineConfig(device="cpu", offload="on", debug=True, **kw))


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


@pytest.mark.parametrize("cpu_kernels", ["torch", "auto"])
def test_offload_prompt_ring_and_decode(mxfp4, cpu_kernels):
    """Prompt chunks streamed through the ring, then decode steps on the miss paths; ggml's CPU
    kernels (auto) leave biased experts to the torch path, which is float32-exact."""
    path, tokens, ref = mxfp4
    engine = offload(path, expert_cache="3", stream_min=2, prefill="8", cpu_kernels=cpu_kernels)
    assert_same(compute_logits(engine, tokens), ref)
    model = engine.model
    assert model.step is not None  # the decode step, eager on the CPU: the parts' static paths
    kv = model.new_cache(len(tokens))
    steps = [model.forward(torch.tensor(tokens[:18]), [Segment(kv, 18)], all_logits=True)]
    steps += [model.decode(t, kv).clone() for t in tokens[18:]]
    assert_same(torch.cat(steps).numpy(), ref)
