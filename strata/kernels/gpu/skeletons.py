"""The K loops every quantized matmul here is built from, shared by matmul.py and moe.py.

    gemv_tile   one token (or up to four, gemv_tile4) against BN weight rows, float32 FMA
                (gemv_tile2: two matrices in one loop):
                acc [BN, G, S] += W[n, k] * x[k]   over the whole row, reduced by the caller.
    gemv_rows_tile  as gemv_tile for one token, with R rows in the same threads, which share
                one x tile a step: a_r [1, G, S] += W[n0 + r, k] * x[k]   (r < R).
    dot_tile    BM tokens against BN rows on tensor cores:
                acc [BM, BN] += x[rows, k0:k0+BK] @ W[n, k0:k0+BK].T   (bf16 operands, f32 acc)
Each K step asks tiles.dequant_tile for the [BN, G, S] values of BK = G * S columns (in natural
column order), so the loops are the same for every GGML type.
"""

from __future__ import annotations

import triton
import triton.language as tl

from strata.kernels.gpu.bits import e8m0_half, mx_join_order, mx_scaled, to_f32
from strata.kernels.gpu.tiles import dequant_tile


@triton.jit
def rows(w, n, N, row_bytes):
    """uint8 pointers [BN, 1, 1] to rows n (clamped to N - 1, so every read stays in bounds)."""
    return w + (tl.minimum(n, N - 1).to(tl.int64) * row_bytes)[:, None, None]


@triton.jit
def group_mask(k0, g, K, S: tl.constexpr, EVEN_K: tl.constexpr):
    """[1, G, 1]: groups of the step at k0 that lie inside the row; None when BK divides K."""
    if EVEN_K:
        m = None
    else:
        m = k0 + g * S < K
    return m


@triton.jit
def x_tile(xr, g, s, m, BN: tl.constexpr):
    """x[g * S + s] (xr: the step's first column) as float32, broadcast to the weight tile's
    shape [BN, G, S]. Loading x in that shape gives it the weight bytes' register layout, so
    nothing is shuffled through shared memory; the repeated reads hit L1."""
    ptrs = tl.broadcast_to(xr + (g * s.shape[2] + s), (BN, g.shape[1], s.shape[2]))
    if m is None:
        v = tl.load(ptrs)
    else:
        v = tl.load(ptrs, mask=m, other=0.0)
    return to_f32(v)


