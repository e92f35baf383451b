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


_HOST_ROWS = """
    import torch
    from strata.kernels.gpu.host_rows import HOST_ROWS_BLOCK, host_rows
    rng = np.random.default_rng(seed)
    for n, row in ((50, 37), (9, HOST_ROWS_BLOCK + 300)):  # (odd bytes; two programs a row)
        table = torch.from_numpy(rng.integers(0, 256, (n, row), dtype=np.uint8))
        ids = torch.from_numpy(rng.integers(0, n, (3, 2)))
        got = host_rows(table, ids)
        assert got.shape == (3, 2, row) and torch.equal(got, table[ids]), (n, row)
    assert host_rows(table, torch.zeros(0, dtype=torch.int64)).shape == (0, row)
    print("ok")
"""


def test_host_rows_under_the_interpreter() -> None:
    """kernels/gpu/host_rows.py: a table's rows gathered by ids of any shape (the token
    embedding's rows from pinned host memory on CUDA), odd row lengths, rows past one program's
    block, no ids."""
    pytest.importorskip("triton")
    from interpreted import fresh_seed, run_interpreted

    run_interpreted(_HOST_ROWS, fresh_seed() % 2**31, timeout=300)


def test_the_plan_leaves_the_token_embedding_on_the_host(synth) -> None:  # noqa: ANN001
    """On CUDA an untied token embedding stays in host RAM (tuning.EMBED_ON_HOST): the plan's
    dense line leaves its bytes out, for slots; a tied one (the output head) stays, and the
    CPU's plan (its budget is host RAM) counts it as before."""
    from strata.config import EngineConfig, ModelConfig
    from strata.engine.memory_plan import dense_bytes, make_plan
    from strata.experts.layout import expert_layouts
    from strata.gguf import open_model
    from strata.kernels.tuning import EMBED_ON_HOST
    from strata.model.weights import embed_on_host

    mf = open_model(synth("qwen3moe", "Q4_K_M"))
    cfg = ModelConfig.from_model(mf)
    assert not cfg.tied_output and embed_on_host(cfg, "cuda") == EMBED_ON_HOST
    assert not embed_on_host(cfg, "cpu")
    embd = mf.tensors["token_embd.weight"].info.nbytes
    assert dense_bytes(mf, cfg, True, host_embed=True) == dense_bytes(mf, cfg, True) - embd
    kw = dict(vram_budget_gib=2, ctx=256, kv_type="f16")
    cuda = make_plan(mf, cfg, EngineConfig(device="cuda", **kw), expert_layouts(mf, cfg))
    cpu = make_plan(mf, cfg, EngineConfig(device="cpu", **kw), expert_layouts(mf, cfg))
    assert cuda.host_embed == EMBED_ON_HOST and not cpu.host_embed
    assert cuda.dense == dense_bytes(mf, cfg, cuda.quant_dense, host_embed=cuda.host_embed)
    assert ("token embedding in host RAM" in cuda.lines()[2]) == EMBED_ON_HOST
    from dataclasses import replace

    assert not embed_on_host(replace(cfg, tied_output=True), "cuda")


@pytest.mark.cuda
def test_a_host_embedding_gives_the_device_tables_rows() -> None:
    """QuantTensor.rows of a table in pinned host memory, indexed on the device (as the token
    embedding on CUDA), equals the same table's rows on the device, also inside a CUDA graph."""
    rng = np.random.default_rng(0)
    raw = torch.from_numpy(random_rows(QType.Q4_K, 300, 512, rng, 0.05))
    host = QuantTensor(raw.pin_memory(), QType.Q4_K, 512)
    dev = QuantTensor(raw.cuda(), QType.Q4_K, 512)
    ids = torch.tensor([[5, 299, 0]], device="cuda")
    assert torch.equal(host.rows(ids), dev.rows(ids))
    out = torch.empty(1, 3, 512, device="cuda")
    graph = torch.cuda.CUDAGraph()
    host.rows(ids)  # (built before the capture)
    with torch.cuda.graph(graph):
        out.copy_(host.rows(ids))
    ids.copy_(torch.tensor([[7, 8, 9]]))
    graph.replay()
    assert torch.equal(out, dev.rows(ids))


@pytest.mark.slow
def test_host_rows_builds_for_sm90() -> None:
    """Without a GPU: the host-rows gather (the token embedding's read on CUDA) builds for sm_90
    with no spills."""
    pytest.importorskip("triton")
    from test_decode_ops import sm90_resources

    from strata.kernels.gpu.host_rows import HOST_ROWS_BLOCK, _host_rows_kernel

    got = sm90_resources(_host_rows_kernel, {"table": "*u8", "ids": "*i64", "out": "*u8"}, {},
                         {"row_bytes": 1152, "stride_t": 1152}, {"BLOCK": HOST_ROWS_BLOCK}, 4)
    assert got["spills"] == 0 and got["local"] == 0, got
