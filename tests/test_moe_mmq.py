"""The MoE layer on integer tensor cores (kernels/gpu/moe_mmq.py): against the reference with x
and each pair's h rounded to 8 bits as the kernels round them (moe_ref x8: the same sums but
for the order of float additions and the 8-bit steps of h that order moves) and against the
float reference within that rounding's bound, under Triton's interpreter on the CPU and
compiled on CUDA."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from interpreted import fresh_seed, run_interpreted

from strata.quant import QType

_BODY = """
    import torch
    import strata.kernels.gpu.moe_mmq as mmq_mod
    from strata.kernels.gpu import moe_forward
    from strata.kernels.gpu.moe_mmq import mmq_types
    from strata.kernels.gpu.reference import moe_ref
    from strata.quant import QType, random_rows

    rng = np.random.default_rng(seed)
    # (rows the kernels do not write read as NaN: an unwritten one would show in the output)
    mmq_mod.scratch = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                              device=device)
    def rel(a, b):
        return float((a - b).norm() / b.norm())
    def rows(q, n, k):
        return torch.from_numpy(random_rows(q, n, k, rng, 0.05))
    e, d, f = 5, 256, 256
    slot_of = torch.tensor([2, -1, 0, 3, 1], dtype=torch.int32)  # expert 1 has no slot
    for down, tokens in ((QType.Q6_K, (1, 20)), (QType.Q4_K, (9,))):
        qt = (QType.Q4_K, QType.Q4_K, down)
        assert mmq_types(qt, d, f)
        gate, up = rows(qt[0], 4 * f, d).view(4, f, -1), rows(qt[1], 4 * f, d).view(4, f, -1)
        dn = rows(down, 4 * d, f).view(4, d, -1)
        for t in tokens:
            ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(t)]))
            x, wts = torch.randn(t, d), torch.rand(t, 2)
            before = torch.randn(t, d)
            out = moe_forward(x, ids, wts, slot_of, gate, up, dn, qt, d, f, out=before.clone(),
                              path="mmq")
            added = out - before
            assert torch.isfinite(added).all(), (down, t)
            same = moe_ref(x, ids, wts, slot_of, gate, up, dn, qt, d, f, x8=True)
            exact = moe_ref(x, ids, wts, slot_of, gate, up, dn, qt, d, f)
            # (the same sums but for the float order, which can move an element of h across
            # one of its 8-bit rounding steps: seen 3.6e-4; a lost term costs 1e-2 and more)
            assert rel(added, same) < 2e-3, (down, t, rel(added, same))
            assert rel(added, exact) < 3e-2, (down, t, rel(added, exact))
            if t > 4:  # (past DECODE_MAX_T: a prompt chunk's call, moe_forward's own pick)
                args = (x, ids, wts, slot_of, gate, up, dn, qt, d, f)
                # --kernels fused (x8): these kernels; exact: tl.dot's float x
                mine = moe_forward(*args, path="mmq")
                assert torch.equal(moe_forward(*args, x8=True), mine), (down, t)
                dot = moe_forward(*args, path="tl.dot")
                assert torch.equal(moe_forward(*args), dot), (down, t)
                assert not torch.equal(dot, mine)
    # types it does not take go to the tl.dot kernels
    qt = (QType.Q8_0, QType.Q4_K, QType.Q4_K)
    assert not mmq_types(qt, d, f)
    gate = rows(qt[0], 4 * f, d).view(4, f, -1)
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(6)]))
    x, wts = torch.randn(6, d), torch.rand(6, 2)
    out = moe_forward(x, ids, wts, slot_of, gate, up, dn, qt, d, f, path="mmq")
    assert rel(out, moe_ref(x, ids, wts, slot_of, gate, up, dn, qt, d, f)) < 1.5e-2
    print("ok")
"""


def test_mmq_kernels_under_the_interpreter():
    """Q4_K gate/up with a Q6_K down at 1 and 20 tokens, a Q4_K down at 9, one expert without a
    slot; moe_forward takes these kernels itself for a prompt-sized call under --kernels fused
    (x8), not without it; path="mmq" falls back to tl.dot for types it does not take."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    run_interpreted(_BODY, fresh_seed() % 2**31, timeout=600)


