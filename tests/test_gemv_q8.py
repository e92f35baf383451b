"""The int8-activation Q4_K / Q6_K kernels (strata/kernels/gpu/gemv_q8.py): the GEMVs under
Triton's interpreter against the dequantized weights (strata.quant.dequantize) times x rounded
to 8 bits, compiled for sm_90 with their dp4a, and on CUDA with fresh inputs; the decode MoE
layer with rounded activations (moe_forward x8) against the reference's (moe_ref x8); the
output head's one-token matmul (QuantTensor.x8)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from interpreted import (  # noqa: E402
    every_case,
    fresh_seed,
    run_interpreted,
    run_interpreted_side_by_side,
)


def check(rng: np.random.Generator, n: int, k: int, dev: str, bb: int = 4,
          qtype: str = "Q4_K", rows: int = 1, halves: bool = False, warps: int = 1) -> None:
    """Q4_K, Q6_K, IQ2_XS or IQ3_XXS rows [n, k] and a fresh x through quantize_x and the
    type's spread GEMV on `dev` (bb blocks a step, `rows` rows a program; Q4_K with rows 2
    reads past L1); qtype "Q6_K run", "IQ2_XS run", "IQ3_XXS run": gemv_q6k_run / gemv_iq_run
    (bb: their split; halves, warps: gemv_iq_run's)."""
    from strata.kernels.gpu.gemv_q8 import (
        gemv_iq_run,
        gemv_iq_spread,
        gemv_q4k_spread,
        gemv_q6k_run,
        gemv_q6k_spread,
        quantize_x,
    )
    from strata.quant import QType, dequantize, random_rows

    run = qtype.endswith(" run")
    qt = QType[qtype.split()[0]]
    w = torch.from_numpy(random_rows(qt, n, k, rng, 0.05))
    x = torch.from_numpy(rng.standard_normal(k).astype(np.float32) * 3)
    x[5] = 0.0
    x[32:64] = 0.0  # a block of zeros: dx = 0, nothing divided by it
    xq, dx, xs4 = (t.cpu() for t in quantize_x(x.to(dev)))
    d = np.repeat(dx.double().numpy(), 32)
    xh = d * xq.double().numpy()  # x rounded to 8 bits
    assert (np.abs(xh - x.double().numpy()) <= d / 2 + 1e-6 * np.abs(x.numpy())).all()
    assert (np.abs(xq.numpy().astype(int)) <= 127).all() and (xq[32:64] == 0).all()
    sx = dx.numpy() * xq.numpy().reshape(-1, 32).sum(1)
    np.testing.assert_allclose(xs4.numpy()[:, 2:], np.stack([sx[0::2], sx[1::2]], axis=1),
                               rtol=1e-6)
    np.testing.assert_array_equal(xs4.numpy()[:, :2], np.stack([dx[0::2], dx[1::2]], axis=1))
    y = torch.full((n,), float("nan"), device=dev)  # poisoned: every row must be written
    if run and qt == QType.Q6_K:
        gemv_q6k_run(xq.to(dev), dx.to(dev), w.to(dev), n, k, out=y, rows=rows, split=bb)
    elif run:
        gemv_iq_run(xq.to(dev), dx.to(dev), w.to(dev), n, k, qt, out=y, rows=rows, split=bb,
                    halves=halves, warps=warps)
    elif qt == QType.Q6_K:
        gemv_q6k_spread(xq.to(dev), dx.to(dev), w.to(dev), n, k, out=y, bb=bb, rows=rows)
    elif qt in (QType.IQ2_XS, QType.IQ3_XXS):
        gemv_iq_spread(xq.to(dev), dx.to(dev), w.to(dev), n, k, qt, out=y, bb=bb, rows=rows)
    else:
        gemv_q4k_spread(xq.to(dev), xs4.to(dev), w.to(dev), n, k, out=y, bb=bb, rows=rows,
                        cg=rows == 2)
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


_INTERPRETED_HEAD = f"""
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from test_gemv_q8 import check
    rng = np.random.default_rng(seed)
"""
_INTERPRETED_K = """
    # blocks a step more, fewer and not a multiple of the row's blocks; rows a program that
    # do not divide the rows
    for n, k, bb, r in ((3, 768, 4, 1), (2, 2048, 8, 1), (2, 1280, 2, 1), (1, 256, 1, 1),
                        (5, 768, 4, 2), (7, 1280, 2, 4), (3, 512, 8, 4), (37, 256, 16, 1)):
        check(rng, n, k, "cpu", bb, "Q4_K", rows=r)
    # Q6_K: rows of an odd number of blocks start 2 mod 4 every other row
    for n, k, bb, r in ((3, 768, 2, 1), (5, 512, 4, 2), (2, 256, 1, 1), (7, 768, 4, 4)):
        check(rng, n, k, "cpu", bb, "Q6_K", rows=r)
    # the Q6_K run form: rows a program not dividing the rows, one run and two a row, a row's
    # runs split between threads: evenly, 3 runs among 4 (one idle), 1 among 2
    for n, k, r, split in ((11, 2048, 8, 1), (3, 4096, 4, 1), (5, 4096, 4, 2), (3, 6144, 2, 4),
                           (3, 2048, 4, 2)):
        check(rng, n, k, "cpu", split, "Q6_K run", rows=r)
"""
_INTERPRETED_IQ = """
    # IQ2_XS and IQ3_XXS: 74- and 98-byte blocks, rows 2 mod 4 every other row too; their run
    # forms as Q6_K's
    for qtype in IQ_TYPES:
        for n, k, bb, r in ((3, 768, 2, 1), (5, 512, 4, 2), (2, 256, 1, 1)):
            check(rng, n, k, "cpu", bb, qtype, rows=r)
        for n, k, r, split in ((11, 2048, 8, 1), (5, 4096, 4, 2), (3, 6144, 2, 4)):
            check(rng, n, k, "cpu", split, qtype + " run", rows=r)
        # each run's blocks in two programs (halves), added into y
        for n, k, r, split in ((5, 4096, 4, 2), (3, 6144, 2, 4)):
            check(rng, n, k, "cpu", split, qtype + " run", rows=r, halves=True)
        # programs of 2 and 4 warps (the rows split across warps), with and without halves
        check(rng, 11, 4096, "cpu", 2, qtype + " run", rows=8, warps=2)
        check(rng, 19, 6144, "cpu", 2, qtype + " run", rows=16, warps=4, halves=True)
"""
_INTERPRETED_X8 = """
    # gemv_x8: quantize_x, then the type's GEMV with its tuned tile
    import torch
    torch.manual_seed(seed)  # (x too comes from the printed seed)
    from strata.kernels.gpu.gemv_q8 import gemv_x8
    from strata.kernels.gpu.reference import matmul_ref, round8
    from strata.quant import QType, random_rows
    for q in (QType.Q4_K, QType.Q6_K, QType.IQ2_XS, QType.IQ3_XXS):
        w = torch.from_numpy(random_rows(q, 9, 512, rng, 0.05))
        x = torch.randn(1, 512)
        ref = matmul_ref(round8(x), w, q)
        assert float((gemv_x8(x, w, q) - ref).norm() / ref.norm()) < 2e-5, q
    # rows of K 2048 and 4096 in the run forms (GEMV_X8_RUN: split 1, then 2), rows 4 bytes
    # off 16 in the spread form
    from strata.kernels.gpu import gemv_q8
    taken = []
    q6k_run, iq_run = gemv_q8.gemv_q6k_run, gemv_q8.gemv_iq_run
    gemv_q8.gemv_q6k_run = lambda *a, **kw: taken.append(("Q6_K", kw["split"])) or q6k_run(
        *a, **kw)
    gemv_q8.gemv_iq_run = lambda *a, **kw: taken.append((a[5].name, kw["split"])) or iq_run(
        *a, **kw)
    for q, k, shift, split in ((QType.Q6_K, 2048, 0, 1), (QType.Q6_K, 4096, 0, 2),
                               (QType.Q6_K, 2048, 4, None), (QType.IQ2_XS, 2048, 0, 1),
                               (QType.IQ3_XXS, 4096, 0, 2), (QType.IQ2_XS, 2048, 4, None)):
        rows = torch.from_numpy(random_rows(q, 9, k, rng, 0.05))
        buf = torch.empty(rows.numel() + 16, dtype=torch.uint8)
        at = (-buf.data_ptr()) % 16 + shift
        w = buf[at:at + rows.numel()].view(rows.shape)
        w.copy_(rows)
        x = torch.randn(1, k)
        ref = matmul_ref(round8(x), w, q)
        taken.clear()
        assert float((gemv_x8(x, w, q) - ref).norm() / ref.norm()) < 2e-5, (q, k)
        assert taken == ([(q.name, split)] if split else []), (q, k, shift, taken)
"""


def test_gemv_under_the_interpreter() -> None:
    """The K-quant GEMVs and IQ2_XS's beside gemv_x8 (IQ3_XXS's among them), each in a process
    of its own."""
    iq2 = _INTERPRETED_IQ.replace("IQ_TYPES", "('IQ2_XS',)")
    ok = '    print("ok")\n'
    run_interpreted_side_by_side([_INTERPRETED_HEAD + _INTERPRETED_K + iq2 + ok,
                                  _INTERPRETED_HEAD + _INTERPRETED_X8 + ok], fresh_seed(),
                                 timeout=600)


@every_case
def test_iq3_xxs_gemvs_under_the_interpreter() -> None:
    """IQ3_XXS's GEMVs and run forms as IQ2_XS's (the interpreter's longest; the CUDA tests run
    them too)."""
    run_interpreted(_INTERPRETED_HEAD + _INTERPRETED_IQ.replace("IQ_TYPES", "('IQ3_XXS',)")
                    + '    print("ok")\n', fresh_seed(), timeout=600)


def test_gemv_compiles_for_sm90() -> None:
    """Without a GPU: the GEMVs compile for sm_90 with their dp4a (and ld.global.cg where
    asked), the rounding kernel too."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import gemv_q8

    target = GPUTarget("cuda", 90, 32)
    sig = {"xq": "*i8", "xs4": "*fp32", "w": "*u8", "y": "*fp32", "N": "i32", "K": "i32",
           "row_bytes": "i32", "R": "constexpr", "BB": "constexpr", "CG": "constexpr"}
    k = triton.compile(ASTSource(gemv_q8._gemv_q4k_spread_kernel, sig,
                                 constexprs={"R": 2, "BB": 8, "CG": True}), target=target)
    assert "dp4a.u32.s32" in k.asm["ptx"] and "ld.global.cg" in k.asm["ptx"] and k.asm["cubin"]
    sig = {"xq": "*i8", "dx": "*fp32", "w": "*u8", "y": "*fp32", "N": "i32", "K": "i32",
           "row_bytes": "i32", "R": "constexpr", "BB": "constexpr"}
    k = triton.compile(ASTSource(gemv_q8._gemv_q6k_spread_kernel, sig,
                                 constexprs={"R": 2, "BB": 4}), target=target)
    assert "dp4a.u32.s32" in k.asm["ptx"] and k.asm["cubin"]
    # the run form: its pieces as aligned 16-byte loads, joined by PRMT
    fn = gemv_q8._gemv_q6k_run_kernel
    rsig = {a: sig.get(a, "constexpr" if a in ("RL", "S") else "i32") for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, rsig, constexprs={"RL": 8, "S": 1},
                                 attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 6)}),
                       target=target, options={"num_warps": 1})
    assert "dp4a.u32.s32" in k.asm["ptx"] and "prmt.b32" in k.asm["ptx"]
    # (ptxas joins the aligned words into 16-byte loads: counted in the SASS)
    import subprocess
    import tempfile

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    assert sass.count("LDG.E.128") >= 45, sass.count("LDG.E.128")  # 3 pieces x 15 a run
    fn = gemv_q8._gemv_iq_spread_kernel
    isig = {a: sig.get(a, "constexpr" if a == "IQ3" else "*i32") for a in fn.arg_names}
    for iq3 in (False, True):
        k = triton.compile(ASTSource(fn, isig, constexprs={"IQ3": iq3, "R": 1, "BB": 8}),
                           target=target)
        # signed bytes: IQ2_XS's picked by PRMT, IQ3_XXS's negated by masks from popc
        assert "dp4a.s32.s32" in k.asm["ptx"] and k.asm["cubin"]
        assert ("popc.b32" if iq3 else "prmt.b32") in k.asm["ptx"]
    # their run forms: the grid indices' pieces as 16-byte loads too
    fn = gemv_q8._gemv_iq_run_kernel
    isig = {a: sig.get(a, "constexpr" if a in ("IQ3", "RL", "S", "EVEN", "HALVES") else "*i32")
            for a in fn.arg_names}
    for iq3 in (False, True):  # (as timed: every run in the row, one program a run)
        k = triton.compile(ASTSource(fn, isig, constexprs={"IQ3": iq3, "RL": 4, "S": 2,
                                                           "EVEN": True, "HALVES": False},
                                     attrs={(i,): [["tt.divisibility", 16]]
                                            for i in (0, 1, 2, 3, 4, 5, 8)}),
                           target=target, options={"num_warps": 1})
        assert "dp4a.s32.s32" in k.asm["ptx"] and "prmt.b32" in k.asm["ptx"]
        assert ("popc.b32" in k.asm["ptx"]) == iq3
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(k.asm["cubin"])
            f.flush()
            sass = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True,
                                  check=True).stdout
        assert sass.count("LDG.E.128") >= 15, (iq3, sass.count("LDG.E.128"))  # a piece a block
    sig = {"x": "*fp32", "xq": "*i8", "dx": "*fp32", "xs4": "*fp32", "NB": "i32",
           "G": "constexpr"}
    k = triton.compile(ASTSource(gemv_q8._quantize_kernel, sig, constexprs={"G": 8}),
                       target=target)
    assert k.asm["cubin"]


def test_gate_up_q8_compiles_for_sm90() -> None:
    """Without a GPU: the MoE gate/up kernel compiles for sm_90 with its dp4a, no shared-memory
    layout conversion inside its K loop (the one left is of the [R] rows before their store)."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import gemv_q8

    fn = gemv_q8._gate_up_q8_kernel
    types = {"xq": "*i8", "xs4": "*fp32", "ids": "*i64", "wts": "*fp32", "slot_of": "*i32",
             "gate": "*u8", "up": "*u8", "h": "*fp32", "mg": "*u8", "mu": "*u8"}
    consts = {"TOPK": 8, "R": 4, "BB": 8, "MISS": True, "HOST_FROM": 8}
    sig = {a: types.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    assert "dp4a.u32.s32" in k.asm["ptx"] and k.asm["cubin"]
    ttgir = k.asm["ttgir"]
    loop = ttgir[ttgir.index("scf.for"):ttgir.index("scf.yield")]
    assert "convert_layout" not in loop and "local_load" not in loop, loop[:2000]
    converts = [ln for ln in ttgir.splitlines() if "convert_layout" in ln]
    assert all(re.search(r"tensor<4xf32", ln) for ln in converts), converts


def test_moe_once_compiles_for_sm90() -> None:
    """Without a GPU: the expert-once kernels and the dense few-token ones (gemm_x8_tokens)
    compile for sm_90 with their dp4a, rows held once (ONE) and re-read; held, some weight
    loads sit before the pairs' (tokens') loop."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import dense_x8, moe_once

    types = {"xq": "*i8", "hq": "*i8", "xs4": "*fp32", "hsc": "*fp32", "hdx": "*fp32",
             "ids": "*i32", "wts": "*fp32", "slot_of": "*i32", "gate": "*u8", "up": "*u8",
             "down": "*u8", "h": "*fp32", "part": "*fp32"}
    types.update({"w": "*u8", "y": "*fp32", "dx": "*fp32"})
    for fn, q6 in ((moe_once._gate_up_once_q8_kernel, None),
                   (moe_once._down_once_q8_kernel, False), (moe_once._down_once_q8_kernel, True),
                   (dense_x8._gemm_q4k_tokens_kernel, None),
                   (dense_x8._gemm_q6k_tokens_kernel, None),
                   (moe_once._gate_up_group_q8_kernel, None),
                   (moe_once._down_group_q8_kernel, False), (moe_once._down_group_q8_kernel, True)):
        for one in (True, False):
            consts = {a: v for a, v in (("R", 4), ("BB", 4), ("PB", 128), ("ONE", one),
                                        ("TOPK", 8), ("MT", 2), ("Q6", q6)) if a in fn.arg_names}
            sig = {a: types.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
            k = triton.compile(ASTSource(fn, sig, constexprs=consts),
                               target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
            ptx = k.asm["ptx"]
            assert "dp4a.u32.s32" in ptx and k.asm["cubin"], (fn.__name__, one)
            if one and "ONE" in fn.arg_names:  # (the weights' loads before the loop)
                ttgir = k.asm["ttgir"]
                loop = ttgir[ttgir.index("scf.for"):]
                held = ttgir[:ttgir.index("scf.for")]
                assert held.count("tt.load") >= 2, fn.__name__  # (quants and header)
                assert loop.count("tt.load") < ttgir.count("tt.load"), fn.__name__


def test_iq_moe_kernels_compile_for_sm90() -> None:
    """Without a GPU: the i-quant MoE kernels (gate/up, down) compile for sm_90 with their
    signed dp4a, IQ2_XS with its PRMT, IQ3_XXS with the popc of its sign bits. (The gate/up's
    run form, RUN, is left to the CUDA runs: it takes 50-100 s to build, its GEMV twin is
    checked in test_gemv_compiles_for_sm90.)"""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import gemv_q8

    types = {"xq": "*i8", "hq": "*i8", "dx": "*fp32", "hdx": "*fp32", "ids": "*i64",
             "wts": "*fp32", "slot_of": "*i32", "gate": "*u8", "up": "*u8", "down": "*u8",
             "h": "*fp32", "part": "*fp32", "mg": "*u8", "mu": "*u8", "md": "*u8",
             "t0": "*i32", "t1": "*i32"}
    for fn, run in ((gemv_q8._gate_up_iq_kernel, {"RUN": False}), (gemv_q8._down_iq_kernel, {})):
        for iq3 in (False, True):
            consts = {"IQ3": iq3, "TOPK": 8, "R": 4, "BB": 4, "MISS": True, "HOST_FROM": 8, **run}
            sig = {a: types.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
            ptx = triton.compile(ASTSource(fn, sig, constexprs=consts),
                                 target=GPUTarget("cuda", 90, 32),
                                 options={"num_warps": 1}).asm["ptx"]
            assert "dp4a.s32.s32" in ptx and ("popc.b32" if iq3 else "prmt.b32") in ptx


def test_mxfp4_moe_kernels_compile_for_sm90() -> None:
    """Without a GPU: the MXFP4 x8 MoE kernels (gpt-oss's gate/up with biases and the clamped
    SwiGLU, and the down) compile for sm_90 with their signed dp4a and PRMTs."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import gemv_q8

    types = {"xq": "*i8", "hq": "*i8", "dx": "*fp32", "hdx": "*fp32", "ids": "*i64",
             "wts": "*fp32", "slot_of": "*i32", "gate": "*u8", "up": "*u8", "down": "*u8",
             "h": "*fp32", "part": "*fp32", "mg": "*u8", "mu": "*u8", "md": "*u8",
             "bg": "*fp32", "bu": "*fp32", "bd": "*fp32"}
    for fn, extra in ((gemv_q8._gate_up_mx8_kernel, {"OAI": True}), (gemv_q8._down_mx8_kernel, {})):
        consts = {"TOPK": 4, "R": 2, "BB": 8, "MISS": True, "HOST_FROM": 4, "BIAS": True,
                  "EVEN": False, **extra}
        sig = {a: types.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
        ptx = triton.compile(ASTSource(fn, sig, constexprs=consts),
                             target=GPUTarget("cuda", 90, 32),
                             options={"num_warps": 2}).asm["ptx"]
        assert "dp4a.s32.s32" in ptx and "prmt.b32" in ptx, fn.__name__


def test_moe_mxfp4_x8_under_the_interpreter() -> None:
    """gpt-oss's decode MoE layer on MXFP4's 8-bit-activation kernels (moe_forward x8 with
    their tiles given), without and with biases and the clamped
    SwiGLU, 1 and 3 tokens: equal to the reference with x and h rounded (moe_ref x8) within
    X8_TOL, and within the rounding of the reference without it; rows of 17-byte blocks at
    every alignment (d 192: 102-byte rows, six blocks in steps of 4, the last masked), slots
    and miss rows (every pair computed), the pairs' rows unsummed and the same call with x8
    off on the float32 kernels (the reference to float rounding) without biases, the pair-major
    grid with them."""
    run_interpreted(f"""
    import torch
    torch.manual_seed(seed)
    from strata.experts.layout import ExpertLayout
    from strata.kernels.gpu import gather_misses, moe_forward
    from strata.kernels.gpu.reference import moe_ref
    from strata.quant import QType, random_rows
    rng = np.random.default_rng(seed)
    def rel(a, b):
        return float((a - b).norm() / b.norm())
    e, d, f = 3, 192, 128
    qt = (QType.MXFP4,) * 3
    lay = ExpertLayout(0, tuple(int(q) for q in qt), d, f)
    records = torch.zeros(e, lay.stride, dtype=torch.uint8)
    for part, (n, k) in zip(lay.views(records), ((f, d), (f, d), (d, f))):
        part[:] = torch.from_numpy(random_rows(QType.MXFP4, e * n, k, rng, 0.05)).view(e, n, -1)
    slot_of = torch.tensor([1, -1, 0], dtype=torch.int32)  # expert 1 only in the records
    slots = lay.views(records[[2, 0]])
    full = (torch.arange(e, dtype=torch.int32), *lay.views(records), qt, d, f)
    # (32 and 64 rows a program: few programs to interpret; d's six blocks in steps of 4, the
    # second masked, f's four in one step of 8)
    tiles = {{"gate_up_mx8": (32, 4, 1), "down_mx8": (64, 8, 1)}}
    fma = {{"gate_up": (64, 256, 1, 4), "down_pairs": (64, 256, 1, 4)}}
    for bias, act in ((None, "swiglu"), (tuple(torch.randn(e, n) for n in (f, f, d)),
                                         "swiglu_oai")):
        kw = dict(bias=bias, act=act)
        for t in (1, 3):  # (one token: slots alone, its pairs unsummed; three: miss rows)
            ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(t)]))
            x, wts = 3 * torch.randn(t, d), torch.rand(t, 2)
            if t == 1:
                out = moe_forward(x, ids, wts, slot_of, *slots, qt, d, f, x8=True, tiles=tiles,
                                  **kw)
                ref8 = moe_ref(x, ids, wts, slot_of, *slots, qt, d, f, x8=True, **kw)
                ref = moe_ref(x, ids, wts, slot_of, *slots, qt, d, f, **kw)
                assert rel(out, ref8) < {X8_TOL}, ("slots", act, rel(out, ref8))
                assert 1e-4 < rel(out, ref) < 3e-2, ("rounding", act, rel(out, ref))
                if bias is None:  # (the rows unsummed: the same launches with or without)
                    parts = moe_forward(x, ids, wts, slot_of, *slots, qt, d, f, x8=True,
                                        tiles=tiles, sum_pairs=False, **kw)
                    assert rel(parts.sum(1), ref8) < {X8_TOL}, ("unsummed", act)
                continue
            miss = torch.full((2 * t, lay.stride), 255, dtype=torch.uint8)
            gather_misses(ids, slot_of, records, miss, lay.nbytes)
            out = moe_forward(x, ids, wts, slot_of, *slots, qt, d, f, miss=lay.views(miss),
                              x8=True, tiles=tiles, **kw)
            ref8 = moe_ref(x, ids, wts, *full, x8=True, **kw)
            assert rel(out, ref8) < {X8_TOL}, ("miss rows", act, rel(out, ref8))
            if bias is not None:  # (the pair-major grid: the biased form, gpt-oss's)
                pm = moe_forward(x, ids, wts, slot_of, *slots, qt, d, f, miss=lay.views(miss),
                                 x8=True, tiles=dict(tiles, pair_major=(1,)), **kw)
                assert torch.equal(pm, out), ("pair-major", act)
                continue
            # (x8 off: the float32 kernels; with biases test_kernels_gpu's interpreted MXFP4
            # calls cover them)
            plain = moe_forward(x, ids, wts, slot_of, *slots, qt, d, f, miss=lay.views(miss),
                                x8=False, tiles=fma, **kw)
            assert rel(plain, moe_ref(x, ids, wts, *full, **kw)) < 2e-5, ("float", act)
    print("ok")
    """, fresh_seed(), timeout=600)


@pytest.mark.cuda
def test_gemv_on_cuda() -> None:
    rng = np.random.default_rng(fresh_seed())
    for n, k, bb, r in ((37, 768, 4, 1), (4096, 2048, 8, 2), (14336, 4096, 16, 4),
                        (5, 14336, 16, 2), (7, 4096, 4, 4), (14336, 4096, 8, 1)):
        check(rng, n, k, "cuda", bb, "Q4_K", rows=r)
    for n, k, bb, r in ((37, 768, 4, 1), (4096, 2048, 8, 2), (14336, 4096, 8, 1),
                        (151936, 2048, 4, 2), (9, 1280, 4, 4)):
        check(rng, n, k, "cuda", bb, "Q6_K", rows=r)
    for n, k, r, split in ((37, 2048, 8, 1), (14336, 4096, 8, 1), (151936, 2048, 8, 1),
                           (9, 6144, 16, 1), (14336, 4096, 4, 2), (9, 6144, 2, 4)):
        check(rng, n, k, "cuda", split, "Q6_K run", rows=r)
    for qtype in ("IQ2_XS", "IQ3_XXS"):
        for n, k, bb, r in ((37, 768, 4, 1), (14336, 4096, 8, 1), (9, 1280, 4, 2)):
            check(rng, n, k, "cuda", bb, qtype, rows=r)
        for n, k, r, split in ((37, 2048, 8, 1), (14336, 4096, 4, 2), (9, 6144, 2, 4)):
            check(rng, n, k, "cuda", split, qtype + " run", rows=r)
        for n, k, r, split in ((14336, 4096, 4, 2), (9, 6144, 2, 4)):
            check(rng, n, k, "cuda", split, qtype + " run", rows=r, halves=True)
        for n, k, r, w, h in ((14336, 4096, 8, 2, False), (14336, 4096, 8, 2, True),
                              (19, 6144, 16, 4, True)):
            check(rng, n, k, "cuda", 2, qtype + " run", rows=r, warps=w, halves=h)


def test_round8_is_quantize_x() -> None:
    """The reference's rounding (reference.round8) is quantize_x's, under the interpreter:
    random rows, a block of zeros, and values that scale to exact halves (both round them to
    the even neighbour)."""
    run_interpreted("""
    import torch
    from strata.kernels.gpu.gemv_q8 import quantize_x
    from strata.kernels.gpu.reference import round8
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((3, 256)).astype(np.float32))
    x[1, 32:64] = 0.0
    x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -3.5])  # (dx = 1)
    # 127 / amax rounded to nearest puts this value at -50.5 exactly (to -50); torch's
    # 127 / tensor, a reciprocal times 127, at -50.500004 (to -51)
    x[2, 32:64] = 0.0
    x[2, 32:34] = torch.tensor([1.9832807779312134, -0.7886273860931396])
    xq, dx, _ = quantize_x(x)
    assert xq[2, :8].tolist() == [127, 0, 2, 2, 0, -2, 126, -4], xq[2, :8]
    assert xq[2, 33] == -50, xq[2, 32:34]
    assert torch.equal((xq.float().view(3, 8, 32) * dx[..., None]).view(3, 256), round8(x))
    print("ok")
    """, fresh_seed(), timeout=120)


def test_moe_x8_under_the_interpreter() -> None:
    """The decode MoE layer with activations rounded to 8 bits (moe_forward x8=True: x for a
    Q4_K gate and up, each pair's h for a Q4_K or Q6_K down): equal to the reference with that
    rounding (moe_ref x8=True) for 1 and 3 tokens (the second pack: 3), experts without a slot
    (they add nothing), the pairs' rows unsummed, miss rows (3 tokens: every pair computed, the
    missing experts' records read from their rows), blocks a step not dividing a row's three;
    and within the rounding of the reference without it. One pack with a Q6_K down (rows of
    one 210-byte block: every other one 2 mod 4) and one of i-quants (IQ2_XS gate and up with an
    IQ3_XXS down: rows of 74- and 98-byte blocks, every other one 2 mod 4 at 1 and 3 blocks a
    row); test_moe_x8_more_packs_under_the_interpreter has the other four."""
    run_interpreted_side_by_side([_moe_x8_script(768, 256, packs, _MOE_X8_TUNE)
                                  for packs in _MOE_X8_PACKS], fresh_seed(), timeout=600)


@every_case
def test_moe_x8_more_packs_under_the_interpreter() -> None:
    """The same for four more packs (a Q6_K gate, the i-quants the other way round, and two
    mixing i-quants with K-quants; test_moe_x8_on_cuda runs all six on CUDA)."""
    run_interpreted_side_by_side([_moe_x8_script(768, 256, packs, _MOE_X8_TUNE)
                                  for packs in _MOE_X8_MORE], fresh_seed(), timeout=600)


@every_case  # (the run form is off by default: tuning.GATE_UP_IQ_TILE)
def test_moe_iq_run_under_the_interpreter() -> None:
    """The same for the i-quant gate/up in the run form (moe_forward tiles "gate_up_iq_run": rows
    of 2048 values, one run of 8 blocks; split 2 leaves half the threads without a run), both
    i-quant packs, slots and miss rows (256 rows a program: the interpreter takes ~5 s a call
    of 2 pairs at that, 4x that at 64)."""
    packs = ("(QType.IQ2_XS, QType.IQ2_XS, QType.IQ3_XXS),",
             "(QType.IQ3_XXS, QType.IQ3_XXS, QType.IQ2_XS),")
    tune = dict(_MOE_X8_TUNE, gate_up_iq_run=(256, 2, 1))
    run_interpreted_side_by_side([_moe_x8_script(2048, 256, p, tune) for p in packs],
                                 fresh_seed(), timeout=900)


@every_case  # (off by default: tuning.DENSE_X8_MAX_T)
def test_gemm_x8_tokens_under_the_interpreter() -> None:
    """gemm_x8_tokens (dense_x8.py): a few tokens, each row read once for all of them, against
    the reference on x rounded to 8 bits: a row's blocks held in one step (768: 3 of 4), or
    walked in steps (4608: 18 in steps of 16, the second masked; 512 in steps of 1)."""
    run_interpreted("""
    import torch
    torch.manual_seed(seed)
    from strata.kernels.gpu.dense_x8 import gemm_x8_tokens
    from strata.kernels.gpu.reference import matmul_ref, round8
    from strata.quant import QType, random_rows
    rng = np.random.default_rng(seed)
    for q in (QType.Q4_K, QType.Q6_K):
        for m, n, k, tile in ((3, 9, 768, None), (2, 5, 4608, (2, 16, 2)), (4, 7, 512, (4, 1, 1))):
            w = torch.from_numpy(random_rows(q, n, k, rng, 0.05))
            x = torch.randn(m, k)
            ref = matmul_ref(round8(x), w, q)
            got = gemm_x8_tokens(x, w, q, tile)
            assert got.shape == (m, n) and float((got - ref).norm() / ref.norm()) < 2e-5, (q, k)
    print("ok")
    """, fresh_seed(), timeout=600)


@every_case  # (off by default: tuning.MOE_ONCE_MIN_PAIRS, MOE_GROUP; the CUDA tests run them)
def test_moe_once_under_the_interpreter() -> None:
    """The expert-once kernels (moe_once.py: a program per rows and expert, the pairs of one
    expert found among the step's ids): bit for bit the per-pair kernels' output, summed and
    unsummed, for Q4_K gate/up with a Q6_K and a Q4_K down; experts routed to 1-4 tokens, some
    without a slot (their pairs zero), rows of a step's blocks held once (ONE: a row's blocks
    in one step) and re-read (BB 1: d's two blocks in two steps); and near the reference with
    x and h rounded (moe_ref x8). The kernels on groups of 2 and 4 pairs of one expert (a token
    axis beside the rows, moe_forward's tiles["group"]) bit for bit the per-pair ones too."""
    run_interpreted_side_by_side([_ONCE_SCRIPT.replace("DOWN", down).replace("X8TOL", str(X8_TOL))
                                  for down in ("Q6_K", "Q4_K")], fresh_seed(), timeout=600)


# (one down type a process: the two side by side)
_ONCE_SCRIPT = """
    import torch
    torch.manual_seed(seed)
    from strata.kernels.gpu import moe_forward, moe_once
    from strata.kernels.gpu.reference import moe_ref
    from strata.quant import QType, random_rows
    launched = []
    class Counted:  # (each launch of an expert-once kernel, by name)
        def __init__(self, name):
            self.name, self.kernel = name, getattr(moe_once, name)
        def __getitem__(self, grid):
            launched.append(self.name)
            return self.kernel[grid]
    for name in ("_gate_up_once_q8_kernel", "_down_once_q8_kernel"):
        setattr(moe_once, name, Counted(name))
    rng = np.random.default_rng(seed)
    e, d, f, t, k = 6, 512, 256, 4, 3
    def rows(n, c, q):
        return torch.from_numpy(random_rows(q, n, c, rng, 0.05))
    slot_of = torch.tensor([2, -1, 0, 3, -1, 1], dtype=torch.int32)
    # expert 0 in every token, 1 (no slot) in three, 5 in one; the rest at random
    ids = torch.tensor([[0, 1, 5], [2, 0, 1], [0, 3, 1], [4, 2, 0]])
    x, wts = torch.randn(t, d), torch.rand(t, k)
    for down in (QType.DOWN,):
        layer = dict(slot_of_expert=slot_of, gate_slots=rows(4 * f, d, QType.Q4_K).view(4, f, -1),
                     up_slots=rows(4 * f, d, QType.Q4_K).view(4, f, -1),
                     down_slots=rows(4 * d, f, down).view(4, d, -1),
                     qtypes=(QType.Q4_K, QType.Q4_K, down), d_model=d, d_expert=f)
        ref = moe_ref(x, ids, wts, **layer, x8=True)
        for bb in (2, 1):
            tiles = dict(gate_up_q8=(128, bb, 1), down_q8=(512, bb, 1), down_q6k_q8=(512, bb, 1))
            once = moe_forward(x, ids, wts, **layer, x8=True, tiles=dict(tiles, once=(1,)))
            pairs = moe_forward(x, ids, wts, **layer, x8=True, tiles=dict(tiles, once=(0,)))
            assert torch.equal(once, pairs), (down, bb, float((once - pairs).abs().max()))
            assert float((once - ref).norm() / ref.norm()) < X8TOL, (down, bb)
            parts = moe_forward(x, ids, wts, **layer, x8=True, sum_pairs=False,
                                tiles=dict(tiles, once=(1,)))
            assert torch.equal(parts.sum(1), pairs), (down, bb)
            assert (parts[ids == 1] == 0).all() and (parts[ids == 4] == 0).all()
            # groups of MT pairs of one expert, a token axis beside the rows (gate/up, down)
            for mt, r in ((2, 64), (4, 32)) if bb == 2 else ():
                grouped = moe_forward(x, ids, wts, **layer, x8=True,
                                      tiles=dict(tiles, once=(0,), group=(mt, r)))
                assert torch.equal(grouped, pairs), (down, bb, mt)
    assert launched == ["_gate_up_once_q8_kernel", "_down_once_q8_kernel"] * 4, launched
    print("ok")
"""


# A pair's h comes from float32 sums in another order than the reference's, so a value next to
# a rounding boundary may round to the other side: one such value moves a Qwen3-30B-A3B layer's
# one-token output by 1e-4 to 1.1e-3 of its norm (measured on random Q4_K experts), so a few of
# them stay under X8_TOL, while h not rounded at all moves it by about 8e-3.
X8_TOL = 2.5e-3

# (in two processes side by side: a K-quant and an i-quant pack in make test, four more with
# STRATA_ALL_TESTS)
_MOE_X8_PACKS = ("(QType.Q4_K, QType.Q4_K, QType.Q6_K),",
                 "(QType.IQ2_XS, QType.IQ2_XS, QType.IQ3_XXS),")
_MOE_X8_MORE = ("""(QType.IQ2_XS, QType.IQ2_XS, QType.Q6_K),
                   (QType.Q6_K, QType.Q4_K, QType.Q4_K)""",
                """(QType.IQ3_XXS, QType.IQ3_XXS, QType.IQ2_XS),
                   (QType.Q4_K, QType.Q4_K, QType.IQ3_XXS)""")
# (larger tiles: fewer programs to interpret; the i-quant down BB 1, f one block: every step in
# the row, so its loads unmasked, EVEN)
_MOE_X8_TUNE = dict(gate_up_q8=(64, 2, 1), down_q8=(256, 2, 1), down_q6k_q8=(256, 2, 1),
                    gate_up_iq=(64, 2, 1), down_iq=(256, 1, 1), gate_up=(64, 256, 1, 4),
                    down_pairs=(64, 256, 1, 4))


def _moe_x8_script(d: int, f: int, packs: str, tune: dict) -> str:
    """test_moe_x8_under_the_interpreter's script: layers of 3 experts (2 with slots) of shape
    d x f in each of packs (the source of a tuple of qtype triples), moe_forward's tiles = tune."""
    return f"""
    import torch
    torch.manual_seed(seed)  # (x too comes from the printed seed)
    from strata.experts.layout import ExpertLayout
    from strata.kernels.gpu import gather_misses, moe_forward
    from strata.kernels.gpu.reference import moe_ref
    from strata.quant import QType, random_rows
    rng = np.random.default_rng(seed)
    def rel(a, b):
        return float((a - b).norm() / b.norm())
    e, d, f = 3, {d}, {f}
    for qt in ({packs}):
        def rows(n, k, q):
            return torch.from_numpy(random_rows(q, n, k, rng, 0.05))
        slot_of = torch.tensor([1, -1, 0], dtype=torch.int32)
        layer = dict(slot_of_expert=slot_of, gate_slots=rows(2 * f, d, qt[0]).view(2, f, -1),
                     up_slots=rows(2 * f, d, qt[1]).view(2, f, -1),
                     down_slots=rows(2 * d, f, qt[2]).view(2, d, -1), qtypes=qt, d_model=d,
                     d_expert=f)
        lay = ExpertLayout(0, tuple(int(v) for v in qt), d, f)
        records = torch.zeros(e, lay.stride, dtype=torch.uint8)
        for part, src, (n, k), q in zip(lay.views(records), (layer["gate_slots"],
                                        layer["up_slots"], layer["down_slots"]),
                                        ((f, d), (f, d), (d, f)), qt):
            part[:] = torch.stack([src[1], rows(n, k, q), src[0]])
        full = dict(layer, slot_of_expert=torch.arange(e, dtype=torch.int32),
                    **dict(zip(("gate_slots", "up_slots", "down_slots"), lay.views(records))))
        tiles = {tune!r}
        tol = {X8_TOL}
        for t in (1, 3) if qt[2] in (QType.Q6_K, QType.IQ3_XXS) else (3,):
            ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(t)]))
            x, wts = torch.randn(t, d), torch.rand(t, 2)
            out = moe_forward(x, ids, wts, **layer, x8=True, tiles=tiles)
            assert rel(out, moe_ref(x, ids, wts, **layer, x8=True)) < tol, (qt, t)
            assert rel(out, moe_ref(x, ids, wts, **layer)) < 3e-2, (qt, t)
            if t == 1:
                parts = moe_forward(x, ids, wts, **layer, sum_pairs=False, x8=True,
                                    tiles=tiles)
                assert rel(parts.sum(1), moe_ref(x, ids, wts, **layer, x8=True)) < tol, qt
                continue
            rows_ = torch.full((2 * t + 1, lay.stride), 255, dtype=torch.uint8)
            gather_misses(ids, slot_of, records, rows_, lay.nbytes)
            out = moe_forward(x, ids, wts, slot_of, *lay.views(records[[2, 0]]), qt, d, f,
                              miss=lay.views(rows_), x8=True, tiles=tiles)
            assert rel(out, moe_ref(x, ids, wts, **full, x8=True)) < tol, ("miss rows", qt, t)
            # the pair-major grid: the same programs in another order, so the same bits
            pm = moe_forward(x, ids, wts, slot_of, *lay.views(records[[2, 0]]), qt, d, f,
                             miss=lay.views(rows_), x8=True, tiles=dict(tiles, pair_major=(1,)))
            assert torch.equal(pm, out), ("pair-major", qt, t)
    print("ok")
"""


@pytest.mark.cuda
@pytest.mark.parametrize("tune", [{}, {"gate_up_q8": (2, 8, 1), "down_q8": (2, 4, 1),
                                       "gate_up_iq": (2, 8, 1), "down_iq": (2, 4, 1)},
                                  {"gate_up_q8": (4, 4, 1), "down_q8": (4, 8, 1),
                                   "down_q6k_q8": (2, 4, 1), "gate_up_iq": (4, 4, 1),
                                   "down_iq": (4, 2, 1)},
                                  {"gate_up_q8": (8, 8, 2), "down_q8": (8, 4, 2),
                                   "gate_up_iq": (8, 8, 2), "down_iq": (8, 4, 2)},
                                  {"gate_up_iq_run": (8, 1, 1), "down_iq": (8, 1, 1)},
                                  {"pair_major": (1,)}])
@pytest.mark.parametrize("pack", ["Q4_K/Q6_K", "Q4_K/Q4_K", "IQ2_XS/IQ3_XXS", "IQ3_XXS/IQ2_XS",
                                  "IQ2_XS/Q6_K", "Q4_K/IQ3_XXS"])
def test_moe_x8_on_cuda(tune: dict, pack: str) -> None:
    """A Qwen3-30B-A3B decode layer (D 2048, F 768, 8 of 16 experts resident, 8 routed) with
    activations rounded to 8 bits, gate and up of the pack's first type and down of its second,
    one token and four, against the reference with that rounding and without; the default
    tiles and others, the i-quant gate/up in the run form too (with a down of BB 1: a row's
    3 blocks, every step in it, EVEN)."""
    _moe_x8_layer(2048, 768, pack, tune)


@pytest.mark.cuda
@pytest.mark.parametrize("tune", [{}, {"gate_up_iq_run": (8, 1, 1)}])
@pytest.mark.parametrize("pack", ["Q4_K/Q6_K", "IQ2_XS/IQ3_XXS"])
def test_moe_x8_on_cuda_235b_shape(tune: dict, pack: str) -> None:
    """The same at Qwen3-235B-A22B's expert shape (D 4096, F 1536: 6 blocks a down row; the
    run form's threads walk two runs)."""
    _moe_x8_layer(4096, 1536, pack, tune)


@pytest.mark.cuda
@pytest.mark.parametrize("tune", [{}, {"gate_up_mx8": (8, 4, 1), "down_mx8": (8, 4, 1)},
                                  {"gate_up_mx8": (2, 8, 2), "down_mx8": (16, 4, 2)},
                                  {"gate_up_mx8": (1, 32, 4), "down_mx8": (4, 4, 2)},
                                  {"pair_major": (1,)}])
def test_moe_mxfp4_x8_on_cuda(tune: dict) -> None:
    """gpt-oss-20b's decode layer (D = F = 2880: 90 blocks of 17 bytes a row, 4 of 32 experts
    routed, 24 resident, biases and the clamped SwiGLU) on MXFP4's 8-bit-activation kernels,
    one token and four: against the reference with x and h rounded, and within the rounding
    of the reference without it."""
    from strata.kernels.gpu import moe_forward
    from strata.kernels.gpu.reference import moe_ref
    from strata.quant import QType, random_rows

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    e, slots, k, d = 32, 24, 4, 2880
    slot_of = np.full(e, -1)
    slot_of[rng.permutation(e)[:slots]] = np.arange(slots)
    mx = QType.MXFP4

    def rows(n: int, cols: int) -> torch.Tensor:
        return torch.from_numpy(random_rows(mx, n, cols, rng, 0.05)).cuda()

    layer = dict(slot_of_expert=torch.tensor(slot_of, dtype=torch.int32).cuda(),
                 gate_slots=rows(slots * d, d).view(slots, d, -1),
                 up_slots=rows(slots * d, d).view(slots, d, -1),
                 down_slots=rows(slots * d, d).view(slots, d, -1), qtypes=(mx, mx, mx),
                 d_model=d, d_expert=d, act="swiglu_oai",
                 bias=tuple(torch.randn(e, d, device="cuda") for _ in range(3)))
    for t in (1, 4):
        ids = torch.from_numpy(np.stack([rng.permutation(e)[:k] for _ in range(t)])).cuda()
        x, wts = torch.randn(t, d, device="cuda"), torch.rand(t, k, device="cuda")
        out = moe_forward(x, ids, wts, **layer, x8=True, tiles=tune)
        ref = moe_ref(x, ids, wts, **layer, x8=True)
        err = float((out - ref).norm() / ref.norm())
        assert err < X8_TOL, f"{tune} t={t} seed={seed}: rel err {err:.2e} with rounding"
        ref = moe_ref(x, ids, wts, **layer)
        err = float((out - ref).norm() / ref.norm())
        assert err < 3e-2, f"{tune} t={t} seed={seed}: rel err {err:.2e} without"


def _moe_x8_layer(d: int, f: int, pack: str, tiles: dict) -> None:
    from strata.kernels.gpu import moe_forward
    from strata.kernels.gpu.reference import moe_ref
    from strata.quant import QType, random_rows

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    e, slots = 16, 8
    q, down = (QType[v] for v in pack.split("/"))
    slot_of = np.full(e, -1)
    slot_of[rng.permutation(e)[:slots]] = np.arange(slots)

    def rows(n: int, k: int, qt: QType) -> torch.Tensor:
        return torch.from_numpy(random_rows(qt, n, k, rng, 0.05)).cuda()

    layer = dict(slot_of_expert=torch.tensor(slot_of, dtype=torch.int32).cuda(),
                 gate_slots=rows(slots * f, d, q).view(slots, f, -1),
                 up_slots=rows(slots * f, d, q).view(slots, f, -1),
                 down_slots=rows(slots * d, f, down).view(slots, d, -1),
                 qtypes=(q, q, down), d_model=d, d_expert=f)
    tol = X8_TOL
    for t in (1, 4, 16):  # (4 and 16: 32 and 128 pairs a batched step's call, step=True; the
        # expert-once kernels where they take the types against the per-pair kernels' sums)
        ids = torch.from_numpy(np.stack([rng.permutation(e)[:8] for _ in range(t)])).cuda()
        x, wts = torch.randn(t, d, device="cuda"), torch.rand(t, 8, device="cuda")
        out = moe_forward(x, ids, wts, **layer, x8=True, tiles=tiles, step=True)
        ref = moe_ref(x, ids, wts, **layer, x8=True)
        err = float((out - ref).norm() / ref.norm())
        assert err < tol, f"{tiles} {pack} t={t} seed={seed}: rel err {err:.2e} with rounding"
        if t > 1:
            once, pairs = (moe_forward(x, ids, wts, **layer, x8=True, step=True,
                                       tiles=dict(tiles, once=(v,))) for v in (1, 0))
            # (the same sums in another order: an h value on a rounding edge of the downs'
            # 8-bit x can go the other way, 4e-5 to 7e-5 at 16 tokens on the H200; a wrong
            # expert or row is O(1))
            err = float((once - pairs).norm() / pairs.norm())
            assert err < 5e-4, f"{tiles} {pack} t={t} seed={seed}: {err:.2e} from per pair"
            for group in ((2, 2), (2, 4), (4, 2)) if q == QType.Q4_K else ():
                # groups of MT pairs of one expert, R rows a program (the downs too where K-quant)
                grouped = moe_forward(x, ids, wts, **layer, x8=True, step=True,
                                      tiles=dict(tiles, once=(0,), group=group))
                err = float((grouped - pairs).norm() / pairs.norm())
                # (the per-pair kernels' sums in their order: held 1e-6 on an H200, but on an
                # H100 1.3e-6 at 4 tokens and 5.8e-5 at 16 for (2, 2): the compiled sums differ
                # in their last bits and a down's 8-bit rounding edge of h amplifies that, as
                # the expert-once kernels' above; a wrong expert or row is O(1))
                assert err < 5e-4, f"{tiles} {pack} t={t} seed={seed}: group {group} {err:.2e}"
        ref = moe_ref(x, ids, wts, **layer)
        err = float((out - ref).norm() / ref.norm())
        assert err < 3e-2, f"{tiles} {pack} t={t} seed={seed}: rel err {err:.2e} without"


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ2_XS", "IQ3_XXS"])
def test_quant_tensor_x8_on_cuda(qtype: str) -> None:
    """A one-token matmul of a large QuantTensor of gemv_x8's types with x8 (--kernels fused)
    rounds x to 8 bits and runs the type's dp4a GEMV (Q6_K, IQ2_XS, IQ3_XXS: the run forms,
    split across a row's two runs at K 4096; rows 4 bytes past a 16-byte boundary: the spread
    forms): the product
    with round8(x) to float rounding, within the rounding of the product with x; a small matrix
    keeps float32 x for one token; two tokens float32 x too (8-bit x over Q4_K and Q6_K rows
    where tuning.DENSE_X8_MAX_T sends them to gemm_x8_tokens)."""
    from strata.kernels.gpu.reference import matmul_ref, round8
    from strata.model.weights import X8_MIN_ROWS, QuantTensor
    from strata.quant import QType, random_rows

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    q = QType[qtype]
    for n, k, shift in ((X8_MIN_ROWS + 7, 2048, 0), (151936, 2048, 0), (512, 2048, 0),
                        (X8_MIN_ROWS + 7, 4096, 0), (X8_MIN_ROWS, 2048, 4)):
        rows = torch.from_numpy(random_rows(q, n, k, rng, 0.05))
        buf = torch.empty(rows.numel() + 16, dtype=torch.uint8, device="cuda")
        at = (-buf.data_ptr()) % 16 + shift
        raw = buf[at:at + rows.numel()].view(rows.shape)
        raw.copy_(rows)
        w = QuantTensor(raw, int(q), k, x8=True)
        x = torch.randn(1, k, device="cuda")
        y = w.matmul_t(x)
        exact = matmul_ref(x, w.raw, q)
        rounded = matmul_ref(round8(x), w.raw, q)
        err = float((y - rounded).norm() / rounded.norm())
        if n >= X8_MIN_ROWS:
            assert err < 2e-5, f"{n}x{k} seed={seed}: rel err {err:.2e} against round8(x)"
            assert float((y - exact).norm() / exact.norm()) < 3e-2
        else:
            assert float((y - exact).norm() / exact.norm()) < 2e-5, (n, k, seed)
        y2 = w.matmul_t(torch.cat([x, x]))  # two tokens: float32 x (8-bit x for Q4_K / Q6_K
        # where tuning.DENSE_X8_MAX_T takes two: gemm_x8_tokens)
        from strata.model.weights import DENSE_X8_MAX_T

        two = rounded if q in (QType.Q4_K, QType.Q6_K) and DENSE_X8_MAX_T >= 2 else exact
        for row in y2:
            assert float((row - two[0]).norm() / two.norm()) < 2e-5, (n, k, seed)


def test_quant_tensor_x8_only_where_it_pays() -> None:
    """QuantTensor takes the int8 GEMV for one token of a matrix of gemv_x8's types, X8_MIN_ROWS
    rows or more only (checked on the CPU side of the decision; the path runs on CUDA)."""
    from strata.model.weights import X8_MIN_ROWS, QuantTensor
    from strata.quant import QType, row_nbytes

    def qt(q: QType, n: int, k: int = 512) -> QuantTensor:
        return QuantTensor(torch.zeros(n, row_nbytes(q, k), dtype=torch.uint8), int(q), k,
                           x8=True)

    one, two = torch.zeros(1, 512), torch.zeros(2, 512)
    assert qt(QType.Q6_K, X8_MIN_ROWS)._x8_for(one) and qt(QType.Q4_K, X8_MIN_ROWS)._x8_for(one)
    assert not qt(QType.Q6_K, X8_MIN_ROWS)._x8_for(two)
    assert not qt(QType.Q6_K, X8_MIN_ROWS - 1)._x8_for(one)
    assert not qt(QType.Q8_0, X8_MIN_ROWS)._x8_for(one)
    assert all(qt(q, X8_MIN_ROWS)._x8_for(one) for q in (QType.IQ2_XS, QType.IQ3_XXS))
    # a few tokens (a batched step's) over Q4_K / Q6_K rows of any count: gemm_x8_tokens, up to
    # tuning.DENSE_X8_MAX_T tokens (0 by default: off)
    from strata.model import weights

    assert not qt(QType.Q4_K, 64)._x8_tokens_for(two) or weights.DENSE_X8_MAX_T >= 2
    was, weights.DENSE_X8_MAX_T = weights.DENSE_X8_MAX_T, 32
    try:
        many = torch.zeros(32, 512)
        assert qt(QType.Q4_K, 64)._x8_tokens_for(two) and qt(QType.Q6_K, 64)._x8_tokens_for(many)
        assert not qt(QType.Q4_K, 64)._x8_tokens_for(one)
        assert not qt(QType.Q4_K, 64)._x8_tokens_for(torch.zeros(33, 512))
        assert not qt(QType.IQ2_XS, 64)._x8_tokens_for(two)
        assert not qt(QType.Q8_0, 64)._x8_tokens_for(two)
    finally:
        weights.DENSE_X8_MAX_T = was


def test_spread_gemvs_refuse_bad_arguments() -> None:
    """Each spread GEMV names what is wrong before it launches anything: K not a multiple of
    256, rows of another size, x of another length, tiles not powers of two, rows not 4-byte
    aligned (they are read as int32 words); the run forms (Q6_K, IQ2_XS, IQ3_XXS) also K not a
    multiple of 2048 or rows not 16-byte aligned, the i-quant ones another type."""
    from strata.kernels.gpu.gemv_q8 import gemv_iq_spread, gemv_q4k_spread, gemv_q6k_spread
    from strata.quant import QType, row_nbytes

    def call(q: QType, w: torch.Tensor, k: int, xq: torch.Tensor, **kw: int) -> None:
        n = w.shape[0]
        if q == QType.Q4_K:
            gemv_q4k_spread(xq, torch.zeros(k // 64, 4), w, n, k, **kw)
        elif q == QType.Q6_K:
            gemv_q6k_spread(xq, torch.zeros(k // 32), w, n, k, **kw)
        else:
            gemv_iq_spread(xq, torch.zeros(k // 32), w, n, k, q, **kw)

    for q in (QType.Q4_K, QType.Q6_K, QType.IQ2_XS, QType.IQ3_XXS):
        rb = row_nbytes(q, 512)
        w, xq = torch.zeros(3, rb, dtype=torch.uint8), torch.zeros(512, dtype=torch.int8)
        with pytest.raises(ValueError, match="multiple of 256"):
            call(q, torch.zeros(3, 10, dtype=torch.uint8), 100, torch.zeros(100, dtype=torch.int8))
        with pytest.raises(ValueError, match=f"rows \\[3, {rb}\\]"):
            call(q, torch.zeros(3, rb + 1, dtype=torch.uint8), 512, xq)
        with pytest.raises(ValueError, match="x \\[256\\]"):
            call(q, w, 512, torch.zeros(256, dtype=torch.int8))
        with pytest.raises(ValueError, match="powers of two"):
            call(q, w, 512, xq, bb=3)
        with pytest.raises(ValueError, match="powers of two"):
            call(q, w, 512, xq, rows=6)
        shifted = torch.zeros(3 * rb + 2, dtype=torch.uint8)[2:].view(3, rb)
        with pytest.raises(ValueError, match="4-byte aligned"):
            call(q, shifted, 512, xq)
    with pytest.raises(ValueError, match="IQ2_XS or IQ3_XXS"):
        gemv_iq_spread(torch.zeros(256, dtype=torch.int8), torch.zeros(8),
                       torch.zeros(1, 144, dtype=torch.uint8), 1, 256, QType.Q4_K)
    # the Q6_K run form: K a multiple of 2048, rows starting 16-byte aligned
    from strata.kernels.gpu.gemv_q8 import gemv_q6k_run

    for k in (1024, 2048):
        rb = row_nbytes(QType.Q6_K, k)
        w = torch.zeros(2 * rb + 4, dtype=torch.uint8)
        w = w[(-w.data_ptr()) % 16 + (4 if k == 2048 else 0):][: 2 * rb].view(2, rb)
        with pytest.raises(ValueError, match="multiple of 2048 and rows starting 16-byte"):
            gemv_q6k_run(torch.zeros(k, dtype=torch.int8), torch.zeros(k // 32), w, 2, k)
    # the i-quants' run form: the same, and their types only
    from strata.kernels.gpu.gemv_q8 import gemv_iq_run

    for q in (QType.IQ2_XS, QType.IQ3_XXS):
        for k in (1024, 2048):
            rb = row_nbytes(q, k)
            w = torch.zeros(2 * rb + 20, dtype=torch.uint8)
            w = w[(-w.data_ptr()) % 16 + (4 if k == 2048 else 0):][: 2 * rb].view(2, rb)
            with pytest.raises(ValueError, match=f"gemv_iq_run \\({q.name}\\): K a multiple of "
                               "2048 and rows starting 16-byte"):
                gemv_iq_run(torch.zeros(k, dtype=torch.int8), torch.zeros(k // 32), w, 2, k, q)
    with pytest.raises(ValueError, match="gemv_iq_run: IQ2_XS or IQ3_XXS rows, got Q6_K"):
        gemv_iq_run(torch.zeros(2048, dtype=torch.int8), torch.zeros(64),
                    torch.zeros(1, 1680, dtype=torch.uint8), 1, 2048, QType.Q6_K)