@triton.jit
def gemv_tile(QT: tl.constexpr, S: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
              STAGES: tl.constexpr, wr, xr, K, tab, tab2, acc):
    """acc [BN, G, S] += W[rows, k] * x[k] over the whole row, for one token.
    wr: row pointers [BN, 1, 1]; xr: pointer to the token's x row. STAGES > 1 lets Triton
    prefetch the weight bytes and x of the next steps (cp.async into shared memory): a decode
    GEMV is otherwise one memory latency per K step."""
    BN: tl.constexpr = acc.shape[0]
    g = tl.arange(0, BK // S)[None, :, None]  # group index inside the step
    s = tl.arange(0, S)[None, None, :]
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        m = group_mask(k0, g, K, S, EVEN_K)
        acc += dequant_tile(QT, wr, k0, g, s, m, tab, tab2) * x_tile(xr + k0, g, s, m, BN)
    return acc


@triton.jit
def gemv_tile2(QA: tl.constexpr, SA: tl.constexpr, QB: tl.constexpr, SB: tl.constexpr,
               BK: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr, wa, wb, xr, K,
               ta, ta2, tb, tb2, acc_a, acc_b):
    """gemv_tile over two matrices of the same shape (gate and up) in one K loop: both tiles'
    loads are issued before either is used, so a step waits one memory latency, not two."""
    BN: tl.constexpr = acc_a.shape[0]
    ga = tl.arange(0, BK // SA)[None, :, None]
    sa = tl.arange(0, SA)[None, None, :]
    gb = tl.arange(0, BK // SB)[None, :, None]
    sb = tl.arange(0, SB)[None, None, :]
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        ma = group_mask(k0, ga, K, SA, EVEN_K)
        mb = group_mask(k0, gb, K, SB, EVEN_K)
        va = dequant_tile(QA, wa, k0, ga, sa, ma, ta, ta2)
        vb = dequant_tile(QB, wb, k0, gb, sb, mb, tb, tb2)
        acc_a += va * x_tile(xr + k0, ga, sa, ma, BN)
        acc_b += vb * x_tile(xr + k0, gb, sb, mb, BN)
    return acc_a, acc_b


@triton.jit
def gemv_tile4(QT: tl.constexpr, S: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
               STAGES: tl.constexpr, BM: tl.constexpr, wr, x0, x1, x2, x3, K, tab, tab2, a0, a1,
               a2, a3):
    """BM (2 or 4) tokens against one pass over the rows: a_t [BN, G, S] += W * x_t."""
    BN: tl.constexpr = a0.shape[0]
    g = tl.arange(0, BK // S)[None, :, None]  # group index inside the step
    s = tl.arange(0, S)[None, None, :]
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        m = group_mask(k0, g, K, S, EVEN_K)
        wv = dequant_tile(QT, wr, k0, g, s, m, tab, tab2)  # [BN, G, S]
        a0 += wv * x_tile(x0 + k0, g, s, m, BN)
        a1 += wv * x_tile(x1 + k0, g, s, m, BN)
        if BM > 2:
            a2 += wv * x_tile(x2 + k0, g, s, m, BN)
            a3 += wv * x_tile(x3 + k0, g, s, m, BN)
    return a0, a1, a2, a3


@triton.jit
def _row_tile(QT: tl.constexpr, WIDE: tl.constexpr, w, n, N, row_bytes, k0, g, s, m, tab, tab2):
    """float32 [1, G, S]: the step's values of row n (clamped to N - 1, so reads stay in bounds)."""
    return dequant_tile(QT, rows(w, n + tl.arange(0, 1), N, row_bytes), k0, g, s, m, tab, tab2,
                        WIDE)


@triton.jit
def gemv_rows_tile(QT: tl.constexpr, S: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                   STAGES: tl.constexpr, R: tl.constexpr, WIDE: tl.constexpr, w, n0, N,
                   row_bytes, xr, K, tab, tab2):
    """a_r [1, G, S] += W[n0 + r, k] * x[k] over the whole row, for R (1, 2, 4 or 8) rows and
    one token (w: the matrix's first byte). Each step loads x once, in one row's tile shape and
    layout, and every row multiplies it from the same registers (gemv_tile loads x as
    [BN, G, S]: one read through L1 per row). The rows are separate [1, G, S] tiles: in one
    [R, G, S] tile the layout pass would spread them over threads."""
    g = tl.arange(0, BK // S)[None, :, None]  # group index inside the step
    s = tl.arange(0, S)[None, None, :]
    a0 = tl.zeros((1, BK // S, S), dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    a4 = a0
    a5 = a0
    a6 = a0
    a7 = a0
    for k0 in tl.range(0, K, BK, num_stages=STAGES):
        m = group_mask(k0, g, K, S, EVEN_K)
        v0 = _row_tile(QT, WIDE, w, n0, N, row_bytes, k0, g, s, m, tab, tab2)
        xv = x_tile(xr + k0, g, s, m, 1)  # after a weight tile, so it takes that tile's layout
        a0 += v0 * xv
        if R > 1:
            a1 += _row_tile(QT, WIDE, w, n0 + 1, N, row_bytes, k0, g, s, m, tab, tab2) * xv
        if R > 2:
            a2 += _row_tile(QT, WIDE, w, n0 + 2, N, row_bytes, k0, g, s, m, tab, tab2) * xv
            a3 += _row_tile(QT, WIDE, w, n0 + 3, N, row_bytes, k0, g, s, m, tab, tab2) * xv
        if R > 4:
            a4 += _row_tile(QT, WIDE, w, n0 + 4, N, row_bytes, k0, g, s, m, tab, tab2) * xv
            a5 += _row_tile(QT, WIDE, w, n0 + 5, N, row_bytes, k0, g, s, m, tab, tab2) * xv
            a6 += _row_tile(QT, WIDE, w, n0 + 6, N, row_bytes, k0, g, s, m, tab, tab2) * xv
            a7 += _row_tile(QT, WIDE, w, n0 + 7, N, row_bytes, k0, g, s, m, tab, tab2) * xv
    return a0, a1, a2, a3, a4, a5, a6, a7


@triton.jit
def dot_tile(QT: tl.constexpr, S: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
             DOT: tl.constexpr, wr, xr, rmask, K, tab, tab2, acc, MX: tl.constexpr = False):
    """acc [BM, BN] += x[rows, :] @ W[n, :].T with DOT operands (bf16; float32 under the
    interpreter) and float32 accumulation. wr: row pointers [BN, 1, 1]; xr: pointers to the x
    rows [BM, 1]; rmask [BM, 1]: rows that exist."""
    return dot_tile_span(QT, S, BK, EVEN_K, DOT, wr, xr, rmask, K, 0, K, tab, tab2, acc, MX)


@triton.jit
def dot_tile_span(QT: tl.constexpr, S: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT: tl.constexpr, wr, xr, rmask, K, K0, K1, tab, tab2, acc,
                  MX: tl.constexpr = False):
    """dot_tile over the columns K0 <= k < min(K1, K) only (K0 a multiple of BK): one split of
    a split-K product. MX: MXFP4 rows (QT 39) through mxfp4_dot_span (BK a multiple of 32)."""
    if MX and QT == 39 and BK % 32 == 0:
        return mxfp4_dot_span(BK, EVEN_K, DOT, wr, xr, rmask, K, K0, K1, acc)
    BN: tl.constexpr = acc.shape[1]
    g = tl.arange(0, BK // S)[None, :, None]  # group index inside the step
    s = tl.arange(0, S)[None, None, :]
    kk = tl.arange(0, BK)[None, :]  # [1, BK]
    for k0 in range(K0, tl.minimum(K1, K), BK):
        m = group_mask(k0, g, K, S, EVEN_K)
        if EVEN_K:
            xm = rmask
        else:
            xm = rmask & (k0 + kk < K)
        wv = dequant_tile(QT, wr, k0, g, s, m, tab, tab2)  # [BN, G, S]
        wt = tl.trans(tl.reshape(wv, (BN, BK)).to(DOT))  # [BK, BN]
        xv = tl.load(xr + k0 + kk, mask=xm, other=0.0).to(DOT)  # [BM, BK]
        acc = tl.dot(xv, wt, acc)
    return acc


@triton.jit
def mxfp4_dot_span(BK: tl.constexpr, EVEN_K: tl.constexpr, DOT: tl.constexpr, wr, xr, rmask,
                   K, K0, K1, acc):
    """dot_tile_span for MXFP4 rows (gpt-oss; 17-byte blocks: E8M0 e, 16 bytes whose low
    nibbles are values 0-15 and high nibbles 16-31). The generic tile reads each byte twice,
    once per nibble group; here a step's G = BK / 32 blocks are read once as [BN, G, 16] bytes,
    both nibbles decoded (bits.mx_scaled) and joined as [BN, G, 16, 2], and x's columns are
    loaded in that joined order (bits.mx_join_order), so the dot is over the same pairs."""
    BN: tl.constexpr = acc.shape[1]
    G: tl.constexpr = BK // 32
    g = tl.arange(0, G)[None, :, None]  # [1, G, 1]: the step's blocks
    j = tl.arange(0, 16)[None, None, :]  # [1, 1, 16]: a block's bytes
    col = mx_join_order(tl.arange(0, BK))[None, :]  # [1, BK]: x's column
    for k0 in range(K0, tl.minimum(K1, K), BK):
        b = wr + (k0 // 32 + g) * 17  # [BN, G, 1]
        if EVEN_K:
            e = tl.load(b).to(tl.int32)
            q = tl.load(b + 1 + j).to(tl.int32)  # [BN, G, 16]
            xm = rmask
        else:
            m = k0 + g * 32 < K
            e = tl.load(b, mask=m, other=0).to(tl.int32)
            q = tl.load(b + 1 + j, mask=m, other=0).to(tl.int32)
            xm = rmask & (k0 + col < K)
        d = e8m0_half(e)
        w = tl.join(mx_scaled(q & 15, d), mx_scaled(q >> 4, d))  # [BN, G, 16, 2]
        wt = tl.trans(tl.reshape(w, (BN, BK)).to(DOT))  # [BK, BN]
        xv = tl.load(xr + k0 + col, mask=xm, other=0.0).to(DOT)  # [BM, BK]
        acc = tl.dot(xv, wt, acc)
    return acc
