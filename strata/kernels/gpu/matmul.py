"""Quantized matmul straight from GGUF blocks: y[t, n] = Σ_k x[t, k] · W[n, k].

    y = quant_matmul(x, w, QType.Q4_K)     # x [M, K] bf16/f32, w uint8 [N, row_nbytes(K)] -> f32
    w16 = dequantize_gpu(w, QType.Q4_K, K)  # -> bf16 [N, K] (or dtype=torch.float32)

M <= 4 tokens (decode, short verify windows) run the FMA kernel, which streams every weight row
from HBM once (more tokens, for benchmarks: programs of 4, a row tile's side by side); 5..63
tokens the tensor-core kernel (skeletons.py; K split across programs where its tiles would
leave SMs idle: a batched decode step's rows; the model's large Q4_K / Q6_K matrices on 8-bit
activations take moe_mmq.mmq_matmul instead, weights.QuantTensor.matmul_t); from 64 tokens the
weights are dequantized to bf16 by the same tiles and multiplied by cuBLAS, measured 3x (512
tokens) to 5x (4096) faster than the fused tensor-core kernel. Types without a tile (F32/F16/BF16:
torch.matmul; anything else: dequantize -> matmul) go through `fallback_matmul`, which logs
once per type.

One token can also take the rows kernel (`gemv_rows`: R rows per program share each x tile
instead of each reading it through L1), for the shapes listed in GEMV_ROWS_TUNE (gpt-oss's
2880-wide Q8_0 head and q/k/v).
Thresholds and tiles: strata.kernels.tuning; a benchmark passes others to quant_matmul.
"""

from __future__ import annotations

import logging

import torch
import triton
import triton.language as tl
from triton import knobs

from strata.kernels.gpu.formats import FLOAT_TYPES, KernelFormat, kernel_format
from strata.kernels.gpu.skeletons import (
    dot_tile_span,
    gemv_rows_tile,
    gemv_tile,
    gemv_tile4,
    group_mask,
    rows,
)
from strata.kernels.gpu.tiles import dequant_tile
from strata.kernels.tuning import (
    DEQUANT_MIN_M,
    GEMM_SPLIT_MIN_STEPS,
    GEMV_MAX_M,
    GEMV_ROWS_TUNE,
    GEMV_TUNE,
)
from strata.quant import QType, dequantize, row_nbytes

log = logging.getLogger("strata.kernels")

# Sizes are not specialized (one compile serves every shape); row_bytes and strides are, so the
# compiler knows when row starts are 16-byte aligned and can vectorize the byte reads.
_SIZES = ["M", "N", "K"]
# tokens one FMA GEMV program takes (gemv_tile4's accumulators); more run in groups of this many
GEMV_GROUP = 4


