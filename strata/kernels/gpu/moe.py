"""A whole MoE layer's resident experts in two launches, reading the weights from VRAM slots.

    out = moe_forward(x, ids, weights, slot_of_expert, gate_slots, up_slots, down_slots,
                      (QType.Q4_K, QType.Q4_K, QType.Q6_K), d_model, d_expert)

    out[t] += Σ_k weights[t, k] · down_e(silu(gate_e · x[t]) ⊙ up_e · x[t]),  e = ids[t, k]

over the pairs (t, k) whose expert is resident (slot_of_expert[e] >= 0); the others add nothing
and are left to the miss path (`resident_pairs` gives the mask). Shapes: T tokens, K routed
experts per token, E experts, D d_model, F d_expert, P = T·K pairs. With the experts' biases
and gpt-oss's clamped SwiGLU (bias=, act="swiglu_oai") a pair adds
weights[t, k] · (down_e(act(gate_e · x[t] + bg_e, up_e · x[t] + bu_e)) + bd_e) on every path
(the kernels' BIAS / OAI constexprs; off, they compile as without).

Decode (T <= DECODE_MAX_T, 4; a decode step's calls without miss rows up to PAIRS_MAX_T, 64:
a batched step): `_gate_up_pairs_kernel` runs one CTA per (pair, BN rows of F)
with the FMA skeleton (gate and up share x and one K loop), writing h [P, F] already scaled by
the routing weight (zero for pairs not resident); `_down_pairs_kernel` runs one CTA per (pair,
BN rows of D) into partial rows [P, D], and each token's K partial rows are summed in a fixed
order (no atomics). With `miss` rows (gather_misses), pairs whose expert has no slot read their
record from their own row instead, so one call computes every pair.

Prompt chunks: pairs are sorted by expert (torch, on the device, no host sync); one CTA per
(expert, BM tokens, BN rows) multiplies on tensor cores, h is kept in bf16, the down kernel
writes each pair's weighted row into y [P, D] and `out += y.sum(K)`: a fixed-order
(deterministic) reduction. Chunks with grouped_min_tokens tokens per expert or more on average
go to moe_grouped.py instead: the experts dequantized to bf16, then torch._grouped_mm.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
import triton
import triton.language as tl

from strata.kernels.gpu.formats import KernelFormat, kernel_format
from strata.kernels.gpu.matmul import dot_dtype, k_step, log_fallback
from strata.kernels.gpu.pairs import (
    bias_row,
    check_bias,
    check_moe_args,
    expert_chunk,
    glu,
    pair_computed,
    record_part,
    sort_pairs,
    words_aligned,
)
from strata.kernels.gpu.skeletons import dot_tile, gemv_tile, gemv_tile2, rows
from strata.kernels.tuning import (
    DECODE_MAX_T,
    DOWN_IQ_TILE,
    DOWN_MX8_TILE,
    DOWN_Q6K_Q8_TILE,
    DOWN_Q8_TILE,
    DOWN_TILE,
    GATE_UP_IQ_TILE,
    GATE_UP_MX8_TILE,
    GATE_UP_Q8_TILE,
    GATE_UP_TILE,
    GATHER_BLOCK,
    GROUPED_MIN_TOKENS,
    IQ_GROUPED_MIN_TOKENS,
    MMQ_GROUPED_MIN_TOKENS,
    MMQ_PROMPT,
    MOE_GROUP,
    MOE_GROUP_MIN_PAIRS,
    MOE_ONCE_MIN_PAIRS,
    MXFP4_DOT_SPAN,
    MXFP4_X8,
    PAIR_MAJOR_MIN_PAIRS,
    PAIRS_MAX_T,
)
from strata.quant import QType, dequantize

_SIZES = ["T", "P", "D", "F", "NC"]
IQ_X8 = (QType.IQ2_XS, QType.IQ3_XXS)  # the i-quant types with int8-activation kernels
# moe_forward(tiles=...) keys: "gate_up" / "down_pairs" -> (BN, BK, stages, warps) instead of
# GATE_UP_TILE / DOWN_TILE; "gate_up_q8" / "down_q8" / "down_q6k_q8" / "gate_up_iq" / "down_iq"
# -> (R, BB, warps) instead of GATE_UP_Q8_TILE / DOWN_Q8_TILE / DOWN_Q6K_Q8_TILE /
# GATE_UP_IQ_TILE / DOWN_IQ_TILE; "gate_up_iq_run" -> (rows, split, warps): the i-quant gate/up
# in the run form (gemv_q8.iq_run_dot) where d_model is a multiple of 2048 and the parts 16-byte
# aligned (off unless given: strata.kernels.tuning says why); "gate_up_mx8" / "down_mx8" ->
# (R, BB, warps): MXFP4 gate/up and down on 8-bit activations (gemv_q8.mxfp4_spread_dot; off
# unless given or tuning.MXFP4_X8); "pair_major" / "once" -> (1,) or (0,): the per-pair grid
# pair-major, the expert-once kernels (moe_once.py), instead of PAIR_MAJOR_MIN_PAIRS' /
# MOE_ONCE_MIN_PAIRS' choice; "group" -> (MT, R): the Q4_K gate/up and Q4_K / Q6_K down on
# moe_once's groups of MT pairs of one expert, R rows a program (a benchmark's; not yet timed)
TILE_KEYS = ("gate_up", "down_pairs", "gate_up_q8", "down_q8", "down_q6k_q8", "gate_up_iq",
             "down_iq", "gate_up_iq_run", "gate_up_mx8", "down_mx8", "pair_major", "once",
             "group")


def _mx8(qtypes: tuple[int, ...], d: int, f: int,
         tiles: Mapping[str, tuple[int, ...]] | None) -> bool:
    """Whether an x8 decode call of these expert types takes the MXFP4 8-bit-activation kernels
    (biases and the clamped SwiGLU included): every part MXFP4, rows of whole 64-value pairs of
    blocks (quantize_x), and tuning.MXFP4_X8 or a tile of theirs given."""
    return (all(int(q) == QType.MXFP4 for q in qtypes) and d % 64 == 0 and f % 64 == 0
            and (MXFP4_X8 or bool(tiles and ("gate_up_mx8" in tiles or "down_mx8" in tiles))))


# ---- decode: per pair, FMA -------------------------------------------------------------------


@triton.jit(do_not_specialize=_SIZES)
def _gate_up_pairs_kernel(x, ids, wts, slot_of, gate, up, h, tg, tg2, tu, tu2, mg, mu, bg, bu,
                          D, F, stride_x, stride_gs, stride_us, stride_ms, rb_g, rb_u,
                          TOPK: tl.constexpr, QG: tl.constexpr, SG: tl.constexpr,
                          QU: tl.constexpr, SU: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, EVEN_D: tl.constexpr, STAGES: tl.constexpr,
                          MISS: tl.constexpr, HOST_FROM: tl.constexpr,
                          BIAS: tl.constexpr = False, OAI: tl.constexpr = False):
    # h[p, n] = wts[p] · glu(Σ_d x[t, d] · G_e[n, d] + bg[e, n], Σ_d x[t, d] · U_e[n, d] + bu[e, n])
    # with t = p // TOPK, glu silu(g) · u (OAI: the clamped SwiGLU), the biases with BIAS only
    # (0 where e is not resident, unless MISS: then e's record is in the miss rows, row p)
    p = tl.program_id(1)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    e = tl.load(ids + p)
    slot = tl.load(slot_of + e)
    live = pair_computed(slot, p, MISS, TOPK, HOST_FROM)
    if live:
        xr = x + (p // TOPK).to(tl.int64) * stride_x
        gb = record_part(gate, slot, stride_gs, mg, p, stride_ms, MISS)
        ub = record_part(up, slot, stride_us, mu, p, stride_ms, MISS)
        wg = rows(gb, n, F, rb_g)
        wu = rows(ub, n, F, rb_u)
        ag, au = gemv_tile2(QG, SG, QU, SU, BK, EVEN_D, STAGES, wg, wu, xr, D, tg, tg2, tu,
                            tu2, tl.zeros((BN, BK // SG, SG), dtype=tl.float32),
                            tl.zeros((BN, BK // SU, SU), dtype=tl.float32))
        g = tl.sum(tl.sum(ag, axis=2), axis=1)  # [BN]
        u = tl.sum(tl.sum(au, axis=2), axis=1)
        if BIAS:
            g += bias_row(bg, e, n, F)
            u += bias_row(bu, e, n, F)
        hv = glu(g, u, OAI) * tl.load(wts + p).to(tl.float32)
    else:
        hv = tl.zeros((BN,), dtype=tl.float32)
    tl.store(h + p.to(tl.int64) * F + n, hv, mask=n < F)


@triton.jit(do_not_specialize=_SIZES)
def _down_pairs_kernel(h, ids, slot_of, down, part, td, td2, md, wts, bd, D, F, stride_ds,
                       stride_ms, rb_d, QD: tl.constexpr, SD: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, EVEN_F: tl.constexpr, STAGES: tl.constexpr,
                       MISS: tl.constexpr, TOPK: tl.constexpr, HOST_FROM: tl.constexpr,
                       BIAS: tl.constexpr = False):
    # part[p, n] = Σ_f h[p, f] · D_e[n, f] (+ wts[p] · bd[e, n] with BIAS: h already carries
    # the weight) for pair p (its expert e = ids[p]; 0 when e is not resident, unless MISS:
    # then from miss row p). The launcher sums part over each token's pairs in a fixed order.
    p = tl.program_id(1)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    e = tl.load(ids + p)
    slot = tl.load(slot_of + e)
    live = pair_computed(slot, p, MISS, TOPK, HOST_FROM)
    total = tl.zeros((BN,), dtype=tl.float32)
    if live:
        base = record_part(down, slot, stride_ds, md, p, stride_ms, MISS)
        acc = gemv_tile(QD, SD, BK, EVEN_F, STAGES, rows(base, n, D, rb_d),
                        h + p.to(tl.int64) * F, F, td, td2,
                        tl.zeros((BN, BK // SD, SD), dtype=tl.float32))
        total = tl.sum(tl.sum(acc, axis=2), axis=1)
        if BIAS:
            total += tl.load(wts + p).to(tl.float32) * bias_row(bd, e, n, D)
    tl.store(part + p.to(tl.int64) * D + n, total, mask=n < D)


@triton.jit
def _gather_kernel(ids, slot_of, src, dst, nwords, stride_src, stride_dst, pre_of, pre,
                   stride_pre, n_items, n_chunks, BLOCK: tl.constexpr, TOPK: tl.constexpr,
                   HOST_FROM: tl.constexpr, PRE: tl.constexpr, LOOP: tl.constexpr):
    # dst[p, :nwords] = src[e, :nwords] for pairs p whose expert e = ids[p] is not resident
    # (int32 words), except a token's pairs from HOST_FROM on (the host computes those); with
    # PRE, from pre[pre_of[e]] (device rows a prefetch filled) where pre_of[e] >= 0. Work item
    # i = (pair i // n_chunks, BLOCK words i % n_chunks): one load of BLOCK words, all in flight
    # before the store. Without LOOP a program per item; with LOOP, the grid's programs take
    # items i = pid, pid + grid, ... (few programs: a copy that leaves most SMs to the compute
    # running beside it).
    if LOOP:
        for i in range(tl.program_id(0), n_items, tl.num_programs(0)):
            _gather_item(ids, slot_of, src, dst, nwords, stride_src, stride_dst, pre_of, pre,
                         stride_pre, i // n_chunks, i % n_chunks, BLOCK, TOPK, HOST_FROM, PRE)
    else:
        _gather_item(ids, slot_of, src, dst, nwords, stride_src, stride_dst, pre_of, pre,
                     stride_pre, tl.program_id(0), tl.program_id(1), BLOCK, TOPK, HOST_FROM,
                     PRE)


@triton.jit
def _gather_item(ids, slot_of, src, dst, nwords, stride_src, stride_dst, pre_of, pre,
                 stride_pre, p, c, BLOCK: tl.constexpr, TOPK: tl.constexpr,
                 HOST_FROM: tl.constexpr, PRE: tl.constexpr):
    e = tl.load(ids + p)  # -1: no expert (a prefetch with fewer guesses than rows)
    if (tl.load(slot_of + e, mask=e >= 0, other=0) < 0) & (p % TOPK < HOST_FROM):
        o = c * BLOCK + tl.arange(0, BLOCK)
        m = o < nwords
        if PRE:
            j = tl.load(pre_of + e)
            if j >= 0:
                v = tl.load(pre + j.to(tl.int64) * stride_pre + o, mask=m)
            else:
                v = tl.load(src + e.to(tl.int64) * stride_src + o, mask=m)
        else:
            v = tl.load(src + e.to(tl.int64) * stride_src + o, mask=m)
        tl.store(dst + p.to(tl.int64) * stride_dst + o, v, mask=m)


# ---- prompt chunks: grouped by expert, tensor cores ------------------------------------------


@triton.jit(do_not_specialize=_SIZES)
def _gate_up_groups_kernel(x, counts, starts, order, slot_of, gate, up, h, tg, tg2, tu, tu2,
                           bg, bu, D, F, NC, stride_x, stride_gs, stride_us, rb_g, rb_u,
                           TOPK: tl.constexpr, QG: tl.constexpr, SG: tl.constexpr,
                           QU: tl.constexpr, SU: tl.constexpr, BM: tl.constexpr,
                           BN: tl.constexpr, BK: tl.constexpr, EVEN_D: tl.constexpr,
                           DOT: tl.constexpr, BIAS: tl.constexpr = False,
                           OAI: tl.constexpr = False, MX: tl.constexpr = False):
    # h[start + r, n] = glu(x[tok] @ G_e[n].T + bg[e, n], x[tok] @ U_e[n].T + bu[e, n]) for BM
    # pairs of expert e (the biases with BIAS only; glu silu(g) · u, OAI the clamped SwiGLU)
    e, live, start, r, rm, pair = expert_chunk(tl.program_id(0), NC, counts, starts, order, BM)
    if live:
        slot = tl.load(slot_of + e)
        if slot >= 0:
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            xr = x + ((pair // TOPK).to(tl.int64) * stride_x)[:, None]  # [BM, 1]
            wg = rows(gate + slot.to(tl.int64) * stride_gs, n, F, rb_g)
            wu = rows(up + slot.to(tl.int64) * stride_us, n, F, rb_u)
            zero = tl.zeros((BM, BN), dtype=tl.float32)
            g = dot_tile(QG, SG, BK, EVEN_D, DOT, wg, xr, rm[:, None], D, tg, tg2, zero, MX)
            u = dot_tile(QU, SU, BK, EVEN_D, DOT, wu, xr, rm[:, None], D, tu, tu2, zero, MX)
            if BIAS:
                g += bias_row(bg, e, n, F)[None, :]
                u += bias_row(bu, e, n, F)[None, :]
            hv = glu(g, u, OAI)
            ptrs = h + (start + r).to(tl.int64)[:, None] * F + n[None, :]
            tl.store(ptrs, hv.to(h.dtype.element_ty), mask=rm[:, None] & (n < F)[None, :])


@triton.jit(do_not_specialize=_SIZES)
def _down_groups_kernel(h, counts, starts, order, wts, slot_of, down, y, td, td2, bd, D, F, NC,
                        stride_ds, rb_d, QD: tl.constexpr, SD: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, EVEN_F: tl.constexpr,
                        DOT: tl.constexpr, BIAS: tl.constexpr = False,
                        MX: tl.constexpr = False):
    # y[pair, n] = wts[pair] · (h[start + r] @ D_e[n].T + bd[e, n])  (bd with BIAS only; zero
    # for experts that are not resident)
    e, live, start, r, rm, pair = expert_chunk(tl.program_id(0), NC, counts, starts, order, BM)
    if live:
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        slot = tl.load(slot_of + e)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if slot >= 0:
            wd = rows(down + slot.to(tl.int64) * stride_ds, n, D, rb_d)
            hr = h + ((start + r).to(tl.int64) * F)[:, None]
            acc = dot_tile(QD, SD, BK, EVEN_F, DOT, wd, hr, rm[:, None], F, td, td2, acc, MX)
            if BIAS:
                acc += bias_row(bd, e, n, D)[None, :]
            acc = acc * tl.load(wts + pair, mask=rm, other=0.0).to(tl.float32)[:, None]
        ptrs = y + pair.to(tl.int64)[:, None] * D + n[None, :]
        tl.store(ptrs, acc, mask=rm[:, None] & (n < D)[None, :])


# ---- launcher ---------------------------------------------------------------------------------


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Intermediate buffers (h, y): left uninitialized; tests swap in a NaN-filled version so
    a read of anything the kernels did not write shows up in the output."""
    return torch.empty(shape, dtype=dtype, device=device)


