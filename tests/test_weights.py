"""Dense weight handling: q, k, v fused into one matrix where they share a format (one GEMV per
decode token), with wq/wk/wv row views of it, giving the separate products."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.model.weights import LayerWeights, QuantTensor, fuse_qkv, linear, qkv_linear
from strata.quant import QType, random_rows

D, HQ, HKV = 256, 512, 128


def quant(q: QType, rows: int, rng: np.random.Generator) -> QuantTensor:
    return QuantTensor(torch.from_numpy(random_rows(q, rows, D, rng, 0.05)), int(q), D)


def layer(wq, wk, wv) -> LayerWeights:  # noqa: ANN001
    none = dict(bq=None, bk=None, bv=None, q_norm=None, k_norm=None)
    return LayerWeights(attn_norm=torch.ones(D), wq=wq, wk=wk, wv=wv, wo=wq, ffn_norm=torch.ones(D),
                        router=torch.zeros(4, D), experts=None, **none)


@pytest.mark.parametrize("types,fused", [((QType.Q4_K,) * 3, 3),
                                         ((QType.Q4_K, QType.Q4_K, QType.Q6_K), 2),
                                         ((QType.Q4_K, QType.Q6_K, QType.Q4_K), 0)])
def test_fused_qkv_gives_the_separate_products(types, fused) -> None:
    rng = np.random.default_rng(0)
    mats = [quant(q, n, rng) for q, n in zip(types, (HQ, HKV, HKV), strict=True)]
    lw = layer(*mats)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(1))
    want = [linear(x, m) for m in mats]
    fuse_qkv(lw)
    assert (lw.qkv[1] if lw.qkv else 0) == fused
    if fused:  # the separate matrices are views of the fused one: no second copy
        assert lw.wq.raw.data_ptr() == lw.qkv[0].raw.data_ptr()
        assert lw.wk.raw.data_ptr() == lw.qkv[0].raw.data_ptr() + lw.wq.raw.numel()
    got = qkv_linear(x, lw)
    for g, w, m in zip(got, want, (lw.wq, lw.wk, lw.wv), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(linear(x, m), w, rtol=1e-6, atol=1e-6)


def test_float_matrices_fuse_too() -> None:
    gen = torch.Generator().manual_seed(2)
    mats = [torch.randn(n, D, generator=gen) for n in (HQ, HKV, HKV)]
    lw = layer(*mats)
    x = torch.randn(2, D, generator=gen)
    fuse_qkv(lw)
    assert lw.qkv is not None and lw.qkv[1] == 3 and lw.qkv[0].shape == (HQ + 2 * HKV, D)
    for g, m in zip(qkv_linear(x, lw), mats, strict=True):
        torch.testing.assert_close(g, x @ m.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("types", [(QType.Q8_0,) * 3, (QType.Q8_0, QType.Q8_0, QType.Q6_K)])
def test_fused_qkv_adds_the_biases(types) -> None:
    """With q, k and v fused their biases are one vector (bq, bk, bv its views) added once;
    fused two of three, or not at all, each is added to its own product: the same sums."""
    rng = np.random.default_rng(3)
    gen = torch.Generator().manual_seed(3)
    mats = [quant(q, n, rng) for q, n in zip(types, (HQ, HKV, HKV), strict=True)]
    lw = layer(*mats)
    lw.bq, lw.bk, lw.bv = (torch.randn(n, generator=gen) for n in (HQ, HKV, HKV))
    x = torch.randn(2, D, generator=gen)
    want = [linear(x, m) + b for m, b in zip(mats, (lw.bq, lw.bk, lw.bv), strict=True)]
    fuse_qkv(lw)
    three = lw.qkv[1] == 3
    assert (lw.bqkv is not None) == three
    if three:
        assert lw.bk.data_ptr() == lw.bqkv.data_ptr() + HQ * 4  # a view, not a copy
    for g, w in zip(qkv_linear(x, lw, bias=True), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
