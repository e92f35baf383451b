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


def test_the_reference_keeps_dequantized_experts_within_its_bytes(synth):
    """The CPU's reference executor keeps the experts it dequantized (least recently used out,
    at most cache_bytes): the same logits to the bit as with nothing kept, and a cap of two
    experts' bytes holds the two last used."""
    from strata.experts.reference import ReferenceExperts

    engine = Engine.load(synth("qwen3moe", "Q4_K_M"), config=EngineConfig(device="cpu"))
    model = engine.model
    ids = torch.tensor([3, 17, 42, 5, 99, 7, 12, 64])

    def logits(ex: ReferenceExperts) -> torch.Tensor:
        model.experts = ex
        kv = model.new_cache(16)
        first = model.forward(ids[:5], [Segment(kv, 5)], all_logits=True)
        return torch.cat([first, model.forward(ids[5:], [Segment(kv, 3)], all_logits=True)])

    kept = ReferenceExperts(dense_tokens=0)  # (one expert at a time: the stacks' test below)
    ref = logits(ReferenceExperts(cache_bytes=0))
    assert torch.equal(logits(kept), ref) and kept._kept
    assert torch.equal(logits(kept), ref)  # (the second time from what it kept)
    layer0 = model.layers[0].ffn.lw.experts
    one = sum(t.numel() * t.element_size() for t in kept.expert(0, layer0, 0))
    two = ReferenceExperts(cache_bytes=2 * one)
    for e in (0, 1, 2, 1):
        two.expert(0, layer0, e)
    assert list(two._kept) == [(0, 2), (0, 1)] and two._kept_bytes == 2 * one
    assert torch.equal(logits(two), ref) and two._kept_bytes <= 2 * one
    assert ReferenceExperts(cache_bytes=0).expert(0, layer0, 0)[0].shape[-1] == \
        model.cfg.d_model and not ReferenceExperts(cache_bytes=0)._kept


# (tokens, experts, used a token, hidden, expert hidden): the tiny preset's decode batch, a
# prime expert count, fewer tokens than experts, one row past a power of two
@pytest.mark.parametrize("shape", [(8, 8, 2, 256, 256), (5, 7, 3, 64, 96), (2, 3, 2, 32, 48),
                                   (17, 8, 2, 64, 64)])
def test_dense_experts_equal_one_expert_at_a_time(shape):
    """dense_experts (every token through every stacked expert, unrouted pairs weighted zero)
    gives the per-expert sum of the reference loop."""
    from strata.experts.reference import dense_experts
    from strata.model.layers import swiglu

    t, e, k, d, f = shape
    g = torch.Generator().manual_seed(sum(shape))
    gate_up, down = torch.randn(e, 2 * f, d, generator=g) / d ** 0.5, \
        torch.randn(e, d, f, generator=g) / f ** 0.5
    h = torch.randn(t, d, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])  # [T, K]
    wts = torch.softmax(torch.randn(t, k, generator=g), -1)
    ref = torch.zeros(t, d)
    for i in range(t):
        for j in range(k):
            x = int(ids[i, j])
            ref[i] += wts[i, j] * swiglu(h[i:i + 1], gate_up[x, :f], gate_up[x, f:], down[x])[0]
    torch.testing.assert_close(dense_experts(gate_up, down, h, ids, wts), ref, rtol=0,
                               atol=2e-5)


def test_a_batch_runs_the_stacked_layer_and_one_token_reads_it_as_before(synth):
    """A few tokens that route to most of a layer's experts (the batched decode of several
    sequences) run its stacked experts: logits within float rounding of one expert at a time;
    the stacks take the layer's kept experts' place in the byte count; one token after it reads
    the stack's views and gets the logits of nothing kept, to the bit. A stack past half the
    bytes is not made (one expert at a time)."""
    from strata.experts.reference import ReferenceExperts

    engine = Engine.load(synth("qwen3moe", "Q4_K_M"), config=EngineConfig(device="cpu"))
    model = engine.model
    prompt, batch = torch.tensor([3, 17, 42, 5, 99]), torch.tensor([7, 12, 64, 1, 900, 33, 8, 2])

    def logits(ex: ReferenceExperts) -> torch.Tensor:
        model.experts = ex
        kvs = [model.new_cache(16) for _ in batch]
        for kv in kvs:
            model.forward(prompt, [Segment(kv, len(prompt))])
        together = model.forward(batch, [Segment(kv, 1) for kv in kvs])  # [8, V]
        return torch.cat([together, model.decode(11, model.new_cache(4))])  # one token alone

    ex = ReferenceExperts()
    ref = logits(ReferenceExperts(cache_bytes=0))
    ours = logits(ex)
    assert sorted(ex._stacks) == list(range(model.cfg.n_layers))  # (8 tokens: every layer)
    assert not ex._kept and ex._stack_bytes == sum(
        4 * sum(t.numel() for t in ex._stacks[i]) for i in ex._stacks)
    torch.testing.assert_close(ours[:-1], ref[:-1], rtol=0, atol=1e-4)
    assert (ours[:-1].argmax(-1) == ref[:-1].argmax(-1)).all()
    assert torch.equal(ours[-1], ref[-1])  # one token: one expert at a time, from the stack

    layer0 = model.layers[0].ffn.lw.experts
    small = ReferenceExperts(cache_bytes=ex._stack_bytes // model.cfg.n_layers)  # one layer
    assert small.stacked(0, layer0) is None and not small._stacks
    assert torch.equal(logits(small)[:-1], logits(ReferenceExperts(dense_tokens=0))[:-1])
    assert small._kept_bytes <= small.cache_bytes