def resident_pairs(ids: torch.Tensor, slot_of_expert: torch.Tensor) -> torch.Tensor:
    """bool [T, K]: the pairs moe_forward computes (their expert has a slot)."""
    return slot_of_expert[ids.long()] >= 0


MOE_PATHS = ("pairs", "tl.dot", "grouped", "mmq")


def moe_path(t: int, topk: int, n_experts: int, miss: bool = False, step: bool = False,
             min_tokens: int = GROUPED_MIN_TOKENS) -> str:
    """The path moe_forward takes for t tokens: "pairs" (each pair reads its expert: up to
    DECODE_MAX_T tokens; a decode step's call without miss rows up to PAIRS_MAX_T), "grouped"
    (from min_tokens tokens per expert on average, grouped_min_tokens: dequantize to bf16, then
    grouped GEMM), else "tl.dot" (pairs grouped by expert onto tensor cores; moe_forward then
    takes "mmq" for it under x8 where the types allow, tuning.MMQ_PROMPT)."""
    if t <= DECODE_MAX_T or (step and not miss and t <= PAIRS_MAX_T):
        return "pairs"
    return "grouped" if t * topk >= min_tokens * max(n_experts, 1) else "tl.dot"


def grouped_min_tokens(qtypes: tuple[int, int, int], d: int, f: int, x8: bool,
                       bias: object = None, act: str = "swiglu") -> int:
    """Tokens per expert on average from which a prompt chunk of these experts takes the
    grouped path: later where the MMQ kernels take the layer (MMQ_GROUPED_MIN_TOKENS), sooner
    for i-quants (IQ_GROUPED_MIN_TOKENS: their tl.dot tiles are slow), else GROUPED_MIN_TOKENS.
    (Worked out once per layer shape: moe_forward asks on every call.)"""
    return _min_tokens(tuple(int(q) for q in qtypes), d, f, x8, bias is not None, act)


