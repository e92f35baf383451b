"""The reference forward pass against references nobody here wrote, and against itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.cli.logits import compute_logits
from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.model.transformer import Segment

from hf_reference import hf_gguf_logits, hf_mixtral_logits, kl_per_position

TOKENS = [5, 311, 17, 902, 64, 64, 1000, 3, 250, 777, 41, 8, 512, 99, 1, 600]


def assert_close(ours: np.ndarray, ref: np.ndarray, max_kl: float = 1e-4) -> None:
    assert ours.shape == ref.shape
    kl = kl_per_position(ref, ours)
    assert kl.max() < max_kl, f"max KL {kl.max():.2e} per position {kl}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all(), "top token differs"


# a pack per quant family, a mixed-by-layer pack, and one that cycles every supported type
@pytest.mark.parametrize("recipe", ["Q4_K_M", "Q8_0", "IQ2_XS-MIX", "ALL-TYPES",
                                    "IQ3_XXS,blk.1.ffn_*_exps=IQ1_S"])
def test_qwen3moe_matches_transformers(synth, recipe):
    path = synth("qwen3moe", recipe)
    engine = Engine.load(path)
    assert_close(compute_logits(engine, TOKENS), hf_gguf_logits(path, TOKENS))


@pytest.mark.parametrize("recipe", ["Q4_K_M", "ALL-TYPES"])
def test_qwen2moe_matches_transformers(synth, recipe):
    path = synth("qwen2moe", recipe)
    engine = Engine.load(path)
    assert engine.config.d_shared and engine.config.qkv_bias
    assert_close(compute_logits(engine, TOKENS), hf_gguf_logits(path, TOKENS))


@pytest.mark.parametrize("recipe", ["Q4_K_M", "ALL-TYPES"])
def test_mixtral_matches_transformers_built_from_gguf_py(synth, recipe):
    path = synth("llama", recipe)
    engine = Engine.load(path)
    assert_close(compute_logits(engine, TOKENS), hf_mixtral_logits(path, TOKENS))


def test_routing_spreads_over_experts(synth):
    engine = Engine.load(synth("qwen3moe", "Q4_K_M"))
    lw = engine.model.w.layers[0]
    x = engine.model.w.embed.rows(torch.arange(engine.config.n_vocab))
    from strata.model.layers import rms_norm, route

    ids, _ = route(rms_norm(x, lw.ffn_norm, 1e-6), lw.router, 2, True)
    share = torch.bincount(ids.flatten(), minlength=8).float() / ids.numel()
    assert share.min() > 0.25 / 8 and share.max() < 4 / 8, share


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama"])
def test_incremental_decoding_equals_full_recompute(synth, arch, device):
    # (--kernels exact: on CUDA the default fused kernels round one-token experts' activations
    # to 8 bits and longer chunks to bf16, which test_fused_decode_within_x8_rounding bounds)
    engine = Engine.load(synth(arch, "Q4_K_M"), config=EngineConfig(device=device,
                                                                     kernels="exact"))
    full = compute_logits(engine, TOKENS)
    kv = engine.model.new_cache(4)  # small, so the cache grows on the way
    steps = [engine.model.forward(torch.tensor(TOKENS[:5]), [Segment(kv, 5)], all_logits=True)]
    for t in TOKENS[5:]:
        steps.append(engine.model.forward(torch.tensor([t]), [Segment(kv, 1)], all_logits=True))
    inc = torch.cat(steps).cpu().numpy()
    np.testing.assert_allclose(inc, full, rtol=0, atol=2e-4)
    assert kv.length == len(TOKENS)


def test_batched_segments_equal_separate_runs(synth):
    engine = Engine.load(synth("qwen2moe", "Q4_K_M"))
    a, b = TOKENS[:9], TOKENS[4:]
    sep = [compute_logits(engine, a)[-1], compute_logits(engine, b)[-1]]
    kva, kvb = engine.model.new_cache(), engine.model.new_cache()
    both = engine.model.forward(torch.tensor(a + b), [Segment(kva, len(a)), Segment(kvb, len(b))])
    np.testing.assert_allclose(both.numpy(), np.stack(sep), rtol=0, atol=2e-4)
