"""The batched step's MoE kernels that read each expert once for every pair routed to it.

The per-pair decode kernels (gemv_q8._gate_up_q8_kernel and its downs) run a program per (pair,
rows): two tokens routed to one expert read its rows twice (the second time from L2), so a step
of T tokens costs by its T·K pairs, not by the experts it reads. Here a program takes (rows, an
expert): its pairs are found among the step's ids in the program itself (no sort, no extra
launch), the expert's rows are read once into registers (q4k_weights / q6k_weights: quant words
and scales) where a row fits one step of the program's blocks (ONE), and each pair's x̂ is dotted
with them in turn. Where a row takes several steps (ONE false), each pair reads the rows again,
from L1 after the first.

The grid is (row tiles, P): program g leads the pairs of ids[g]'s expert when g is the first
pair routed to it, and the others return at once. Pairs of an expert without a slot get zeros,
as the per-pair kernels give them (no miss rows here: such calls keep the per-pair kernels).
Results equal the per-pair kernels' bit for bit: the same sums in the same order.

    _gate_up_once_q8_kernel   Q4_K gate and up, x̂ by token: h[p] = w_p silu(g) u
    _down_once_q8_kernel      a Q4_K (Q6: Q6_K) down of each pair's ĥ: part[p]

Timed on the H200 (bench/2026-12-06-h200-once.md) these took about twice the per-pair kernels'
time a pair, so they are off (tuning.MOE_ONCE_MIN_PAIRS). A second form keeps each program as
light as a per-pair one: `_gate_up_group_q8_kernel` takes a group of MT pairs of one expert
(its pairs of rank 0..MT-1, MT..2MT-1, ... in pair order: `_group_of`) with the tokens as a
tensor axis beside the rows (`q4k_group_dot`): the rows' words and scales read once a block
step, nothing held across a loop, no loop over pairs; `_down_group_q8_kernel` the same for a
Q4_K or Q6_K down (`q6k_group_dot`; over several steps of blocks its Q6_K sums associate
per step, so equal to float rounding) (moe_forward's tiles["group"] = (MT, R); not yet timed).
"""

from __future__ import annotations

import triton
import triton.language as tl

from strata.kernels.gpu.gemv_q8 import (
    _dp4a,
    _i2f_signed,
    _q6k_quants,
    _row_offsets,
    held_q4k_dot,
    held_q6k_dot,
    q4k_weights,
    q6k_layout,
    q6k_spread_dot,
    q6k_weights,
    spread_dot,
    spread_layout,
    spread_rows,
    spread_x,
)


@triton.jit
def _expert_pairs(ids, slot_of, g, P, PB: tl.constexpr):
    """(lead, p, match, ar, count, slot) of program g: whether g is the first pair routed to
    its expert e (the program that takes e), p = g, match [PB]: the pairs routed to e (ar their
    ids), count of them, and e's slot."""
    ar = tl.arange(0, PB)
    every = tl.load(ids + ar, mask=ar < P, other=-1)
    e = tl.load(ids + g)
    match = every == e
    first = tl.min(tl.where(match, ar, PB), axis=0)
    return (first == g, first, match, ar, tl.sum(match.to(tl.int32), axis=0),
            tl.load(slot_of + e))


@triton.jit
def _next_pair(p, match, ar, PB: tl.constexpr):
    """The pair after p routed to the same expert (PB: none)."""
    return tl.min(tl.where(match & (ar > p), ar, PB), axis=0)