@functools.cache
def _min_tokens(qtypes: tuple[int, ...], d: int, f: int, x8: bool, biased: bool,
                act: str) -> int:
    from strata.kernels.gpu.moe_mmq import mmq_types

    if x8 and MMQ_PROMPT and mmq_types(qtypes, d, f, object() if biased else None, act):
        return MMQ_GROUPED_MIN_TOKENS
    if any(QType(q).name.startswith("IQ") for q in qtypes):
        return IQ_GROUPED_MIN_TOKENS
    return GROUPED_MIN_TOKENS


def layouts_min_tokens(layouts: list, x8: bool = True) -> int:
    """grouped_min_tokens of the layers' expert layouts (experts.layout.ExpertLayout), the least:
    from there some layer takes the grouped path (its scratch counted from there)."""
    return min((grouped_min_tokens(la.qtypes, la.d_model, la.d_expert, x8, la.bias,
                                   getattr(la.bias, "act", "swiglu")) for la in layouts),
               default=GROUPED_MIN_TOKENS)


def use_grouped(t: int, topk: int, n_experts: int,
                min_tokens: int = GROUPED_MIN_TOKENS) -> bool:
    """True when moe_forward hands a call of t tokens (no miss rows) to the grouped path."""
    return moe_path(t, topk, n_experts, min_tokens=min_tokens) == "grouped"


