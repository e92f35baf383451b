"""A prompt chunk's (or a batch's) MoE layer on integer tensor cores: pairs grouped by expert, x
rounded to 8 bits per 32 values, the weights' quants multiplied as int8 (llama.cpp's MMQ idea).

    moe_forward_mmq(x, ids, weights, slot_of_expert, gate_slots, up_slots, down_slots,
                    (QType.Q4_K, QType.Q4_K, QType.Q6_K), d_model, d_expert, out)

Same contract as moe.moe_forward (out [T, D] float32 += the resident pairs' weighted outputs),
for Q4_K gate and up and a Q4_K or Q6_K down, D and F multiples of 256, no biases; or MXFP4
gate, up and down (gpt-oss), D and F multiples of 64, with its biases and clamped SwiGLU
(`mmq_kernel_types`; moe_forward picks these for MXFP4 only where tuning.MMQ_MXFP4 says:
`mmq_types`).

Why: the tl.dot group kernels (moe._prompt) turn every weight into a bf16 value before the dot,
some fifteen operations a weight, for the ~8 tokens an expert gets in a 128-token chunk of
Qwen3-30B-A3B: ALU-bound at ~14% of HBM speed (bench/2026-12-02-h200-prompt-graphs.md). Here
a weight costs a shift, a mask and a convert, and its block's scales are applied to [BM, BN]
integer sums once per 32 values:

    a Q4_K sub-block j of row n (32 values, w = dl·q - ml, q the nibbles, dl = d·sc, ml =
    dmin·mn) against token t's x ≈ dx·xq (quantize_x: xq int8, dx = max|x| / 127, sx = dx Σ xq):
        Σ w x ≈ dl · dx · Σ q xq  -  ml · sx
    a Q6_K pair of 16-value sub-blocks (w = d·sc·(q - 32), sc int8): the two halves' integer
    sums taken apart (the other half's quants zeroed) and scaled each, d · dx · (sc_a I_a +
    sc_b I_b)
    an MXFP4 block (32 values, w = 2^(e-127) · v, v an E2M1 value in ±{0, .5, 1, 1.5, 2, 3, 4,
    6}): the doubled values are int8, so Σ w x ≈ 2^(e-128) · dx · Σ (2v) xq; biases added to g,
    u before the activation and w · b_down to each pair's row

1. Pairs sorted by expert on the device (pairs.sort_pairs, as moe._prompt: no host sync).
2. `_gate_up_mmq_kernel`, program (expert, BM of its pairs, BN rows of F): h = w · silu(g) · u
   in float32 [P, F] (rows in sorted order); then quantize_x(h) per pair row, as the per-pair
   kernels round each pair's h.
3. `_down_mmq_kernel`, program (expert, BM pairs, BN rows of D): each pair's row at its pair id
   in y [P, D] (zero for pairs whose expert has no slot); out += y.view(T, K, D).sum(1), a fixed
   order.

The integer sums are exact; the result differs from the per-pair kernels' (moe._decode with
x8, which round x and h the same way) by the order of float32 additions, and where that moves
an element of h across a rounding boundary of its 8 bits, by one step of it. moe_forward takes
this path for the calls it would give tl.dot when x8 (--kernels fused) and mmq_types allow:
1.4-1.5x tl.dot's speed from 8 to 128 tokens of the 30B-A3B layer on an H100
(tuning.MMQ_PROMPT); scripts/bench_kernels.py --moe-prompt-only times it beside the others.

`mmq_matmul` runs a dense Q4_K or Q6_K matrix on the down kernel (one expert, every token
routed to it with weight 1): for a batched decode step's rows over the output head, timed by
scripts/bench_kernels.py --dense-batch.

Legend: T tokens, K experts a token, P = T·K pairs, E experts, D d_model, F d_expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.gpu.bits import e8m0_half, f16, f16_bits, mx_doubled, mx_join_order, u8, u16
from strata.kernels.gpu.pairs import (
    bias_row,
    check_bias,
    expert_chunk,
    glu,
    sort_pairs,
    words_aligned,
)
from strata.kernels.gpu.tiles_kquants import scale_min
from strata.kernels.tuning import (
    DENSE_MMQ_MIN_N,
    DEQUANT_MIN_M,
    GEMV_MAX_M,
    MMQ_MXFP4,
    MMQ_TILE,
    MMQ_TILE_WIDE,
    MMQ_WIDE_MIN,
)
from strata.quant import QType

# the byte alignment each type's rows need here: Q4_K headers read as int32 words (_q4k_head),
# Q6_K quants as int16 words (_bytes32)
WORD_ALIGN = {QType.Q4_K: 4, QType.Q6_K: 2}


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """h and y: left uninitialized (tests swap in a NaN-filled version, as for moe.py's)."""
    return torch.empty(shape, dtype=dtype, device=device)


def mmq_types(qtypes: tuple[int, int, int], d: int, f: int, bias: object = None,
              act: str = "swiglu") -> bool:
    """moe_forward's own pick takes this path for the layer: Q4_K gate and up, a Q4_K or Q6_K
    down, D and F multiples of 256, plain SwiGLU without biases; MXFP4 everywhere (gpt-oss:
    biases and the clamped SwiGLU too) where tuning.MMQ_MXFP4 says (mmq_kernel_types: what the
    kernels compute when asked by path="mmq")."""
    mx = all(QType(q) == QType.MXFP4 for q in qtypes)
    return mmq_kernel_types(qtypes, d, f, bias, act) and (MMQ_MXFP4 or not mx)


def mmq_kernel_types(qtypes: tuple[int, int, int], d: int, f: int, bias: object = None,
                     act: str = "swiglu") -> bool:
    """The kernels compute the layer: as mmq_types, and MXFP4 gate, up and down with D and F
    multiples of 64 (quantize_x's rows), with or without biases, either activation."""
    qg, qu, qd = (QType(q) for q in qtypes)
    if qg == qu == qd == QType.MXFP4:
        return d % 64 == 0 and f % 64 == 0
    return (qg == qu == QType.Q4_K and qd in (QType.Q4_K, QType.Q6_K) and d % 256 == 0
            and f % 256 == 0 and bias is None and act == "swiglu")


def mmq_aligned(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                qtypes: tuple[int, int, int]) -> bool:
    """Whether the kernels can read these slots: every Q4_K part's rows 4-byte aligned (their
    block headers are read as int32 words, _q4k_head), every Q6_K part's 2-byte aligned (read
    as int16 words, _bytes32)."""
    return all(words_aligned(t, align=WORD_ALIGN.get(QType(q), 1))
               for t, q in zip((gate, up, down), qtypes, strict=True))


@triton.jit
def _q4k_head(rows, kb):
    """The header of 256-value block kb of the Q4_K rows at `rows` (uint8 pointers [BN], every
    row 4-byte aligned: moe_forward_mmq checks) as four int32 words [BN] each: d and dmin, then
    the 12 scale bytes (one load each, where a byte at a time took three a sub-block)."""
    w = (rows + kb * 144).to(tl.pointer_type(tl.int32))
    return tl.load(w), tl.load(w + 1), tl.load(w + 2), tl.load(w + 3)


@triton.jit
def _q4k_scales(I: tl.constexpr, h1, h2, h3):
    """The 6-bit (scale, min) [BN] of sub-block I from a Q4_K header's words h1..h3
    (_q4k_head): bytes 4 + j, 8 + j, 12 + j of the header are byte j of h1..h3 (j = I % 4)."""
    sh: tl.constexpr = 8 * (I % 4)
    return scale_min((h1 >> sh) & 255, (h2 >> sh) & 255, (h3 >> sh) & 255, I)


@triton.jit
def _q4k_dot(acc, rows, xq, xd, xs, tok, rm, K: tl.constexpr, s):
    """acc [BM, BN] += Σ over K of the Q4_K rows (pointers [BN]) times the BM tokens' 8-bit x
    rows (xq int8 [*, K] at rows tok [BM]; dx [*, K/32]; xs4 [*, K/64, 4]). A block's 32 quant
    bytes c hold sub-block 2c in their low nibbles and 2c + 1 in their high ones: loaded once
    for both. Per 256-value block, Σ_i d·sc_i·dx_i·I_i - dmin·mn_i·sx_i with the block's d and
    dmin taken out of the sum over its eight sub-blocks i (w = d·sc·q - dmin·mn): a sub-block
    costs an integer multiply (I_i · sc_i, exact) and two FMAs an element, the block's scales
    one multiply-add each at its end."""
    for kb in range(0, K // 256):
        h0, h1, h2, h3 = _q4k_head(rows, kb)
        main = tl.zeros(acc.shape, tl.float32)
        mins = tl.zeros(acc.shape, tl.float32)
        for c in tl.static_range(4):
            qs = tl.load(rows[:, None] + (kb * 144 + 16 + c * 32) + s[None, :])  # uint8 [BN, 32]
            for half in tl.static_range(2):
                blk = kb * 8 + 2 * c + half
                xv = tl.load(xq + tok[:, None] * K + blk * 32 + s[None, :], mask=rm[:, None],
                             other=0)  # int8 [BM, 32]
                dx = tl.load(xd + tok * (K // 32) + blk, mask=rm, other=0.0)
                sx = tl.load(xs + tok * (K // 16) + (blk // 2) * 4 + 2 + half, mask=rm,
                             other=0.0)
                sc, mn = _q4k_scales(2 * c + half, h1, h2, h3)
                q = ((qs >> (half * 4)) & 15).to(tl.int8)
                isum = tl.dot(xv, tl.trans(q), out_dtype=tl.int32)  # [BM, BN], |I| <= 32·127·15
                main += (isum * sc[None, :]).to(tl.float32) * dx[:, None]  # (|I·sc| < 2^22)
                mins += sx[:, None] * mn.to(tl.float32)[None, :]
        acc += main * f16_bits(h0)[None, :] - mins * f16_bits(h0 >> 16)[None, :]
    return acc


@triton.jit
def _bytes32(p, s16):
    """The 32 bytes at 2-aligned byte pointers p [BN], in order, as int32 [BN, 32] 0..255:
    sixteen int16 loads a row, each split into its two bytes (a Q6_K block is 210 bytes, so
    half its rows' blocks are 2 mod 4: no wider load is known aligned, and byte loads took 32
    a row)."""
    w = tl.load(p.to(tl.pointer_type(tl.int16))[:, None] + s16[None, :]).to(tl.int32)
    return tl.reshape(tl.join(w & 255, (w >> 8) & 255), (w.shape[0], 32))


@triton.jit
def _q6k_dot(acc, rows, xq, xd, tok, rm, K: tl.constexpr, s):
    """_q4k_dot for Q6_K rows: per 32 values two 16-value sub-blocks, each its own int8 scale
    (both in one int16 load), their integer sums scaled and added in int32 (|I_a sc_a + I_b
    sc_b| <= 2 · 16·127·32 · 128 < 2^24: exact in float32), then one FMA an element for the
    32 values' dx, and the block's d once at its end."""
    half = s < 16
    s16 = tl.arange(0, 16)
    for kb in range(0, K // 256):
        b = rows + kb * 210
        main = tl.zeros(acc.shape, tl.float32)
        for c in tl.static_range(8):  # 32 values: sub-blocks 2c, 2c + 1
            blk = kb * 8 + c
            xv = tl.load(xq + tok[:, None] * K + blk * 32 + s[None, :], mask=rm[:, None],
                         other=0)
            dx = tl.load(xd + tok * (K // 32) + blk, mask=rm, other=0.0)
            ql = _bytes32(b + ((c // 4) * 64 + (c % 2) * 32), s16)
            qh = _bytes32(b + (128 + (c // 4) * 32), s16)
            q = (((ql >> (((c // 2) % 2) * 4)) & 15) | (((qh >> ((c % 4) * 2)) & 3) << 4)) - 32
            sab = u16(b + 192 + 2 * c, None)  # [BN]: the two int8 scales
            sa = ((sab & 255) ^ 0x80) - 128
            sb = ((sab >> 8) ^ 0x80) - 128
            ia = tl.dot(xv, tl.trans(tl.where(half[None, :], q, 0).to(tl.int8)),
                        out_dtype=tl.int32)
            ib = tl.dot(xv, tl.trans(tl.where(half[None, :], 0, q).to(tl.int8)),
                        out_dtype=tl.int32)
            main += (ia * sa[None, :] + ib * sb[None, :]).to(tl.float32) * dx[:, None]
        acc += main * f16(b + 208, None)[None, :]
    return acc


@triton.jit
def _mxfp4_dot(acc, rows, xq, xd, tok, rm, K: tl.constexpr, s):
    """_q4k_dot for MXFP4 rows (17-byte blocks: E8M0 e, then 16 bytes whose low nibbles are
    values 0-15 and high nibbles 16-31; any byte alignment): per block an int8 dot of x with
    twice the values, times 2^(e-128) dx (the doubled values' half folded into the scale). A
    block's 16 bytes are read once and both nibbles joined, and x's block is read in that
    joined order (bits.mx_join_order)."""
    BN: tl.constexpr = rows.shape[0]
    j = tl.arange(0, 16)[None, :]
    xcol = mx_join_order(s)[None, :]  # [1, 32]: x's value at each joined column
    for blk in range(0, K // 32):
        b = rows + blk * 17  # [BN]
        qs = tl.load(b[:, None] + 1 + j).to(tl.int32)  # [BN, 16]
        q = tl.reshape(tl.join(mx_doubled(qs & 15), mx_doubled(qs >> 4)), (BN, 32)).to(tl.int8)
        xv = tl.load(xq + tok[:, None] * K + blk * 32 + xcol, mask=rm[:, None],
                     other=0)  # int8 [BM, 32]
        dx = tl.load(xd + tok * (K // 32) + blk, mask=rm, other=0.0)
        e = u8(b, None)
        d = e8m0_half(e)
        isum = tl.dot(xv, tl.trans(q), out_dtype=tl.int32)  # [BM, BN]
        acc += isum.to(tl.float32) * dx[:, None] * d[None, :]
    return acc


@triton.jit(do_not_specialize=["NC"])
def _gate_up_mmq_kernel(xq, xd, xs, counts, starts, order, wts, slot_of, gate, up, h, bg, bu,
                        NC, stride_gs, stride_us, row_bytes, D: tl.constexpr, F: tl.constexpr,
                        TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                        MX: tl.constexpr = False, BIAS: tl.constexpr = False,
                        OAI: tl.constexpr = False):
    # h[start + r, n] = w · silu(x[tok] · G_e[n]) · (x[tok] · U_e[n]) for BM pairs of expert e
    # (MX: MXFP4 rows; BIAS: + bg[e, n], bu[e, n] before the activation; OAI: the clamped SwiGLU)
    e, live, start, r, rm, pair = expert_chunk(tl.program_id(0), NC, counts, starts, order, BM)
    if live:
        slot = tl.load(slot_of + e)
        if slot >= 0:
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            nn = tl.minimum(n, F - 1).to(tl.int64) * row_bytes
            s = tl.arange(0, 32)
            tok = (pair // TOPK).to(tl.int64)
            zero = tl.zeros((BM, BN), dtype=tl.float32)
            gr = gate + slot.to(tl.int64) * stride_gs + nn
            ur = up + slot.to(tl.int64) * stride_us + nn
            if MX:
                g = _mxfp4_dot(zero, gr, xq, xd, tok, rm, D, s)
                u = _mxfp4_dot(zero, ur, xq, xd, tok, rm, D, s)
            else:
                g = _q4k_dot(zero, gr, xq, xd, xs, tok, rm, D, s)
                u = _q4k_dot(zero, ur, xq, xd, xs, tok, rm, D, s)
            if BIAS:
                g += bias_row(bg, e, n, F)[None, :]
                u += bias_row(bu, e, n, F)[None, :]
            w = tl.load(wts + pair, mask=rm, other=0.0).to(tl.float32)
            hv = glu(g, u, OAI) * w[:, None]
            ptrs = h + (start + r).to(tl.int64)[:, None] * F + n[None, :]
            tl.store(ptrs, hv, mask=rm[:, None] & (n < F)[None, :])


@triton.jit(do_not_specialize=["NC"])
def _down_mmq_kernel(hq, hd, hs, counts, starts, order, slot_of, down, y, wts, bd, NC,
                     stride_ds, row_bytes, D: tl.constexpr, F: tl.constexpr, Q6: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, MX: tl.constexpr = False,
                     BIAS: tl.constexpr = False):
    # y[pair, n] = h[start + r] · D_e[n] (h already weighted; zero for experts without a slot;
    # MX: MXFP4 rows; BIAS: + w · bd[e, n])
    e, live, start, r, rm, pair = expert_chunk(tl.program_id(0), NC, counts, starts, order, BM)
    if live:
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        slot = tl.load(slot_of + e)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if slot >= 0:
            rows = down + slot.to(tl.int64) * stride_ds + tl.minimum(n, D - 1).to(tl.int64) \
                * row_bytes
            s = tl.arange(0, 32)
            hrow = (start + r).to(tl.int64)
            if MX:
                acc = _mxfp4_dot(acc, rows, hq, hd, hrow, rm, F, s)
            elif Q6:
                acc = _q6k_dot(acc, rows, hq, hd, hrow, rm, F, s)
            else:
                acc = _q4k_dot(acc, rows, hq, hd, hs, hrow, rm, F, s)
            if BIAS:
                w = tl.load(wts + pair, mask=rm, other=0.0).to(tl.float32)
                acc += w[:, None] * bias_row(bd, e, n, D)[None, :]
        ptrs = y + pair.to(tl.int64)[:, None] * D + n[None, :]
        tl.store(ptrs, acc, mask=rm[:, None] & (n < D)[None, :])


def mmq_tile(t: int, topk: int, experts: int) -> tuple[int, int, int]:
    """(BM, BN, warps) for t tokens of top-`topk` routing over `experts`: the wider tile where
    an expert serves MMQ_WIDE_MIN tokens or more on average (strata.kernels.tuning)."""
    return MMQ_TILE_WIDE if t * topk >= MMQ_WIDE_MIN * experts else MMQ_TILE


def moe_forward_mmq(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    slot_of: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    down: torch.Tensor, qtypes: tuple[int, int, int], out: torch.Tensor,
                    tile: tuple[int, int, int] | None = None,
                    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                    act: str = "swiglu") -> torch.Tensor:
    """out [T, D] float32 += the resident pairs' outputs (the module doc); x [T, D] f32/bf16,
    ids [T, K], weights [T, K], slot_of int32 [E], gate/up uint8 [slots, F, row(D)], down
    [slots, D, row(F)]. tile: (BM, BN, warps) instead of mmq_tile's (benchmarks). bias, act: as
    moe.moe_forward's (MXFP4 layers only: mmq_kernel_types)."""
    from strata.kernels.gpu.gemv_q8 import quantize_x

    t, d = x.shape
    topk, f, e = ids.shape[1], gate.shape[1], slot_of.shape[0]
    if not mmq_kernel_types(qtypes, d, f, bias, act):
        raise ValueError(f"moe_forward_mmq: types {[QType(q).name for q in qtypes]} with D {d}, "
                         f"F {f}: give Q4_K gate/up, a Q4_K or Q6_K down, D and F multiples of "
                         "256, or MXFP4 everywhere with D and F multiples of 64")
    check_bias(bias, act, e, d, f, x.device)
    if not mmq_aligned(gate, up, down, qtypes):
        raise ValueError("moe_forward_mmq: Q4_K rows must start 4-byte aligned, Q6_K rows 2-byte "
                         "aligned (read as int32 and int16 words)")
    if t == 0 or topk == 0:
        return out
    mx = QType(qtypes[0]) == QType.MXFP4
    bg, bu, bd = bias if bias is not None else (out, out, out)  # (unread without BIAS)
    counts, starts, order = sort_pairs(ids, e)
    bm, bn, warps = tile or mmq_tile(t, topk, e)
    nc = triton.cdiv(t, bm)  # (an expert takes at most one pair per token)
    xq, xd, xs = quantize_x(x.contiguous())
    h = scratch((t * topk, f), torch.float32, x.device)
    w = weights.contiguous()
    _gate_up_mmq_kernel[(e * nc, triton.cdiv(f, bn))](
        xq, xd, xs, counts, starts, order, w, slot_of, gate, up, h, bg, bu, nc,
        gate.stride(0), up.stride(0), gate.shape[2], D=d, F=f, TOPK=topk, BM=bm, BN=bn, MX=mx,
        BIAS=bias is not None, OAI=act == "swiglu_oai", num_warps=warps)
    hq, hd, hs = quantize_x(h)  # (rows of experts without a slot: never read)
    y = scratch((t * topk, d), torch.float32, x.device)
    _down_mmq_kernel[(e * nc, triton.cdiv(d, bn))](
        hq, hd, hs, counts, starts, order, slot_of, down, y, w, bd, nc, down.stride(0),
        down.shape[2], D=d, F=f, Q6=QType(qtypes[2]) == QType.Q6_K, BM=bm, BN=bn, MX=mx,
        BIAS=bias is not None, num_warps=warps)
    out += y.view(t, topk, d).sum(1)
    return out


def mmq_matmul_takes(x: torch.Tensor, w: torch.Tensor, qtype: int | QType) -> bool:
    """Whether x @ W.T on 8-bit activations goes to mmq_matmul (weights.QuantTensor.matmul_t,
    --kernels fused): more tokens than the FMA GEMV takes and fewer than the cuBLAS route's
    (tuning.GEMV_MAX_M, DEQUANT_MIN_M), a Q4_K / Q6_K matrix of at least tuning.DENSE_MMQ_MIN_N
    rows (the output head) that it can read as words."""
    qtype = QType(qtype)
    m, k = x.shape
    align = WORD_ALIGN.get(qtype)
    return (DENSE_MMQ_MIN_N is not None and GEMV_MAX_M < m < DEQUANT_MIN_M
            and align is not None and w.dim() == 2 and w.shape[0] >= DENSE_MMQ_MIN_N
            and k % 256 == 0 and w.stride(1) == 1 and words_aligned(w, align=align))


def mmq_matmul(x: torch.Tensor, w: torch.Tensor, qtype: int | QType,
               out: torch.Tensor | None = None,
               tile: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y [M, N] float32 = x W^T on the integer tensor cores: a dense matrix as one expert that
    every token routes to with weight 1, through `_down_mmq_kernel` (x rounded to 8 bits per 32
    values, as the one-token x8 GEMVs round it). x [M, K] f32/bf16 contiguous; w uint8 [N,
    row(K)] Q4_K (rows 4-byte aligned) or Q6_K (2-byte aligned), K a multiple of 256. For a
    batched decode step's rows over a tall matrix (the output head: one program a 64-row tile,
    thousands of them): where mmq_matmul_takes says. tile: (BM,
    BN, warps), MMQ_TILE's by default."""
    from strata.kernels.gpu.gemv_q8 import quantize_x
    from strata.kernels.gpu.matmul import check_weights

    qtype = QType(qtype)
    m, k = x.shape
    n = w.shape[0]
    if qtype not in (QType.Q4_K, QType.Q6_K) or k % 256:
        raise ValueError(f"mmq_matmul: Q4_K or Q6_K rows of a multiple of 256 values, got "
                         f"{qtype.name} with {k}")
    if w.dim() != 2 or w.stride(1) != 1 or not words_aligned(w, align=WORD_ALIGN[qtype]):
        raise ValueError("mmq_matmul: uint8 [N, row] rows; Q4_K rows must start 4-byte "
                         "aligned, Q6_K rows 2-byte aligned (read as int32 and int16 words)")
    check_weights(w, qtype, k)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    elif out.shape != (m, n) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be float32 [{m}, {n}], contiguous")
    if m == 0 or n == 0:
        return out
    bm, bn, warps = tile or MMQ_TILE
    xq, xd, xs = quantize_x(x.contiguous())
    counts = torch.full((1,), m, dtype=torch.int32, device=x.device)
    starts = torch.zeros(1, dtype=torch.int32, device=x.device)
    order = torch.arange(m, dtype=torch.int32, device=x.device)  # (rows in their own order)
    nc = triton.cdiv(m, bm)
    # (slot_of: the one expert in slot 0, `starts`' zero; wts and bd unread without BIAS)
    _down_mmq_kernel[(nc, triton.cdiv(n, bn))](
        xq, xd, xs, counts, starts, order, starts, w, out, out, out, nc, 0, w.stride(0), D=n,
        F=k, Q6=qtype == QType.Q6_K, BM=bm, BN=bn, num_warps=warps)
    return out