# ---- kernels ----------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["N", "K"])
def _dequant_kernel(w, out, tab, tab2, N, K, row_bytes, stride_on,
                    QT: tl.constexpr, S: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    EVEN_K: tl.constexpr):
    # out[n, k] = W[n, k]
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    wr = rows(w, n, N, row_bytes)
    k0 = tl.program_id(1) * BK
    g = tl.arange(0, BK // S)[None, :, None]  # [1, G, 1]
    s = tl.arange(0, S)[None, None, :]  # [1, 1, S]
    v = dequant_tile(QT, wr, k0, g, s, group_mask(k0, g, K, S, EVEN_K), tab, tab2)  # [BN,G,S]
    ptrs = out + n.to(tl.int64)[:, None, None] * stride_on + (k0 + g * S + s)
    tl.store(ptrs, v.to(out.dtype.element_ty), mask=(n < N)[:, None, None] & (k0 + g * S < K))


@triton.jit
def _store_row(y, t, M, n, N, acc, bias=None, BIAS: tl.constexpr = False):
    """y[t, n] = Σ acc[n, :, :] (+ bias[n]) for a token t < M."""
    v = tl.sum(tl.sum(acc, axis=2), axis=1)
    if BIAS:
        v += tl.load(bias + n, mask=n < N, other=0.0)
    tl.store(y + n, v, mask=(n < N) & (t < M))


@triton.jit(do_not_specialize=_SIZES + ["G"])
def _gemv_kernel(x, w, y, tab, tab2, M, N, K, G, row_bytes, stride_xm, stride_ym,
                 QT: tl.constexpr, S: tl.constexpr, BM: tl.constexpr,
                 BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                 STAGES: tl.constexpr, bias=None, BIAS: tl.constexpr = False):
    # y[t, n] = Σ_k x[t, k] · W[n, k] (+ bias[n]: BIAS, one token only), float32 FMA, the
    # tokens in G groups of BM <= 4: program p takes group p % G of the rows p // G, so a row
    # tile's groups run side by side and all but the first read W from L2 (every weight from
    # HBM once)
    pid = tl.program_id(0)
    t0 = (pid % G) * BM
    x += t0.to(tl.int64) * stride_xm
    y += t0.to(tl.int64) * stride_ym
    M -= t0
    n = (pid // G) * BN + tl.arange(0, BN)
    wr = rows(w, n, N, row_bytes)
    zero = tl.zeros((BN, BK // S, S), dtype=tl.float32)
    if BM == 1:
        _store_row(y, 0, M, n, N, gemv_tile(QT, S, BK, EVEN_K, STAGES, wr, x, K, tab, tab2,
                                            zero), bias, BIAS)
    else:
        # tokens t >= M read row M - 1 (in bounds) and are not stored
        x1 = x + tl.minimum(1, M - 1).to(tl.int64) * stride_xm
        x2 = x + tl.minimum(2, M - 1).to(tl.int64) * stride_xm
        x3 = x + tl.minimum(3, M - 1).to(tl.int64) * stride_xm
        a0, a1, a2, a3 = gemv_tile4(QT, S, BK, EVEN_K, STAGES, BM, wr, x, x1, x2, x3, K, tab,
                                    tab2, zero, zero, zero, zero)
        _store_row(y, 0, M, n, N, a0)
        _store_row(y + stride_ym, 1, M, n, N, a1)
        if BM > 2:
            _store_row(y + 2 * stride_ym, 2, M, n, N, a2)
            _store_row(y + 3 * stride_ym, 3, M, n, N, a3)


@triton.jit(do_not_specialize=["NA", "NB", "K"])
def _gemv_pair_kernel(x, wa, wb, ya, yb, ta, ta2, tb, tb2, NA, NB, K, rb_a, rb_b, GA,
                      QA: tl.constexpr, SA: tl.constexpr, BNA: tl.constexpr, BKA: tl.constexpr,
                      STA: tl.constexpr, QB: tl.constexpr, SB: tl.constexpr, BNB: tl.constexpr,
                      BKB: tl.constexpr, STB: tl.constexpr, EVEN_A: tl.constexpr,
                      EVEN_B: tl.constexpr):
    # one token, two matrices of other types in one launch: programs < GA y_a = W_a x (BNA
    # rows each), the others y_b = W_b x
    pid = tl.program_id(0)
    # (each branch names its own rows: Triton wants a name set in both to have one shape)
    if pid < GA:
        na = pid * BNA + tl.arange(0, BNA)
        _store_row(ya, 0, 1, na, NA, gemv_tile(QA, SA, BKA, EVEN_A, STA,
                                                rows(wa, na, NA, rb_a), x, K, ta, ta2,
                                                tl.zeros((BNA, BKA // SA, SA), tl.float32)))
    else:
        nb = (pid - GA) * BNB + tl.arange(0, BNB)
        _store_row(yb, 0, 1, nb, NB, gemv_tile(QB, SB, BKB, EVEN_B, STB,
                                                rows(wb, nb, NB, rb_b), x, K, tb, tb2,
                                                tl.zeros((BNB, BKB // SB, SB), tl.float32)))


@triton.jit
def _store_rows(y, n0, N, R: tl.constexpr, a0, a1, a2, a3, a4, a5, a6, a7, bias=None,
                BIAS: tl.constexpr = False):
    """y[n0 + r] = Σ a_r (+ bias[n0 + r]) for the rows r < R inside N: the R sums gathered
    into one [R, G] tile first, so the threads and warps combine once, not once per row."""
    r = tl.arange(0, R)[:, None]
    t = tl.where(r == 0, tl.sum(a0, axis=2), 0.0)  # [R, G]
    if R > 1:
        t += tl.where(r == 1, tl.sum(a1, axis=2), 0.0)
    if R > 2:
        t += tl.where(r == 2, tl.sum(a2, axis=2), 0.0)
        t += tl.where(r == 3, tl.sum(a3, axis=2), 0.0)
    if R > 4:
        t += tl.where(r == 4, tl.sum(a4, axis=2), 0.0)
        t += tl.where(r == 5, tl.sum(a5, axis=2), 0.0)
        t += tl.where(r == 6, tl.sum(a6, axis=2), 0.0)
        t += tl.where(r == 7, tl.sum(a7, axis=2), 0.0)
    n = n0 + tl.arange(0, R)
    v = tl.sum(t, axis=1)
    if BIAS:
        v += tl.load(bias + n, mask=n < N, other=0.0)
    tl.store(y + n, v, mask=n < N)


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_rows_kernel(x, w, y, tab, tab2, N, K, row_bytes, QT: tl.constexpr, S: tl.constexpr,
                      R: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                      STAGES: tl.constexpr, WIDE: tl.constexpr, bias=None,
                      BIAS: tl.constexpr = False):
    # y[n] = Σ_k x[k] · W[n, k] (+ bias[n]) for one token, R rows per program sharing each
    # step's x tile
    n0 = tl.program_id(0) * R
    a0, a1, a2, a3, a4, a5, a6, a7 = gemv_rows_tile(QT, S, BK, EVEN_K, STAGES, R, WIDE, w, n0,
                                                    N, row_bytes, x, K, tab, tab2)
    _store_rows(y, n0, N, R, a0, a1, a2, a3, a4, a5, a6, a7, bias, BIAS)


@triton.jit(do_not_specialize=_SIZES + ["KS", "stride_ys"])
def _gemm_kernel(x, w, y, tab, tab2, M, N, K, KS, row_bytes, stride_xm, stride_ym, stride_ys,
                 QT: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, GROUP_M: tl.constexpr, EVEN_K: tl.constexpr,
                 DOT: tl.constexpr):
    # y[t, n] = Σ_k x[t, k] · W[n, k]: bf16 tensor-core tiles, f32 accumulation; split-K: the
    # programs of axis 1 each sum KS columns (a multiple of BK) into their own y (stride_ys)
    pid = tl.program_id(0)
    k0 = tl.program_id(1) * KS
    y += tl.program_id(1).to(tl.int64) * stride_ys
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    width = GROUP_M * n_n  # GROUP_M row tiles sweep the columns together, so W tiles hit L2
    first_m = (pid // width) * GROUP_M
    group_m = tl.minimum(n_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_m
    pid_n = (pid % width) // group_m
    r = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    wr = rows(w, n, N, row_bytes)
    xr = x + (tl.minimum(r, M - 1).to(tl.int64) * stride_xm)[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc = dot_tile_span(QT, S, BK, EVEN_K, DOT, wr, xr, (r < M)[:, None], K, k0, k0 + KS, tab,
                        tab2, acc)
    ptrs = y + r.to(tl.int64)[:, None] * stride_ym + n[None, :]
    tl.store(ptrs, acc, mask=(r < M)[:, None] & (n < N)[None, :])


# ---- launchers --------------------------------------------------------------------------------


def check_weights(w: torch.Tensor, qtype: QType, n_cols: int, dims: int = 2) -> int:
    """Bytes per row, after checking w is uint8 [..., N, row_nbytes(n_cols)] with dense rows."""
    if w.dtype != torch.uint8 or w.dim() != dims:
        raise TypeError(f"quantized weights must be uint8 with {dims} dims, got {w.dtype} "
                        f"{tuple(w.shape)}")
    nbytes = row_nbytes(qtype, n_cols)
    if w.shape[-1] != nbytes or w.stride(-1) != 1 or w.stride(-2) != nbytes:
        raise ValueError(f"{qtype.name} rows of {n_cols} values take {nbytes} bytes, laid out "
                         f"back to back; got shape {tuple(w.shape)} strides {w.stride()}")
    return nbytes


def check_x(x: torch.Tensor, n_cols: int) -> None:
    if x.dim() != 2 or x.shape[1] != n_cols or x.stride(1) != 1:
        raise ValueError(f"x must be [M, {n_cols}] with contiguous rows, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x must be bfloat16 or float32, got {x.dtype}")


def gemv_config(fmt: KernelFormat, m: int, n: int, k: int = 0, ctas: int = 1,
                tile: tuple[int, int, int, int] | None = None,
                base_tile: tuple[int, int, int, int] | None = None) -> tuple[int, int, int, int]:
    """(BN rows per CTA, BK values per step, pipeline stages, warps) for the FMA kernel: the
    type's tile (formats.py), BN divided by the tokens (each keeps its own accumulator) and by
    what it takes to give every SM four CTAs when N (times `ctas` independent problems) is
    short; BK from k_step. tile: one token's tile as is (else GEMV_TUNE's for the
    shape); base_tile: instead of the type's, adjusted as it is."""
    tuned = (tile or GEMV_TUNE.get((int(fmt.qtype), n, k))) if m == 1 else None
    if tuned is not None:
        return tuned
    bn, bk, stages, warps = base_tile or fmt.gemv
    bn = max(1, bn // triton.next_power_of_2(m))
    while bn > 1 and triton.cdiv(n, bn) * ctas < 4 * sm_count():
        bn //= 2
    return bn, k_step(bk, k, fmt.group), stages, warps


def k_step(bk: int, k: int, group: int) -> int:
    """BK of a GEMV-like kernel over rows of k values (k 0: unknown, BK as given): halved while
    it leaves over an eighth of k masked in the last step (such a kernel's steps run one after
    another, each waiting one memory latency: gpt-oss's 2880 took 90 steps of 32 when BK
    halved down to a divisor, 6 of 512 with 192 masked now), never below the type's group."""
    while k and k % bk and bk > group and (-k % bk) * 8 > k:
        bk //= 2
    return max(bk, group)


_SMS: list[int] = []


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU (1 under the interpreter, where fewer,
    bigger programs run faster)."""
    if not _SMS:
        ok = torch.cuda.is_available() and not knobs.runtime.interpret
        props = torch.cuda.get_device_properties(torch.cuda.current_device()) if ok else None
        _SMS.append(props.multi_processor_count if props is not None else 1)
    return _SMS[0]


def gemm_config(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages): 128 x 128 tiles for prompts; BM shrinks for short
    inputs so tokens are not padded 8x, BN until there are two tiles per SM; BK = 64 keeps the
    dequantized tile at 32 values per thread."""
    bm = 128 if m > 64 else max(16, triton.next_power_of_2(m))
    bn = 128
    while bn > 32 and triton.cdiv(m, bm) * triton.cdiv(n, bn) < 2 * sm_count():
        bn //= 2
    return bm, bn, 64, 8 if bm >= 64 else 4, 3


def gemm_split(tiles: int, k: int, bk: int) -> int:
    """Splits of K for the tensor-core kernel: where its (BM x BN) tiles leave SMs idle (a few
    tokens over a short matrix: 128 tiles of the 30B-A3B's 4096 x 2048 q took 21.8 us at 1-16
    tokens, flat, one program a tile walking 32 steps of K), enough splits to give every SM
    two programs, each at least GEMM_SPLIT_MIN_STEPS steps of BK; their partial sums are added
    after (a [split, M, N] float32 scratch, summed in a fixed order: deterministic)."""
    steps = triton.cdiv(k, bk)
    split = 1
    while (tiles * split < 2 * sm_count() and steps // (2 * split) >= GEMM_SPLIT_MIN_STEPS):
        split *= 2
    return split


def dot_dtype() -> tl.dtype:
    """bf16 tensor-core operands; float32 under the interpreter, whose bf16 tl.dot multiplies
    the raw bits (Triton 3.6 with NumPy 2.4)."""
    return tl.float32 if knobs.runtime.interpret else tl.bfloat16


def dequantize_gpu(w: torch.Tensor, qtype: int | QType, n_cols: int,
                   dtype: torch.dtype = torch.bfloat16,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """uint8 [N, row_nbytes] -> dtype [N, n_cols] with the fused tile (the dequantize half of
    dequantize -> cuBLAS, and the tiles' own test). The tiles compute d * (q - c) as one FMA,
    so float32 results match strata.quant.dequantize to within a rounding of the block scale."""
    qtype = QType(qtype)
    fmt = kernel_format(qtype)
    if fmt is None:
        log_fallback("dequantize_gpu", qtype)
        return dequantize(w, qtype, n_cols).to(dtype)
    nbytes = check_weights(w, qtype, n_cols)
    n = w.shape[0]
    if out is None:
        out = torch.empty(n, n_cols, dtype=dtype, device=w.device)
    elif out.shape != (n, n_cols) or out.stride(1) != 1:
        raise ValueError(f"out must be [{n}, {n_cols}] with contiguous rows")
    bn, bk = 16, 256
    tab, tab2 = fmt.tables(w.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(n_cols, bk))
    _dequant_kernel[grid](w, out, tab, tab2, n, n_cols, nbytes, out.stride(0), QT=int(qtype),
                          S=fmt.group, BN=bn, BK=bk, EVEN_K=n_cols % bk == 0, num_warps=4)
    return out


def quant_matmul(x: torch.Tensor, w: torch.Tensor, qtype: int | QType,
                 out: torch.Tensor | None = None, *,
                 tile: tuple[int, int, int, int] | None = None,
                 base_tile: tuple[int, int, int, int] | None = None,
                 rows_tile: tuple[int, int, int, int] | None = None,
                 dequant_min_m: int = DEQUANT_MIN_M,
                 gemv_max_m: int = GEMV_MAX_M, split_k: int | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """y[t, n] = Σ_k x[t, k] · W[n, k] (+ bias[n]: float32 [N], contiguous; one token's GEMV
    adds it as it stores y, other calls after). x [M, K] bf16/f32, w uint8 [N, row_nbytes(K)]
    -> f32.
    For benchmarks (defaults: strata.kernels.tuning's): tile, one token's FMA tile (BN, BK,
    stages, warps) as is; base_tile, the FMA tile instead of the type's (still fitted to M, N
    and K); rows_tile, one token on the rows kernel with (R, BK, stages, warps); dequant_min_m,
    the tokens from which the weights are dequantized for cuBLAS; gemv_max_m, the most tokens
    the FMA GEMV takes (past it the tensor-core kernel); split_k, the tensor-core kernel's
    splits of K (None: gemm_split's)."""
    qtype = QType(qtype)
    k = x.shape[-1]
    fmt = kernel_format(qtype)
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (w.shape[0],)
                             or not bias.is_contiguous() or bias.device != w.device):
        raise ValueError(f"bias must be float32 [{w.shape[0]}], contiguous, on {w.device}")
    if fmt is None:
        y = fallback_matmul(x, w, qtype, k)
        return y if bias is None else y.add_(bias)
    check_x(x, k)
    nbytes = check_weights(w, qtype, k)
    if x.device != w.device:
        raise ValueError(f"x on {x.device}, weights on {w.device}")
    m, n = x.shape[0], w.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    elif out.shape != (m, n) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{m}, {n}] with contiguous rows")
    if m > 0 and n > 0:
        fused_bias = _launch(x, w, out, fmt, nbytes, tile, base_tile, rows_tile, dequant_min_m,
                             gemv_max_m, split_k, bias)
        if bias is not None and not fused_bias:
            out.add_(bias)
    return out


def _launch(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, fmt: KernelFormat,
            nbytes: int, tile: tuple[int, int, int, int] | None = None,
            base_tile: tuple[int, int, int, int] | None = None,
            rows_tile: tuple[int, int, int, int] | None = None,
            dequant_min_m: int = DEQUANT_MIN_M, gemv_max_m: int = GEMV_MAX_M,
            split_k: int | None = None, bias: torch.Tensor | None = None) -> bool:
    """The launches of quant_matmul; -> whether they added bias (one token's GEMVs do)."""
    m, k = x.shape
    n = w.shape[0]
    tab, tab2 = fmt.tables(x.device)
    rows_tile = (rows_tile or GEMV_ROWS_TUNE.get((int(fmt.qtype), n, k))) if m == 1 else None
    if rows_tile is not None:
        _launch_rows(x, w, out, fmt, nbytes, rows_tile, bias)
        return bias is not None
    if m <= gemv_max_m:
        bm = triton.next_power_of_2(min(m, GEMV_GROUP))
        groups = triton.cdiv(m, bm)
        bn, bk, stages, warps = gemv_config(fmt, bm, n, k, ctas=groups, tile=tile,
                                            base_tile=base_tile)
        one = bias is not None and bm == 1
        _gemv_kernel[(triton.cdiv(n, bn) * groups,)](
            x, w, out, tab, tab2, m, n, k, groups, nbytes, x.stride(0), out.stride(0),
            QT=int(fmt.qtype), S=fmt.group, BM=bm, BN=bn, BK=bk, EVEN_K=k % bk == 0,
            STAGES=stages, bias=bias if one else out, BIAS=one, num_warps=warps)
        return one
    if m >= dequant_min_m and not knobs.runtime.interpret:
        w16 = dequantize_gpu(w, fmt.qtype, k, torch.bfloat16)  # [N, K]
        mm_f32(x.to(torch.bfloat16), w16.T, out)
    else:
        bm, bn, bk, warps, stages = gemm_config(m, n)
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        split = gemm_split(tiles, k, bk) if split_k is None else split_k
        span = triton.cdiv(triton.cdiv(k, bk), split) * bk
        y = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        _gemm_kernel[(tiles, split)](
            x, w, y, tab, tab2, m, n, k, span, nbytes, x.stride(0), y.stride(-2),
            y.stride(0) if split > 1 else 0, QT=int(fmt.qtype), S=fmt.group, BM=bm, BN=bn,
            BK=bk, GROUP_M=8, EVEN_K=k % bk == 0, DOT=dot_dtype(), num_warps=warps,
            num_stages=stages)
        if split > 1:
            torch.sum(y, 0, out=out)
    return False


def gemv_pair(x: torch.Tensor, a: tuple[torch.Tensor, int | QType],
              b: tuple[torch.Tensor, int | QType],
              out: tuple[torch.Tensor, torch.Tensor] | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x W_a^T, x W_b^T) for one token and two matrices of different types (a = (w, qtype)):
    one launch (`_gemv_pair_kernel`) where both types have a tile and the token is one row on
    the weights' device, else quant_matmul twice. Each matrix takes its own tile (gemv_config,
    with the CTAs of both counted); the warps are the larger of the two tiles'. A layer whose v
    projection has another type than q and k (Q4_K_M's Q6_K v) runs its three in one launch.
    out: float32 [1, N_a] and [1, N_b] to write into (contiguous) instead of new tensors."""
    (wa, qa), (wb, qb) = a, b
    oa, ob = out if out is not None else (None, None)
    fa, fb = kernel_format(QType(qa)), kernel_format(QType(qb))
    k = x.shape[-1]
    if (fa is None or fb is None or x.dim() != 2 or x.shape[0] != 1 or x.device != wa.device
            or x.device != wb.device or not x.is_cuda and not knobs.runtime.interpret):
        return quant_matmul(x, wa, qa, out=oa), quant_matmul(x, wb, qb, out=ob)
    check_x(x, k)
    na, nb = check_weights(wa, fa.qtype, k), check_weights(wb, fb.qtype, k)
    n_a, n_b = wa.shape[0], wb.shape[0]
    ya, yb = (torch.empty(1, n, dtype=torch.float32, device=x.device) if o is None else o
              for o, n in ((oa, n_a), (ob, n_b)))
    for name, y, n in (("out[0]", ya, n_a), ("out[1]", yb, n_b)):
        if y.shape != (1, n) or y.dtype != torch.float32 or not y.is_contiguous():
            raise ValueError(f"{name} must be float32 [1, {n}], contiguous")
    bna, bka, sta, wpa = gemv_config(fa, 1, n_a, k)
    bnb, bkb, stb, wpb = gemv_config(fb, 1, n_b, k)
    ga = triton.cdiv(n_a, bna)
    ta, ta2 = fa.tables(x.device)
    tb, tb2 = fb.tables(x.device)
    _gemv_pair_kernel[(ga + triton.cdiv(n_b, bnb),)](
        x, wa, wb, ya, yb, ta, ta2, tb, tb2, n_a, n_b, k, na, nb, ga, QA=int(fa.qtype),
        SA=fa.group, BNA=bna, BKA=bka, STA=sta, QB=int(fb.qtype), SB=fb.group, BNB=bnb,
        BKB=bkb, STB=stb, EVEN_A=k % bka == 0, EVEN_B=k % bkb == 0, num_warps=max(wpa, wpb))
    return ya, yb


def gemv_rows(x: torch.Tensor, w: torch.Tensor, qtype: int | QType,
              tile: tuple[int, int, int, int] = (4, 1024, 1, 2),
              out: torch.Tensor | None = None) -> torch.Tensor:
    """y [1, N] f32 = x W^T for one token (x [1, K] bf16/f32) by the rows kernel; tile = (R rows
    a program: 1, 2, 4 or 8; BK values a step; pipeline stages; warps). quant_matmul takes this
    kernel for the shapes in GEMV_ROWS_TUNE."""
    qtype = QType(qtype)
    fmt = kernel_format(qtype)
    if fmt is None:
        raise ValueError(f"gemv_rows: no dequantize tile for {qtype.name}")
    k = x.shape[-1]
    check_x(x, k)
    nbytes = check_weights(w, qtype, k)
    n = w.shape[0]
    if x.shape[0] != 1 or x.device != w.device:
        raise ValueError(f"gemv_rows: one token on the weights' device, got x {tuple(x.shape)} "
                         f"on {x.device}, weights on {w.device}")
    r, bk = tile[0], tile[1]
    if r not in (1, 2, 4, 8) or bk % fmt.group or bk & (bk - 1):
        raise ValueError(f"gemv_rows: R in (1, 2, 4, 8) and BK a power of two multiple of "
                         f"{fmt.group} for {qtype.name}, got tile {tile}")
    if out is None:
        out = torch.empty(1, n, dtype=torch.float32, device=x.device)
    elif out.shape != (1, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be float32 [1, {n}], contiguous")
    if n > 0:
        _launch_rows(x, w, out, fmt, nbytes, tile)
    return out


def _launch_rows(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, fmt: KernelFormat,
                 nbytes: int, tile: tuple[int, int, int, int],
                 bias: torch.Tensor | None = None) -> None:
    r, bk, stages, warps = tile
    k = x.shape[1]
    n = w.shape[0]
    tab, tab2 = fmt.tables(x.device)
    # WIDE: 8-aligned rows (Q4_K and Q5_K row bytes are multiples of 16), whose block headers
    # the tiles read as two u64
    _gemv_rows_kernel[(triton.cdiv(n, r),)](x, w, out, tab, tab2, n, k, nbytes,
                                            QT=int(fmt.qtype), S=fmt.group, R=r, BK=bk,
                                            EVEN_K=k % bk == 0, STAGES=stages,
                                            WIDE=w.data_ptr() % 8 == 0,
                                            bias=out if bias is None else bias,
                                            BIAS=bias is not None, num_warps=warps)


_MM_DTYPE: list[bool] = []


def mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """out (float32) = a @ b for bf16 a, b: cuBLAS with a float32 output where torch offers it
    (mm's out_dtype), else a bf16 product widened into out."""
    if not _MM_DTYPE or _MM_DTYPE[0]:
        try:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
            _MM_DTYPE[:] = [True]
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_DTYPE[:] = [False]
    out.copy_(torch.mm(a, b))


_LOGGED: set[str] = set()


def log_fallback(what: str, qtype: QType) -> None:
    """One log line per (entry point, type) that runs without a fused kernel."""
    key = f"{what}/{qtype.name}"
    if key not in _LOGGED:
        _LOGGED.add(key)
        how = "torch.matmul" if qtype in FLOAT_TYPES else "dequantize -> matmul"
        log.info("%s: no fused kernel for %s, using %s", what, qtype.name, how)


def fallback_matmul(x: torch.Tensor, w: torch.Tensor, qtype: QType, n_cols: int) -> torch.Tensor:
    """The unfused path: dequantize (or view the float rows) and torch.matmul in float32."""
    log_fallback("quant_matmul", qtype)
    return x.float() @ dequantize(w, qtype, n_cols).T