def moe_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                slot_of_expert: torch.Tensor, gate_slots: torch.Tensor, up_slots: torch.Tensor,
                down_slots: torch.Tensor, qtypes: tuple[int, int, int], d_model: int,
                d_expert: int, out: torch.Tensor | None = None,
                scratch_bytes: int | None = None,
                miss: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                sum_pairs: bool = True, host_from: int | None = None,
                x8: bool = False, tiles: Mapping[str, tuple[int, ...]] | None = None,
                path: str | None = None, step: bool = False,
                bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                act: str = "swiglu") -> torch.Tensor:
    """out [T, D] float32 (+)= the resident experts' weighted outputs (see the module doc).
    sum_pairs=False with no `out`: a decode call on fused kernels returns each pair's weighted
    output, [T, K, D] float32 (the caller sums a token's K rows, as decode_ops.add_rms_norm
    does in the next layer's residual step: one launch fewer a layer); other calls sum anyway.
    host_from (with miss): a token's pairs k >= host_from whose expert has no slot are left to
    the host (their rows are zero; gather_misses skips them too).
    x [T, D] bf16/f32; ids [T, K] int32/int64 < E; weights [T, K]; slot_of_expert int32 [E];
    gate/up slots uint8 [n_slots, F, row_nbytes(D)], down uint8 [n_slots, D, row_nbytes(F)].
    scratch_bytes: the grouped path's bf16 weight scratch (None: its default).
    miss: (gate, up, down) views of at least T·K rows laid out as the slots, row p holding the
    record of pair p's expert when it is not resident (gather_misses writes them): every pair
    is then computed. Decode sizes only (T <= DECODE_MAX_T) with fused kernels for the types.
    x8: a decode call with Q4_K gate and up (rows 4-byte aligned), or IQ2_XS / IQ3_XXS ones
    (both of one type), rounds x to 8 bits per 32 values and runs gate/up on integer dot
    products (gemv_q8.py: ~1e-2 relative to the product with x itself, as llama.cpp's CUDA
    path), and with a Q4_K, Q6_K, IQ2_XS or IQ3_XXS down rounds each pair's h the same way for
    it; other types and calls keep float32 activations.
    tiles: decode tiles to use instead of strata.kernels.tuning's (TILE_KEYS; a benchmark's
    variants); path: one of MOE_PATHS whatever the call's size (None: moe_path's choice; with
    miss rows only "pairs"; "mmq", moe_mmq.py's integer tensor-core kernels, for the types
    moe_mmq.mmq_types takes, else "tl.dot"; with x8 and no path asked, moe_path's "tl.dot"
    becomes "mmq" where the types allow: tuning.MMQ_PROMPT); step: a decode step's call (a
    batched step's tokens: moe_path).
    bias: the experts' biases (gate [E, F], up [E, F], down [E, D], contiguous float32 on x's
    device, rows by expert id: gpt-oss), act: the activation, "swiglu" silu(g) · u or
    "swiglu_oai" (the clamped SwiGLU, strata.kernels.torch_ops.glu): a pair then adds
    w · (down_e(act(gate_e x + bg_e, up_e x + bu_e)) + bd_e), on every path; x8 is ignored
    for such calls (its kernels have neither)."""
    if tiles is not None and set(tiles) - set(TILE_KEYS):
        raise ValueError(f"moe_forward tiles: unknown {sorted(set(tiles) - set(TILE_KEYS))}, "
                         f"choose from {TILE_KEYS}")
    t = x.shape[0] if x.dim() == 2 else 0
    if path is not None and path not in MOE_PATHS:
        raise ValueError(f"moe_forward path {path!r}: choose from {MOE_PATHS}")
    chosen = path is None  # (moe_path's pick: may go to mmq below; an asked-for path stays)
    if path is None:
        path = moe_path(t, ids.shape[-1] if ids.dim() == 2 else 1, slot_of_expert.shape[0],
                        miss is not None, step,
                        grouped_min_tokens(qtypes, d_model, d_expert, x8, bias, act))
    # a call on the per-pair kernels with no `out` writes the sums straight into a new one (no
    # zero fill + add)
    direct = (out is None and t > 0 and path == "pairs" and ids.dim() == 2 and ids.shape[1] > 0
              and all(kernel_format(q) is not None for q in qtypes))
    (qg, qu, qd), out = check_moe_args(x, ids, weights, slot_of_expert, gate_slots, up_slots,
                                       down_slots, qtypes, d_model, d_expert, out,
                                       zero=not direct)
    check_bias(bias, act, slot_of_expert.shape[0], d_model, d_expert, x.device)
    if (bias is not None or act != "swiglu") and not _mx8((qg, qu, qd), d_model, d_expert,
                                                          tiles):
        x8 = False  # (the int8-activation kernels but MXFP4's compute plain SwiGLU, no biases)
    if chosen and path == "tl.dot" and x8 and miss is None:
        # (--kernels fused: the tl.dot sizes on integer tensor cores where the types allow,
        # tuning.MMQ_PROMPT)
        from strata.kernels.gpu.moe_mmq import mmq_types

        if MMQ_PROMPT and mmq_types((qg, qu, qd), d_model, d_expert, bias, act):
            path = "mmq"
    if miss is not None:
        if t > DECODE_MAX_T or path != "pairs" or any(kernel_format(q) is None
                                                      for q in (qg, qu, qd)):
            raise ValueError(f"miss rows are for up to {DECODE_MAX_T} tokens of fused types")
        if miss[0].shape[0] < t * ids.shape[1] or any(
                m.shape[1:] != s.shape[1:] for m, s in zip(miss, (gate_slots, up_slots,
                                                                   down_slots), strict=True)):
            raise ValueError(f"miss rows must be [>= {t * ids.shape[1]}, ...] like the slots")
    elif host_from is not None:
        raise ValueError("host_from is for calls with miss rows")
    if t == 0 or ids.shape[1] == 0:
        return out
    if path == "mmq":
        from strata.kernels.gpu.moe_mmq import mmq_aligned, mmq_kernel_types, moe_forward_mmq

        # (moe_path's pick came through mmq_types above; an asked-for path takes whatever the
        # kernels compute)
        if (mmq_kernel_types((qg, qu, qd), d_model, d_expert, bias, act) and miss is None
                and mmq_aligned(gate_slots, up_slots, down_slots, (qg, qu, qd))):
            return moe_forward_mmq(x, ids, weights.float(), slot_of_expert, gate_slots, up_slots,
                                   down_slots, (qg, qu, qd), out, bias=bias, act=act)
        path = "tl.dot"
    if path == "grouped":
        from strata.kernels.gpu.moe_grouped import moe_forward_grouped

        kw = {} if scratch_bytes is None else {"scratch_bytes": scratch_bytes}
        return moe_forward_grouped(x, ids, weights, slot_of_expert, gate_slots, up_slots,
                                   down_slots, (qg, qu, qd), d_model, d_expert, out=out,
                                   bias=bias, act=act, **kw)
    fmts = [kernel_format(q) for q in (qg, qu, qd)]
    if any(f is None for f in fmts):
        for q, f in zip((qg, qu, qd), fmts, strict=True):
            if f is None:
                log_fallback("moe_forward", q)
        return _moe_fallback(x, ids, weights, slot_of_expert, gate_slots, up_slots, down_slots,
                             (qg, qu, qd), d_model, d_expert, out, bias, act)
    ids = ids.contiguous()
    weights = weights.contiguous()
    if path == "pairs":
        parts = _decode(x, ids, weights, slot_of_expert, gate_slots, up_slots, down_slots, fmts,
                        None if direct and not sum_pairs else out, miss, accumulate=not direct,
                        host_from=host_from, x8=x8, tiles=tiles or {}, bias=bias, act=act)
        if parts is not None:
            return parts
    else:
        _prompt(x, ids, weights, slot_of_expert, gate_slots, up_slots, down_slots, fmts, out,
                bias, act)
    return out


