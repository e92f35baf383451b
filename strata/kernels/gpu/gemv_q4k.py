"""A one-token Q4_K GEMV that streams whole blocks, with the scales applied per sub-block.

    y = gemv_q4k(x, w)      # x [1, K] bf16/f32, w uint8 [N, row_nbytes(Q4_K, K)] -> f32 [1, N]

A candidate to the shared FMA skeleton (skeletons.gemv_tile) for the most common expert type,
kept behind matmul.Q4K_BLOCKS (None: off) until the benchmark says it is faster. The shared
skeleton dequantizes each value (scale and min from per-group byte loads repeated across the
threads that hold the group), then multiplies; here, per block of 256 values:

    y += d · Σ_i sc_i · Σ_l q_il x_il  −  dmin · Σ_i mn_i · Σ_l x_il     (i: 8 sub-blocks of 32)

so a value costs a shift, a mask-and-or (q into the mantissa of f = 1 + q/16, no int-to-float
conversion) and one FMA; the 16-byte header (d, dmin, 12 bytes of 6-bit scales) is loaded as four
words once per block and unpacked with shifts. Each program takes BN rows and NB blocks of each
per step, the 128 bytes of quants of a block loaded as 4 x 32 contiguous bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.quant import QType, row_nbytes

_BLOCK, _BYTES = 256, 144


@triton.jit
def _sub_scales(w1, w2, w3, p, h: tl.constexpr):
    """6-bit (scale, min) of sub-block 2p + h for pairs p [1, 1, 4], from the scale words
    w1, w2, w3 ([BN, NB, 1]: bytes 0-3, 4-7, 8-11 of the scales), as float32 [BN, NB, 4]."""
    sh = 8 * ((2 * p + h) % 4)
    b1 = (w1 >> sh) & 255
    b2 = (w2 >> sh) & 255
    b3 = (w3 >> sh) & 255
    sc = tl.where(p < 2, b1 & 63, (b3 & 15) | ((b1 >> 6) << 4))
    mn = tl.where(p < 2, b2 & 63, (b3 >> 4) | ((b2 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def q4k_rows_dot(rows, x, K, BN: tl.constexpr, NB: tl.constexpr):
    """float32 [BN]: Σ_k x[k] · W[r, k] for the BN Q4_K rows starting at the uint8 pointers
    `rows` [BN] (K values each), x a pointer to K values (bf16/f32); NB blocks a step."""
    blk = tl.arange(0, NB)
    p = tl.arange(0, 4)
    lane = tl.arange(0, 32)
    quad = tl.arange(0, 4)[None, None, :]
    pp = p[None, None, :]  # [1, 1, 4]
    acc = tl.zeros((BN, NB), tl.float32)
    n_blocks = K // 256
    for b0 in range(0, n_blocks, NB):
        bi = b0 + blk  # [NB]
        bm = bi < n_blocks
        base = rows[:, None] + (tl.minimum(bi, n_blocks - 1).to(tl.int64) * 144)[None, :]
        hdr = tl.load(base[:, :, None].to(tl.pointer_type(tl.int32)) + quad)  # [BN, NB, 4]
        w0 = tl.sum(tl.where(quad == 0, hdr, 0), axis=2)  # [BN, NB]
        w1 = tl.sum(tl.where(quad == 1, hdr, 0), axis=2)[:, :, None]
        w2 = tl.sum(tl.where(quad == 2, hdr, 0), axis=2)[:, :, None]
        w3 = tl.sum(tl.where(quad == 3, hdr, 0), axis=2)[:, :, None]
        d = (w0 & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((w0 >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sc_lo, mn_lo = _sub_scales(w1, w2, w3, pp, 0)  # sub-blocks 2p: low nibbles
        sc_hi, mn_hi = _sub_scales(w1, w2, w3, pp, 1)  # sub-blocks 2p + 1: high nibbles
        q = tl.load(base[:, :, None, None] + 16 + p[None, None, :, None] * 32
                    + lane[None, None, None, :]).to(tl.int32)  # [BN, NB, 4, 32]
        f_lo = (((q & 15) << 19) | 0x3F800000).to(tl.float32, bitcast=True)  # 1 + q / 16
        f_hi = (((q >> 4) << 19) | 0x3F800000).to(tl.float32, bitcast=True)
        xi = bi[:, None, None] * 256 + p[None, :, None] * 64 + lane[None, None, :]  # [NB, 4, 32]
        xm = bm[:, None, None]
        x_lo = tl.load(x + xi, mask=xm, other=0.0).to(tl.float32)[None]  # [1, NB, 4, 32]
        x_hi = tl.load(x + xi + 32, mask=xm, other=0.0).to(tl.float32)[None]
        s_lo = tl.sum(f_lo * x_lo, axis=3)  # [BN, NB, 4]
        s_hi = tl.sum(f_hi * x_hi, axis=3)
        xs_lo = tl.sum(x_lo, axis=3)  # [1, NB, 4]
        xs_hi = tl.sum(x_hi, axis=3)
        # Σ q x = 16 (Σ f x - Σ x)
        dots = sc_lo * ((s_lo - xs_lo) * 16.0) + sc_hi * ((s_hi - xs_hi) * 16.0)
        mins = mn_lo * xs_lo + mn_hi * xs_hi
        acc += d * tl.sum(dots, axis=2) - dmin * tl.sum(mins, axis=2)
    return tl.sum(acc, axis=1)


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_q4k_kernel(x, w, y, N, K, row_bytes, BN: tl.constexpr, NB: tl.constexpr):
    # y[n] = Σ_k x[k] · W[n, k] for BN rows n
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = w + tl.minimum(n, N - 1).to(tl.int64) * row_bytes
    tl.store(y + n, q4k_rows_dot(rows, x, K, BN, NB), mask=n < N)


def gemv_q4k(x: torch.Tensor, w: torch.Tensor, tile: tuple[int, int, int],
             out: torch.Tensor | None = None) -> torch.Tensor:
    """[1, K] x Q4_K rows [N, row_nbytes] -> float32 [1, N]; tile (BN rows, NB blocks, warps).
    The caller checked shapes (matmul.quant_matmul)."""
    k = x.shape[1]
    n = w.shape[0]
    if k % _BLOCK or w.shape[1] != row_nbytes(QType.Q4_K, k):
        raise ValueError(f"Q4_K rows of {k} values: {row_nbytes(QType.Q4_K, k)} bytes each")
    if out is None:
        out = torch.empty(1, n, dtype=torch.float32, device=x.device)
    bn, nb, warps = tile
    _gemv_q4k_kernel[(triton.cdiv(n, bn),)](x, w, out, n, k, w.shape[1], BN=bn, NB=nb,
                                            num_warps=warps)
    return out