@pytest.mark.cuda
@pytest.mark.parametrize("t", [8, 128, 512])
@pytest.mark.parametrize("down", ["Q4_K", "Q6_K"])
def test_mmq_kernels_on_cuda_at_the_30b_shape(t: int, down: str):
    """Qwen3-30B-A3B's layer (128 experts, top-8, D 2048, F 768; 7 experts without a slot)."""
    from strata.kernels.gpu import moe_forward
    from strata.kernels.gpu.reference import moe_ref
    from strata.quant import random_rows

    rng = np.random.default_rng(fresh_seed() % 2**31)
    e, k, d, f = 128, 8, 2048, 768
    qt = (QType.Q4_K, QType.Q4_K, QType[down])
    slot_of = torch.arange(e, dtype=torch.int32)
    slot_of[rng.choice(e, 7, replace=False)] = -1

    def slots(q: QType, n: int, cols: int) -> torch.Tensor:
        return torch.from_numpy(random_rows(q, e * n, cols, rng, 0.02)).view(e, n, -1).cuda()

    gate, up, dn = slots(qt[0], f, d), slots(qt[1], f, d), slots(qt[2], d, f)
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:k] for _ in range(t)])).cuda()
    x, wts = torch.randn(t, d, device="cuda"), torch.rand(t, k, device="cuda")
    args = (x, ids, wts, slot_of.cuda(), gate, up, dn, qt, d, f)
    out = moe_forward(*args, path="mmq")
    same = moe_ref(*args, x8=True)
    assert float((out - same).norm() / same.norm()) < 2e-3


def mmq_resources(kernel: str, down: str = "Q6_K") -> dict:
    """One of the MMQ kernels as moe_forward_mmq launches it at Qwen3-30B-A3B's shape, built for
    sm_90 (no GPU): shared bytes, registers, spills."""
    from test_decode_ops import sm90_resources

    from strata.kernels.gpu import moe_mmq

    bm, bn, warps = moe_mmq.MMQ_TILE
    d, f, p = 2048, 768, 128 * 8
    if kernel == "gate_up":
        pointers = {n: t for n, t in (("xq", "*i8"), ("xd", "*fp32"), ("xs", "*fp32"),
                                       ("counts", "*i32"), ("starts", "*i32"), ("order", "*i32"),
                                       ("wts", "*fp32"), ("slot_of", "*i32"), ("gate", "*u8"),
                                       ("up", "*u8"), ("h", "*fp32"))}
        ints = dict(NC=p // bm, stride_gs=f * 1152, stride_us=f * 1152, row_bytes=1152)
        const = dict(D=d, F=f, TOPK=8, BM=bm, BN=bn)
        fn = moe_mmq._gate_up_mmq_kernel
    else:
        rb = 3 * (210 if down == "Q6_K" else 144)
        pointers = {n: t for n, t in (("hq", "*i8"), ("hd", "*fp32"), ("hs", "*fp32"),
                                       ("counts", "*i32"), ("starts", "*i32"), ("order", "*i32"),
                                       ("slot_of", "*i32"), ("down", "*u8"), ("y", "*fp32"))}
        ints = dict(NC=p // bm, stride_ds=d * rb, row_bytes=rb)
        const = dict(D=d, F=f, Q6=down == "Q6_K", BM=bm, BN=bn)
        fn = moe_mmq._down_mmq_kernel
    return sm90_resources(fn, pointers, {}, ints, const, warps)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,down", [("gate_up", "Q4_K"), ("down", "Q4_K"),
                                         ("down", "Q6_K")])
def test_mmq_kernels_build_for_sm90(kernel: str, down: str):
    """Without a GPU: the integer tensor-core kernels build for sm_90 at Qwen3-30B-A3B's shape
    within its shared memory and registers, with no spills."""
    pytest.importorskip("triton")
    got = mmq_resources(kernel, down)
    assert got["shared"] <= 232448 and got["regs"] <= 255, got
    assert got["spills"] == 0 and got["stack"] == 0 and got["local"] == 0, got
