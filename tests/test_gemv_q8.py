"""The int8-activation Q4_K / Q6_K GEMV experiment (strata/kernels/gpu/gemv_q8.py): under Triton's
interpreter against the dequantized weights (strata.quant.dequantize) times x rounded to 8
bits, and compiled for sm_90 with its dp4a; on CUDA the same check with fresh inputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from interpreted import fresh_seed, run_interpreted  # noqa: E402


def check(rng: np.random.Generator, n: int, k: int, dev: str, bn: int = 4,
          qtype: str = "Q4_K", spread: bool = False, rows: int = 1) -> None:
    """Q4_K or Q6_K rows [n, k] and a fresh x through quantize_x and the type's GEMV on `dev`
    (spread: the Q4_K kernel with a row's blocks across the threads, bn blocks a step, `rows`
    rows a program)."""
    from strata.kernels.gpu.gemv_q8 import gemv_q4k_q8, gemv_q4k_spread, gemv_q6k_q8, quantize_x
    from strata.quant import QType, dequantize, random_rows

    qt = QType[qtype]
    w = torch.from_numpy(random_rows(qt, n, k, rng, 0.05))
    x = torch.from_numpy(rng.standard_normal(k).astype(np.float32) * 3)
    x[5] = 0.0
    x[32:64] = 0.0  # a block of zeros: dx = 0, nothing divided by it
    xq, dx, sx, sx16, xs4 = (t.cpu() for t in quantize_x(x.to(dev)))
    d = np.repeat(dx.double().numpy(), 32)
    xh = d * xq.double().numpy()  # x rounded to 8 bits
    assert (np.abs(xh - x.double().numpy()) <= d / 2 + 1e-6 * np.abs(x.numpy())).all()
    assert (np.abs(xq.numpy().astype(int)) <= 127).all() and (xq[32:64] == 0).all()
    np.testing.assert_allclose(sx.numpy(), dx.numpy() * xq.numpy().reshape(-1, 32).sum(1),
                               rtol=1e-6)
    np.testing.assert_allclose(sx16.numpy(), np.repeat(dx.numpy(), 2)
                               * xq.numpy().reshape(-1, 16).sum(1), rtol=1e-6)
    np.testing.assert_array_equal(xs4.numpy(), np.stack(
        [dx[0::2], dx[1::2], sx[0::2], sx[1::2]], axis=1))
    y = torch.full((n,), float("nan"), device=dev)  # poisoned: every row must be written
    if spread:
        gemv_q4k_spread(xq.to(dev), xs4.to(dev), w.to(dev), n, k, out=y, bb=bn, rows=rows,
                        cg=rows == 2)
    else:
        gemv, sums = (gemv_q4k_q8, sx) if qt == QType.Q4_K else (gemv_q6k_q8, sx16)
        gemv(xq.to(dev), dx.to(dev), sums.to(dev), w.to(dev), n, k, out=y, bn=bn)
    wf = dequantize(w, qt, k).double().numpy()  # [N, K]
    xf = x.double().numpy()
    exact, ref = wf @ xh, wf @ xf
    scale = np.abs(wf) @ np.abs(xh)  # per row: what float rounding is relative to
    y = y.cpu().double().numpy()
    # the same sum as W x̂ but for float rounding (row by row: one row may cancel)
    assert (np.abs(y - exact) <= 1e-5 * scale + 1e-30).all(), (n, k)
    # against x itself, within what rounding x to 8 bits can move each row
    assert (np.abs(y - ref) <= np.abs(wf) @ np.abs(xf - xh) + 1e-5 * scale).all(), (n, k)
    if n >= 32:  # and typically about 1e-2 of the output's norm
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 2e-2, (n, k)


_INTERPRETED = f"""
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from test_gemv_q8 import check
    rng = np.random.default_rng(seed)
    for qtype in ("Q4_K", "Q6_K"):
        for n, k, bn in ((37, 512, 4), (37, 256, 16), (5, 256, 4), (1, 768, 16)):  # rows not
            check(rng, n, k, "cpu", bn, qtype)  # a multiple of BN; one row
    # the spread kernel: blocks a step more, fewer and not a multiple of the row's blocks
    # and rows a program that do not divide the rows
    for n, k, bb, r in ((3, 768, 4, 1), (2, 2048, 8, 1), (2, 1280, 2, 1), (1, 256, 1, 1),
                        (5, 768, 4, 2), (7, 1280, 2, 4), (3, 512, 8, 4)):
        check(rng, n, k, "cpu", bb, "Q4_K", spread=True, rows=r)
    print("ok")
"""


def test_gemv_q4k_q8_under_the_interpreter() -> None:
    run_interpreted(_INTERPRETED, fresh_seed(), timeout=600)


def test_gemv_q4k_q8_compiles_for_sm90() -> None:
    """Without a GPU: both kernels compile for sm_90, the GEMV with its dp4a."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import gemv_q8

    target = GPUTarget("cuda", 90, 32)
    sig = {"xq": "*i8", "dx": "*fp32", "sx": "*fp32", "w": "*u8", "y": "*fp32", "N": "i32",
           "K": "i32", "row_bytes": "i32", "BN": "constexpr", "STAGES": "constexpr"}
    k = triton.compile(ASTSource(gemv_q8._gemv_q4k_kernel, sig,
                                 constexprs={"BN": 4, "STAGES": 2}), target=target)
    assert "dp4a.u32.s32" in k.asm["ptx"] and k.asm["cubin"]
    sig6 = dict(sig)
    del sig6["sx"]
    sig6 = {"xq": "*i8", "dx": "*fp32", "sx16": "*fp32", **{a: t for a, t in sig6.items()
                                                              if a not in ("xq", "dx")}}
    k = triton.compile(ASTSource(gemv_q8._gemv_q6k_kernel, sig6,
                                 constexprs={"BN": 16, "STAGES": 1}), target=target)
    assert "dp4a.u32.s32" in k.asm["ptx"] and k.asm["cubin"]
    sig = {"xq": "*i8", "xs4": "*fp32", "w": "*u8", "y": "*fp32", "N": "i32", "K": "i32",
           "row_bytes": "i32", "R": "constexpr", "BB": "constexpr", "CG": "constexpr"}
    k = triton.compile(ASTSource(gemv_q8._gemv_q4k_spread_kernel, sig,
                                 constexprs={"R": 2, "BB": 8, "CG": True}), target=target)
    assert "dp4a.u32.s32" in k.asm["ptx"] and "ld.global.cg" in k.asm["ptx"] and k.asm["cubin"]
    sig = {"x": "*fp32", "xq": "*i8", "dx": "*fp32", "sx": "*fp32", "sx16": "*fp32",
           "xs4": "*fp32", "NB": "i32", "G": "constexpr"}
    k = triton.compile(ASTSource(gemv_q8._quantize_kernel, sig, constexprs={"G": 8}),
                       target=target)
    assert k.asm["cubin"]


@pytest.mark.cuda
def test_gemv_q4k_q8_on_cuda() -> None:
    rng = np.random.default_rng(fresh_seed())
    for qtype in ("Q4_K", "Q6_K"):
        for n, k, bn in ((37, 512, 4), (4096, 2048, 16), (14336, 4096, 32)):
            check(rng, n, k, "cuda", bn, qtype)
    for n, k, bb, r in ((37, 768, 4, 1), (4096, 2048, 8, 2), (14336, 4096, 16, 4),
                        (5, 14336, 16, 2), (7, 4096, 4, 4), (14336, 4096, 8, 1)):
        check(rng, n, k, "cuda", bb, "Q4_K", spread=True, rows=r)
