"""Activations rounded to 8 bits and Q4_K / Q6_K / IQ2_XS / IQ3_XXS weights multiplied four
values at a time by the integer dot-product instruction (dp4a), as ggml's q8 activations are:
the one-token GEMVs
and the decode MoE kernels of `--kernels fused` (moe_forward(..., x8=True), QuantTensor.x8).

    quantize_x(x)       x [..., K] -> (xq int8 [..., K], dx [..., K/32], xs4 [..., K/64, 4]):
                        per 32 values dx = max|x| / 127, xq = round(x (127 / max|x|)), the
                        divisions rounded to nearest; xs4 the (dx, sx) of two blocks side by
                        side, sx = dx Σ xq
    spread_dot          Q4_K rows · x̂: a row's blocks spread across the threads, R rows a
                        thread sharing x's words (docs/kernels.md: 63% of HBM copy)
    q6k_spread_dot      the same for Q6_K rows (words of 210-byte blocks, 2-byte aligned)
    q6k_run_dot         Q6_K rows of K % 2048 == 0: a thread walks runs of 8 blocks, its pieces
                        read as aligned 16-byte words (gemv_x8's Q6_K form where it fits)
    iq2xs_spread_dot    the same for IQ2_XS rows (grid codes and signs gathered as PRMT
                        selectors) and IQ3_XXS rows (grid rows as bytes, signs as byte masks)
    iq3xxs_spread_dot
    iq_run_dot          q6k_run_dot's form for IQ2_XS / IQ3_XXS rows (gemv_iq_run; not yet
                        timed, not used by the engine)
    gemv_q4k_spread(xq, xs4, w, N, K), gemv_q6k_spread(xq, dx, w, N, K), gemv_q6k_run(...),
    gemv_iq_spread(xq, dx, w, N, K, qtype), gemv_iq_run(...) -> y [N] f32
    gemv_x8(x, w, qtype)   quantize_x, then the type's GEMV with its tuned tile

For a Q4_K sub-block i (32 values, 6-bit scale sc and min mn, super-block d and dmin) of a row,
w = d sc q - dmin mn with q the nibbles, so Σ w x̂ = d sc dx Σ q xq - dmin mn sx; for a Q6_K
16-value sub-block, Σ w x̂ = d sc dx Σ (q - 32) xq. The int8 sums stay int32 until the scales
apply. The result equals the float32 product of the dequantized weights with x̂ = dx * xq up to
float rounding (reference.round8 rounds the same way); against x itself it differs by the
rounding of x to 8 bits (~1e-2 relative).
"""
from __future__ import annotations

import gguf.quants as gq
import numpy as np
import torch
import triton
import triton.language as tl

from strata.kernels.gpu.bits import ASM, e8m0_half, f16_bits, i2f
from strata.kernels.gpu.pairs import bias_row, glu, pair_computed, record_part, words_aligned
from strata.kernels.gpu.tiles_kquants import scale_min
from strata.kernels.tuning import GEMV_X8_RUN, GEMV_X8_TILE
from strata.quant import QType, grids, row_nbytes
from strata.quant.base import device_table


@triton.jit
def _dp4a(a, b, c, SIGNED_A: tl.constexpr = False):
    """c + Σ_k byte_k(a) * sbyte_k(b), int32: b's bytes signed, a's unsigned (SIGNED_A: signed)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            asm="dp4a.s32.s32 $0, $1, $2, $3;" if SIGNED_A else "dp4a.u32.s32 $0, $1, $2, $3;",
            constraints="=r,r,r,r", args=[a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = c
        for k in tl.static_range(4):
            ua = (a >> (8 * k)) & 0xFF
            sb = (b >> (8 * k)) & 0xFF
            if SIGNED_A:
                ua = ua - ((ua & 0x80) << 1)
            out += ua * (sb - ((sb & 0x80) << 1))
    return out


@triton.jit
def _quantize_kernel(x, xq, dx, xs4, NB, G: tl.constexpr):
    # G blocks of 32 per program: dx = amax / 127, xq = round(x (127 / amax)); xs4 holds (dx,
    # dx, sx, sx) of blocks 2g and 2g + 1 side by side, sx = dx Σ xq (the spread kernels' one
    # load)
    blk = tl.program_id(0) * G + tl.arange(0, G)[:, None]  # [G, 1]
    v = tl.load(x + blk * 32 + tl.arange(0, 32)[None, :], mask=blk < NB,
                other=0.0).to(tl.float32)  # [G, 32]
    amax = tl.max(tl.abs(v), axis=1)  # [G]
    # (divisions rounded to nearest, as reference.round8's: CUDA's default is approximate, and
    # a quotient an ulp off moves a value at a half to the other side)
    d = tl.math.div_rn(amax, amax * 0 + 127.0)
    inv = tl.where(amax > 0, tl.math.div_rn(amax * 0 + 127.0, amax), 0.0)
    t = v * inv[:, None]
    if ASM:
        q = tl.extra.cuda.libdevice.rint(t)  # (round half to even)
    else:  # the same: halves to the even neighbour (floor(t + 0.5) alone rounds them up)
        q = tl.floor(t + 0.5)
        q = tl.where((q - t == 0.5) & ((q.to(tl.int32) & 1) == 1), q - 1.0, q)
    qi = q.to(tl.int32)
    tl.store(xq + blk * 32 + tl.arange(0, 32)[None, :], qi.to(tl.int8), mask=blk < NB)
    b1 = tl.program_id(0) * G + tl.arange(0, G)
    tl.store(dx + b1, d, mask=b1 < NB)
    tl.store(xs4 + (b1 // 2) * 4 + b1 % 2, d, mask=b1 < NB)
    tl.store(xs4 + (b1 // 2) * 4 + 2 + b1 % 2, d * tl.sum(qi, axis=1).to(tl.float32),
             mask=b1 < NB)


@triton.jit
def _pick(t, W: tl.constexpr):
    """[BB, 4, R]: element (0, W) of each thread's [2, 4] words of t [BB, 4, 2, R, 4] (a
    register: the select folds away once the tile is unrolled)."""
    hf = tl.arange(0, 2)[None, None, :, None, None]
    w4 = tl.arange(0, 4)[None, None, None, None, :]
    return tl.sum(tl.sum(tl.where((hf == 0) & (w4 == W), t, 0), axis=4), axis=2)


@triton.jit
def _row_offsets(n, N, row_bytes):
    """Byte offsets [R] (int64) of rows n ([R], clamped to N - 1: a program's rows past the
    last read the last row, their results masked at the store)."""
    return tl.minimum(n, N - 1).to(tl.int64) * row_bytes


@triton.jit
def spread_rows(base, n, N, row_bytes):
    """int32 pointers [1, 1, 1, R, 1] to rows n ([R], clamped to N - 1) from byte pointer base."""
    r = _row_offsets(n, N, row_bytes)[None, None, None, :, None]
    return (base + r).to(tl.pointer_type(tl.int32))


@triton.jit
def spread_dot(ra, rb, xw, xs, nb, TWO: tl.constexpr, BB: tl.constexpr, CG: tl.constexpr):
    """(Σ_k x̂[k] · A[r, k], the same for B) [R] each, for the Q4_K rows at int32 pointers ra
    and rb ([1, 1, 1, R, 1]: spread_rows) of nb blocks, and x̂ as quantize_x gives it (xw: its
    int8 values as int32 words, xs: its xs4); with TWO False only A (B's sums are A's).

    The threads spread over BB blocks x 4 sub-block pairs; a thread holds a pair's 8 quant
    words of each row (low nibbles: values 64c + 4v + t of sub-block 2c, high: 64c + 32 + 4v + t
    of 2c + 1), x's words for them once, and sums their dp4a's in int32. Dims (block, pair,
    half, row, word): Triton 3.6 orders dims of equal contiguity by index, so the lanes go to
    blocks and pairs, and halves and rows stay in each thread. CG: weight words read with
    ld.global.cg (cached in L2 only)."""
    R: tl.constexpr = ra.shape[3]
    bb = tl.arange(0, BB)[:, None, None, None, None]  # [BB, 1, 1, 1, 1]
    c = tl.arange(0, 4)[None, :, None, None, None]
    hf = tl.arange(0, 2)[None, None, :, None, None]
    w4 = tl.arange(0, 4)[None, None, None, None, :]
    v = hf * 4 + w4  # the word of the pair, 0..7
    c3 = tl.arange(0, 4)[None, :, None]  # [1, 4, 1]
    zero = tl.zeros((BB, 4, 2, R, 4), tl.int32)
    acc_a = tl.zeros((BB, 4, R), tl.float32)
    acc_b = acc_a
    for b0 in range(0, nb, BB):
        b = b0 + bb
        m = b < nb
        xlo, xhi, dxl, dxh, sxl, sxh = spread_x(xw, xs, b, m, c, v, w4, hf)
        acc_a += _spread_block(ra + b * 36, m, c, v, w4, hf, c3, xlo, xhi, dxl, dxh, sxl, sxh,
                               zero, CG)
        if TWO:
            acc_b += _spread_block(rb + b * 36, m, c, v, w4, hf, c3, xlo, xhi, dxl, dxh, sxl,
                                   sxh, zero, CG)
    sa = tl.sum(tl.sum(acc_a, axis=1), axis=0)
    sb = sa
    if TWO:
        sb = tl.sum(tl.sum(acc_b, axis=1), axis=0)
    return sa, sb


@triton.jit
def spread_x(xw, xs, b, m, c, v, w4, hf):
    """x̂'s part for blocks b ([BB, 1, 1, 1, 1], mask m) in spread_dot's layout: its words for
    each thread's low and high nibbles [BB, 4, 2, 1, 4], and the (dx, sx) of the pair's two
    sub-blocks [BB, 4, 1] each."""
    xlo = tl.load(xw + b * 64 + c * 16 + v, mask=m, other=0)  # [BB, 4, 2, 1, 4]
    xhi = tl.load(xw + b * 64 + c * 16 + 8 + v, mask=m, other=0)
    xq = tl.load(xs + (b * 4 + c) * 4 + w4, mask=m & (hf == 0), other=0.0)
    return xlo, xhi, _pick(xq, 0), _pick(xq, 1), _pick(xq, 2), _pick(xq, 3)


@triton.jit
def q4k_weights(blk, m, c, v, w4, hf, c3, CG: tl.constexpr):
    """A Q4_K block's part (int32 pointers blk) in spread_dot's layout: the thread's quant words
    [BB, 4, 2, R, 4], then d, dmin and the pair's two 6-bit scales and mins as float32 [BB, 4,
    R] (what does not depend on x: a kernel taking several x̂ against the same rows keeps it)."""
    if CG:
        qs = tl.load(blk + 4 + c * 8 + v, mask=m, other=0, cache_modifier=".cg")
        hd = tl.load(blk + w4 + c * 0, mask=m & (hf == 0), other=0, cache_modifier=".cg")
    else:
        qs = tl.load(blk + 4 + c * 8 + v, mask=m, other=0)  # [BB, 4, 2, R, 4]
        hd = tl.load(blk + w4 + c * 0, mask=m & (hf == 0), other=0)  # the header's words
    h0 = _pick(hd, 0)
    h1 = _pick(hd, 1)
    h2 = _pick(hd, 2)
    h3 = _pick(hd, 3)
    sh = 16 * (c3 % 2)  # byte 2c % 4 of the scale words (sub-block 2c), then 2c + 1
    sc_lo, mn_lo = scale_min((h1 >> sh) & 255, (h2 >> sh) & 255, (h3 >> sh) & 255, 2 * c3)
    sc_hi, mn_hi = scale_min((h1 >> (sh + 8)) & 255, (h2 >> (sh + 8)) & 255,
                              (h3 >> (sh + 8)) & 255, 2 * c3 + 1)
    return (qs, f16_bits(h0), f16_bits(h0 >> 16), i2f(sc_lo, 0.0), i2f(sc_hi, 0.0),
            i2f(mn_lo, 0.0), i2f(mn_hi, 0.0))


@triton.jit
def q4k_dot(qs, d, dmin, sc_lo, sc_hi, mn_lo, mn_hi, xlo, xhi, dxl, dxh, sxl, sxh, zero):
    """[BB, 4, R]: q4k_weights' part of a block dotted with spread_x's part of x̂."""
    ilo = tl.sum(tl.sum(_dp4a(qs & 0x0F0F0F0F, xlo, zero), axis=4), axis=2)  # [BB, 4, R]
    ihi = tl.sum(tl.sum(_dp4a((qs >> 4) & 0x0F0F0F0F, xhi, zero), axis=4), axis=2)
    return (d * (sc_lo * dxl * _i2f_signed(ilo) + sc_hi * dxh * _i2f_signed(ihi))
            - dmin * (mn_lo * sxl + mn_hi * sxh))


@triton.jit
def _spread_block(blk, m, c, v, w4, hf, c3, xlo, xhi, dxl, dxh, sxl, sxh, zero,
                  CG: tl.constexpr):
    """[BB, 4, R]: each thread's pair of its block (int32 pointers blk) dotted with x̂."""
    qs, d, dmin, sc_lo, sc_hi, mn_lo, mn_hi = q4k_weights(blk, m, c, v, w4, hf, c3, CG)
    return q4k_dot(qs, d, dmin, sc_lo, sc_hi, mn_lo, mn_hi, xlo, xhi, dxl, dxh, sxl, sxh, zero)


