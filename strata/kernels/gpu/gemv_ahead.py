"""A one-token Q4_K GEMV that keeps the next block's bytes in flight while it computes one.

    y = gemv_ahead(x, w, (rows, ahead, warps))   # x [1, K] f32/bf16, w Q4_K [N, row_nbytes]

An experiment against the shared skeleton (skeletons.gemv_tile), not used by the engine until
the H200 says it is faster (`scripts/bench_moe_decode.py --gemv-only 14336x4096` times it beside
the skeleton). docs/kernels.md estimates that the skeleton keeps about 10 KB of weights in
flight per SM, which by Little's law is about what it reaches (~27% of HBM), and that a larger
tile buys bytes in flight only with registers for the decoded floats and x of the whole step.
Here the bytes of the next step are loaded as int32 words, which the registers hold as loaded
(a uint8 tile is unpacked right after its load, which would wait for the data in the same
iteration), and are decoded only in the next iteration, after that iteration has issued the
loads of the step after it: two steps of each CTA in flight for 5 registers a row.

Layout: a step is one 256-value block of each of the program's R rows. Lane l (of 32) holds
quant word l of each block (bytes 16 + 4l .. 16 + 4l + 3): with c = l // 8 and j = l % 8 its
low nibbles are values 64c + 4j + t and its high nibbles values 64c + 32 + 4j + t (t = 0..3),
of sub-blocks 2c and 2c + 1. Per lane and row a step adds

    d (sc_lo · Σ_t q_lo,t x + sc_hi · Σ_t q_hi,t x) - dmin (mn_lo Σ_t x_lo + mn_hi Σ_t x_hi)

(q put into the mantissa of f = 1 + q / 16, so Σ q x = 16 (Σ f x - Σ x)); the lanes' sums are
reduced across the warp once, after the last block. Every lane reads the block's 16-byte header
(one broadcast line) and decodes its two sub-blocks' 6-bit scales from it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.gpu.bits import f16_bits
from strata.kernels.gpu.moe import _computed, _record_part
from strata.kernels.gpu.tiles_kquants import _scale_min as _scale_min_bytes
from strata.quant import QType, row_nbytes

_QK, _QB = 256, 144  # values and bytes of a Q4_K block


@triton.jit
def _load_block(rows, b, lane):
    """The raw int32 words of block b of the rows ([1, R] byte pointers), each [32, R]: quant
    word `lane` ([32, 1]), and the header words d | dmin, scale bytes 0-3, 4-7, 8-11 (the same
    for every lane: one broadcast line). Lanes are the first dim: Triton 3.6 orders dims of
    equal contiguity by index, so the header loads (contiguous in neither) keep the lanes across
    the threads as the quant words (contiguous along the lanes) do, and no layout conversion
    runs between them."""
    base = (rows + b * 144).to(tl.pointer_type(tl.int32))  # [1, R]
    zero = lane * 0
    return (tl.load(base + 4 + lane), tl.load(base + zero), tl.load(base + 1 + zero),
            tl.load(base + 2 + zero), tl.load(base + 3 + zero))


@triton.jit
def _nib(q, SHIFT: tl.constexpr):
    """1 + (4-bit field of q at SHIFT) / 16, exactly, as float32 (q put into the mantissa)."""
    return ((((q >> SHIFT) & 15) << 19) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _scale_min(h1, h2, h3, i):
    """6-bit (scale, min) of sub-block i from the scale words, as float32 (the Q4_K tile's
    unpacking, tiles_kquants._scale_min, of byte i % 4 of each word)."""
    sh = 8 * (i % 4)
    sc, mn = _scale_min_bytes((h1 >> sh) & 255, (h2 >> sh) & 255, (h3 >> sh) & 255, i)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _block_dot(q, h0, h1, h2, h3, x, b, lane):
    """[32, R]: each lane's share of block b's dot with x (see the module doc)."""
    c = lane // 8  # [32, 1]
    xr = x + b * 256 + c * 64 + (lane % 8) * 4  # [32, 1]: four values apart from each other
    x0 = tl.load(xr).to(tl.float32)  # (scalar loads: a [32, 1, 4] vector load took a layout
    x1 = tl.load(xr + 1).to(tl.float32)  # of its own, converted through shared memory)
    x2 = tl.load(xr + 2).to(tl.float32)
    x3 = tl.load(xr + 3).to(tl.float32)
    y0 = tl.load(xr + 32).to(tl.float32)
    y1 = tl.load(xr + 33).to(tl.float32)
    y2 = tl.load(xr + 34).to(tl.float32)
    y3 = tl.load(xr + 35).to(tl.float32)
    xs_lo = (x0 + x1) + (x2 + x3)  # [32, 1]
    xs_hi = (y0 + y1) + (y2 + y3)
    # Σ q x = 16 (Σ f x - Σ x), f = 1 + q / 16
    dot_lo = (_nib(q, 0) * x0 + _nib(q, 8) * x1 + _nib(q, 16) * x2 + _nib(q, 24) * x3
              - xs_lo) * 16.0  # [32, R]
    dot_hi = (_nib(q, 4) * y0 + _nib(q, 12) * y1 + _nib(q, 20) * y2 + _nib(q, 28) * y3
              - xs_hi) * 16.0
    sc_lo, mn_lo = _scale_min(h1, h2, h3, 2 * c)
    sc_hi, mn_hi = _scale_min(h1, h2, h3, 2 * c + 1)
    return (f16_bits(h0) * (sc_lo * dot_lo + sc_hi * dot_hi)
            - f16_bits(h0 >> 16) * (mn_lo * xs_lo + mn_hi * xs_hi))


@triton.jit
def rows_dot(ra, rb, x, nb, TWO: tl.constexpr, AHEAD: tl.constexpr):
    """(Σ_k x[k] · A[r, k], the same for B) [R] each, for the Q4_K rows at byte pointers ra and
    rb ([1, R]) of nb blocks; with TWO False only A (B's sums are A's). Both matrices in one
    loop, so their blocks are in flight together; with AHEAD the next block's words are loaded
    before the current one's dot."""
    lane = tl.arange(0, 32)[:, None]
    acc_a = tl.zeros((32, ra.shape[1]), tl.float32)
    acc_b = acc_a
    if AHEAD:
        qa, a0, a1, a2, a3 = _load_block(ra, 0, lane)
        if TWO:
            qb, b0, b1, b2, b3 = _load_block(rb, 0, lane)
        for i in range(1, nb):
            # the next block's words are in flight while this one's dot runs
            nqa, na0, na1, na2, na3 = _load_block(ra, i, lane)
            if TWO:
                nqb, nb0, nb1, nb2, nb3 = _load_block(rb, i, lane)
            acc_a += _block_dot(qa, a0, a1, a2, a3, x, i - 1, lane)
            qa, a0, a1, a2, a3 = nqa, na0, na1, na2, na3
            if TWO:
                acc_b += _block_dot(qb, b0, b1, b2, b3, x, i - 1, lane)
                qb, b0, b1, b2, b3 = nqb, nb0, nb1, nb2, nb3
        acc_a += _block_dot(qa, a0, a1, a2, a3, x, nb - 1, lane)
        if TWO:
            acc_b += _block_dot(qb, b0, b1, b2, b3, x, nb - 1, lane)
    else:
        for i in range(0, nb):
            qa, a0, a1, a2, a3 = _load_block(ra, i, lane)
            if TWO:
                qb, b0, b1, b2, b3 = _load_block(rb, i, lane)
            acc_a += _block_dot(qa, a0, a1, a2, a3, x, i, lane)
            if TWO:
                acc_b += _block_dot(qb, b0, b1, b2, b3, x, i, lane)
    sa = tl.sum(acc_a, axis=0)
    sb = sa
    if TWO:
        sb = tl.sum(acc_b, axis=0)
    return sa, sb


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_ahead_kernel(x, w, y, N, K, row_bytes, R: tl.constexpr, AHEAD: tl.constexpr):
    # y[n] = Σ_k x[k] · W[n, k] for R rows n a program, one Q4_K block of each a step
    n = tl.program_id(0) * R + tl.arange(0, R)
    rows = (w + tl.minimum(n, N - 1).to(tl.int64) * row_bytes)[None, :]  # [1, R]
    s, _ = rows_dot(rows, rows, x, K // 256, False, AHEAD)
    tl.store(y + n, s, mask=n < N)


def gemv_ahead(x: torch.Tensor, w: torch.Tensor, tile: tuple[int, bool, int] = (16, True, 4),
               out: torch.Tensor | None = None) -> torch.Tensor:
    """y [1, N] f32 = x W^T for one token and Q4_K rows (K a multiple of 256); tile = (R rows
    a program, a power of two; the next block loaded ahead; warps)."""
    k = x.shape[-1]
    n = w.shape[0]
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(1) != 1 or x.dtype not in (
            torch.float32, torch.bfloat16):
        raise ValueError(f"gemv_ahead: x must be f32/bf16 [1, K], contiguous, got {x.dtype} "
                         f"{tuple(x.shape)}")
    if k % _QK or w.dtype != torch.uint8 or w.dim() != 2 or \
            w.shape[1] != row_nbytes(QType.Q4_K, k) or w.stride(1) != 1 or \
            w.stride(0) != w.shape[1] or w.device != x.device or w.data_ptr() % 4:
        raise ValueError(f"gemv_ahead: Q4_K rows of K = {k} (a multiple of 256), 4-byte "
                         f"aligned, on x's device: "
                         f"uint8 [N, {row_nbytes(QType.Q4_K, k) if k % _QK == 0 else '?'}], "
                         f"got {w.dtype} {tuple(w.shape)}")
    r, ahead, warps = tile
    if r < 1 or r & (r - 1):
        raise ValueError(f"gemv_ahead: R must be a power of two, got {r}")
    if out is None:
        out = torch.empty(1, n, dtype=torch.float32, device=x.device)
    elif out.shape != (1, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be float32 [1, {n}], contiguous")
    if n:
        _gemv_ahead_kernel[(triton.cdiv(n, r),)](x, w, out, n, k, w.shape[1], R=r,
                                                 AHEAD=bool(ahead), num_warps=warps)
    return out


# ---- the decode MoE kernels in this form (moe.DECODE_TUNE "gate_up_ahead" / "down_ahead") ----


@triton.jit
def _pair_rows(slots, slot, stride_s, miss_rows, stride_m, p, n, N, row_bytes,
               MISS: tl.constexpr):
    """[1, R] byte pointers to rows n (clamped to N - 1) of pair p's part of its record."""
    base = _record_part(slots, slot, stride_s, miss_rows, p, stride_m, MISS)
    return (base + tl.minimum(n, N - 1).to(tl.int64) * row_bytes)[None, :]


@triton.jit(do_not_specialize=["D", "F"])
def _gate_up_ahead_kernel(x, ids, wts, slot_of, gate, up, h, mg, mu, D, F, stride_x, stride_gs,
                          stride_us, stride_ms, row_bytes, TOPK: tl.constexpr, R: tl.constexpr,
                          AHEAD: tl.constexpr, MISS: tl.constexpr, HOST_FROM: tl.constexpr):
    # as moe._gate_up_pairs_kernel, for Q4_K gate and up: R rows of both a program
    p = tl.program_id(1)
    n = tl.program_id(0) * R + tl.arange(0, R)
    slot = tl.load(slot_of + tl.load(ids + p))
    hv = tl.zeros((R,), tl.float32)
    if _computed(slot, p, MISS, TOPK, HOST_FROM):
        xr = x + (p // TOPK).to(tl.int64) * stride_x
        g, u = rows_dot(_pair_rows(gate, slot, stride_gs, mg, stride_ms, p, n, F, row_bytes,
                                   MISS),
                        _pair_rows(up, slot, stride_us, mu, stride_ms, p, n, F, row_bytes,
                                   MISS), xr, D // 256, True, AHEAD)
        hv = g / (1.0 + tl.exp(-g)) * u * tl.load(wts + p).to(tl.float32)
    tl.store(h + p.to(tl.int64) * F + n, hv, mask=n < F)


@triton.jit(do_not_specialize=["D", "F"])
def _down_ahead_kernel(h, ids, slot_of, down, part, md, D, F, stride_ds, stride_ms, row_bytes,
                       TOPK: tl.constexpr, R: tl.constexpr, AHEAD: tl.constexpr,
                       MISS: tl.constexpr, HOST_FROM: tl.constexpr):
    # as moe._down_pairs_kernel, for a Q4_K down: R rows a program
    p = tl.program_id(1)
    n = tl.program_id(0) * R + tl.arange(0, R)
    slot = tl.load(slot_of + tl.load(ids + p))
    total = tl.zeros((R,), tl.float32)
    if _computed(slot, p, MISS, TOPK, HOST_FROM):
        rows = _pair_rows(down, slot, stride_ds, md, stride_ms, p, n, D, row_bytes, MISS)
        total, _ = rows_dot(rows, rows, h + p.to(tl.int64) * F, F // 256, False, AHEAD)
    tl.store(part + p.to(tl.int64) * D + n, total, mask=n < D)
