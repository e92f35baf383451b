"""glm4moe (GLM-4.5 / 4.6 / 4.7, Air): read as llama.cpp writes it, the reference path against
transformers' glm4_moe and llama.cpp, incremental decode, the offload paths and the decode step
(eager on the CPU) against the reference; the presets of the real shapes; refusals."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGUFValueType
from test_decode_step import PROMPT, decoded_logits
from test_offload import TOKENS, assert_same, offload

from strata.cli.info import describe
from strata.cli.logits import compute_logits
from strata.cli.main import main
from strata.config import ModelConfig
from strata.engine.generator import Engine
from strata.errors import StrataError
from strata.gguf import open_model
from strata.model.parts import Segment
from strata.synth.presets import get_preset
from strata.synth.recipes import Recipe
from strata.synth.writer import config_of, plan_tensors

from arch_checks import (
    FUSED_ONE_TOKEN_INTERPRETED,
    check_chat_and_generate,
    check_command_passes,
    check_decode_graphs_on_cuda,
    check_f16_matches_llama_cpp,
    check_fused_decode_within_x8_rounding,
    check_matches_transformers,
    check_offload_paths,
    check_quantized_agrees_with_llama_cpp,
    check_streamed_prompt,
    exact_engine,
)
from gguf_edit import rewrite
from hf_reference import hf_glm4moe_logits

ARCH = "glm4moe"


@pytest.mark.parametrize("recipe", ["F32", "Q4_K_M"])
def test_matches_transformers_glm4_moe(synth, recipe):
    check_matches_transformers(synth(ARCH, recipe), hf_glm4moe_logits)


def test_f16_file_matches_llama_cpp(synth):
    check_f16_matches_llama_cpp(synth(ARCH, "F16"))


def test_quantized_file_agrees_with_llama_cpp(synth):
    check_quantized_agrees_with_llama_cpp(synth(ARCH, "Q4_K_M"))


def test_config_and_weights_read_every_part(synth):
    mf = open_model(synth(ARCH, "Q4_K_M"))
    cfg = ModelConfig.from_model(mf)
    p = get_preset("tiny", ARCH)
    assert cfg == replace(config_of(p), rms_eps=cfg.rms_eps)  # (stored as a float32)
    assert cfg.rms_eps == pytest.approx(1e-5)
    assert (cfg.n_layers, cfg.n_nextn, cfg.n_dense_lead) == (3, 1, 1)
    assert (cfg.gating, cfg.expert_bias, cfg.expert_scale, cfg.norm_topk) == (
        "sigmoid", True, 2.5, True)
    assert cfg.rope_dim == 32 < cfg.head_dim and cfg.qkv_bias and cfg.qk_norm
    engine = Engine.load(mf.path)
    w = engine.model.w
    assert len(w.layers) == 3 and w.layers[0].router is None and w.layers[0].ffn_gate is not None
    assert w.layers[1].router_bias.shape == (8,) and w.layers[1].shared_gate is None
    (nextn,) = w.nextn  # kept for speculative decoding, not run by the forward
    assert nextn.enorm.shape == (256,) and nextn.layer.router is not None
    assert [layer.ffn.routed for layer in engine.model.layers] == [False, True, True]


def test_incremental_decoding_equals_full_recompute(synth, device):
    engine = exact_engine(synth(ARCH, "Q4_K_M"), device)  # (float32 on every path)
    full = compute_logits(engine, TOKENS)
    kv = engine.model.new_cache(4)
    steps = [engine.model.forward(torch.tensor(TOKENS[:5]), [Segment(kv, 5)], all_logits=True)]
    for t in TOKENS[5:]:
        steps.append(engine.model.forward(torch.tensor([t]), [Segment(kv, 1)], all_logits=True))
    np.testing.assert_allclose(torch.cat(steps).cpu().numpy(), full, rtol=0, atol=2e-4)


@pytest.mark.slow
def test_fused_one_token_experts_under_the_interpreter():
    """The fused MoE kernels CUDA runs for a few tokens (moe_forward's decode form), run by
    Triton's interpreter on the CPU: a 4-token chunk, then a single token, give the reference
    logits through glm4moe's and deepseek2's routing (scaled, biased), dense first layer and
    shared expert; on 8-bit activations (--kernels fused) within that rounding's bound. (The two
    architectures side by side, a process each.)"""
    from interpreted import fresh_seed, run_interpreted_side_by_side

    run_interpreted_side_by_side([f"\n    ARCH = {a!r}" + FUSED_ONE_TOKEN_INTERPRETED
                                  for a in (ARCH, "deepseek2")], fresh_seed(), timeout=900)


@pytest.mark.cuda
def test_fused_decode_within_x8_rounding(synth):
    check_fused_decode_within_x8_rounding(synth(ARCH, "Q4_K_M"))


# cache: none, a few, every expert of the two routed layers (2 x 8); misses on the CPU or copied
@pytest.mark.parametrize("cache", ["0", "5", "16"])
@pytest.mark.parametrize("miss", ["cpu", "dma"])
def test_offload_paths_give_reference_logits(synth, cache, miss, device):
    engine = check_offload_paths(synth(ARCH, "Q4_K_M"), device, cache, miss, routed_layers=2)
    assert engine.model.experts.cache.layers[0].capacity == 0  # (the dense layer: no slots)


def test_streamed_prompt_gives_reference_logits(synth, device):
    check_streamed_prompt(synth(ARCH, "Q4_K_M"), device)


@pytest.mark.parametrize("cache", ["0", "16"])
def test_decode_step_gives_reference_logits(synth, cache, device):
    """The StaticStep branch of sigmoid routing (torch ops; on CUDA captured as graphs)."""
    path = synth(ARCH, "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)[PROMPT:]
    engine = offload(path, device, expert_cache=cache)
    assert engine.model.step is not None
    assert_same(decoded_logits(engine, TOKENS), ref)


@pytest.mark.cuda
def test_decode_step_graphs_on_cuda(synth):
    check_decode_graphs_on_cuda(synth(ARCH, "Q4_K_M"))


@pytest.mark.parametrize("preset,layers,dense,experts,shexp", [
    ("glm-4.5-air", 46, 1, 128, 1408), ("glm-4.6", 92, 3, 160, 1536)])
def test_real_shape_presets(preset, layers, dense, experts, shexp):
    p = get_preset(preset, None)
    assert (p.arch, p.n_layers, p.n_dense_lead, p.n_experts, p.n_nextn) == (
        ARCH, layers, dense, experts, 1)
    names = {t.name: t.shape for t in plan_tensors(p, Recipe("Q4_K_M"))}
    assert names["blk.0.ffn_gate.weight"] == (p.d_ff, p.d_model)
    assert names[f"blk.{dense}.ffn_up_shexp.weight"] == (shexp, p.d_model)
    assert names[f"blk.{layers}.nextn.eh_proj.weight"] == (p.d_model, 2 * p.d_model)
    assert names[f"blk.{layers}.ffn_gate_exps.weight"] == (experts, p.d_expert, p.d_model)
    assert f"blk.{layers + 1}.attn_q.weight" not in names


def test_synth_cli_layers_and_info(tmp_path, capsys):
    out = tmp_path / "glm.gguf"
    assert main(["synth", str(out), "--arch", ARCH, "--layers", "2", "--quant", "Q8_0"]) == 0
    mf = open_model(out)
    cfg = ModelConfig.from_model(mf)
    assert (cfg.n_layers, cfg.n_dense_lead, cfg.n_nextn) == (2, 1, 1)
    text = "\n".join(describe(mf, cfg))
    assert "glm4moe" in text and "sigmoid" in text and "nextn" in text


def test_unsupported_gating_is_refused_in_one_line(synth, tmp_path):
    src = synth(ARCH, "F32")
    bad = rewrite(src, tmp_path / "gating.gguf", {f"{ARCH}.expert_gating_func": 3})
    with pytest.raises(StrataError, match="expert_gating_func is 3"):
        ModelConfig.from_model(open_model(bad))
    sections = ([8, 8, 0, 0], GGUFValueType.ARRAY)
    vision = rewrite(src, tmp_path / "mrope.gguf", {f"{ARCH}.rope.dimension_sections": sections})
    with pytest.raises(StrataError, match="dimension_sections"):
        ModelConfig.from_model(open_model(vision))


def test_check_command_passes_offload_against_the_reference(synth, capsys):
    check_command_passes(synth(ARCH, "Q4_K_M"), capsys)


def test_chat_through_the_file_template_and_generate(synth, capsys):
    check_chat_and_generate(synth(ARCH, "Q4_K_M"), capsys)