@triton.jit
def spread_layout(BB: tl.constexpr, R: tl.constexpr):
    """spread_dot's index tensors for one step of BB blocks from block 0: (b, c, hf, w4, v,
    c3, zero) (block, pair, half, word, the pair's word, the pair as [1, 4, 1], int32 zeros
    [BB, 4, 2, R, 4])."""
    b = tl.arange(0, BB)[:, None, None, None, None]
    c = tl.arange(0, 4)[None, :, None, None, None]
    hf = tl.arange(0, 2)[None, None, :, None, None]
    w4 = tl.arange(0, 4)[None, None, None, None, :]
    return b, c, hf, w4, hf * 4 + w4, tl.arange(0, 4)[None, :, None], \
        tl.zeros((BB, 4, 2, R, 4), tl.int32)


@triton.jit
def held_q4k_dot(wq, xp, zero):
    """[R]: Q4_K rows held as q4k_weights gives them (one step of blocks: the whole row) dotted
    with x̂'s part as spread_x gives it for those blocks."""
    return tl.sum(tl.sum(q4k_dot(wq[0], wq[1], wq[2], wq[3], wq[4], wq[5], wq[6], xp[0], xp[1],
                                 xp[2], xp[3], xp[4], xp[5], zero), axis=1), axis=0)


@triton.jit
def q6k_layout(BB: tl.constexpr, R: tl.constexpr):
    """q6k_spread_dot's index tensors for one step of BB blocks from block 0: (b, h, q, i, zero,
    ones) (block, half, quarter, word; int32 zeros and 0x01010101 [BB, 2, 2, R, 4])."""
    zero = tl.zeros((BB, 2, 2, R, 4), tl.int32)
    return (tl.arange(0, BB)[:, None, None, None, None], tl.arange(0, 2)[None, :, None, None, None],
            tl.arange(0, 2)[None, None, :, None, None], tl.arange(0, 4)[None, None, None, None, :],
            zero, zero + 0x01010101)


@triton.jit
def held_q6k_dot(wq, xw, dx, b, m, h, q, i, zero, ones):
    """[R]: Q6_K rows held as q6k_weights gives them (one step of blocks b, mask m: the whole
    row) dotted with x̂ (xw its int8 words, dx its per-32 scales)."""
    acc = q6k_dot(tl.zeros(zero.shape, tl.float32), wq[0], wq[1], wq[2], wq[3], wq[4], wq[5],
                  wq[6], wq[7], xw, dx, b, m, h, q, i, zero, ones)
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=2), axis=1), axis=0)


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_q4k_spread_kernel(xq, xs4, w, y, N, K, row_bytes, R: tl.constexpr, BB: tl.constexpr,
                            CG: tl.constexpr):
    # y[n] = Σ_k W[n, k] x̂[k] for R rows n a program (spread_dot)
    n = tl.program_id(0) * R + tl.arange(0, R)
    rows = spread_rows(w, n, N, row_bytes)
    s, _ = spread_dot(rows, rows, xq.to(tl.pointer_type(tl.int32)), xs4, K // 256, False, BB, CG)
    tl.store(y + n, s, mask=n < N)


@triton.jit
def _u32_at(wbase, o, i, m):
    """[..., 4]: the little-endian u32 at bytes o + 4i (o even, int64; wbase int32 words at a
    4-aligned address): one aligned word, or where o is 2 mod 4 the halves of two."""
    w0 = tl.load(wbase + (o >> 2) + i, mask=m, other=0)
    w1 = tl.load(wbase + (o >> 2) + i + 1, mask=m, other=0)
    return tl.where((o & 2) == 0, w0, ((w0 >> 16) & 0xFFFF) | (w1 << 16))


@triton.jit
def _q6k_quants(qa, qb, qh, j: tl.constexpr):
    """The 6-bit values (as bytes) of group j (0..3) of a Q6_K half's words: the low nibbles of
    qa (j even) or qb (j odd), their high nibbles for j >= 2, and bits 2j, 2j + 1 of each qh
    byte moved to bits 4, 5."""
    lo = qa if j % 2 == 0 else qb
    if j >= 2:
        lo = lo >> 4
    if j < 2:
        hi = qh << (4 - 2 * j)
    else:
        hi = qh >> (2 * j - 4)
    return (lo & 0x0F0F0F0F) | (hi & 0x30303030)


@triton.jit
def q6k_spread_dot(wbase, ro, xw, dx, nb, BB: tl.constexpr):
    """Σ_k x̂[k] · W[r, k] [R] for Q6_K rows at byte offsets ro ([1, 1, 1, R, 1], int64) from
    wbase (int32 words, 4-aligned) of nb blocks, and x̂ as quantize_x gives it (xw: its int8
    values as int32 words, dx: its per-32 scales).

    Q6_K blocks are 210 bytes, so a row's words are only 2-byte aligned: each is read as one
    aligned word or the halves of two (_u32_at). The threads spread over BB blocks x 2 halves x
    2 quarters; a thread reads, per row, 4 words at each of ql + 64h + 16q, ql + 64h + 32 + 16q
    and qh + 32h + 16q, which hold the 6-bit values of the 16-value sub-blocks 8h + 2j + q
    (positions 128h + 32j + 16q + 4i + t, j = 0..3): one dp4a per 4 values with x̂, less 32 Σ xq
    (a dp4a with ones), times the sub-block's int8 scale, in int32; then d dx per j. (Summing
    a sub-block's 4 words in int32 first cut the MoE down kernel's step from 894 to 615
    instructions but put shared-memory loads and barriers in it: its 30B-A3B layer took 26.1 us
    against 24.9, runs 114, 106.)"""
    R: tl.constexpr = ro.shape[3]
    bb = tl.arange(0, BB)[:, None, None, None, None]  # [BB, 1, 1, 1, 1]
    h = tl.arange(0, 2)[None, :, None, None, None]
    q = tl.arange(0, 2)[None, None, :, None, None]
    i = tl.arange(0, 4)[None, None, None, None, :]
    zero = tl.zeros((BB, 2, 2, R, 4), tl.int32)
    ones = zero + 0x01010101
    acc = tl.zeros((BB, 2, 2, R, 4), tl.float32)
    for b0 in range(0, nb, BB):
        b = b0 + bb
        m = b < nb
        qa, qb, qh, d, s0, s1, s2, s3 = q6k_weights(wbase, ro + b * 210, m, h, q, i)
        acc = q6k_dot(acc, qa, qb, qh, d, s0, s1, s2, s3, xw, dx, b, m, h, q, i, zero, ones)
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=2), axis=1), axis=0)


