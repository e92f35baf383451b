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

from strata.kernels.tuning import MMQ_TILE, MMQ_TILE_WIDE
from strata.quant import QType

_HEAD = """
    import torch
    import strata.kernels.gpu.moe_mmq as mmq_mod
    from strata.kernels.gpu import moe_forward
    from strata.kernels.gpu.moe_mmq import mmq_kernel_types, mmq_types
    from strata.kernels.gpu.reference import moe_ref
    from strata.kernels.tuning import GROUPED_MIN_TOKENS, MMQ_MXFP4
    from strata.quant import QType, random_rows

    rng = np.random.default_rng(seed)
    # (rows the kernels do not write read as NaN: an unwritten one would show in the output)
    mmq_mod.scratch = lambda shape, dtype, device: torch.full(shape, float("nan"), dtype=dtype,
                                                              device=device)
    def rel(a, b):
        return float((a - b).norm() / b.norm())
"""

_BODY = _HEAD + """
    def rows(q, n, k):
        return torch.from_numpy(random_rows(q, n, k, rng, 0.05))
    e, d, f = 5, 256, 256
    slot_of = torch.tensor([2, -1, 0, 3, 1], dtype=torch.int32)  # expert 1 has no slot
    for down, tokens in ((QType.Q6_K, (1, 20, 41)), (QType.Q4_K, (9,))):
        # (41 tokens x 2 of 5 experts: 16 an expert, mmq_tile's wide tile)
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
                assert not torch.equal(dot, mine)
                if t * 2 < GROUPED_MIN_TOKENS * e:  # (past it the grouped path's bf16)
                    assert torch.equal(moe_forward(*args), dot), (down, t)
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
    """Q4_K gate/up with a Q6_K down at 1, 20 and 41 tokens (the last on the wide tile), a Q4_K
    down at 9, one expert without a slot; moe_forward takes these kernels itself for a
    prompt-sized call under --kernels fused (x8), not without it; path="mmq" falls back to
    tl.dot for types it does not take."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    run_interpreted(_BODY, fresh_seed() % 2**31, timeout=600)


_MX_BODY = _HEAD + """
    e, d, f = 5, 192, 128  # (6 and 4 blocks of 17 bytes a row: rows at many byte alignments)
    qt = (QType.MXFP4,) * 3
    assert mmq_kernel_types(qt, d, f, object(), "swiglu_oai") and not mmq_kernel_types(qt, 96, f)
    assert mmq_types(qt, d, f) == MMQ_MXFP4
    slot_of = torch.tensor([2, -1, 0, 3, 1], dtype=torch.int32)  # expert 1 has no slot
    gate = torch.from_numpy(random_rows(QType.MXFP4, 4 * f, d, rng, 0.05)).view(4, f, -1)
    up = torch.from_numpy(random_rows(QType.MXFP4, 4 * f, d, rng, 0.05)).view(4, f, -1)
    dn = torch.from_numpy(random_rows(QType.MXFP4, 4 * d, f, rng, 0.05)).view(4, d, -1)
    biases = tuple(torch.randn(e, n) for n in (f, f, d))
    for bias, act in ((None, "swiglu"), (biases, "swiglu_oai")):
        for t in (1, 9):
            ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(t)]))
            x, wts = 3 * torch.randn(t, d), torch.rand(t, 2)
            before = torch.randn(t, d)
            args = (x, ids, wts, slot_of, gate, up, dn, qt, d, f)
            out = moe_forward(*args, out=before.clone(), path="mmq", bias=bias, act=act)
            added = out - before
            assert torch.isfinite(added).all(), (act, t)
            same = moe_ref(*args, x8=True, bias=bias, act=act)
            exact = moe_ref(*args, bias=bias, act=act)
            # (the float order can move an element of h across an 8-bit step; seen 2e-7)
            assert rel(added, same) < 2e-3, (act, t, rel(added, same))
            assert 1e-4 < rel(added, exact) < 3e-2, (act, t, rel(added, exact))
    print("ok")
"""


