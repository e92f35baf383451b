"""The experimental one-token Q4_K GEMV that loads the next block while it computes one
(strata/kernels/gpu/gemv_ahead.py) against the reference (dequantize + float32 matmul): under
Triton's interpreter on the CPU, compiled for sm_90 (no GPU needed: its layouts), and on CUDA.
Fresh random rows each run (the seed in each failure); outputs start as NaN, so a row the
kernel does not write fails."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from interpreted import fresh_rng, rel_err, run_interpreted  # noqa: E402

from strata.kernels.gpu import gemv_ahead as ga  # noqa: E402
from strata.kernels.gpu.reference import matmul_ref  # noqa: E402
from strata.quant import QType, random_rows  # noqa: E402

TOL = 2e-5  # float32 FMA sums in another order than the reference's
# (N, K, tile): rows not a multiple of R, one block a row, the prefetch on and off, R per thread
CASES = [(7, 512, (4, True, 1)), (5, 256, (2, True, 1)), (9, 768, (8, False, 2)),
         (3, 1024, (16, True, 4)), (33, 512, (16, True, 8))]


def test_under_the_interpreter() -> None:
    _, seed = fresh_rng()
    run_interpreted("""
    import torch
    from strata.kernels.gpu.gemv_ahead import gemv_ahead
    from strata.kernels.gpu.reference import matmul_ref
    from strata.quant import QType, random_rows
    rng = np.random.default_rng(seed)
    for n, k, tile in CASES:
        w = torch.from_numpy(random_rows(QType.Q4_K, n, k, rng, 0.05))
        for dt in (torch.float32, torch.bfloat16):
            x = torch.randn(1, k).to(dt)
            out = torch.full((1, n), float("nan"))
            assert gemv_ahead(x, w, tile, out=out) is out
            ref = matmul_ref(x, w, QType.Q4_K)
            err = float((out - ref).norm() / ref.norm())
            assert err < 2e-5, (n, k, tile, dt, err)
    print("ok")
    """.replace("CASES", repr(CASES)), seed, timeout=300)


@pytest.mark.parametrize("ahead", [True, False])
def test_compiles_for_sm90_without_layout_conversions(ahead: bool) -> None:
    """Without a GPU: every 2-D tensor in one layout (lanes across the threads, rows inside
    them), so nothing in the K loop goes through shared memory; the one conversion left is of
    the [R] row sums before their store."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"x": "*fp32", "w": "*u8", "y": "*fp32", "N": "i32", "K": "i32", "row_bytes": "i32",
           "R": "constexpr", "AHEAD": "constexpr"}
    k = triton.compile(ASTSource(ga._gemv_ahead_kernel, sig, constexprs={"R": 16,
                                                                         "AHEAD": ahead}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert k.asm["cubin"]
    converts = [ln for ln in k.asm["ttgir"].splitlines() if "convert_layout" in ln]
    assert len(converts) == 1 and re.search(r"tensor<16xf32", converts[0]), converts


@pytest.mark.parametrize("kernel", ["gate_up", "down"])
def test_moe_kernels_compile_for_sm90(kernel: str) -> None:
    """Without a GPU: the decode MoE kernels in this form compile for sm_90 with their loops
    free of layout conversions (the one left is of the [R] sums before their store)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    common = {"ids": "*i64", "slot_of": "*i32", "D": "i32", "F": "i32", "stride_ms": "i32",
              "row_bytes": "i32", "TOPK": "constexpr", "R": "constexpr", "AHEAD": "constexpr",
              "MISS": "constexpr", "HOST_FROM": "constexpr"}
    if kernel == "gate_up":
        fn = ga._gate_up_ahead_kernel
        sig = {"x": "*fp32", "wts": "*fp32", "gate": "*u8", "up": "*u8", "h": "*fp32",
               "mg": "*u8", "mu": "*u8", "stride_x": "i32", "stride_gs": "i32",
               "stride_us": "i32", **common}
    else:
        fn = ga._down_ahead_kernel
        sig = {"h": "*fp32", "down": "*u8", "part": "*fp32", "md": "*u8", "stride_ds": "i32",
               **common}
    sig = {name: sig[name] for name in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs={"TOPK": 8, "R": 16, "AHEAD": True,
                                                       "MISS": True, "HOST_FROM": 8}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert k.asm["cubin"]
    converts = [ln for ln in k.asm["ttgir"].splitlines() if "convert_layout" in ln]
    assert all(re.search(r"tensor<16xf32", ln) for ln in converts), converts


def test_bad_arguments() -> None:
    w = torch.zeros(4, 144, dtype=torch.uint8)
    with pytest.raises(ValueError, match="multiple of 256"):
        ga.gemv_ahead(torch.zeros(1, 100), w)
    with pytest.raises(ValueError, match="x must be"):
        ga.gemv_ahead(torch.zeros(2, 256), w)
    with pytest.raises(ValueError, match="power of two"):
        ga.gemv_ahead(torch.zeros(1, 256), w, (3, True, 1))
    with pytest.raises(ValueError, match="4-byte"):
        ga.gemv_ahead(torch.zeros(1, 256), torch.zeros(4 * 144 + 2, dtype=torch.uint8)[2:]
                      .view(4, 144))
    # the MoE launcher takes these kernels only for parts whose rows are 4-byte aligned
    from strata.kernels.gpu.moe import _words_aligned

    slots = torch.zeros(2, 4, 144 + 2, dtype=torch.uint8)
    assert _words_aligned(slots[:, :, :144].contiguous())
    assert not _words_aligned(slots[:, :, 2:])  # rows 146 bytes apart, starting at 2


@pytest.mark.cuda
@pytest.mark.parametrize("tile", [(16, True, 4), (16, False, 4), (32, True, 4), (8, True, 2)])
def test_on_cuda(tile: tuple[int, bool, int]) -> None:
    rng, seed = fresh_rng()
    for n, k in ((4608, 2048), (41, 768)):
        w = torch.from_numpy(random_rows(QType.Q4_K, n, k, rng, 0.05)).cuda()
        x = torch.randn(1, k, device="cuda")
        out = torch.full((1, n), float("nan"), device="cuda")
        ga.gemv_ahead(x, w, tile, out=out)
        err = rel_err(out, matmul_ref(x, w, QType.Q4_K))
        assert err < TOL, f"{n}x{k} {tile} seed={seed}: rel err {err:.2e}"


def test_moe_kernels_under_the_interpreter() -> None:
    """The decode MoE layer with gemv_ahead.py's gate/up and down kernels (moe.DECODE_TUNE
    "gate_up_ahead" / "down_ahead"), Q4_K parts: against the reference for 1 and 3 tokens with
    experts without a slot (they add nothing), the pairs' rows unsummed, and with miss rows
    (3 tokens: every pair computed, the missing experts' records read from their rows)."""
    _, seed = fresh_rng()
    run_interpreted("""
    import torch
    from strata.experts.layout import ExpertLayout
    from strata.kernels.gpu import gather_misses, moe_forward
    from strata.kernels.gpu import moe as moe_mod
    from strata.kernels.gpu.reference import moe_ref
    from strata.quant import QType, random_rows
    rng = np.random.default_rng(seed)
    def rows(n, k):
        return torch.from_numpy(random_rows(QType.Q4_K, n, k, rng, 0.05))
    def rel(a, b):
        return float((a - b).norm() / b.norm())
    e, d, f, q = 3, 512, 512, QType.Q4_K  # two blocks a row: the loads ahead run
    qt = (q, q, q)
    slot_of = torch.tensor([1, -1, 0], dtype=torch.int32)
    layer = dict(slot_of_expert=slot_of, gate_slots=rows(2 * f, d).view(2, f, -1),
                 up_slots=rows(2 * f, d).view(2, f, -1), down_slots=rows(2 * d, f).view(2, d, -1),
                 qtypes=qt, d_model=d, d_expert=f)
    lay = ExpertLayout(0, tuple(int(v) for v in qt), d, f)
    records = torch.zeros(e, lay.stride, dtype=torch.uint8)
    for part, src, (n, k) in zip(lay.views(records), (layer["gate_slots"], layer["up_slots"],
                                 layer["down_slots"]), ((f, d), (f, d), (d, f))):
        part[:] = torch.stack([src[1], rows(n, k), src[0]])
    full = dict(layer, slot_of_expert=torch.arange(e, dtype=torch.int32),
                **dict(zip(("gate_slots", "up_slots", "down_slots"), lay.views(records))))
    # (the form without the loads ahead shares everything else: test_under_the_interpreter)
    for tune in ({"gate_up_ahead": (64, True, 1), "down_ahead": (128, True, 2)},):
        moe_mod.DECODE_TUNE = tune
        for t in (1, 3):
            ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(t)]))
            x, wts = torch.randn(t, d), torch.rand(t, 2)
            out = moe_forward(x, ids, wts, **layer)
            assert rel(out, moe_ref(x, ids, wts, **layer)) < 2e-5, (tune, t)
            if t == 1:
                parts = moe_forward(x, ids, wts, **layer, sum_pairs=False)
                assert rel(parts.sum(1), moe_ref(x, ids, wts, **layer)) < 2e-5, tune
                continue
            rows_ = torch.full((2 * t + 1, lay.stride), 255, dtype=torch.uint8)
            gather_misses(ids, slot_of, records, rows_, lay.nbytes)
            out = moe_forward(x, ids, wts, slot_of, *lay.views(records[[2, 0]]), qt, d, f,
                              miss=lay.views(rows_))
            assert rel(out, moe_ref(x, ids, wts, **full)) < 2e-5, ("miss rows", tune, t)
    print("ok")
    """, seed, timeout=400)


@pytest.mark.cuda
@pytest.mark.parametrize("tune", [{"gate_up_ahead": (16, True, 4), "down_ahead": (16, True, 4)},
                                  {"gate_up_ahead": (8, False, 2), "down_ahead": (32, True, 4)}])
def test_moe_on_cuda(tune: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Qwen3-30B-A3B decode layer (D 2048, F 768, 8 of 16 experts resident, 8 routed) with
    the kernels in this form, one token and four, against the reference."""
    from strata.kernels.gpu import moe as moe_mod
    from strata.kernels.gpu import moe_forward
    from strata.kernels.gpu.reference import moe_ref

    rng, seed = fresh_rng()
    monkeypatch.setattr(moe_mod, "DECODE_TUNE", tune)
    e, d, f, q = 16, 2048, 768, QType.Q4_K
    slots = 8
    slot_of = np.full(e, -1)
    slot_of[rng.permutation(e)[:slots]] = np.arange(slots)
    layer = dict(slot_of_expert=torch.tensor(slot_of, dtype=torch.int32).cuda(),
        gate_slots=torch.from_numpy(random_rows(q, slots * f, d, rng, 0.05)).cuda()
        .view(slots, f, -1),
        up_slots=torch.from_numpy(random_rows(q, slots * f, d, rng, 0.05)).cuda()
        .view(slots, f, -1),
        down_slots=torch.from_numpy(random_rows(q, slots * d, f, rng, 0.05)).cuda()
        .view(slots, d, -1), qtypes=(q, q, q), d_model=d, d_expert=f)
    for t in (1, 4):
        ids = torch.from_numpy(np.stack([rng.permutation(e)[:8] for _ in range(t)])).cuda()
        x, wts = torch.randn(t, d, device="cuda"), torch.rand(t, 8, device="cuda")
        err = rel_err(moe_forward(x, ids, wts, **layer), moe_ref(x, ids, wts, **layer))
        assert err < TOL, f"{tune} t={t} seed={seed}: rel err {err:.2e}"