@triton.jit(do_not_specialize=["D", "F", "P"])
def _gate_up_once_q8_kernel(xq, xs4, ids, wts, slot_of, gate, up, h, D, F, P, stride_gs,
                            stride_us, row_bytes, TOPK: tl.constexpr, R: tl.constexpr,
                            BB: tl.constexpr, PB: tl.constexpr, ONE: tl.constexpr):
    # h[p, n] = wts[p] silu(gate_e[n] · x̂_t) (up_e[n] · x̂_t) for R rows n and every pair p =
    # (t, k) of the expert this program leads (Q4_K gate and up; ONE: D <= 256 BB)
    n = tl.program_id(0) * R + tl.arange(0, R)
    lead, p, match, ar, count, slot = _expert_pairs(ids, slot_of, tl.program_id(1), P, PB)
    if lead:
        nb = D // 256
        ra = spread_rows(gate + tl.maximum(slot, 0).to(tl.int64) * stride_gs, n, F, row_bytes)
        rb = spread_rows(up + tl.maximum(slot, 0).to(tl.int64) * stride_us, n, F, row_bytes)
        if ONE:  # the rows' one step of blocks, read once (spread_dot's layout)
            b, c, hf, w4, v, c3, zero = spread_layout(BB, R)
            m = (b < nb) & (slot >= 0)
            ga = q4k_weights(ra + b * 36, m, c, v, w4, hf, c3, False)
            ua = q4k_weights(rb + b * 36, m, c, v, w4, hf, c3, False)
        for _pair in range(count):
            hv = tl.zeros((R,), tl.float32)
            if slot >= 0:
                t = (p // TOPK).to(tl.int64)
                xw = (xq + t * D).to(tl.pointer_type(tl.int32))
                if ONE:  # (x̂'s part read once for both)
                    xp = spread_x(xw, xs4 + t * (D // 16), b, m, c, v, w4, hf)
                    g = held_q4k_dot(ga, xp, zero)
                    u = held_q4k_dot(ua, xp, zero)
                else:
                    g, u = spread_dot(ra, rb, xw, xs4 + t * (D // 16), nb, True, BB, False)
                hv = g / (1.0 + tl.exp(-g)) * u * tl.load(wts + p).to(tl.float32)
            tl.store(h + p.to(tl.int64) * F + n, hv, mask=n < F)
            p = _next_pair(p, match, ar, PB)


@triton.jit(do_not_specialize=["D", "F", "P"])
def _down_once_q8_kernel(hq, hsc, ids, slot_of, down, part, D, F, P, stride_ds, row_bytes,
                         R: tl.constexpr, BB: tl.constexpr, PB: tl.constexpr,
                         ONE: tl.constexpr, Q6: tl.constexpr = False):
    # part[p, n] = down_e[n] · ĥ_p for R rows n and every pair p of the expert this program
    # leads: a Q4_K down (hsc: ĥ's xs4), or with Q6 a Q6_K one (hsc: its per-32 scales;
    # q6k_weights / q6k_dot); ONE: F <= 256 BB
    n = tl.program_id(0) * R + tl.arange(0, R)
    lead, p, match, ar, count, slot = _expert_pairs(ids, slot_of, tl.program_id(1), P, PB)
    if lead:
        nb = F // 256
        base = down + tl.maximum(slot, 0).to(tl.int64) * stride_ds
        if Q6:
            words = base.to(tl.pointer_type(tl.int32))
            ro = _row_offsets(n, D, row_bytes)[None, None, None, :, None]
        else:
            rows = spread_rows(base, n, D, row_bytes)
        if ONE:  # the rows' one step of blocks, read once
            if Q6:
                b, hh, q, i, zero, ones = q6k_layout(BB, R)
                m = (b < nb) & (slot >= 0)
                wa = q6k_weights(words, ro + b * 210, m, hh, q, i)
            else:
                b, c, hf, w4, v, c3, zero = spread_layout(BB, R)
                m = (b < nb) & (slot >= 0)
                wa = q4k_weights(rows + b * 36, m, c, v, w4, hf, c3, False)
        for _pair in range(count):
            total = tl.zeros((R,), tl.float32)
            if slot >= 0:
                hw = (hq + p.to(tl.int64) * F).to(tl.pointer_type(tl.int32))
                if Q6:
                    hd = hsc + p.to(tl.int64) * (F // 32)
                    if ONE:
                        total = held_q6k_dot(wa, hw, hd, b, m, hh, q, i, zero, ones)
                    else:
                        total = q6k_spread_dot(words, ro, hw, hd, nb, BB)
                else:
                    hs = hsc + p.to(tl.int64) * (F // 16)
                    if ONE:
                        total = held_q4k_dot(wa, spread_x(hw, hs, b, m, c, v, w4, hf), zero)
                    else:
                        total, _ = spread_dot(rows, rows, hw, hs, nb, False, BB, False)
            tl.store(part + p.to(tl.int64) * D + n, total, mask=n < D)
            p = _next_pair(p, match, ar, PB)


def once_grid(n: int, r: int, p: int) -> tuple[int, int]:
    """The grid of a kernel here for n rows, r a program, p pairs."""
    return triton.cdiv(n, r), p


# ---- groups of MT pairs of one expert as a tensor axis (no loop, nothing held) ----


@triton.jit
def _group_of(ids, g, P, PB: tl.constexpr, MT: tl.constexpr):
    """(lead, e, pairs [MT], live [MT]) of program g: g leads a group where it is its expert's
    pair of rank 0, MT, 2 MT, ... among the step's pairs routed to that expert (in pair order);
    the group is those pairs of ranks rank .. rank + MT - 1 (live: the ones that exist)."""
    ar = tl.arange(0, PB)
    every = tl.load(ids + ar, mask=ar < P, other=-1)
    e = tl.load(ids + g)
    match = (every == e).to(tl.int32)
    before = tl.cumsum(match, axis=0) - match  # [PB]: pairs of e before each
    rank = tl.sum(tl.where(ar < g, match, 0), axis=0)
    mm = tl.arange(0, MT)
    member = (match[None, :] == 1) & (before[None, :] == rank + mm[:, None])  # [MT, PB]
    pairs = tl.min(tl.where(member, ar[None, :], PB), axis=1)  # [MT]
    return rank % MT == 0, e, pairs, pairs < PB


@triton.jit
def _tokens_pick(t, W: tl.constexpr):
    """[BB, 4, 1, MT]: element (0, W) of each thread's [2, 4] words of t [BB, 4, 2, 1, MT, 4]."""
    hf = tl.arange(0, 2)[None, None, :, None, None, None]
    w4 = tl.arange(0, 4)[None, None, None, None, None, :]
    return tl.sum(tl.sum(tl.where((hf == 0) & (w4 == W), t, 0), axis=5), axis=2)


@triton.jit
def q4k_group_dot(blk, xw, xs, b, m, xm, BB: tl.constexpr, R: tl.constexpr, MT: tl.constexpr):
    """[BB, 4, R, MT]: Q4_K blocks b (mask m) of R rows (int32 pointers blk, [1, 1, 1, R, 1] +
    block offsets) dotted with MT tokens' x̂ (int32 word pointers xw and xs4 pointers xs, each
    [1, 1, 1, 1, MT, 1]; xm [1, 1, 1, 1, MT, 1]: the live tokens): the rows' words and scales
    read once (q4k_weights, spread_dot's layout), a token axis beside the rows."""
    _, c, hf, w4, v, c3, _ = spread_layout(BB, R)
    qs, d, dmin, sc_lo, sc_hi, mn_lo, mn_hi = q4k_weights(blk, m, c, v, w4, hf, c3, False)
    # (block, pair, half, row, token, word)
    b6 = b[:, :, :, :, None, :]
    m6 = m[:, :, :, :, None, :] & xm
    c6 = tl.arange(0, 4)[None, :, None, None, None, None]
    hf6 = tl.arange(0, 2)[None, None, :, None, None, None]
    w46 = tl.arange(0, 4)[None, None, None, None, None, :]
    v6 = hf6 * 4 + w46
    xlo = tl.load(xw + b6 * 64 + c6 * 16 + v6, mask=m6, other=0)  # [BB, 4, 2, 1, MT, 4]
    xhi = tl.load(xw + b6 * 64 + c6 * 16 + 8 + v6, mask=m6, other=0)
    xq = tl.load(xs + (b6 * 4 + c6) * 4 + w46, mask=m6 & (hf6 == 0), other=0.0)
    zero = tl.zeros((BB, 4, 2, R, MT, 4), tl.int32)
    q6 = qs[:, :, :, :, None, :]
    ilo = tl.sum(tl.sum(_dp4a(q6 & 0x0F0F0F0F, xlo, zero), axis=5), axis=2)  # [BB, 4, R, MT]
    ihi = tl.sum(tl.sum(_dp4a((q6 >> 4) & 0x0F0F0F0F, xhi, zero), axis=5), axis=2)
    return (d[:, :, :, None] * (sc_lo[:, :, :, None] * _tokens_pick(xq, 0) * _i2f_signed(ilo)
                                + sc_hi[:, :, :, None] * _tokens_pick(xq, 1) * _i2f_signed(ihi))
            - dmin[:, :, :, None] * (mn_lo[:, :, :, None] * _tokens_pick(xq, 2)
                                     + mn_hi[:, :, :, None] * _tokens_pick(xq, 3)))


@triton.jit(do_not_specialize=["D", "F", "P"])
def _gate_up_group_q8_kernel(xq, xs4, ids, wts, slot_of, gate, up, h, D, F, P, stride_gs,
                             stride_us, row_bytes, TOPK: tl.constexpr, R: tl.constexpr,
                             MT: tl.constexpr, BB: tl.constexpr, PB: tl.constexpr):
    # h[p, n] = wts[p] silu(gate_e[n] · x̂_t) (up_e[n] · x̂_t) for R rows n and the MT pairs p =
    # (t, k) of expert e that this program's group holds (_group_of): the rows read once for
    # the group, its tokens a tensor axis beside them (as spread_dot's rows); Q4_K gate and up
    n = tl.program_id(0) * R + tl.arange(0, R)
    lead, e, pairs, live = _group_of(ids, tl.program_id(1), P, PB, MT)
    if lead:
        slot = tl.load(slot_of + e)
        p = tl.where(live, pairs, 0).to(tl.int64)  # [MT]
        t = p // TOPK
        xw = (xq + t * D).to(tl.pointer_type(tl.int32))[None, None, None, None, :, None]
        xs = (xs4 + t * (D // 16))[None, None, None, None, :, None]
        xm = (live & (slot >= 0))[None, None, None, None, :, None]
        ra = spread_rows(gate + tl.maximum(slot, 0).to(tl.int64) * stride_gs, n, F, row_bytes)
        rb = spread_rows(up + tl.maximum(slot, 0).to(tl.int64) * stride_us, n, F, row_bytes)
        nb = D // 256
        bb = tl.arange(0, BB)[:, None, None, None, None]
        acc_g = tl.zeros((BB, 4, R, MT), tl.float32)
        acc_u = acc_g
        for b0 in range(0, nb, BB):
            b = b0 + bb
            m = (b < nb) & (slot >= 0)
            acc_g += q4k_group_dot(ra + b * 36, xw, xs, b, m, xm, BB, R, MT)
            acc_u += q4k_group_dot(rb + b * 36, xw, xs, b, m, xm, BB, R, MT)
        g = tl.sum(tl.sum(acc_g, axis=1), axis=0)  # [R, MT]
        u = tl.sum(tl.sum(acc_u, axis=1), axis=0)
        w = tl.load(wts + p, mask=live, other=0.0).to(tl.float32)[None, :]
        hv = tl.where(slot >= 0, g / (1.0 + tl.exp(-g)) * u * w, 0.0)
        tl.store(h + p[None, :] * F + n[:, None], hv, mask=live[None, :] & (n < F)[:, None])


@triton.jit
def q6k_group_dot(words, ro, xw, dx, b, m, xm, BB: tl.constexpr, R: tl.constexpr,
                  MT: tl.constexpr):
    """[BB, 2, 2, R, MT, 4]: Q6_K blocks b (mask m) of R rows (byte offsets ro [1, 1, 1, R, 1]
    from int32 words) dotted with MT tokens' x̂ (int32 word pointers xw and per-32 scale
    pointers dx, each [1, 1, 1, 1, MT, 1]; xm: the live tokens): the rows' quants and scales
    read once (q6k_weights, q6k_spread_dot's layout), a token axis beside the rows."""
    _, h, q, i, _, _ = q6k_layout(BB, R)
    qa, qb, qh, d, s0, s1, s2, s3 = q6k_weights(words, ro + b * 210, m, h, q, i)
    # (block, half, quarter, row, token, word)
    b6 = b[:, :, :, :, None, :]
    m6 = m[:, :, :, :, None, :] & xm
    h6 = h[:, :, :, :, None, :]
    q6 = q[:, :, :, :, None, :]
    i6 = i[:, :, :, :, None, :]
    zero = tl.zeros((BB, 2, 2, R, MT, 4), tl.int32)
    acc = tl.zeros((BB, 2, 2, R, MT, 4), tl.float32)
    for j in tl.static_range(4):
        qj = _q6k_quants(qa, qb, qh, j)[:, :, :, :, None, :]
        xj = tl.load(xw + b6 * 64 + 32 * h6 + 8 * j + 4 * q6 + i6, mask=m6, other=0)
        dot = _dp4a(qj, xj, zero) - 32 * _dp4a(zero + 0x01010101, xj, zero)  # Σ (q - 32) xq
        sc = s0 if j == 0 else (s1 if j == 1 else (s2 if j == 2 else s3))
        dxj = tl.load(dx + b6 * 8 + 4 * h6 + j + 0 * (q6 + i6), mask=m6, other=0.0)
        acc += (d[:, :, :, :, None, :] * dxj) * _i2f_signed(sc[:, :, :, :, None, :] * dot)
    return acc


@triton.jit(do_not_specialize=["D", "F", "P"])
def _down_group_q8_kernel(hq, hsc, ids, slot_of, down, part, D, F, P, stride_ds, row_bytes,
                          R: tl.constexpr, MT: tl.constexpr, BB: tl.constexpr,
                          PB: tl.constexpr, Q6: tl.constexpr = False):
    # part[p, n] = down_e[n] · ĥ_p for R rows n and the MT pairs p of expert e that this
    # program's group holds (_group_of), a Q4_K down (hsc: ĥ's xs4) or with Q6 a Q6_K one
    # (hsc: its per-32 scales): the rows read once for the group, its tokens a tensor axis
    n = tl.program_id(0) * R + tl.arange(0, R)
    lead, e, pairs, live = _group_of(ids, tl.program_id(1), P, PB, MT)
    if lead:
        slot = tl.load(slot_of + e)
        p = tl.where(live, pairs, 0).to(tl.int64)  # [MT]
        xw = (hq + p * F).to(tl.pointer_type(tl.int32))[None, None, None, None, :, None]
        xm = (live & (slot >= 0))[None, None, None, None, :, None]
        base = down + tl.maximum(slot, 0).to(tl.int64) * stride_ds
        nb = F // 256
        bb = tl.arange(0, BB)[:, None, None, None, None]
        if Q6:
            xs = (hsc + p * (F // 32))[None, None, None, None, :, None]
            words = base.to(tl.pointer_type(tl.int32))
            ro = _row_offsets(n, D, row_bytes)[None, None, None, :, None]
            acc6 = tl.zeros((BB, 2, 2, R, MT, 4), tl.float32)
            for b0 in range(0, nb, BB):
                b = b0 + bb
                acc6 += q6k_group_dot(words, ro, xw, xs, b, (b < nb) & (slot >= 0), xm, BB, R,
                                      MT)
            total = tl.sum(tl.sum(tl.sum(tl.sum(acc6, axis=5), axis=2), axis=1), axis=0)
        else:
            xs = (hsc + p * (F // 16))[None, None, None, None, :, None]
            rows = spread_rows(base, n, D, row_bytes)
            acc4 = tl.zeros((BB, 4, R, MT), tl.float32)
            for b0 in range(0, nb, BB):
                b = b0 + bb
                acc4 += q4k_group_dot(rows + b * 36, xw, xs, b, (b < nb) & (slot >= 0), xm, BB,
                                      R, MT)
            total = tl.sum(tl.sum(acc4, axis=1), axis=0)  # [R, MT]
        tl.store(part + p[None, :] * D + n[:, None], tl.where(slot >= 0, total, 0.0),
                 mask=live[None, :] & (n < D)[:, None])