def test_mmq_mxfp4_kernels_under_the_interpreter():
    """MXFP4 gate, up and down (gpt-oss's experts) on the integer tensor-core kernels, without
    and with biases and the clamped SwiGLU, 1 and 9 tokens, one expert without a slot, rows of
    6 and 4 blocks (102- and 68-byte rows): against the reference with x and h rounded to 8
    bits, and within that rounding of the float reference; the kernels take D and F multiples
    of 64, and moe_forward's own pick takes them as tuning.MMQ_MXFP4 says."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    run_interpreted(_MX_BODY, fresh_seed() % 2**31, timeout=600)


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


@pytest.mark.cuda
@pytest.mark.parametrize("t", [16, 128, 512])
def test_mmq_mxfp4_kernels_on_cuda_at_the_gpt_oss_shape(t: int):
    """gpt-oss-20b's layer (32 experts, top-4, D = F = 2880, biases, the clamped SwiGLU; 3
    experts without a slot) on the MXFP4 integer tensor-core kernels."""
    from strata.kernels.gpu import moe_forward
    from strata.kernels.gpu.reference import moe_ref
    from strata.quant import random_rows

    rng = np.random.default_rng(fresh_seed() % 2**31)
    e, k, d = 32, 4, 2880
    qt = (QType.MXFP4,) * 3
    slot_of = torch.arange(e, dtype=torch.int32)
    slot_of[rng.choice(e, 3, replace=False)] = -1

    def slots(n: int, cols: int) -> torch.Tensor:
        return torch.from_numpy(random_rows(QType.MXFP4, e * n, cols, rng, 0.02)).view(
            e, n, -1).cuda()

    gate, up, dn = slots(d, d), slots(d, d), slots(d, d)
    bias = tuple(torch.randn(e, d, device="cuda") for _ in range(3))
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:k] for _ in range(t)])).cuda()
    x, wts = torch.randn(t, d, device="cuda"), torch.rand(t, k, device="cuda")
    args = (x, ids, wts, slot_of.cuda(), gate, up, dn, qt, d, d)
    out = moe_forward(*args, path="mmq", bias=bias, act="swiglu_oai")
    same = moe_ref(*args, x8=True, bias=bias, act="swiglu_oai")
    assert float((out - same).norm() / same.norm()) < 2e-3


def mmq_resources(kernel: str, down: str = "Q6_K", tile: tuple[int, int, int] = MMQ_TILE) -> dict:
    """One of the MMQ kernels as moe_forward_mmq launches it at Qwen3-30B-A3B's shape (down
    "MXFP4": gpt-oss-20b's, every part MXFP4 with biases and the clamped SwiGLU) at `tile`,
    built for sm_90 (no GPU): shared bytes, registers, spills."""
    from test_decode_ops import sm90_resources

    from strata.kernels.gpu import moe_mmq

    bm, bn, warps = tile
    mx = down == "MXFP4"
    d, f, topk, e = (2880, 2880, 4, 32) if mx else (2048, 768, 8, 128)
    p = e * topk
    extra = dict(MX=True, BIAS=True) if mx else {}
    if kernel == "gate_up":
        rb = 90 * 17 if mx else 1152
        pointers = {n: t for n, t in (("xq", "*i8"), ("xd", "*fp32"), ("xs", "*fp32"),
                                       ("counts", "*i32"), ("starts", "*i32"), ("order", "*i32"),
                                       ("wts", "*fp32"), ("slot_of", "*i32"), ("gate", "*u8"),
                                       ("up", "*u8"), ("h", "*fp32"), ("bg", "*fp32"),
                                       ("bu", "*fp32"))}
        ints = dict(NC=p // bm, stride_gs=f * rb, stride_us=f * rb, row_bytes=rb)
        const = dict(D=d, F=f, TOPK=topk, BM=bm, BN=bn, **extra, **({"OAI": True} if mx else {}))
        fn = moe_mmq._gate_up_mmq_kernel
    else:
        rb = 90 * 17 if mx else 3 * (210 if down == "Q6_K" else 144)
        pointers = {n: t for n, t in (("hq", "*i8"), ("hd", "*fp32"), ("hs", "*fp32"),
                                       ("counts", "*i32"), ("starts", "*i32"), ("order", "*i32"),
                                       ("slot_of", "*i32"), ("down", "*u8"), ("y", "*fp32"),
                                       ("wts", "*fp32"), ("bd", "*fp32"))}
        ints = dict(NC=p // bm, stride_ds=d * rb, row_bytes=rb)
        const = dict(D=d, F=f, Q6=down == "Q6_K", BM=bm, BN=bn, **extra)
        fn = moe_mmq._down_mmq_kernel
    return sm90_resources(fn, pointers, {}, ints, const, warps)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,down,tile", [
    ("gate_up", "Q4_K", MMQ_TILE), ("down", "Q4_K", MMQ_TILE), ("down", "Q6_K", MMQ_TILE),
    ("gate_up", "MXFP4", MMQ_TILE), ("down", "MXFP4", MMQ_TILE),
    ("gate_up", "Q4_K", MMQ_TILE_WIDE), ("down", "Q6_K", MMQ_TILE_WIDE),
    ("gate_up", "MXFP4", MMQ_TILE_WIDE), ("down", "MXFP4", MMQ_TILE_WIDE)])
def test_mmq_kernels_build_for_sm90(kernel: str, down: str, tile: tuple[int, int, int]):
    """Without a GPU: the integer tensor-core kernels build for sm_90 at Qwen3-30B-A3B's shape
    (MXFP4: gpt-oss-20b's) at both of mmq_tile's tiles within its shared memory and registers,
    with no spills."""
    pytest.importorskip("triton")
    got = mmq_resources(kernel, down, tile)
    assert got["shared"] <= 232448 and got["regs"] <= 255, got
    assert got["spills"] == 0 and got["stack"] == 0 and got["local"] == 0, got


_DENSE_BODY = _HEAD + """
    from strata.kernels.gpu.moe_mmq import mmq_matmul
    from strata.kernels.gpu.reference import matmul_ref, round8

    for qtype, n, k in (("Q4_K", 37, 512), ("Q6_K", 70, 256)):
        qt = QType[qtype]
        w = torch.from_numpy(random_rows(qt, n, k, rng, 0.05))
        for m in (1, 3, 16, 21):  # (21: two programs of 16 rows along the tokens)
            x = torch.randn(m, k) * 3
            y = mmq_matmul(x, w, qt, out=torch.full((m, n), float("nan")))
            assert torch.isfinite(y).all(), (qtype, m, "not every token and row written")
            same = matmul_ref(round8(x), w, qt)  # x rounded to 8 bits as the kernel rounds it
            assert rel(y, same) < 1e-5, (qtype, m, rel(y, same))
            assert 1e-4 < rel(y, matmul_ref(x, w, qt)) < 3e-2, (qtype, m)
    w = torch.from_numpy(random_rows(QType.Q4_K, 8, 256, rng, 0.05))
    shifted = torch.zeros(8 * 144 + 4, dtype=torch.uint8)[2:2 + 8 * 144].view(8, 144)
    shifted.copy_(w)  # (rows 2 bytes past a 4-byte boundary)
    for bad in (lambda: mmq_matmul(torch.randn(2, 256), shifted, QType.Q4_K),
                lambda: mmq_matmul(torch.randn(2, 512), w, QType.Q4_K),
                lambda: mmq_matmul(torch.randn(2, 128), w[:, :72], QType.Q4_K),
                lambda: mmq_matmul(torch.randn(2, 256), w, QType.Q8_0)):
        try:
            bad()
        except ValueError:
            continue
        raise AssertionError("mmq_matmul took rows it cannot read")
    import strata.kernels.gpu.moe_mmq as mmq_mod
    from strata.model.weights import QuantTensor

    w = torch.from_numpy(random_rows(QType.Q6_K, 70, 256, rng, 0.05))
    x = torch.randn(8, 256)  # (past GEMV_MAX_M, under DEQUANT_MIN_M: the tensor-core kernels)
    mmq = mmq_matmul(x, w, QType.Q6_K)

    def matmul_t(x, x8):  # the model's product with the fused kernels on (CUDA's, interpreted)
        t = QuantTensor(w, QType.Q6_K, 256, x8=x8)
        t.fused_for = lambda x: True
        return t.matmul_t(x)

    mmq_mod.DENSE_MMQ_MIN_N = 70  # a matrix of at least 70 rows on 8-bit activations goes there
    assert torch.equal(matmul_t(x, True), mmq)
    dot = matmul_t(x, False)  # (--kernels exact: tl.dot on x as it is)
    assert not torch.equal(dot, mmq) and rel(dot, matmul_ref(x, w, QType.Q6_K)) < 1e-2
    assert not torch.equal(matmul_t(x[:3], True), mmq[:3])  # (3 rows: the GEMV)
    mmq_mod.DENSE_MMQ_MIN_N = 71
    assert torch.equal(matmul_t(x, True), dot)  # (tuning.DENSE_X8_MAX_T 0: tl.dot)
    import strata.model.weights as weights_mod
    weights_mod.DENSE_X8_MAX_T = 8  # (fewer rows: gemm_x8_tokens, x rounded as MMQ rounds it)
    few = matmul_t(x, True)
    assert not torch.equal(few, dot) and rel(few, matmul_ref(round8(x), w, QType.Q6_K)) < 2e-5
    print("ok")
"""


def test_mmq_matmul_under_the_interpreter():
    """mmq_matmul (a dense matrix on the down kernel, one expert every token routes to) at 1, 3,
    16 and 21 tokens over Q4_K and Q6_K rows, N not a multiple of its 64-row tile: equal to the
    reference on x rounded to 8 bits, within that rounding of the float one; misaligned rows,
    rows of another length than K's, K not a multiple of 256 and other types refused.
    QuantTensor.matmul_t hands it a matrix of a few tokens on 8-bit activations (x8) with at
    least tuning.DENSE_MMQ_MIN_N rows (fewer: tl.dot, or dense_x8.gemm_x8_tokens up to
    tuning.DENSE_X8_MAX_T tokens), and not without x8."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    run_interpreted(_DENSE_BODY, fresh_seed() % 2**31, timeout=600)


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_mmq_matmul_on_cuda_at_the_head_shape(qtype: str):
    """The 30B-A3B's output head (151936 x 2048) for 8 and 16 rows against the reference on x
    rounded to 8 bits."""
    from strata.kernels.gpu.moe_mmq import mmq_matmul
    from strata.kernels.gpu.reference import matmul_ref, round8
    from strata.quant import random_rows

    rng = np.random.default_rng(fresh_seed() % 2**31)
    qt = QType[qtype]
    w = torch.from_numpy(random_rows(qt, 151936, 2048, rng, 0.02))
    for m in (8, 16):
        x = torch.randn(m, 2048)
        got = mmq_matmul(x.cuda(), w.cuda(), qt).cpu()
        ref = matmul_ref(round8(x), w, qt)
        assert float((got - ref).norm() / ref.norm()) < 1e-5, (qtype, m)
