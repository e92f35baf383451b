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
    _down_once_q8_kernel      a Q4_K down of each pair's ĥ: part[p]
    _down_once_q6k_q8_kernel  a Q6_K down of each pair's ĥ: part[p]
"""

from __future__ import annotations

import triton
import triton.language as tl

from strata.kernels.gpu.gemv_q8 import (
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
def _expert_pairs(ids, g, P, PB: tl.constexpr):
    """(e, lead, first, match, ar) of program g: its pair's expert e, whether g is e's first
    pair (the program that takes e), and match [PB]: the pairs routed to e (ar their ids)."""
    ar = tl.arange(0, PB)
    every = tl.load(ids + ar, mask=ar < P, other=-1)
    e = tl.load(ids + g)
    match = every == e
    first = tl.min(tl.where(match, ar, PB), axis=0)
    return e, first == g, first, match, ar


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
    e, lead, p, match, ar = _expert_pairs(ids, tl.program_id(1), P, PB)
    if lead:
        count = tl.sum(match.to(tl.int32), axis=0)
        slot = tl.load(slot_of + e)
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
def _down_once_q8_kernel(hq, hs4, ids, slot_of, down, part, D, F, P, stride_ds, row_bytes,
                         R: tl.constexpr, BB: tl.constexpr, PB: tl.constexpr,
                         ONE: tl.constexpr):
    # part[p, n] = down_e[n] · ĥ_p for R rows n and every pair p of the expert this program
    # leads (Q4_K down; ONE: F <= 256 BB)
    n = tl.program_id(0) * R + tl.arange(0, R)
    e, lead, p, match, ar = _expert_pairs(ids, tl.program_id(1), P, PB)
    if lead:
        count = tl.sum(match.to(tl.int32), axis=0)
        slot = tl.load(slot_of + e)
        nb = F // 256
        rows = spread_rows(down + tl.maximum(slot, 0).to(tl.int64) * stride_ds, n, D,
                           row_bytes)
        if ONE:
            b, c, hf, w4, v, c3, zero = spread_layout(BB, R)
            m = (b < nb) & (slot >= 0)
            wa = q4k_weights(rows + b * 36, m, c, v, w4, hf, c3, False)
        for _pair in range(count):
            total = tl.zeros((R,), tl.float32)
            if slot >= 0:
                hw = (hq + p.to(tl.int64) * F).to(tl.pointer_type(tl.int32))
                hs = hs4 + p.to(tl.int64) * (F // 16)
                if ONE:
                    total = held_q4k_dot(wa, spread_x(hw, hs, b, m, c, v, w4, hf), zero)
                else:
                    total, _ = spread_dot(rows, rows, hw, hs, nb, False, BB, False)
            tl.store(part + p.to(tl.int64) * D + n, total, mask=n < D)
            p = _next_pair(p, match, ar, PB)


@triton.jit(do_not_specialize=["D", "F", "P"])
def _down_once_q6k_q8_kernel(hq, hdx, ids, slot_of, down, part, D, F, P, stride_ds, row_bytes,
                             R: tl.constexpr, BB: tl.constexpr, PB: tl.constexpr,
                             ONE: tl.constexpr):
    # as _down_once_q8_kernel for a Q6_K down (q6k_weights / q6k_dot; ONE: F <= 256 BB)
    n = tl.program_id(0) * R + tl.arange(0, R)
    e, lead, p, match, ar = _expert_pairs(ids, tl.program_id(1), P, PB)
    if lead:
        count = tl.sum(match.to(tl.int32), axis=0)
        slot = tl.load(slot_of + e)
        nb = F // 256
        base = (down + tl.maximum(slot, 0).to(tl.int64) * stride_ds).to(tl.pointer_type(tl.int32))
        ro = _row_offsets(n, D, row_bytes)[None, None, None, :, None]
        if ONE:
            b, hh, q, i, zero, ones = q6k_layout(BB, R)
            m = (b < nb) & (slot >= 0)
            wa = q6k_weights(base, ro + b * 210, m, hh, q, i)
        for _pair in range(count):
            total = tl.zeros((R,), tl.float32)
            if slot >= 0:
                hw = (hq + p.to(tl.int64) * F).to(tl.pointer_type(tl.int32))
                hd = hdx + p.to(tl.int64) * (F // 32)
                if ONE:
                    total = held_q6k_dot(wa, hw, hd, b, m, hh, q, i, zero, ones)
                else:
                    total = q6k_spread_dot(base, ro, hw, hd, nb, BB)
            tl.store(part + p.to(tl.int64) * D + n, total, mask=n < D)
            p = _next_pair(p, match, ar, PB)


def once_grid(n: int, r: int, p: int) -> tuple[int, int]:
    """The grid of a kernel here for n rows, r a program, p pairs."""
    return triton.cdiv(n, r), p
