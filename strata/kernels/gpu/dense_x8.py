"""Dense matmuls of a few tokens (a batched step's q/k/v/o) on 8-bit activations, each row read
once for every token (QuantTensor.matmul_t under x8, 2 to tuning.DENSE_X8_MAX_T tokens; 0 by
default: off, bench/2026-12-06-h200-once.md).

    gemm_x8_tokens(x, w, qtype)   x [M, K] @ W.T -> [M, N] float32 for Q4_K / Q6_K rows: x
                                  rounded per token (gemv_q8.quantize_x), then a program per R
                                  rows holds their blocks in registers (one step of up to 16
                                  blocks: K <= 4096) and dots each token's x̂ against them
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.gpu import gemv_q8 as q8
from strata.kernels.tuning import DENSE_X8_ROWS
from strata.quant import QType


@triton.jit(do_not_specialize=["M", "N", "K"])
def _gemm_q4k_tokens_kernel(xq, xs4, w, y, M, N, K, row_bytes, stride_y, R: tl.constexpr,
                            BB: tl.constexpr, ONE: tl.constexpr):
    # y[t, n] = Σ_k W[n, k] x̂_t[k] for R rows n a program and every token t: with ONE (K <=
    # 256 BB) the rows held in registers and each token's x̂ dotted with them; else each token
    # re-reads them (spread_dot; from L1 after the first)
    n = tl.program_id(0) * R + tl.arange(0, R)
    rows = q8.spread_rows(w, n, N, row_bytes)
    nb = K // 256
    if ONE:
        b, c, hf, w4, v, c3, zero = q8.spread_layout(BB, R)
        m = b < nb
        wq = q8.q4k_weights(rows + b * 36, m, c, v, w4, hf, c3, False)
    for t in range(M):
        xw = (xq + t * K).to(tl.pointer_type(tl.int32))  # (t K: a few tokens, int32)
        xs = xs4 + t * (K // 16)
        if ONE:
            s = q8.held_q4k_dot(wq, q8.spread_x(xw, xs, b, m, c, v, w4, hf), zero)
        else:
            s, _ = q8.spread_dot(rows, rows, xw, xs, nb, False, BB, False)
        tl.store(y + t * stride_y + n, s, mask=n < N)


@triton.jit(do_not_specialize=["M", "N", "K"])
def _gemm_q6k_tokens_kernel(xq, dx, w, y, M, N, K, row_bytes, stride_y, R: tl.constexpr,
                            BB: tl.constexpr, ONE: tl.constexpr):
    # as _gemm_q4k_tokens_kernel for Q6_K rows (q6k_weights / q6k_spread_dot)
    n = tl.program_id(0) * R + tl.arange(0, R)
    base = w.to(tl.pointer_type(tl.int32))
    ro = q8._row_offsets(n, N, row_bytes)[None, None, None, :, None]
    nb = K // 256
    if ONE:
        b, h, q, i, zero, ones = q8.q6k_layout(BB, R)
        m = b < nb
        wq = q8.q6k_weights(base, ro + b * 210, m, h, q, i)
    for t in range(M):
        xw = (xq + t * K).to(tl.pointer_type(tl.int32))  # (t K: a few tokens, int32)
        xd = dx + t * (K // 32)
        if ONE:
            s = q8.held_q6k_dot(wq, xw, xd, b, m, h, q, i, zero, ones)
        else:
            s = q8.q6k_spread_dot(base, ro, xw, xd, nb, BB)
        tl.store(y + t * stride_y + n, s, mask=n < N)


def tokens_tile(k: int, rows: int | None = None) -> tuple[int, int, int]:
    """(rows a program, blocks a step, warps) of gemm_x8_tokens for rows of k values: a row's
    blocks in one step where it has at most 16 (the rows held once), else 16 a step;
    DENSE_X8_ROWS rows a program unless given."""
    bb = min(16, triton.next_power_of_2(max(1, k // 256)))
    return rows or DENSE_X8_ROWS, bb, max(1, bb * 4 // 32)


def gemm_x8_tokens(x: torch.Tensor, w: torch.Tensor, qtype: int,
                   tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] float32/bf16 @ W.T -> [M, N] float32 for Q4_K or Q6_K rows w (4-byte aligned;
    Q4_K rows each), a few tokens (a batched step's): x rounded to 8 bits per token
    (quantize_x), then a program per `rows` rows reads them once for every token
    (_gemm_q4k_tokens_kernel / _gemm_q6k_tokens_kernel); tile (rows, bb, warps): tokens_tile's
    by default."""
    q = QType(qtype)
    if q not in (QType.Q4_K, QType.Q6_K):
        raise ValueError(f"gemm_x8_tokens: Q4_K or Q6_K rows, got {q.name}")
    m, k = x.shape
    n = w.shape[0]
    r, bb, warps = tile or tokens_tile(k)
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    # (the spread GEMVs' checks of w, k and the tile, on the first token's row and output)
    q8._spread_args(w, n, k, q, x[0] if m else x.new_empty(k), out[0] if m else None,
                    "gemm_x8_tokens", bb, r, warps)
    if m == 0 or n == 0:
        return out
    xq, dx, xs4 = q8.quantize_x(x.contiguous())
    (_gemm_q4k_tokens_kernel if q == QType.Q4_K else _gemm_q6k_tokens_kernel)[
        (triton.cdiv(n, r),)](xq, xs4 if q == QType.Q4_K else dx, w, out, m, n, k, w.stride(0),
                              out.stride(0), R=r, BB=bb, ONE=k // 256 <= bb, num_warps=warps)
    return out