@triton.jit
def q6k_weights(wbase, o, m, h, q, i):
    """A Q6_K block's part in q6k_spread_dot's layout (o [BB, 1, 1, R, 1]: the block's byte
    offset in each row): the thread's words of ql (two) and qh [BB, 2, 2, R, 4], d [BB, 1, 1,
    R, 1] and the int8 scales of its four sub-blocks [BB, 2, 2, R, 1] (what does not depend on
    x)."""
    qa = _u32_at(wbase, o + 64 * h + 16 * q, i, m)  # [BB, 2, 2, R, 4]
    qb = _u32_at(wbase, o + 64 * h + 32 + 16 * q, i, m)
    qh = _u32_at(wbase, o + 128 + 32 * h + 16 * q, i, m)
    hd = o + 208 + 0 * (h + q + i)  # d, the same for every word of the block
    d = tl.load((wbase.to(tl.pointer_type(tl.int8)) + hd).to(tl.pointer_type(tl.int16)),
                mask=m, other=0).to(tl.float16, bitcast=True).to(tl.float32)
    b8 = wbase.to(tl.pointer_type(tl.int8)) + o + 192 + 8 * h + q  # the 16 values' scales
    return (qa, qb, qh, d, tl.load(b8, mask=m, other=0).to(tl.int32),
            tl.load(b8 + 2, mask=m, other=0).to(tl.int32),
            tl.load(b8 + 4, mask=m, other=0).to(tl.int32),
            tl.load(b8 + 6, mask=m, other=0).to(tl.int32))