def gather_misses(ids: torch.Tensor, slot_of_expert: torch.Tensor, records: torch.Tensor,
                  rows: torch.Tensor, nbytes: int, host_from: int | None = None,
                  prefetched: tuple[torch.Tensor, torch.Tensor] | None = None,
                  programs: int | None = None) -> None:
    """rows[p, :nbytes] = records[ids[p], :nbytes] for every pair p whose expert has no slot
    (slot_of_expert < 0; ids[p] = -1: no expert, left alone), except a token's pairs k >= host_from
    (ids [T, K]; the host computes those, moe_forward's host_from); other rows are left as they
    are. records uint8 [E, stride]: the layer's arena, host memory mapped for the device
    (cudaHostRegister), read over PCIe by the kernel (so a CUDA graph can hold it: which experts
    move is read on the device); rows uint8 [>= P, >= nbytes] on the device; whole int32 words are
    copied (rows and records are padded to a multiple of 4 bytes: ExpertLayout.stride). prefetched:
    (pre_of [>= E] int32, pre uint8 [R, >= nbytes] on the device): an expert with pre_of[e] = j >= 0
    is copied from pre[j] instead (a prefetch brought its record there already). programs: at most
    this many programs, each looping over its share of the work (a copy beside compute on another
    stream: loads waiting on PCIe hold up every other load of their SM)."""
    p = ids.numel()
    nwords = triton.cdiv(nbytes, 4)  # whole words: records are padded to their stride
    if rows.shape[0] < p or min(rows.shape[1], records.shape[1]) < 4 * nwords:
        raise ValueError(f"gather_misses: {p} pairs of {nbytes} bytes into rows "
                         f"{tuple(rows.shape)} from records {tuple(records.shape)}")
    if records.stride(0) % 4 or rows.stride(0) % 4 or records.stride(1) != 1 or \
            rows.stride(1) != 1:
        raise ValueError("gather_misses: rows of contiguous bytes, 4-byte aligned strides")
    pre_of, pre = prefetched if prefetched is not None else (slot_of_expert, rows)
    if prefetched is not None and (
            pre_of.dtype != torch.int32 or pre_of.numel() < records.shape[0]
            or pre_of.device != rows.device or pre.device != rows.device
            or pre.shape[1] < 4 * nwords or pre.stride(0) % 4 or pre.stride(1) != 1):
        raise ValueError(f"gather_misses: prefetched rows {tuple(pre.shape)} ({pre.device}) with "
                         f"pre_of {pre_of.dtype} [{pre_of.numel()}] ({pre_of.device}) for "
                         f"{records.shape[0]} experts of {nbytes} bytes into {rows.device}")
    if p == 0:
        return
    src, dst, pre = _words(records), _words(rows), _words(pre)
    topk = ids.shape[-1] if ids.dim() == 2 else 1
    if programs is not None and programs < 1:
        raise ValueError(f"gather_misses: programs={programs}, give at least 1")
    n_chunks = triton.cdiv(nwords, GATHER_BLOCK)
    loop = programs is not None and programs < p * n_chunks
    _gather_kernel[(programs,) if loop else (p, n_chunks)](
        ids.reshape(-1), slot_of_expert, src, dst, nwords, src.stride(0), dst.stride(0), pre_of,
        pre, pre.stride(0), p * n_chunks, n_chunks, BLOCK=GATHER_BLOCK, TOPK=topk,
        HOST_FROM=topk if host_from is None else host_from, PRE=prefetched is not None,
        LOOP=loop, num_warps=8)


def _words(t: torch.Tensor) -> torch.Tensor:
    """A uint8 [n, m] tensor with 4-byte aligned rows seen as int32 [n, m // 4]."""
    return t[:, : t.shape[1] // 4 * 4].view(torch.int32) if t.shape[1] % 4 else \
        t.view(torch.int32)


def _decode(x, ids, weights, slot_of, gate, up, down, fmts: list[KernelFormat],  # noqa: ANN001
            out: torch.Tensor | None, miss: tuple[torch.Tensor, ...] | None = None,
            accumulate: bool = True, host_from: int | None = None,
            x8: bool = False, tiles: Mapping[str, tuple[int, ...]] | None = None,
            bias: tuple[torch.Tensor, ...] | None = None, act: str = "swiglu",
            ) -> torch.Tensor | None:
    """Into out (accumulate: +=), or with out None the pairs' rows [T, K, D], returned.
    x8 calls have no bias and act "swiglu" (moe_forward sees to it), but MXFP4 ones (_mx8)."""
    tiles = tiles or {}
    fg, fu, fd = fmts
    t, d = x.shape
    topk = ids.shape[1]
    f = gate.shape[1]
    p = t * topk
    h = scratch((p, f), torch.float32, x.device)  # weighted glu(g, u) of every pair
    tg, tg2 = fg.tables(x.device)
    tu, tu2 = fu.tables(x.device)
    td, td2 = fd.tables(x.device)
    mg, mu, md = miss if miss is not None else (gate, up, down)
    host = topk if host_from is None else host_from
    pm = pair_major(p, tiles)
    if (x8 and _mx8((fg.qtype, fu.qtype, fd.qtype), d, f, tiles)
            and words_aligned(gate, up, mg, mu, rows=False)):
        from strata.kernels.gpu.gemv_q8 import _gate_up_mx8_kernel, quantize_x

        xq, dx, _ = quantize_x(x.contiguous())
        r, bb, warps = tiles.get("gate_up_mx8") or GATE_UP_MX8_TILE
        bg, bu, bd = bias if bias is not None else (dx, dx, dx)  # (unread without BIAS)
        _gate_up_mx8_kernel[_x8_grid(f, r, p, pm)](
            xq, dx, ids, weights, slot_of, gate, up, h, mg, mu, bg, bu, d, f, gate.stride(0),
            up.stride(0), mg.stride(0), gate.shape[2], TOPK=topk, R=r, BB=bb,
            MISS=miss is not None, HOST_FROM=host, BIAS=bias is not None,
            OAI=act == "swiglu_oai", EVEN=(d // 32) % bb == 0, PM=pm, num_warps=warps)
        return _decode_down(h, ids, slot_of, down, md, fd, td, td2, out, t, topk, d, f, miss,
                            accumulate, host, x8, tiles, weights=weights,
                            bias_down=bd if bias is not None else None)
    if (x8 and fg.qtype == fu.qtype and fg.qtype in IQ_X8 and d % 256 == 0
            and words_aligned(gate, up, mg, mu, rows=False)):
        from strata.kernels.gpu.gemv_q8 import _gate_up_iq_kernel, iq_tables, quantize_x

        xq, dx, _ = quantize_x(x.contiguous())
        t0, t1 = iq_tables(fg.qtype, x.device)
        run = (tiles.get("gate_up_iq_run") if d % 2048 == 0
               and words_aligned(gate, up, mg, mu, align=16) else None)
        r, bb, warps = run or tiles.get("gate_up_iq") or GATE_UP_IQ_TILE
        _gate_up_iq_kernel[_x8_grid(f, r, p, pm)](
            xq, dx, ids, weights, slot_of, gate, up, h, mg, mu, t0, t1, d, f, gate.stride(0),
            up.stride(0), mg.stride(0), gate.shape[2], IQ3=fg.qtype == QType.IQ3_XXS,
            TOPK=topk, R=r, BB=bb, MISS=miss is not None, HOST_FROM=host, RUN=run is not None,
            EVEN=d % ((2048 if run else 256) * bb) == 0, PM=pm, num_warps=warps)
        return _decode_down(h, ids, slot_of, down, md, fd, td, td2, out, t, topk, d, f, miss,
                            accumulate, host, x8, tiles)
    if (x8 and fg.qtype == fu.qtype == QType.Q4_K and d % 256 == 0
            and words_aligned(gate, up, mg, mu)):
        from strata.kernels.gpu.gemv_q8 import _gate_up_q8_kernel, quantize_x

        xq, _, xs4 = quantize_x(x.contiguous())
        r, bb, warps = tiles.get("gate_up_q8") or GATE_UP_Q8_TILE
        group = group_tile(p, miss is not None, tiles)
        if group:  # (MT, R): groups of MT pairs of one expert, R rows a program (moe_once.py)
            from strata.kernels.gpu.moe_once import _gate_up_group_q8_kernel, once_grid

            mt, rg = group
            _gate_up_group_q8_kernel[once_grid(f, rg, p)](
                xq, xs4, ids, weights, slot_of, gate, up, h, d, f, p, gate.stride(0),
                up.stride(0), gate.shape[2], TOPK=topk, R=rg, MT=mt, BB=bb,
                PB=triton.next_power_of_2(p), num_warps=warps)
        elif expert_once(p, miss is not None, tiles):
            from strata.kernels.gpu.moe_once import _gate_up_once_q8_kernel, once_grid

            _gate_up_once_q8_kernel[once_grid(f, r, p)](
                xq, xs4, ids, weights, slot_of, gate, up, h, d, f, p, gate.stride(0),
                up.stride(0), gate.shape[2], TOPK=topk, R=r, BB=bb,
                PB=triton.next_power_of_2(p), ONE=d // 256 <= bb, num_warps=warps)
        else:
            _gate_up_q8_kernel[_x8_grid(f, r, p, pm)](
                xq, xs4, ids, weights, slot_of, gate, up, h, mg, mu, d, f, gate.stride(0),
                up.stride(0), mg.stride(0), gate.shape[2], TOPK=topk, R=r, BB=bb,
                MISS=miss is not None, HOST_FROM=host, PM=pm, num_warps=warps)
        return _decode_down(h, ids, slot_of, down, md, fd, td, td2, out, t, topk, d, f, miss,
                            accumulate, host, x8, tiles)
    bg, bu, bd = bias if bias is not None else (tg, tg, tg)  # (unread without BIAS)
    bn, bk, st, w = tiles.get("gate_up") or decode_tile(GATE_UP_TILE, (fg, fu), d)
    _gate_up_pairs_kernel[(triton.cdiv(f, bn), p)](
        x, ids, weights, slot_of, gate, up, h, tg, tg2, tu, tu2, mg, mu, bg, bu, d, f,
        x.stride(0), gate.stride(0), up.stride(0), mg.stride(0), gate.shape[2], up.shape[2],
        TOPK=topk, QG=int(fg.qtype), SG=fg.group, QU=int(fu.qtype), SU=fu.group, BN=bn, BK=bk,
        EVEN_D=d % bk == 0, STAGES=st, MISS=miss is not None, HOST_FROM=host,
        BIAS=bias is not None, OAI=act == "swiglu_oai", num_warps=w)
    return _decode_down(h, ids, slot_of, down, md, fd, td, td2, out, t, topk, d, f, miss,
                        accumulate, host, x8, weights=weights,
                        bias_down=bd if bias is not None else None)


def _decode_down(h, ids, slot_of, down, md, fd: KernelFormat, td, td2,  # noqa: ANN001
                 out: torch.Tensor | None, t: int, topk: int, d: int, f: int, miss,
                 accumulate: bool, host_from: int, x8: bool = False,
                 tiles: Mapping[str, tuple[int, ...]] | None = None,
                 weights: torch.Tensor | None = None,
                 bias_down: torch.Tensor | None = None) -> torch.Tensor | None:
    """The down half of _decode: partial rows per pair, then each token's K rows summed into
    out (or, out None, the rows returned as [T, K, D]). bias_down [E, D] (with the routing
    weights [T, K]): each pair's row adds w · bd[e] (FMA kernel only)."""
    tiles = tiles or {}
    p = t * topk
    pm = pair_major(p, tiles)
    part = scratch((p, d), torch.float32, h.device)
    # (Q6_K rows may start 2 mod 4: its kernel reads them so; their records must not)
    mx8 = x8 and _mx8((fd.qtype,), d, f, tiles) and words_aligned(down, md, rows=False)
    x8 = x8 and bias_down is None
    if mx8:
        from strata.kernels.gpu.gemv_q8 import _down_mx8_kernel, quantize_x

        hq, hdx, _ = quantize_x(h)
        r, bb, warps = tiles.get("down_mx8") or DOWN_MX8_TILE
        bd = bias_down if bias_down is not None else hdx  # (unread without BIAS)
        _down_mx8_kernel[_x8_grid(d, r, p, pm)](
            hq, hdx, ids, slot_of, down, part, md, hdx if weights is None else weights, bd,
            d, f, down.stride(0), md.stride(0), down.shape[2], TOPK=topk, R=r, BB=bb,
            MISS=miss is not None, HOST_FROM=host_from, BIAS=bias_down is not None,
            EVEN=(f // 32) % bb == 0, PM=pm, num_warps=warps)
    elif x8 and fd.qtype in IQ_X8 and f % 256 == 0 and words_aligned(down, md, rows=False):
        from strata.kernels.gpu.gemv_q8 import _down_iq_kernel, iq_tables, quantize_x

        hq, hdx, _ = quantize_x(h)
        t0, t1 = iq_tables(fd.qtype, h.device)
        r, bb, warps = tiles.get("down_iq") or DOWN_IQ_TILE
        _down_iq_kernel[_x8_grid(d, r, p, pm)](
            hq, hdx, ids, slot_of, down, part, md, t0, t1, d, f, down.stride(0), md.stride(0),
            down.shape[2], IQ3=fd.qtype == QType.IQ3_XXS, TOPK=topk, R=r, BB=bb,
            MISS=miss is not None, HOST_FROM=host_from, EVEN=f % (256 * bb) == 0,
            PM=pm, num_warps=warps)
    elif (x8 and fd.qtype in (QType.Q4_K, QType.Q6_K) and f % 256 == 0
            and words_aligned(down, md, rows=fd.qtype == QType.Q4_K)):
        from strata.kernels.gpu.gemv_q8 import _down_q6k_q8_kernel, _down_q8_kernel, quantize_x

        hq, hdx, hs4 = quantize_x(h)
        q4 = fd.qtype == QType.Q4_K
        r, bb, warps = ((tiles.get("down_q8") or DOWN_Q8_TILE) if q4
                        else (tiles.get("down_q6k_q8") or DOWN_Q6K_Q8_TILE))
        group = group_tile(p, miss is not None, tiles)
        if group:  # (MT, R): groups of MT pairs of one expert, R rows a program
            from strata.kernels.gpu.moe_once import _down_group_q8_kernel, once_grid

            mt, rg = group
            _down_group_q8_kernel[once_grid(d, rg, p)](
                hq, hs4 if q4 else hdx, ids, slot_of, down, part, d, f, p, down.stride(0),
                down.shape[2], R=rg, MT=mt, BB=bb, PB=triton.next_power_of_2(p), Q6=not q4,
                num_warps=warps)
        elif expert_once(p, miss is not None, tiles):
            from strata.kernels.gpu.moe_once import _down_once_q8_kernel, once_grid

            _down_once_q8_kernel[once_grid(d, r, p)](
                hq, hs4 if q4 else hdx, ids, slot_of, down, part, d, f, p, down.stride(0),
                down.shape[2], R=r, BB=bb, PB=triton.next_power_of_2(p), ONE=f // 256 <= bb,
                Q6=not q4, num_warps=warps)
        else:
            (_down_q8_kernel if q4 else _down_q6k_q8_kernel)[_x8_grid(d, r, p, pm)](
                hq, hs4 if q4 else hdx, ids, slot_of, down, part, md, d, f, down.stride(0),
                md.stride(0), down.shape[2], TOPK=topk, R=r, BB=bb, MISS=miss is not None,
                HOST_FROM=host_from, PM=pm, num_warps=warps)
    else:
        bn, bk, stages, warps = (tiles.get("down_pairs")
                                 or decode_tile(DOWN_TILE, (fd,), f))
        bd = bias_down if bias_down is not None else td  # (unread without BIAS)
        _down_pairs_kernel[(triton.cdiv(d, bn), p)](
            h, ids, slot_of, down, part, td, td2, md, td if weights is None else weights, bd,
            d, f, down.stride(0), md.stride(0), down.shape[2], QD=int(fd.qtype), SD=fd.group,
            BN=bn, BK=bk, EVEN_F=f % bk == 0, STAGES=stages, MISS=miss is not None, TOPK=topk,
            HOST_FROM=host_from, BIAS=bias_down is not None, num_warps=warps)
    if out is None:
        return part.view(t, topk, d)
    if accumulate:  # each token's K pairs, in a fixed order
        out += part.view(t, topk, d).sum(1)
    else:
        torch.sum(part.view(t, topk, d), dim=1, out=out)
    return None


def pair_major(p: int, tiles: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether the x8 per-pair kernels of a call with p pairs take the pair-major grid (gemv_q8.
    _pair): from PAIR_MAJOR_MIN_PAIRS pairs, or as tiles["pair_major"] = (1,) / (0,) says."""
    if "pair_major" in tiles:
        return bool(tiles["pair_major"][0])
    return p >= PAIR_MAJOR_MIN_PAIRS


def group_tile(p: int, miss: bool, tiles: Mapping[str, tuple[int, ...]]
               ) -> tuple[int, ...] | None:
    """(MT, R) where an x8 call with p pairs takes moe_once.py's group kernels (its types
    permitting): without miss rows, tiles["group"], else tuning.MOE_GROUP from
    MOE_GROUP_MIN_PAIRS pairs; None: not."""
    if miss:
        return None
    if "group" in tiles:
        return tiles["group"] or None
    return MOE_GROUP if p >= MOE_GROUP_MIN_PAIRS else None


def expert_once(p: int, miss: bool, tiles: Mapping[str, tuple[int, ...]]) -> bool:
    """Whether an x8 call with p pairs takes moe_once.py's kernels (each expert read once for
    its pairs) where its types have them: without miss rows, from MOE_ONCE_MIN_PAIRS pairs, or
    as tiles["once"] = (1,) / (0,) says."""
    if miss:
        return False
    if "once" in tiles:
        return bool(tiles["once"][0])
    return MOE_ONCE_MIN_PAIRS is not None and p >= MOE_ONCE_MIN_PAIRS


def _x8_grid(n: int, r: int, p: int, pm: bool) -> tuple[int, int]:
    """An x8 per-pair kernel's grid for n rows, r a program, p pairs: (row tiles, pairs), or
    pair-major (pairs, row tiles)."""
    return (p, triton.cdiv(n, r)) if pm else (triton.cdiv(n, r), p)


def decode_tile(tile: tuple[int, int, int, int], fmts: tuple[KernelFormat, ...],
                k: int) -> tuple[int, int, int, int]:
    """(BN, BK, stages, warps) of a decode kernel: BK from matmul.k_step for the row length k
    and the types' largest group."""
    bn, bk, stages, warps = tile
    return bn, k_step(bk, k, max(f.group for f in fmts)), stages, warps


def group_config(t: int, topk: int, n_experts: int) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps) for the grouped kernels: BM follows the mean number of tokens
    per expert (T·K / E) so a chunk is mostly real tokens; 16 is the smallest tl.dot tile."""
    mean = t * topk / max(n_experts, 1)
    bm = min(128, max(16, triton.next_power_of_2(int(mean))))
    return bm, 128, 64, 8 if bm >= 64 else 4


def _prompt(x, ids, weights, slot_of, gate, up, down, fmts: list[KernelFormat],  # noqa: ANN001
            out: torch.Tensor, bias: tuple[torch.Tensor, ...] | None = None,
            act: str = "swiglu") -> None:
    fg, fu, fd = fmts
    t, d = x.shape
    topk = ids.shape[1]
    f = gate.shape[1]
    e = slot_of.shape[0]
    counts, starts, order = sort_pairs(ids, e)
    bm, bn, bk, warps = group_config(t, topk, e)
    nc = triton.cdiv(t, bm)  # an expert takes at most one pair per token
    h = scratch((t * topk, f), torch.bfloat16, x.device)
    y = scratch((t * topk, d), torch.float32, x.device)
    tg, tg2 = fg.tables(x.device)
    tu, tu2 = fu.tables(x.device)
    td, td2 = fd.tables(x.device)
    dot = dot_dtype()
    bg, bu, bd = bias if bias is not None else (tg, tg, tg)  # (unread without BIAS)
    _gate_up_groups_kernel[(e * nc, triton.cdiv(f, bn))](
        x, counts, starts, order, slot_of, gate, up, h, tg, tg2, tu, tu2, bg, bu, d, f, nc,
        x.stride(0), gate.stride(0), up.stride(0), gate.shape[2], up.shape[2], TOPK=topk,
        QG=int(fg.qtype), SG=fg.group, QU=int(fu.qtype), SU=fu.group, BM=bm, BN=bn, BK=bk,
        EVEN_D=d % bk == 0, DOT=dot, BIAS=bias is not None, OAI=act == "swiglu_oai",
        MX=MXFP4_DOT_SPAN, num_warps=warps, num_stages=3)
    _down_groups_kernel[(e * nc, triton.cdiv(d, bn))](
        h, counts, starts, order, weights, slot_of, down, y, td, td2, bd, d, f, nc,
        down.stride(0), down.shape[2], QD=int(fd.qtype), SD=fd.group, BM=bm, BN=bn, BK=bk,
        EVEN_F=f % bk == 0, DOT=dot, BIAS=bias is not None, MX=MXFP4_DOT_SPAN,
        num_warps=warps, num_stages=3)
    out += y.view(t, topk, d).sum(1)


def _moe_fallback(x, ids, weights, slot_of, gate, up, down, qtypes, d_model,  # noqa: ANN001
                  d_expert, out, bias=None, act: str = "swiglu"):  # noqa: ANN001
    """Per resident expert: dequantize (or view float rows) and run it in float32."""
    from strata.kernels.torch_ops import glu

    qg, qu, qd = qtypes
    xf = x.float()
    slots = slot_of[ids.long()]  # [T, K]
    for e in torch.unique(ids[slots >= 0]).tolist():
        s = int(slot_of[e])
        tok, k = torch.nonzero(ids == e, as_tuple=True)
        g = xf[tok] @ dequantize(gate[s], qg, d_model).T
        u = xf[tok] @ dequantize(up[s], qu, d_model).T
        if bias is not None:
            g, u = g + bias[0][e], u + bias[1][e]
        y = glu(g, u, act) @ dequantize(down[s], qd, d_expert).T
        if bias is not None:
            y = y + bias[2][e]
        out.index_add_(0, tok, y * weights[tok, k, None].float())
    return out