@triton.jit
def q6k_dot(acc, qa, qb, qh, d, s0, s1, s2, s3, xw, dx, b, m, h, q, i, zero, ones):
    """acc [BB, 2, 2, R, 4] plus q6k_weights' part of blocks b (mask m) dotted with x̂'s."""
    for j in tl.static_range(4):
        qj = _q6k_quants(qa, qb, qh, j)
        xj = tl.load(xw + b * 64 + 32 * h + 8 * j + 4 * q + i, mask=m, other=0)
        dot = _dp4a(qj, xj, zero) - 32 * _dp4a(ones, xj, zero)  # Σ (q - 32) xq
        sc = s0 if j == 0 else (s1 if j == 1 else (s2 if j == 2 else s3))
        dxj = tl.load(dx + b * 8 + 4 * h + j + 0 * (q + i), mask=m, other=0.0)
        acc += (d * dxj) * _i2f_signed(sc * dot)
    return acc


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_q6k_spread_kernel(xq, dx, w, y, N, K, row_bytes, R: tl.constexpr, BB: tl.constexpr):
    # y[n] = Σ_k W[n, k] x̂[k] for R rows n a program of Q6_K (q6k_spread_dot)
    n = tl.program_id(0) * R + tl.arange(0, R)
    ro = _row_offsets(n, N, row_bytes)[None, None, None, :, None]
    s = q6k_spread_dot(w.to(tl.pointer_type(tl.int32)), ro, xq.to(tl.pointer_type(tl.int32)), dx,
                       K // 256, BB)
    tl.store(y + n, s, mask=n < N)


@triton.jit
def _col(t, c: tl.constexpr):
    """[RL, P]: word c of each thread's 4 words of t [RL, P, 4]."""
    i = tl.arange(0, 4)[None, None, :]
    return tl.sum(tl.where(i == c, t, 0), axis=2)


@triton.jit
def _piece(wp, ob, k: tl.constexpr, m):
    """[RL, P, 4]: the 16 bytes at byte ob + 2k (ob [RL, P, 1] int64, 16-aligned; k the block
    in the run) as 4 words: the 32-byte aligned window's words k // 2 .. k // 2 + 4, halves
    joined where k is odd."""
    i = tl.arange(0, 4)[None, None, :]
    base = ob >> 2
    lo = tl.load(wp + base + i, mask=m, other=0)
    if k == 0:
        out = lo
    else:
        hi = tl.load(wp + base + 4 + i, mask=m, other=0)
        out = lo * 0
        for c in tl.static_range(4):
            a = c + k // 2
            wa = _col(lo, a) if a < 4 else _col(hi, a - 4)
            if k % 2 == 1:
                b = a + 1
                wb = _col(lo, b) if b < 4 else _col(hi, b - 4)
                wa = _prmt(wa, wb, 0x5432)
            out = tl.where(i == c, wa[:, :, None], out)
    return out


@triton.jit
def _run_block(r0, s, k: tl.constexpr, nb, EVEN: tl.constexpr):
    """(rb3, b, b3, m, m3) of block k of each thread's run, run s ([1, P]) of those from block
    r0 on: the run's first block [1, P, 1], the block, as [1, P, 1], whether it is in the row,
    as [1, P, 4]; EVEN (nb a multiple of 8 S: every run in the row): masks true when built, so
    the loads are unmasked."""
    i = tl.arange(0, 4)[None, None, :]
    rb = r0 + 8 * s
    b = rb + k
    m = _in_row(b, nb, EVEN)
    if EVEN:
        m3 = tl.full((b.shape[0], b.shape[1], 4), True, tl.int1)
    else:
        m3 = m[:, :, None] & (i >= 0)
    return rb[:, :, None], b, b[:, :, None], m, m3


@triton.jit
def q6k_run_dot(wp, ro, xw, dx, nb, S: tl.constexpr, EVEN: tl.constexpr = False):
    """Σ_k x̂[k] W[r, k] [RL] for Q6_K rows at byte offsets ro ([RL], int64, 16-aligned) from wp
    (int32 words, 16-aligned) of nb blocks (a multiple of 8), x̂ as for q6k_spread_dot.

    The lanes spread over RL rows x S runs x 4 parts (h, q) of a block (q6k_spread_dot's
    pieces); a thread walks its row in runs of 8 consecutive blocks, every S-th run (S > 1
    gives a short row more threads: 14336 x 4096 has 2 runs a row). A run is 1680 bytes, so
    block k of it starts 2k bytes past a 16-byte boundary known when the kernel is built: each
    16-byte piece is read as the aligned 16-byte words around it (_piece), never as
    2-byte-aligned words two loads apiece as in q6k_spread_dot (sm_90 SASS: 0.26 loads a
    weight byte against 0.82-1.01, 3.2-3.3 instructions a weight against 5.5-6.1, 2.8 with
    every run in the row, EVEN, its loads unmasked; L1 requests,
    not instructions, bound the spread kernels Nsight Compute has measured, Q4_K's and the
    i-quants'). A block's 16 scales are one more piece, a half's 4 dx one 16-byte load (108
    loads a thread step against 149 as byte and word loads: 18.0 against 18.8 us on 14336 x
    4096, run 99); d is a 2-byte load."""
    RL: tl.constexpr = ro.shape[0]
    p = tl.arange(0, 4 * S)[None, :]  # run s = p // 4, part: h = (p // 2) % 2, q = p % 2
    h = (p // 2) % 2
    q = p % 2
    s = p // 4
    h3 = h[:, :, None]
    q3 = q[:, :, None]
    i = tl.arange(0, 4)[None, None, :]
    zero = tl.zeros((RL, 4 * S, 4), tl.int32)
    ones = zero + 0x01010101
    acc = tl.zeros((RL, 4 * S), tl.float32)
    rr = ro[:, None]  # [RL, 1]
    rr3 = rr[:, :, None]
    for r0 in range(0, nb, 8 * S):
        for k in tl.static_range(8):
            rb3, b, b3, m, m3 = _run_block(r0, s, k, nb, EVEN)
            # block k's 16-aligned window (+ 2k)
            ob = tl.multiple_of(rr3 + rb3 * 210 + 208 * k, [16, 16, 16])
            qa = _piece(wp, ob + 64 * h3 + 16 * q3, k, m3)
            qb = _piece(wp, ob + 64 * h3 + 32 + 16 * q3, k, m3)
            qh = _piece(wp, ob + 128 + 32 * h3 + 16 * q3, k, m3)
            o = rr + b * 210  # the block's bytes
            bp = wp.to(tl.pointer_type(tl.int8)) + o
            d = tl.load(bp.to(tl.pointer_type(tl.int16)) + 104, mask=m,
                        other=0).to(tl.float16, bitcast=True).to(tl.float32)  # [RL, 4S]
            # the 16 scales as one piece, the half's 4 dx as one 16-byte load
            scw = _piece(wp, ob + 192, k, m3)
            dxo = tl.multiple_of(b3 * 8 + 4 * h3 + 0 * rr3, [4, 4, 4])
            dxv = tl.load(dx + dxo + i, mask=m3, other=0.0)
            for j in tl.static_range(4):
                qj = _q6k_quants(qa, qb, qh, j)
                # (x's words in the rows' shape: the pieces' layout, one 16-byte load)
                xo = tl.multiple_of(b3 * 64 + 32 * h3 + 8 * j + 4 * q3 + 0 * rr3, [4, 4, 4])
                xj = tl.load(xw + xo + i, mask=m3, other=0)
                dot = tl.sum(_dp4a(qj, xj, zero) - 32 * _dp4a(ones, xj, zero), axis=2)
                # scale byte 8h + 2j + q: word 2h + j // 2, signed
                scj = tl.sum(tl.where(i == 2 * h3 + j // 2, scw, 0), axis=2)
                sc = (scj << (24 - 8 * (2 * (j % 2) + q))) >> 24
                dxj = tl.sum(tl.where(i == j, dxv, 0.0), axis=2)
                acc += (d * dxj) * _i2f_signed(sc * dot)
    return tl.sum(acc, axis=1)


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_q6k_run_kernel(xq, dx, w, y, N, K, row_bytes, RL: tl.constexpr, S: tl.constexpr,
                         EVEN: tl.constexpr = False):
    # y[n] = Σ_k W[n, k] x̂[k] for RL rows n a program of Q6_K (q6k_run_dot)
    n = tl.program_id(0) * RL + tl.arange(0, RL)
    ro = _row_offsets(n, N, row_bytes)
    s = q6k_run_dot(w.to(tl.pointer_type(tl.int32)), ro, xq.to(tl.pointer_type(tl.int32)), dx,
                    K // 256, S, EVEN)
    tl.store(y + n, s, mask=n < N)


@triton.jit
def _prmt(a, b, sel):
    """The bytes of (b, a) that sel's low four nibbles pick (0-3: a's, 4-7: b's; PTX prmt)."""
    if ASM:
        out = tl.inline_asm_elementwise(
            asm="prmt.b32 $0, $1, $2, $3;", constraints="=r,r,r,r", args=[a, b, sel],
            dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = sel * 0
        for k in tl.static_range(4):
            i = (sel >> (4 * k)) & 7
            out |= (tl.where(i < 4, a, b) >> (8 * (i & 3)) & 0xFF) << (8 * k)
    return out


# IQ2_XS's three grid values 8, 25, 43 as bytes 0-2, and negated as bytes 4-6 (PRMT's source)
IQ2_POS = tl.constexpr(0x002B1908)
IQ2_NEG = tl.constexpr(0x00D5E7F8)


@triton.jit
def _in_row(b, nb, EVEN: tl.constexpr):
    """Whether blocks b are in the row (b < nb); EVEN (every step's blocks are): true when the
    kernel is built, so the loads it masks are built unmasked (fewer instructions, and loads
    of one address merged)."""
    if EVEN:
        m = tl.full(b.shape, True, tl.int1)
    else:
        m = b < nb
    return m


@triton.jit
def _x_block_step(acc, v, bp, b, m, c, j, dx, f: tl.constexpr):
    """acc [BB, 4, R, 1, 1] + f d (dx[0] Σ_{j < 4} v + dx[1] Σ_{j >= 4} v): the IQ2_XS spread
    form's float step, one for each 32 values of x (groups 4h .. 4h + 3 of quarter c of blocks
    b take dx[h]); v [BB, 4, R, 8, 2] the words' int32 dots times their integer scales (summed
    exactly: |Σ| < 2^24), bp the blocks' bytes (d, fp16, first), m the blocks in the row.
    (Summed by masks, not by reshaping v to [.., 2, 8]: that form was exact under the
    interpreter and wrong on the H200 for IQ3_XXS at BB 1 and 2, run 113.)"""
    v0 = tl.sum(tl.sum(tl.where(j < 4, v, 0), axis=4, keep_dims=True), axis=3, keep_dims=True)
    v1 = tl.sum(tl.sum(tl.where(j < 4, 0, v), axis=4, keep_dims=True), axis=3, keep_dims=True)
    d = tl.load((bp + 0 * c).to(tl.pointer_type(tl.int16)), mask=m,
                other=0).to(tl.float16, bitcast=True).to(tl.float32)  # [BB, 4, R, 1, 1]
    dx0 = tl.load(dx + b * 8 + 2 * c, mask=m, other=0.0)  # [BB, 4, 1, 1, 1]
    dx1 = tl.load(dx + b * 8 + 2 * c + 1, mask=m, other=0.0)
    return acc + (d * f) * (dx0 * v0.to(tl.float32) + dx1 * v1.to(tl.float32))


@triton.jit
def iq2xs_spread_dot(wbase, ro, xw, dx, gsel, ssel, nb, BB: tl.constexpr,
                     EVEN: tl.constexpr = False):
    """Σ_k x̂[k] · W[r, k] [R] for IQ2_XS rows at byte offsets ro ([1, 1, R, 1, 1], int64)
    from wbase (int32 words, 4-aligned) of nb blocks, x̂ as quantize_x gives it (xw: int8 values
    as int32 words, dx: per-32 scales); gsel / ssel: iq_tables(IQ2_XS).

    74-byte blocks: d, 32 u16 (grid index 0-8, ksigns index 9-15), 8 bytes of 4-bit scales
    (one per 16 values). The threads spread over BB blocks x 4 quarters; a thread takes, per
    row, the 8 groups of 8 values of its quarter. A group's grid row is 8 codes (0-2) as
    nibbles (gsel, 2 KB) and its signs 4 in the nibbles (ssel, 512 B): their OR picks each
    signed value byte with one PRMT a word, then one signed dp4a; each word's int32 dot times
    its 16-value sub-block's 2 sc + 1, summed over each 32 values of x, takes d / 8 and dx in
    one float step (_x_block_step). (Gathering 8 value bytes and 8 sign
    masks a group instead, 4 KB + 1 KB of tables, took 28.4 us against 20.1 on 14336 x 4096:
    the gathers' L1 wavefronts bound these kernels, docs/kernels.md.)"""
    R: tl.constexpr = ro.shape[2]
    bb = tl.arange(0, BB)[:, None, None, None, None]  # [BB, 1, 1, 1, 1]
    c = tl.arange(0, 4)[None, :, None, None, None]
    j = tl.arange(0, 8)[None, None, None, :, None]  # the quarter's group
    w = tl.arange(0, 2)[None, None, None, None, :]  # the group's word (4 values)
    zero = tl.zeros((BB, 4, R, 8, 2), tl.int32)
    acc = tl.zeros((BB, 4, R, 1, 1), tl.float32)
    for b0 in range(0, nb, BB):
        b = b0 + bb
        m = _in_row(b, nb, EVEN)
        o = ro + b * 74  # [BB, 1, R, 1, 1]: the block's bytes in each row
        # group j's u16: half j % 2 of the word at o + 2 + 16c + 4 (j // 2)
        e = (_u32_at(wbase, o + 2 + 16 * c + 4 * (j // 2), 0, m) >> (16 * (j % 2))) & 0xFFFF
        sel = tl.load(gsel + (e & 511)) | tl.load(ssel + (e >> 9))  # [BB, 4, R, 8, 1]
        g = _prmt(IQ2_POS + zero, IQ2_NEG, sel >> (16 * w))  # [BB, 4, R, 8, 2]: signed bytes
        xj = tl.load(xw + b * 64 + 16 * c + 2 * j + w, mask=m, other=0)  # [BB, 4, 1, 8, 2]
        dot = _dp4a(g, xj, zero, True)
        b8 = (wbase.to(tl.pointer_type(tl.int8)) + o).to(tl.pointer_type(tl.uint8))
        sc = (tl.load(b8 + 66 + 2 * c + j // 4 + 0 * w, mask=m, other=0).to(tl.int32)
              >> (4 * ((j // 2) % 2))) & 15
        # d (sc + 0.5) / 4 = d (2 sc + 1) / 8
        acc = _x_block_step(acc, dot * (2 * sc + 1), b8, b, m, c, j, dx, 0.125)
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=1), axis=0)


@triton.jit
def _parity(v):
    """1 where v (int32, >= 0) has an odd number of bits set, else 0."""
    if ASM:
        n = tl.inline_asm_elementwise(asm="popc.b32 $0, $1;", constraints="=r,r", args=[v],
                                      dtype=tl.int32, is_pure=True, pack=1)
    else:
        n = v ^ (v >> 16)
        n = n ^ (n >> 8)
        n = n ^ (n >> 4)
        n = n ^ (n >> 2)
        n = n ^ (n >> 1)
    return n & 1


@triton.jit
def _signed(g, bits, w):
    """g (4 non-negative value bytes: word w of a group's 8) with each byte negated where the
    group's sign is: 7 ksigns bits in bits' low bits (the eighth: their parity, ggml's ksigns
    table); the word's 4 bits spread one to a byte by a multiply (t: 0x01 where negative),
    then ~byte + 1 where t is (no carry: a negated byte is 0x81 or more before the 1)."""
    s7 = bits & 127
    s8 = s7 | (_parity(s7) << 7)
    t = ((s8 >> (4 * w)) & 15) * 0x204081 & 0x01010101
    return (g ^ (t * 255)) + t


@triton.jit
def iq3xxs_spread_dot(wbase, ro, xw, dx, grid4, smask, nb, BB: tl.constexpr,
                      EVEN: tl.constexpr = False):
    """As iq2xs_spread_dot, for IQ3_XXS rows (98-byte blocks: d, 64 grid indices of 4 values,
    8 u32 of 4 x 7 ksigns bits and a 4-bit scale per 32 values, db = d (0.5 + s) / 2); grid4 /
    smask: iq_tables(IQ3_XXS) (each grid row's 4 values as bytes; the sign masks). A
    thread's group j of quarter c is group i = 8c + j of the block: grid indices qs[2i + w]
    (w = 0, 1: its two words), signs from 7 bits (7 (i % 4)) of word i // 4. Eight levels
    leave PRMT no room for their negatives (iq2xs_spread_dot's form): the signs become byte
    masks by arithmetic (_signed; no table, so no gather) and negate the grid bytes they
    mark before one signed dp4a a word, whose int32 dot takes its scale d (0.5 + s) / 2 and dx
    in a float step of its own."""
    R: tl.constexpr = ro.shape[2]
    bb = tl.arange(0, BB)[:, None, None, None, None]  # [BB, 1, 1, 1, 1]
    c = tl.arange(0, 4)[None, :, None, None, None]
    j = tl.arange(0, 8)[None, None, None, :, None]
    w = tl.arange(0, 2)[None, None, None, None, :]
    zero = tl.zeros((BB, 4, R, 8, 2), tl.int32)
    acc = tl.zeros((BB, 4, R, 8, 2), tl.float32)
    for b0 in range(0, nb, BB):
        b = b0 + bb
        m = _in_row(b, nb, EVEN)
        o = ro + b * 98  # [BB, 1, R, 1, 1]
        # index byte 16c + 2j + w of qs: byte 2 (j % 2) + w of the word at o + 2 + 16c + 4 (j // 2)
        q4 = _u32_at(wbase, o + 2 + 16 * c + 4 * (j // 2), w * 0, m)
        idx = (q4 >> (8 * (2 * (j % 2) + w))) & 255
        aux = _u32_at(wbase, o + 66 + 4 * (2 * c + j // 4), w * 0, m)  # [BB, 4, R, 8, 2]
        g = tl.load(grid4 + idx)  # 4 grid bytes
        xj = tl.load(xw + b * 64 + 16 * c + 2 * j + w, mask=m, other=0)
        dot = _dp4a(_signed(g, aux >> (7 * (j % 4)), w), xj, zero, True)
        d = tl.load((wbase.to(tl.pointer_type(tl.int8)) + o + 0 * (c + j + w))
                    .to(tl.pointer_type(tl.int16)), mask=m,
                    other=0).to(tl.float16, bitcast=True).to(tl.float32)
        dxj = tl.load(dx + b * 8 + 2 * c + j // 4 + 0 * w, mask=m, other=0.0)
        # a float step a word: summing the words' dots first (_x_block_step) crosses lanes
        # here (48 more SHFL a step in the MoE gate/up kernel at (4, 4, 1); SHFL, LDS and STS in
        # the down at (8, 1, 1)), and that layer took 30.0 us against 28.5 (runs 114, 104)
        acc += (d * (i2f((aux >> 28) & 15, 0.0) + 0.5) * 0.5 * dxj) * _i2f_signed(dot)
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=1), axis=0)


@triton.jit
def iq_spread_dot(wbase, ro, xw, dx, t0, t1, nb, IQ3: tl.constexpr, BB: tl.constexpr,
                  EVEN: tl.constexpr = False):
    """iq3xxs_spread_dot if IQ3 else iq2xs_spread_dot (t0, t1: the type's iq_tables; EVEN: nb
    a multiple of BB, the loads unmasked)."""
    if IQ3:
        s = iq3xxs_spread_dot(wbase, ro, xw, dx, t0, t1, nb, BB, EVEN)
    else:
        s = iq2xs_spread_dot(wbase, ro, xw, dx, t0, t1, nb, BB, EVEN)
    return s


@triton.jit
def _bytes16(wp, ob, off: tl.constexpr, m):
    """[RL, P, 4]: the 16 bytes at byte ob + off (ob [RL, P, 1] int64, 16-aligned; off an even
    constant) as 4 words (_piece)."""
    return _piece(wp, ob + 16 * (off // 16), (off % 16) // 2, m)


@triton.jit
def _run_x(xw, b3, c3, rr3, t: tl.constexpr, m3):
    """[RL, P, 4]: words 4t .. 4t + 3 of block b's quarter c of x̂ (64 int8 values), in the
    rows' shape (one layout with the weights' pieces)."""
    i = tl.arange(0, 4)[None, None, :]
    xo = tl.multiple_of(b3 * 64 + 16 * c3 + 4 * t + 0 * rr3, [4, 4, 4])
    return tl.load(xw + xo + i, mask=m3, other=0)


@triton.jit
def iq_run_dot(wp, ro, xw, dx, t0, t1, nb, IQ3: tl.constexpr, S: tl.constexpr,
               EVEN: tl.constexpr = False, K0: tl.constexpr = 0, K1: tl.constexpr = 8):
    """Σ_k x̂[k] W[r, k] [RL] for IQ2_XS (IQ3: IQ3_XXS) rows at byte offsets ro ([RL], int64,
    16-aligned) from wp (int32 words, 16-aligned) of nb blocks (a multiple of 8); t0, t1 the
    type's iq_tables, x̂ as for iq2xs_spread_dot.

    q6k_run_dot's form for the i-quants: the lanes spread over RL rows x S runs x 4 quarters of
    a block, a thread walks every S-th run of 8 blocks of its row (592 or 784 bytes: 16-byte
    aligned), and block k of a run starts (74 or 98) k mod 16 bytes past a boundary known when
    the kernel is built, so a quarter's 16 bytes of grid indices are one piece of aligned
    16-byte words (_piece) instead of 4-byte words two loads apiece where a block starts 2 mod
    4. Each group of 8 values as in iq2xs_spread_dot / iq3xxs_spread_dot (table gathers, PRMT
    or sign masks, signed dp4a); IQ2_XS's scales are one 2-byte load, IQ3_XXS's two words of
    scales and signs come from one more piece, two quarters' words (the second pair's ends at
    the block's end: no piece reads past a row's last block)."""
    RL: tl.constexpr = ro.shape[0]
    BS: tl.constexpr = 98 if IQ3 else 74
    p = tl.arange(0, 4 * S)[None, :]  # run s = p // 4, quarter c = p % 4
    c = p % 4
    s = p // 4
    c3 = c[:, :, None]
    i = tl.arange(0, 4)[None, None, :]
    zero = tl.zeros((RL, 4 * S), tl.int32)
    acc = tl.zeros((RL, 4 * S), tl.float32)
    rr = ro[:, None]  # [RL, 1]
    rr3 = rr[:, :, None]
    for r0 in range(0, nb, 8 * S):
        for k in tl.static_range(K0, K1):  # (blocks K0 .. K1 - 1 of each run: all by default)
            sh = (BS * k) % 16  # block k's bytes start sh past its window
            rb3, b, b3, m, m3 = _run_block(r0, s, k, nb, EVEN)
            ob = tl.multiple_of(rr3 + rb3 * BS + (BS * k - sh), [16, 16, 16])
            qs = _bytes16(wp, ob + 16 * c3, sh + 2, m3)  # the quarter's grid indices
            bp = wp.to(tl.pointer_type(tl.int8)) + rr + b * BS  # the block's bytes
            d = tl.load(bp.to(tl.pointer_type(tl.int16)), mask=m,
                        other=0).to(tl.float16, bitcast=True).to(tl.float32)  # [RL, 4S]
            dx0 = tl.load(dx + b * 8 + 2 * c + 0 * rr, mask=m, other=0.0)
            dx1 = tl.load(dx + b * 8 + 2 * c + 1 + 0 * rr, mask=m, other=0.0)
            if IQ3:  # aux words of quarters 2 (c // 2), 2 (c // 2) + 1 (bytes 66 + 16 (c // 2)..)
                aw = _bytes16(wp, ob + 16 * (c3 // 2), sh + 66, m3)
            else:  # the quarter's 4 scale nibbles, bytes 66 + 2c, 67 + 2c
                sc16 = tl.load((bp + 66 + 2 * c).to(tl.pointer_type(tl.int16)), mask=m,
                               other=0).to(tl.int32) & 0xFFFF
            for t in tl.static_range(4):  # groups 2t, 2t + 1: x's words 4t .. 4t + 3
                xt = _run_x(xw, b3, c3, rr3, t, m3)
                qw = _col(qs, t)
                if t % 2 == 0 or not IQ3:  # the int32 sum of the groups sharing a scale
                    dot = zero
                for u in tl.static_range(2):
                    j = 2 * t + u  # the quarter's group
                    if IQ3:
                        aux = tl.sum(tl.where(i == 2 * (c3 % 2) + j // 4, aw, 0), axis=2)
                        g0 = tl.load(t0 + ((qw >> (16 * u)) & 255))
                        g1 = tl.load(t0 + ((qw >> (16 * u + 8)) & 255))
                        g0 = _signed(g0, aux >> (7 * (j % 4)), 0)
                        g1 = _signed(g1, aux >> (7 * (j % 4)), 1)
                    else:
                        e = (qw >> (16 * u)) & 0xFFFF
                        sel = tl.load(t0 + (e & 511)) | tl.load(t1 + (e >> 9))
                        g0 = _prmt(IQ2_POS + zero, IQ2_NEG, sel)
                        g1 = _prmt(IQ2_POS + zero, IQ2_NEG, sel >> 16)
                    dot = _dp4a(g1, _col(xt, 2 * u + 1), _dp4a(g0, _col(xt, 2 * u), dot, True),
                                True)
                dxj = dx0 if t < 2 else dx1
                if IQ3:  # groups 4 (t // 2) .. + 3 share aux's scale (bits 28-31)
                    if t % 2 == 1:
                        db = d * (i2f((aux >> 28) & 15, 0.0) + 0.5) * 0.5
                        acc += (db * dxj) * _i2f_signed(dot)
                else:  # groups 2t, 2t + 1 share scale nibble t: (sc + 0.5) / 4 = (2 sc + 1) / 8
                    sc2 = ((sc16 >> (4 * t)) & 15) * 2 + 1
                    if t % 2 == 0:
                        isum = dot * sc2
                    else:  # the two scales of x's block j // 2 summed exactly in int32
                        isum += dot * sc2
                        acc += (d * dxj * 0.125) * isum.to(tl.float32)
    return tl.sum(acc, axis=1)


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_iq_run_kernel(xq, dx, w, y, t0, t1, N, K, row_bytes, IQ3: tl.constexpr,
                        RL: tl.constexpr, S: tl.constexpr, EVEN: tl.constexpr = False,
                        HALVES: tl.constexpr = False):
    # y[n] = Σ_k W[n, k] x̂[k] for RL rows n a program of IQ2_XS or, IQ3, IQ3_XXS (iq_run_dot);
    # HALVES: program_id(1) takes blocks 0-3 or 4-7 of each run, added into y (zeroed): two
    # addends onto 0, so the sum does not depend on their order
    n = tl.program_id(0) * RL + tl.arange(0, RL)
    ro = _row_offsets(n, N, row_bytes)
    wp, xw = w.to(tl.pointer_type(tl.int32)), xq.to(tl.pointer_type(tl.int32))
    if HALVES:
        if tl.program_id(1) == 0:
            s = iq_run_dot(wp, ro, xw, dx, t0, t1, K // 256, IQ3, S, EVEN, 0, 4)
        else:
            s = iq_run_dot(wp, ro, xw, dx, t0, t1, K // 256, IQ3, S, EVEN, 4, 8)
        tl.atomic_add(y + n, s, mask=n < N, sem="relaxed")
    else:
        s = iq_run_dot(wp, ro, xw, dx, t0, t1, K // 256, IQ3, S, EVEN)
        tl.store(y + n, s, mask=n < N)


@triton.jit
def _iq_rows(n, N, row_bytes):
    """Byte offsets [1, 1, R, 1, 1] (int64) of rows n ([R], clamped to N - 1)."""
    return _row_offsets(n, N, row_bytes)[None, None, :, None, None]


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_iq_spread_kernel(xq, dx, w, y, t0, t1, N, K, row_bytes, IQ3: tl.constexpr,
                           R: tl.constexpr, BB: tl.constexpr, EVEN: tl.constexpr = False):
    # y[n] = Σ_k W[n, k] x̂[k] for R rows n a program of IQ2_XS or, IQ3, IQ3_XXS
    n = tl.program_id(0) * R + tl.arange(0, R)
    s = iq_spread_dot(w.to(tl.pointer_type(tl.int32)), _iq_rows(n, N, row_bytes),
                      xq.to(tl.pointer_type(tl.int32)), dx, t0, t1, K // 256, IQ3, BB, EVEN)
    tl.store(y + n, s, mask=n < N)

@triton.jit
def _i2f_signed(v):
    """Exact float32 of int32 |v| < 2**22: v added to the bits of 1.5 * 2**23, less that."""
    return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] f32/bf16, contiguous (K a multiple of 64) -> (xq int8 [..., K], dx [..., K/32]
    f32, xs4 [..., K/64, 4] f32: dx and sx = dx Σ xq of 32-value blocks 2g, 2g + 1 side by
    side), each row of x on its own."""
    k = x.shape[-1]
    if k % 64 or x.dtype not in (torch.float32, torch.bfloat16) or not x.is_contiguous():
        raise ValueError(f"quantize_x: contiguous float32/bfloat16 x of rows of a multiple of "
                         f"64 values, got {x.dtype} {list(x.shape)}")
    lead = tuple(x.shape[:-1])
    nb = x.numel() // 32
    xq = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    dx = torch.empty(lead + (k // 32,), dtype=torch.float32, device=x.device)
    xs4 = torch.empty(lead + (k // 64, 4), dtype=torch.float32, device=x.device)
    g = 8
    if nb:
        _quantize_kernel[(triton.cdiv(nb, g),)](x.reshape(-1), xq, dx, xs4, nb, G=g, num_warps=2)
    return xq, dx, xs4


def _spread_args(w: torch.Tensor, n: int, k: int, qtype: QType, xq: torch.Tensor,
                 out: torch.Tensor | None, name: str, bb: int, rows: int,
                 warps: int) -> tuple[torch.Tensor, int]:
    """A spread GEMV's checks (rows [n, row_nbytes(k)] starting 4-byte aligned, x of k values,
    bb and rows powers of two) -> (out or a new float32 [n], the warps: by default bb * 4 / 32,
    at least 1)."""
    rb = row_nbytes(qtype, k) if k % 256 == 0 else -1
    if k % 256 or tuple(w.shape) != (n, rb) or w.dtype != torch.uint8 or xq.numel() != k:
        raise ValueError(f"{name}: rows [{n}, {rb}] for K = {k} (a multiple of 256) and x of "
                         f"K values, got {tuple(w.shape)} {w.dtype}, x [{xq.numel()}]")
    if bb < 1 or bb & (bb - 1) or rows < 1 or rows & (rows - 1):
        raise ValueError(f"{name}: bb and rows must be powers of two, got {bb}, {rows}")
    if w.data_ptr() % 4:
        raise ValueError(f"{name}: the rows must start 4-byte aligned (read as int32 words)")
    y = out if out is not None else torch.empty(n, dtype=torch.float32, device=w.device)
    return y, warps or max(1, bb * 4 // 32)


def gemv_q4k_spread(xq: torch.Tensor, xs4: torch.Tensor, w: torch.Tensor, n: int, k: int,
                    out: torch.Tensor | None = None, bb: int = 16, warps: int = 0, rows: int = 1,
                    cg: bool = False) -> torch.Tensor:
    """y [N] f32 = W x̂ for Q4_K rows w (4-byte aligned) and quantize_x's x̂ (xq, xs4): `rows`
    rows a program (a power of two), its threads spread over bb blocks (a power of two) x 4
    sub-block pairs; warps by default bb * 4 / 32 (at least 1); cg: weights read past L1."""
    y, warps = _spread_args(w, n, k, QType.Q4_K, xq, out, "gemv_q4k_spread", bb, rows, warps)
    if n:
        _gemv_q4k_spread_kernel[(triton.cdiv(n, rows),)](
            xq, xs4, w, y, n, k, w.stride(0), R=rows, BB=bb, CG=cg, num_warps=warps)
    return y


def gemv_q6k_spread(xq: torch.Tensor, dx: torch.Tensor, w: torch.Tensor, n: int, k: int,
                    out: torch.Tensor | None = None, bb: int = 8, warps: int = 0,
                    rows: int = 1) -> torch.Tensor:
    """y [N] f32 = W x̂ for Q6_K rows w (4-byte aligned) and quantize_x's x̂ (xq, dx): `rows`
    rows a program (a power of two), its threads spread over bb blocks (a power of two) x 2
    halves x 2 quarters; warps by default bb * 4 / 32 (at least 1)."""
    y, warps = _spread_args(w, n, k, QType.Q6_K, xq, out, "gemv_q6k_spread", bb, rows, warps)
    if n:
        _gemv_q6k_spread_kernel[(triton.cdiv(n, rows),)](
            xq, dx, w, y, n, k, w.stride(0), R=rows, BB=bb, num_warps=warps)
    return y


def gemv_q6k_run(xq: torch.Tensor, dx: torch.Tensor, w: torch.Tensor, n: int, k: int,
                 out: torch.Tensor | None = None, rows: int = 8, warps: int = 1,
                 split: int = 1) -> torch.Tensor:
    """y [N] f32 = W x̂ for Q6_K rows w and quantize_x's x̂ (xq, dx) by q6k_run_dot: K a
    multiple of 2048 (so every row starts 16-byte aligned) and w 16-byte aligned; `rows` rows a
    program, each row's runs of 8 blocks dealt to `split` threads a part (rows * split * 4
    lanes, powers of two: rows 8 or rows 4 split 2 fill one warp)."""
    y = _run_args(w, n, k, QType.Q6_K, xq, out, "gemv_q6k_run", split, rows, warps)
    if n:
        _gemv_q6k_run_kernel[(triton.cdiv(n, rows),)](xq, dx, w, y, n, k, w.stride(0), RL=rows,
                                                       S=split, EVEN=k % (2048 * split) == 0,
                                                       num_warps=warps)
    return y


def _run_args(w: torch.Tensor, n: int, k: int, qtype: QType, xq: torch.Tensor,
              out: torch.Tensor | None, name: str, split: int, rows: int,
              warps: int) -> torch.Tensor:
    """A run form's checks (_spread_args', and run_fits) -> out or a new float32 [n]."""
    y, _ = _spread_args(w, n, k, qtype, xq, out, name, split, rows, warps)
    if not run_fits(w, k):
        raise ValueError(f"{name}: K a multiple of 2048 and rows starting 16-byte aligned, got "
                         f"K = {k}, rows at {w.data_ptr() % 16} mod 16, {w.stride(0)} bytes apart")
    return y


def run_fits(w: torch.Tensor, k: int) -> bool:
    """Whether rows w of k values (Q6_K, IQ2_XS or IQ3_XXS) can take the run forms
    (gemv_q6k_run, gemv_iq_run): K a multiple of 2048 and rows starting 16-byte aligned."""
    return k % 2048 == 0 and words_aligned(w, align=16)


# ---- the decode MoE kernels in this form (moe_forward(..., x8=True)) ----


@triton.jit
def _pair(ids, slot_of, R: tl.constexpr, PM: tl.constexpr):
    """(p, n, slot) of a per-pair decode kernel's program: its pair, its R rows, the pair's slot
    (-1: none). The grid is (row tiles, pairs), or with PM (pairs, row tiles): pair-major, so
    the programs that run together take one row tile of every pair, and pairs of one expert
    read its rows at about the same time (from L2 after the first)."""
    p = tl.program_id(0) if PM else tl.program_id(1)
    tile = tl.program_id(1) if PM else tl.program_id(0)
    return p, tile * R + tl.arange(0, R), tl.load(slot_of + tl.load(ids + p))


@triton.jit(do_not_specialize=["D", "F"])
def _gate_up_q8_kernel(xq, xs4, ids, wts, slot_of, gate, up, h, mg, mu, D, F, stride_gs,
                       stride_us, stride_ms, row_bytes, TOPK: tl.constexpr, R: tl.constexpr,
                       BB: tl.constexpr, MISS: tl.constexpr, HOST_FROM: tl.constexpr,
                       PM: tl.constexpr = False):
    # as moe._gate_up_pairs_kernel, for Q4_K gate and up and x rounded to 8 bits (quantize_x):
    # R rows of both a program, their blocks in flight together (spread_dot)
    p, n, slot = _pair(ids, slot_of, R, PM)
    hv = tl.zeros((R,), tl.float32)
    if pair_computed(slot, p, MISS, TOPK, HOST_FROM):
        t = (p // TOPK).to(tl.int64)
        g, u = spread_dot(
            spread_rows(record_part(gate, slot, stride_gs, mg, p, stride_ms, MISS), n, F,
                        row_bytes),
            spread_rows(record_part(up, slot, stride_us, mu, p, stride_ms, MISS), n, F,
                        row_bytes),
            (xq + t * D).to(tl.pointer_type(tl.int32)), xs4 + t * (D // 16), D // 256, True, BB,
            False)
        hv = g / (1.0 + tl.exp(-g)) * u * tl.load(wts + p).to(tl.float32)
    tl.store(h + p.to(tl.int64) * F + n, hv, mask=n < F)


@triton.jit(do_not_specialize=["D", "F"])
def _down_q8_kernel(hq, hs4, ids, slot_of, down, part, md, D, F, stride_ds, stride_ms, row_bytes,
                    TOPK: tl.constexpr, R: tl.constexpr, BB: tl.constexpr, MISS: tl.constexpr,
                    HOST_FROM: tl.constexpr, PM: tl.constexpr = False):
    # as moe._down_pairs_kernel, for a Q4_K down and h rounded to 8 bits (quantize_x of each
    # pair's row): R rows a program (spread_dot)
    p, n, slot = _pair(ids, slot_of, R, PM)
    total = tl.zeros((R,), tl.float32)
    if pair_computed(slot, p, MISS, TOPK, HOST_FROM):
        rows = spread_rows(record_part(down, slot, stride_ds, md, p, stride_ms, MISS), n, D,
                           row_bytes)
        total, _ = spread_dot(rows, rows, (hq + p.to(tl.int64) * F).to(tl.pointer_type(tl.int32)),
                              hs4 + p.to(tl.int64) * (F // 16), F // 256, False, BB, False)
    tl.store(part + p.to(tl.int64) * D + n, total, mask=n < D)


@triton.jit(do_not_specialize=["D", "F"])
def _down_q6k_q8_kernel(hq, hdx, ids, slot_of, down, part, md, D, F, stride_ds, stride_ms,
                        row_bytes, TOPK: tl.constexpr, R: tl.constexpr, BB: tl.constexpr,
                        MISS: tl.constexpr, HOST_FROM: tl.constexpr,
                        PM: tl.constexpr = False):
    # as moe._down_pairs_kernel, for a Q6_K down and h rounded to 8 bits: R rows a program
    # (q6k_spread_dot)
    p, n, slot = _pair(ids, slot_of, R, PM)
    total = tl.zeros((R,), tl.float32)
    if pair_computed(slot, p, MISS, TOPK, HOST_FROM):
        base = record_part(down, slot, stride_ds, md, p, stride_ms, MISS)
        ro = _row_offsets(n, D, row_bytes)[None, None, None, :, None]
        total = q6k_spread_dot(base.to(tl.pointer_type(tl.int32)), ro,
                               (hq + p.to(tl.int64) * F).to(tl.pointer_type(tl.int32)),
                               hdx + p.to(tl.int64) * (F // 32), F // 256, BB)
    tl.store(part + p.to(tl.int64) * D + n, total, mask=n < D)


# MXFP4's values doubled (ggml's kvalues_mxfp4) as bytes for PRMT: 0..7 and, negated, 8..15
MX_POS_LO = tl.constexpr(0x3020100)
MX_POS_HI = tl.constexpr(0xc080604)
MX_NEG_LO = tl.constexpr(-33620224)  # 0xFDFEFF00: 0, -1, -2, -3
MX_NEG_HI = tl.constexpr(-185009412)  # 0xF4F8FAFC: -4, -6, -8, -12


@triton.jit
def _word_any(wbase, o, m):
    """The little-endian u32 at byte offset o (int64, any alignment) from wbase (int32 words,
    4-aligned): one aligned word, or the bytes of two joined by one PRMT (the second word is
    read only where o is not 4-aligned, so no byte past the last field is read)."""
    sh = (o & 3).to(tl.int32)
    w0 = tl.load(wbase + (o >> 2), mask=m, other=0)
    w1 = tl.load(wbase + (o >> 2) + 1, mask=m & (sh != 0), other=0)
    return _prmt(w0, w1, 0x3210 + 0x1111 * sh)


@triton.jit
def _mx_values(q):
    """The signed value bytes (ggml's doubled E2M1: 0, ±1, ±2, ±3, ±4, ±6, ±8, ±12) of the four
    nibbles in q's low 16 bits, in their order: PRMT from the positive and the negative table
    by each nibble's low 3 bits, then a third PRMT picks by its bit 3 (the sign)."""
    sel = q & 0x7777
    pos = _prmt(MX_POS_LO + sel * 0, MX_POS_HI, sel)
    neg = _prmt(MX_NEG_LO + sel * 0, MX_NEG_HI, sel)
    return _prmt(pos, neg, 0x3210 | ((q & 0x8888) >> 1))


@triton.jit
def mxfp4_spread_dot(wbase, ro, xw, dx, nb, BB: tl.constexpr, EVEN: tl.constexpr = False):
    """Σ_k x̂[k] · W[r, k] [R] for MXFP4 rows at byte offsets ro ([1, 1, R], int64) from wbase
    (int32 words, 4-aligned) of nb blocks, x̂ as quantize_x gives it (xw: its int8 values as
    int32 words, dx: its per-32 scales: one a block).

    17-byte blocks, e (E8M0) then 16 bytes whose low nibbles are values 0-15 and high nibbles
    16-31: a row's words have any alignment (_word_any). The threads spread over BB blocks x 4
    words; a thread's word holds values 4c..4c+3 (low nibbles) and 16+4c..16+4c+3 (high), as
    nibble pairs byte by byte, so its low and high 16 bits give, by _mx_values, two value words
    in that interleaved order; x's two words are interleaved to match (two PRMTs, shared by the
    R rows), then two signed dp4a. Each block's int32 sum (|Σ| <= 32 · 12 · 127) times
    2^(e-128) dx in float."""
    R: tl.constexpr = ro.shape[2]
    bb = tl.arange(0, BB)[:, None, None]  # [BB, 1, 1]
    c = tl.arange(0, 4)[None, :, None]  # [1, 4, 1]
    zero = tl.zeros((BB, 4, R), tl.int32)
    acc = tl.zeros((BB, 4, R), tl.float32)
    b8 = (wbase.to(tl.pointer_type(tl.int8))).to(tl.pointer_type(tl.uint8))
    for b0 in range(0, nb, BB):
        b = b0 + bb
        m = _in_row(b, nb, EVEN)
        o = ro + b * 17  # [BB, 1, R]: the block's first byte (e) in each row
        q = _word_any(wbase, o + 1 + 4 * c, m)  # [BB, 4, R]
        xa = tl.load(xw + b * 8 + c, mask=m, other=0)  # [BB, 4, 1]: values 4c .. 4c + 3
        xb = tl.load(xw + b * 8 + 4 + c, mask=m, other=0)  # 16 + 4c .. 16 + 4c + 3
        dot = _dp4a(_mx_values(q), _prmt(xa, xb, 0x5140) + zero, zero, True)
        dot = _dp4a(_mx_values(q >> 16), _prmt(xa, xb, 0x7362) + zero, dot, True)
        e = tl.load(b8 + o, mask=m, other=0).to(tl.int32)  # [BB, 1, R]
        d = e8m0_half(e)
        dxb = tl.load(dx + b, mask=m, other=0.0)  # [BB, 1, 1]
        acc += (d * dxb) * dot.to(tl.float32)
    return tl.sum(tl.sum(acc, axis=1), axis=0)


@triton.jit(do_not_specialize=["D", "F"])
def _gate_up_mx8_kernel(xq, dx, ids, wts, slot_of, gate, up, h, mg, mu, bg, bu, D, F,
                        stride_gs, stride_us, stride_ms, row_bytes, TOPK: tl.constexpr,
                        R: tl.constexpr, BB: tl.constexpr, MISS: tl.constexpr,
                        HOST_FROM: tl.constexpr, BIAS: tl.constexpr, OAI: tl.constexpr,
                        EVEN: tl.constexpr, PM: tl.constexpr = False):
    # as moe._gate_up_pairs_kernel, for MXFP4 gate and up and x rounded to 8 bits (quantize_x):
    # R rows of each a program (mxfp4_spread_dot); the biases and gpt-oss's clamped SwiGLU as
    # there (BIAS, OAI); EVEN: D a multiple of 32 BB (every step's blocks in the row)
    p, n, slot = _pair(ids, slot_of, R, PM)
    hv = tl.zeros((R,), tl.float32)
    if pair_computed(slot, p, MISS, TOPK, HOST_FROM):
        t = (p // TOPK).to(tl.int64)
        xw = (xq + t * D).to(tl.pointer_type(tl.int32))
        ro = _row_offsets(n, F, row_bytes)[None, None, :]
        gb = record_part(gate, slot, stride_gs, mg, p, stride_ms, MISS)
        ub = record_part(up, slot, stride_us, mu, p, stride_ms, MISS)
        g = mxfp4_spread_dot(gb.to(tl.pointer_type(tl.int32)), ro, xw, dx + t * (D // 32),
                             D // 32, BB, EVEN)
        u = mxfp4_spread_dot(ub.to(tl.pointer_type(tl.int32)), ro, xw, dx + t * (D // 32),
                             D // 32, BB, EVEN)
        if BIAS:
            e = tl.load(ids + p)
            g += bias_row(bg, e, n, F)
            u += bias_row(bu, e, n, F)
        hv = glu(g, u, OAI) * tl.load(wts + p).to(tl.float32)
    tl.store(h + p.to(tl.int64) * F + n, hv, mask=n < F)


@triton.jit(do_not_specialize=["D", "F"])
def _down_mx8_kernel(hq, hdx, ids, slot_of, down, part, md, wts, bd, D, F, stride_ds, stride_ms,
                     row_bytes, TOPK: tl.constexpr, R: tl.constexpr, BB: tl.constexpr,
                     MISS: tl.constexpr, HOST_FROM: tl.constexpr, BIAS: tl.constexpr,
                     EVEN: tl.constexpr, PM: tl.constexpr = False):
    # as moe._down_pairs_kernel, for an MXFP4 down and each pair's h (already weighted) rounded
    # to 8 bits: R rows a program (mxfp4_spread_dot), + wts[p] · bd[e] with BIAS
    p, n, slot = _pair(ids, slot_of, R, PM)
    total = tl.zeros((R,), tl.float32)
    if pair_computed(slot, p, MISS, TOPK, HOST_FROM):
        base = record_part(down, slot, stride_ds, md, p, stride_ms, MISS)
        ro = _row_offsets(n, D, row_bytes)[None, None, :]
        total = mxfp4_spread_dot(base.to(tl.pointer_type(tl.int32)), ro,
                                 (hq + p.to(tl.int64) * F).to(tl.pointer_type(tl.int32)),
                                 hdx + p.to(tl.int64) * (F // 32), F // 32, BB, EVEN)
        if BIAS:
            total += tl.load(wts + p).to(tl.float32) * bias_row(bd, tl.load(ids + p), n, D)
    tl.store(part + p.to(tl.int64) * D + n, total, mask=n < D)


@triton.jit(do_not_specialize=["D", "F"])
def _gate_up_iq_kernel(xq, dx, ids, wts, slot_of, gate, up, h, mg, mu, t0, t1, D, F, stride_gs,
                       stride_us, stride_ms, row_bytes, IQ3: tl.constexpr, TOPK: tl.constexpr,
                       R: tl.constexpr, BB: tl.constexpr, MISS: tl.constexpr,
                       HOST_FROM: tl.constexpr, RUN: tl.constexpr = False,
                       EVEN: tl.constexpr = False, PM: tl.constexpr = False):
    # as _gate_up_q8_kernel, for IQ2_XS or (IQ3) IQ3_XXS gate and up: R rows of each a program
    # (iq_spread_dot, once for each; RUN: iq_run_dot with BB its split, rows and records
    # 16-byte aligned and D a multiple of 2048; EVEN: D a multiple of 2048 BB for RUN, else of
    # 256 BB, the loads unmasked)
    p, n, slot = _pair(ids, slot_of, R, PM)
    hv = tl.zeros((R,), tl.float32)
    if pair_computed(slot, p, MISS, TOPK, HOST_FROM):
        t = (p // TOPK).to(tl.int64)
        xw = (xq + t * D).to(tl.pointer_type(tl.int32))
        gb = record_part(gate, slot, stride_gs, mg, p, stride_ms, MISS)
        ub = record_part(up, slot, stride_us, mu, p, stride_ms, MISS)
        if RUN:
            ro = _row_offsets(n, F, row_bytes)
            g = iq_run_dot(gb.to(tl.pointer_type(tl.int32)), ro, xw, dx + t * (D // 32), t0,
                           t1, D // 256, IQ3, BB, EVEN)
            u = iq_run_dot(ub.to(tl.pointer_type(tl.int32)), ro, xw, dx + t * (D // 32), t0,
                           t1, D // 256, IQ3, BB, EVEN)
        else:
            ro = _iq_rows(n, F, row_bytes)
            g = iq_spread_dot(gb.to(tl.pointer_type(tl.int32)), ro, xw, dx + t * (D // 32), t0,
                              t1, D // 256, IQ3, BB, EVEN)
            u = iq_spread_dot(ub.to(tl.pointer_type(tl.int32)), ro, xw, dx + t * (D // 32), t0,
                              t1, D // 256, IQ3, BB, EVEN)
        hv = g / (1.0 + tl.exp(-g)) * u * tl.load(wts + p).to(tl.float32)
    tl.store(h + p.to(tl.int64) * F + n, hv, mask=n < F)


@triton.jit(do_not_specialize=["D", "F"])
def _down_iq_kernel(hq, hdx, ids, slot_of, down, part, md, t0, t1, D, F, stride_ds, stride_ms,
                    row_bytes, IQ3: tl.constexpr, TOPK: tl.constexpr, R: tl.constexpr,
                    BB: tl.constexpr, MISS: tl.constexpr, HOST_FROM: tl.constexpr,
                    EVEN: tl.constexpr = False, PM: tl.constexpr = False):
    # as _down_q6k_q8_kernel, for an IQ2_XS or (IQ3) IQ3_XXS down (iq_spread_dot; EVEN: F a
    # multiple of 256 BB)
    p, n, slot = _pair(ids, slot_of, R, PM)
    total = tl.zeros((R,), tl.float32)
    if pair_computed(slot, p, MISS, TOPK, HOST_FROM):
        base = record_part(down, slot, stride_ds, md, p, stride_ms, MISS)
        total = iq_spread_dot(base.to(tl.pointer_type(tl.int32)), _iq_rows(n, D, row_bytes),
                              (hq + p.to(tl.int64) * F).to(tl.pointer_type(tl.int32)),
                              hdx + p.to(tl.int64) * (F // 32), t0, t1, F // 256, IQ3, BB,
                              EVEN)
    tl.store(part + p.to(tl.int64) * D + n, total, mask=n < D)


def run_tile(k: int) -> tuple[int, int, int]:
    """GEMV_X8_RUN's (rows a program, split, warps) for rows of k values (k % 2048 == 0)."""
    return next(t for runs, t in GEMV_X8_RUN if k // 2048 >= runs)


def gemv_x8(x: torch.Tensor, w: torch.Tensor, qtype: int) -> torch.Tensor:
    """x [1, K] float32/bf16 @ W.T -> [1, N] float32 for Q4_K, Q6_K, IQ2_XS or IQ3_XXS rows w
    (4-byte aligned), x rounded to 8 bits first (quantize_x) and the GEMV on dp4a,
    GEMV_X8_TILE's tile; Q6_K, IQ2_XS and IQ3_XXS rows in the run forms where they fit them
    (GEMV_X8_RUN's tile)."""
    q = QType(qtype)
    r, bb, warps = GEMV_X8_TILE[q]
    n, k = w.shape[0], x.shape[-1]
    xq, dx, xs4 = quantize_x(x.reshape(k).contiguous())
    out = torch.empty(1, n, dtype=torch.float32, device=x.device)
    if q == QType.Q4_K:
        gemv_q4k_spread(xq, xs4, w, n, k, out=out[0], bb=bb, warps=warps, rows=r)
    elif run_fits(w, k):
        r, split, warps = run_tile(k)
        if q == QType.Q6_K:
            gemv_q6k_run(xq, dx, w, n, k, out=out[0], rows=r, warps=warps, split=split)
        else:
            gemv_iq_run(xq, dx, w, n, k, q, out=out[0], rows=r, warps=warps, split=split)
    elif q == QType.Q6_K:
        gemv_q6k_spread(xq, dx, w, n, k, out=out[0], bb=bb, warps=warps, rows=r)
    else:
        gemv_iq_spread(xq, dx, w, n, k, q, out=out[0], bb=bb, warps=warps, rows=r)
    return out


def _grid_bytes(ref: type, n: int, width: int) -> np.ndarray:
    """int32 [n, width / 4]: each grid row's values (small non-negative integers) as bytes."""
    g = grids._grid_np(ref)
    if not (g == np.round(g)).all() or g.min() < 0 or g.max() > 127:
        raise ValueError(f"{ref.__name__} grid values are not small non-negative integers")
    return g.astype(np.uint8).reshape(n, width).view(np.int32)


def _iq2xs_sel() -> tuple[np.ndarray, np.ndarray]:
    """int32 [512]: each IQ2_XS grid row's 8 values as codes 0-2 (8, 25, 43) in nibbles; int32
    [128]: each ksigns index's 8 signs as 4 in the nibbles of the negative values."""
    g = grids._grid_np(gq.IQ2_XS)
    code = np.select([g == 8, g == 25, g == 43], [0, 1, 2], -1).astype(np.int64)
    if (code < 0).any():
        raise ValueError("IQ2_XS grid values other than 8, 25, 43")
    nib = 4 * np.arange(8)
    neg = (grids._ksigns_np() < 0).astype(np.int64) * 4
    return ((code << nib).sum(1).astype(np.uint32).view(np.int32),
            (neg << nib).sum(1).astype(np.uint32).view(np.int32))


def iq_tables(qtype: QType, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ2_XS: (gsel, ssel) of _iq2xs_sel; IQ3_XXS: (grid int32 [256], each grid row's 4 values
    as bytes, little endian; smask int32 [128, 2], each ksigns index's 8 signs as bytes, 0xFF
    where negative)."""
    if qtype == QType.IQ2_XS:
        return (device_table("iq2xs_gsel", device, lambda: _iq2xs_sel()[0]),
                device_table("iq2xs_ssel", device, lambda: _iq2xs_sel()[1]))
    grid = device_table("iq3xxs_grid4", device, lambda: _grid_bytes(gq.IQ3_XXS, 256, 4))
    smask = device_table("ksigns_mask8", device, lambda: np.where(
        grids._ksigns_np() < 0, 255, 0).astype(np.uint8).view(np.int32))
    return grid, smask


def _iq_name(fn: str, qtype: QType) -> str:
    """fn's name in its errors, "fn (TYPE)", for IQ2_XS or IQ3_XXS; any other type refused."""
    if qtype not in (QType.IQ2_XS, QType.IQ3_XXS):
        raise ValueError(f"{fn}: IQ2_XS or IQ3_XXS rows, got {QType(qtype).name}")
    return f"{fn} ({QType(qtype).name})"


def gemv_iq_run(xq: torch.Tensor, dx: torch.Tensor, w: torch.Tensor, n: int, k: int,
                qtype: QType, out: torch.Tensor | None = None, rows: int = 8, warps: int = 1,
                split: int = 1, halves: bool = False) -> torch.Tensor:
    """y [N] f32 = W x̂ for IQ2_XS or IQ3_XXS rows w and quantize_x's x̂ (xq, dx) by iq_run_dot:
    K a multiple of 2048 (every row 16-byte aligned) and w 16-byte aligned; `rows` rows a
    program, each row's runs of 8 blocks dealt to `split` threads a quarter (rows * split * 4
    lanes, powers of two); halves: twice the programs, each taking half of every run's blocks,
    their sums added into y (zeroed first; a benchmark option, slower than one program a run
    on the H200, run 107)."""
    name = _iq_name("gemv_iq_run", qtype)
    y = _run_args(w, n, k, QType(qtype), xq, out, name, split, rows, warps)
    t0, t1 = iq_tables(QType(qtype), w.device)
    if n:
        if halves:
            y.zero_()
        _gemv_iq_run_kernel[(triton.cdiv(n, rows), 2 if halves else 1)](
            xq, dx, w, y, t0, t1, n, k, w.stride(0), IQ3=qtype == QType.IQ3_XXS, RL=rows,
            S=split, EVEN=k % (2048 * split) == 0, HALVES=halves, num_warps=warps)
    return y


def gemv_iq_spread(xq: torch.Tensor, dx: torch.Tensor, w: torch.Tensor, n: int, k: int,
                   qtype: QType, out: torch.Tensor | None = None, bb: int = 8, warps: int = 0,
                   rows: int = 1) -> torch.Tensor:
    """y [N] f32 = W x̂ for IQ2_XS or IQ3_XXS rows w (4-byte aligned) and quantize_x's x̂ (xq,
    dx): `rows` rows a program (a power of two), its threads spread over bb blocks (a power of
    two) x 4 quarters; warps by default bb * 4 / 32 (at least 1)."""
    y, warps = _spread_args(w, n, k, QType(qtype), xq, out, _iq_name("gemv_iq_spread", qtype),
                            bb, rows, warps)
    grid, smask = iq_tables(QType(qtype), w.device)
    if n:
        _gemv_iq_spread_kernel[(triton.cdiv(n, rows),)](
            xq, dx, w, y, grid, smask, n, k, w.stride(0), IQ3=qtype == QType.IQ3_XXS, R=rows,
            BB=bb, EVEN=k % (256 * bb) == 0, num_warps=warps)
    return y
