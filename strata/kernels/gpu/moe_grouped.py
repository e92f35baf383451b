"""Prompt-chunk MoE on cuBLAS-class tensor cores: dequantize the experts to bf16, then two
grouped GEMMs (torch._grouped_mm).

    out = moe_forward_grouped(x, ids, weights, slot_of_expert, gate_slots, up_slots, down_slots,
                              (QType.Q4_K, QType.Q4_K, QType.Q6_K), d_model, d_expert)

Same contract as moe.moe_forward: out [T, D] float32 += Σ over the resident pairs (slot >= 0)
of weights[t, k] · down_e(silu(gate_e x_t) ⊙ up_e x_t); other pairs add nothing.

1. Pairs (P = T·K) are sorted by expert on the device (stable argsort; pairs whose expert has no
   slot get the key E and sort last), counted with scatter_add and turned into cumulative int32
   group ends: no host sync (no .item(), .tolist() or bincount).
2. The experts of a batch are dequantized into a bf16 scratch, one launch per part
   (`_dequant_slots_kernel`: matmul.py's dequantize kernel over the tiles of tiles.py, reading
   the slot table, so the slot views' record stride and any slot order work; MXFP4 on a kernel
   of its own, `_dequant_mxfp4_slots_kernel`, each block's bytes read once): gate and up into
   one [n, 2F, D] buffer, so one grouped GEMM gives g | u, down into [n, D, F]. Experts
   without a slot, and those no pair of the call routes to, are skipped (their slot passed as
   -1 on the device: the grid stays fixed; their groups are empty and never read), so a short
   chunk dequantizes only the experts it uses. Types without a tile go
   through strata.quant.dequantize.
3. h = grouped_mm(x[tok] [P, D], W_gu^T [n, D, 2F]); act = silu(g) · u · w (float32 math, the
   routing weight folded in before rounding to bf16); y = grouped_mm(act, W_d^T [n, F, D]).
   With biases (gpt-oss: moe_forward's bias and act) g and u get their expert's gate and up
   bias before the activation (glu: silu or the clamped SwiGLU) and each row w · its expert's
   down bias. On CUDA (and under Triton's interpreter) the activation is one kernel
   (`_glu_rows_kernel`) and, with the layer in one batch, `_combine_kernel` adds each token's
   K rows from the sorted order (w · b_down with them, in float32; rows of experts without a
   slot add nothing) to out, k in order. Elsewhere, and for a layer in several batches, torch
   ops: each pair's row lands at its pair id (the down bias added in float32 before one
   rounding to bf16) and out += y.view(T, K, D).sum(1) in float32. Either way a fixed order,
   deterministic, no host sync.

Scratch (bounded): the bf16 weights of `experts_per_batch` experts, at most `scratch_bytes`
(default GROUPED_SCRATCH_BYTES; never less than one expert), plus P·(6D + 10F) bytes of
activations; `grouped_scratch_bytes` gives the total for a memory plan. A layer that needs more
than one batch gathers all P rows once per batch (a batch's pair count is on the device), so
its row-wise work (not its GEMMs) repeats per batch.

torch._grouped_mm (2D x 3D with offs), as read in torch's GroupedBlas.cpp and GroupMM.cu:
bf16 operands and output; sm90/sm100 take the CUTLASS kernel with no host sync, other GPUs a
torch loop that reads offs on the host; rows [P, D] row-major, the weights "column-major"
(W^T views of [n, N, K] buffers: stride(-2) == 1), row strides multiples of 16 bytes (D and F are
multiples of 32 for every GGML type), 16-byte aligned pointers, offs int32 on the device,
fewer than 1024 groups (batches are capped at 1023 experts); empty groups are allowed, output
rows past offs[-1] are left unwritten (masked here). Where torch has no _grouped_mm or it
refuses, a per-expert loop of torch.mm runs instead (reading offs on the host: a sync on CUDA),
logged once.

On the CPU (and under Triton's interpreter) the same code runs in float32 (`compute_dtype`);
torch._grouped_mm has CPU kernels for float32 and bf16.

`experts_forward_grouped` is the same computation for groups known on the host (the streaming
ring, strata/experts/ring.py): no sorting; out gets the rows through one accumulating
index_put_ (each token's rows added in row order, so the sums are deterministic).
"""

from __future__ import annotations

import logging

import numpy as np
import torch
import triton
import triton.language as tl
from triton import knobs

from strata.kernels.gpu.bits import e8m0_half, mx_scaled
from strata.kernels.gpu.formats import kernel_format
from strata.kernels.gpu.matmul import log_fallback
from strata.kernels.gpu.pairs import check_bias, check_moe_args, glu
from strata.kernels.gpu.skeletons import group_mask, rows
from strata.kernels.gpu.tiles import dequant_tile
from strata.kernels.tuning import GROUPED_SCRATCH_BYTES, MXFP4_DEQUANT_BLOCKS
from strata.quant import QType, dequantize
from strata.runtime.waits import to_device

log = logging.getLogger("strata.kernels")

MAX_GROUPS = 1023  # torch._grouped_mm's CUTLASS kernel takes fewer than 1024 groups


# ---- dequantize slots -------------------------------------------------------------------------


@triton.jit(do_not_specialize=["N", "K"])
def _dequant_slots_kernel(w, slots, out, tab, tab2, N, K, row_bytes, stride_ws, stride_oe,
                          stride_on, QT: tl.constexpr, S: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr, EVEN_K: tl.constexpr):
    # out[j, n, k] = W_{slots[j]}[n, k]; nothing is written where slots[j] < 0
    j = tl.program_id(2)
    slot = tl.load(slots + j)
    if slot >= 0:
        n = tl.program_id(0) * BN + tl.arange(0, BN)
        wr = rows(w + slot.to(tl.int64) * stride_ws, n, N, row_bytes)
        k0 = tl.program_id(1) * BK
        g = tl.arange(0, BK // S)[None, :, None]  # [1, G, 1]
        s = tl.arange(0, S)[None, None, :]  # [1, 1, S]
        v = dequant_tile(QT, wr, k0, g, s, group_mask(k0, g, K, S, EVEN_K), tab, tab2)
        ptrs = (out + j.to(tl.int64) * stride_oe + n.to(tl.int64)[:, None, None] * stride_on
                + (k0 + g * S + s))
        tl.store(ptrs, v.to(out.dtype.element_ty),
                 mask=(n < N)[:, None, None] & (k0 + g * S < K))


@triton.jit(do_not_specialize=["N", "NB"])
def _dequant_mxfp4_slots_kernel(w, slots, out, N, NB, row_bytes, stride_ws, stride_oe,
                                stride_on, BR: tl.constexpr):
    # out[j, n, 32 b + v] = MXFP4 block b of row n of W_{slots[j]}, BR blocks a program: each
    # block's 16 bytes read once (value v < 16 its low nibble, 16 + v its high one), its values
    # computed from the codes (bits.mx_scaled); nothing written where slots[j] < 0
    j = tl.program_id(1)
    slot = tl.load(slots + j)
    if slot >= 0:
        i = tl.program_id(0) * BR + tl.arange(0, BR)  # (row, block) pairs, row-major
        live = i < N * NB
        r, b = (i // NB).to(tl.int64), i % NB
        blk = w + slot.to(tl.int64) * stride_ws + r * row_bytes + b * 17  # [BR]
        d = e8m0_half(tl.load(blk, mask=live, other=0).to(tl.int32))[:, None]
        v = tl.arange(0, 16)[None, :]
        m = live[:, None]
        q = tl.load(blk[:, None] + 1 + v, mask=m, other=0).to(tl.int32)  # [BR, 16]
        lo, hi = mx_scaled(q & 15, d), mx_scaled(q >> 4, d)
        dst = out + j.to(tl.int64) * stride_oe + r * stride_on + b * 32  # [BR]
        ty = out.dtype.element_ty
        tl.store(dst[:, None] + v, lo.to(ty), mask=m)
        tl.store(dst[:, None] + 16 + v, hi.to(ty), mask=m)


def dequantize_slots(w: torch.Tensor, slots: torch.Tensor, qtype: int | QType, n_cols: int,
                     out: torch.Tensor) -> torch.Tensor:
    """out[j] = the dequantized rows of w[slots[j]] for every j with slots[j] >= 0 (out[j] is
    left as it was where slots[j] < 0). w: uint8 [n_slots, N, row_nbytes(n_cols)] (a strided
    slot view), slots: int32 [n] on w's device, out: [n, N, n_cols] with contiguous rows (any
    stride between experts, e.g. a slice of a wider buffer). One launch on CUDA (and under
    Triton's interpreter); strata.quant.dequantize per expert elsewhere or for types without a
    tile (exact)."""
    qtype = QType(qtype)
    n, rows_n = slots.shape[0], w.shape[1]
    if out.shape != (n, rows_n, n_cols) or out.stride(2) != 1:
        raise ValueError(f"out must be [{n}, {rows_n}, {n_cols}] with contiguous rows, got "
                         f"{tuple(out.shape)} strides {out.stride()}")
    if n == 0 or w.shape[0] == 0:
        return out
    fmt = kernel_format(qtype)
    if fmt is None or not (w.is_cuda or knobs.runtime.interpret):
        if fmt is None:
            log_fallback("dequantize_slots", qtype)
        idx = slots.long()
        for j in range(n):  # one expert's float32 values at a time
            # index_select, not w[idx[j]]: indexing by a 0-d device tensor reads it on the host
            rec = w.index_select(0, idx[j:j + 1].clamp(min=0))[0]  # slot -1: a spare read
            vals = dequantize(rec, qtype, n_cols)
            out[j].copy_(torch.where(idx[j] >= 0, vals.to(out.dtype), out[j]))
        return out
    if qtype == QType.MXFP4 and MXFP4_DEQUANT_BLOCKS:
        nb, br = n_cols // 32, MXFP4_DEQUANT_BLOCKS
        _dequant_mxfp4_slots_kernel[(triton.cdiv(rows_n * nb, br), n)](
            w, slots, out, rows_n, nb, w.stride(1), w.stride(0), out.stride(0), out.stride(1),
            BR=br, num_warps=4)
        return out
    bn, bk = 16, 256
    tab, tab2 = fmt.tables(w.device)
    grid = (triton.cdiv(rows_n, bn), triton.cdiv(n_cols, bk), n)
    _dequant_slots_kernel[grid](w, slots, out, tab, tab2, rows_n, n_cols, w.stride(1),
                                w.stride(0), out.stride(0), out.stride(1), QT=int(qtype),
                                S=fmt.group, BN=bn, BK=bk, EVEN_K=n_cols % bk == 0,
                                num_warps=4)
    return out


# ---- the row-wise steps around the GEMMs --------------------------------------------------------


@triton.jit(do_not_specialize=["F", "R"])
def _glu_rows_kernel(h, w, eid, bg, bu, out, F, R, BIAS: tl.constexpr, OAI: tl.constexpr,
                     BR: tl.constexpr, BF: tl.constexpr):
    # out[r, n] = w[r] · glu(h[r, n] + bg[eid[r], n], h[r, F + n] + bu[eid[r], n]) in float32,
    # one rounding to out's type (the biases with BIAS only)
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    n = tl.program_id(1) * BF + tl.arange(0, BF)
    rm = r < R
    m = rm[:, None] & (n < F)[None, :]
    row = h + r.to(tl.int64)[:, None] * (2 * F) + n[None, :]
    g = tl.load(row, mask=m, other=0.0).to(tl.float32)
    u = tl.load(row + F, mask=m, other=0.0).to(tl.float32)
    if BIAS:
        e = tl.load(eid + r, mask=rm, other=0).to(tl.int64)[:, None] * F + n[None, :]
        g += tl.load(bg + e, mask=m, other=0.0)
        u += tl.load(bu + e, mask=m, other=0.0)
    a = glu(g, u, OAI) * tl.load(w + r, mask=rm, other=0.0)[:, None]
    tl.store(out + r.to(tl.int64)[:, None] * F + n[None, :], a.to(out.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["D"])
def _combine_kernel(y, inv, end, w, eid, bd, out, D, TOPK: tl.constexpr, BIAS: tl.constexpr,
                    BD: tl.constexpr):
    # out[t, n] += Σ_k (y[r, n] + w[r] · bd[eid[r], n]) over token t's pairs, r = inv[t·K + k]
    # its row in sorted order, rows r >= end (experts without a slot) adding nothing; k in order
    t = tl.program_id(0)
    n = tl.program_id(1) * BD + tl.arange(0, BD)
    nm = n < D
    stop = tl.load(end)
    acc = tl.zeros((BD,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        r = tl.load(inv + t * TOPK + k)
        ok = r < stop
        v = tl.load(y + r.to(tl.int64) * D + n, mask=nm & ok, other=0.0).to(tl.float32)
        if BIAS:
            b = tl.load(bd + tl.load(eid + r).to(tl.int64) * D + n, mask=nm & ok, other=0.0)
            v += tl.load(w + r) * b
        acc += v
    o = out + t.to(tl.int64) * D + n
    tl.store(o, tl.load(o, mask=nm, other=0.0) + acc, mask=nm)


def fused_rows(device: torch.device) -> bool:
    """The row-wise steps run as the two kernels above: on CUDA and under Triton's interpreter
    (torch ops elsewhere: the CPU's float32 path)."""
    return device.type == "cuda" or bool(knobs.runtime.interpret)


def glu_rows(h: torch.Tensor, w: torch.Tensor, f: int, act: str = "swiglu",
             bias: tuple[torch.Tensor, ...] | None = None,
             eid: torch.Tensor | None = None) -> torch.Tensor:
    """[R, F] in h's dtype: row r = w[r] · glu(g + bg[eid[r]], u + bu[eid[r]]) of h [R, 2F]
    (g | u, contiguous), in float32 and rounded once (the biases where given)."""
    r = h.shape[0]
    out = torch.empty(r, f, dtype=h.dtype, device=h.device)
    if r == 0:
        return out
    bg, bu = (bias[0], bias[1]) if bias is not None else (w, w)  # (unread without BIAS)
    br, bf = 4, 256
    _glu_rows_kernel[(triton.cdiv(r, br), triton.cdiv(f, bf))](
        h, w, eid if eid is not None else w, bg, bu, out, f, r, BIAS=bias is not None,
        OAI=act == "swiglu_oai", BR=br, BF=bf, num_warps=4)
    return out


def combine(y: torch.Tensor, order: torch.Tensor, end: torch.Tensor, w: torch.Tensor,
            eid: torch.Tensor, bd: torch.Tensor | None, out: torch.Tensor, topk: int) -> None:
    """out [T, D] float32 += the sum over each token's K pairs of y's rows (y [P, D], rows in
    the sorted order `order` gives: row r is pair order[r]; rows r >= end[0] add nothing), each
    with w[r] · bd[eid[r]] where bd is given: one launch, no scatter of y back to pair order."""
    p, d = y.shape
    inv = torch.empty_like(order)
    inv.scatter_(0, order, torch.arange(p, device=order.device, dtype=order.dtype))
    bd_ = bd if bd is not None else w  # (unread without BIAS)
    bdim = min(1024, triton.next_power_of_2(d))
    _combine_kernel[(p // topk, triton.cdiv(d, bdim))](
        y, inv, end, w, eid, bd_, out, d, TOPK=topk, BIAS=bd is not None, BD=bdim, num_warps=4)


# ---- sizes ------------------------------------------------------------------------------------


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 tensor-core operands on CUDA; float32 on the CPU (exact weights, the CI path)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def experts_per_batch(n_experts: int, d_model: int, d_expert: int,
                      scratch_bytes: int = GROUPED_SCRATCH_BYTES, itemsize: int = 2) -> int:
    """Experts dequantized at once: as many as `scratch_bytes` holds (at least one, at most
    MAX_GROUPS), then evened out over the batches that takes."""
    per_expert = 3 * d_model * d_expert * itemsize
    fit = max(1, min(n_experts, scratch_bytes // per_expert, MAX_GROUPS))
    n_batches = triton.cdiv(max(n_experts, 1), fit)
    return triton.cdiv(max(n_experts, 1), n_batches)


def grouped_scratch_bytes(layout_or_dims: object, n_experts: int, tokens: int, topk: int,
                          scratch_bytes: int = GROUPED_SCRATCH_BYTES) -> int:
    """Device bytes one moe_forward_grouped call allocates at most (bf16, CUDA): the weight
    scratch of one batch of experts plus every activation buffer, counted as if all were live
    at once. layout_or_dims: an ExpertLayout (d_model, d_expert attributes) or (d_model,
    d_expert). Qwen3-30B-A3B, 4096 tokens, top-8: 1.125 GiB of weights + 0.66 GiB (1.78 GiB)."""
    if isinstance(layout_or_dims, tuple):
        d, f = layout_or_dims
    else:
        d, f = layout_or_dims.d_model, layout_or_dims.d_expert
    weights = experts_per_batch(n_experts, d, f, scratch_bytes) * 3 * d * f * 2
    p = tokens * topk
    # x[tok] 2D, h 4F, silu(g)·u float32 4F, act 2F, y per batch 2D, y by pair 2D (bf16 bytes);
    # int64 sort keys, order, rows, tokens, float32 weights: ~40 bytes per pair
    rows_bytes = p * (6 * d + 10 * f + 40) + 2 * d
    tokens_bytes = tokens * d * (2 + 4)  # x in bf16, the float32 sum over K
    return weights + rows_bytes + tokens_bytes


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The weight scratch and the by-pair output: left uninitialized; tests swap in a NaN-filled
    version so a read of anything not written shows up in the output."""
    return torch.empty(shape, dtype=dtype, device=device)


# ---- grouped GEMM ------------------------------------------------------------------------------

_LOGGED: list[bool] = []  # the torch.mm loop was logged


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """[P, N]: rows offs[g-1]:offs[g] of a [P, K] times b[g] [K, N] (offs int32 cumulative group
    ends on a's device, offs[-1] <= P; rows past offs[-1] are undefined)."""
    try:
        return torch._grouped_mm(a, b, offs=offs)
    except torch.OutOfMemoryError:
        raise
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        if not _LOGGED:
            _LOGGED.append(True)
            log.info("torch._grouped_mm refused (%s): a loop of torch.mm per expert, which "
                     "reads the group sizes on the host", str(e).splitlines()[0][:200])
    y = torch.empty(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end], b[g], out=y[start:end])
        start = end
    return y


def _experts(x: torch.Tensor, tok: torch.Tensor, w: torch.Tensor, offs: torch.Tensor,
             slots: torch.Tensor, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
             qtypes: tuple[QType, QType, QType], d: int, f: int,
             wbuf: torch.Tensor, bias: tuple[torch.Tensor, ...] | None = None,
             eid: torch.Tensor | None = None, act: str = "swiglu",
             down_bias: bool = True) -> torch.Tensor:
    """y [R, D] in wbuf's dtype: row r = w[r] · expert(x[tok[r]]) for the rows r < offs[-1],
    expert j (slot slots[j]) taking rows offs[j-1]:offs[j]; rows past offs[-1] undefined.
    wbuf: the weight scratch, at least n·3·F·D elements. bias (gate [E, F], up [E, F], down
    [E, D] float32) with eid (int64 [R]: row r's expert id, any valid id past offs[-1]): the
    experts' biases; act: the activation (torch_ops.glu); down_bias=False leaves w · b_down
    to the caller (combine adds it)."""
    n = slots.shape[0]
    gate, up, down = parts
    qg, qu, qd = qtypes
    w_gu = wbuf[: n * 2 * f * d].view(n, 2 * f, d)  # gate rows, then up rows, per expert
    w_d = wbuf[n * 2 * f * d: n * 3 * f * d].view(n, d, f)
    dequantize_slots(gate, slots, qg, d, w_gu[:, :f])
    dequantize_slots(up, slots, qu, d, w_gu[:, f:])
    dequantize_slots(down, slots, qd, f, w_d)
    # [R, D] in bf16: convert x first when it has fewer rows than gathered
    a = (x.to(wbuf.dtype).index_select(0, tok) if x.shape[0] <= tok.shape[0]
         else x.index_select(0, tok).to(wbuf.dtype))
    h = grouped_mm(a, w_gu.transpose(1, 2), offs)  # [R, 2F]: g | u
    del a
    if fused_rows(h.device) and h.is_contiguous():
        g = glu_rows(h, w, f, act, bias, eid)
    elif bias is None and act == "swiglu":
        g = h[:, :f].float()
        torch.nn.functional.silu(g, inplace=True)
        g.mul_(h[:, f:]).mul_(w[:, None])  # the routing weight, before rounding to bf16
    else:
        from strata.kernels.torch_ops import glu

        g, u = h[:, :f].float(), h[:, f:].float()
        if bias is not None:
            g.add_(bias[0].index_select(0, eid))
            u.add_(bias[1].index_select(0, eid))
        g = glu(g, u, act).mul_(w[:, None])
        del u
    del h
    y = grouped_mm(g.to(wbuf.dtype), w_d.transpose(1, 2), offs)  # [R, D]
    if bias is None or not down_bias:
        return y
    # w · b_down in float32, then one rounding to bf16
    return y.float().addcmul_(bias[2].index_select(0, eid), w[:, None]).to(wbuf.dtype)


def _weight_buffer(n: int, d: int, f: int, dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor:
    return scratch((n * 3 * f * d,), dtype, device)


# ---- entry points ------------------------------------------------------------------------------


def moe_forward_grouped(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                        slot_of_expert: torch.Tensor, gate_slots: torch.Tensor,
                        up_slots: torch.Tensor, down_slots: torch.Tensor,
                        qtypes: tuple[int, int, int], d_model: int, d_expert: int,
                        out: torch.Tensor | None = None,
                        scratch_bytes: int = GROUPED_SCRATCH_BYTES,
                        bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                        act: str = "swiglu") -> torch.Tensor:
    """out [T, D] float32 (+)= the resident experts' weighted outputs; arguments as
    moe.moe_forward (see the module doc; bias and act too). No host sync on sm90/sm100."""
    qtypes, out = check_moe_args(x, ids, weights, slot_of_expert, gate_slots, up_slots,
                                 down_slots, qtypes, d_model, d_expert, out)
    check_bias(bias, act, slot_of_expert.shape[0], d_model, d_expert, x.device)
    t, topk = ids.shape
    e = slot_of_expert.shape[0]
    p = t * topk
    if p == 0:
        return out
    dev, d, f = x.device, d_model, d_expert
    dtype = compute_dtype(dev)
    flat = ids.reshape(-1).long()  # [P] pair p = token p // K, its k-th expert
    key = torch.where(slot_of_expert[flat] >= 0, flat, e)  # not resident: sorts last, key E
    order = torch.argsort(key, stable=True)  # pair ids sorted by expert
    counts = torch.zeros(e + 2, dtype=torch.int32, device=dev)  # counts[i + 1]: expert i's
    counts.scatter_add_(0, key + 1, torch.ones_like(key, dtype=torch.int32))
    bounds = torch.cumsum(counts[:e + 1], 0, dtype=torch.int32)  # expert i: bounds[i]:[i + 1]
    # the slots of the experts some pair uses: the dequantize launches skip the others (their
    # groups are empty), on the device over the same fixed grid
    live = torch.where(counts[1:e + 1] > 0, slot_of_expert, -1)
    wflat = weights.reshape(-1).float()
    nb = experts_per_batch(e, d, f, scratch_bytes, dtype.itemsize)
    wbuf = _weight_buffer(min(nb, e), d, f, dtype, dev)
    parts = (gate_slots, up_slots, down_slots)
    idx = torch.arange(p, device=dev)
    if nb >= e:  # one batch
        offs = bounds[1:]
        eid, w_sorted = flat[order], wflat[order]
        summed = fused_rows(dev) and out.is_contiguous()  # (combine adds w · b_down)
        y_sorted = _experts(x, order // topk, w_sorted, offs, live, parts, qtypes, d, f, wbuf,
                            bias, eid, act, down_bias=not summed)
        if summed:  # straight from the sorted rows (non-resident pairs add nothing)
            combine(y_sorted, order, offs[-1:], w_sorted, eid,
                    bias[2] if bias is not None else None, out, topk)
            return out
        # every position's pair written, non-resident ones as zeros
        y_sorted.masked_fill_((idx >= offs[-1])[:, None], 0)
        y = scratch((p, d), dtype, dev)
        y.index_copy_(0, order, y_sorted)  # order is a permutation of the pairs
    else:  # a batch's pairs start on the device: gather P rows from there, write the valid
        y = torch.zeros(p + 1, d, dtype=dtype, device=dev)  # row P: where the rest go
        for e0 in range(0, e, nb):
            e1 = min(e, e0 + nb)
            offs = bounds[e0 + 1:e1 + 1] - bounds[e0]
            pairs = order[(idx + bounds[e0]).clamp_(max=p - 1)]
            y_b = _experts(x, pairs // topk, wflat[pairs], offs, live[e0:e1], parts,
                           qtypes, d, f, wbuf, bias, flat[pairs], act)
            y.index_copy_(0, torch.where(idx < offs[-1], pairs, p), y_b)
        y = y[:p]
    out += y.view(t, topk, d).sum(1, dtype=torch.float32)
    return out


def experts_forward_grouped(x: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor,
                            counts: list[int], slots: torch.Tensor, gate_slots: torch.Tensor,
                            up_slots: torch.Tensor, down_slots: torch.Tensor,
                            qtypes: tuple[int, int, int], d_model: int, d_expert: int,
                            out: torch.Tensor,
                            scratch_bytes: int = GROUPED_SCRATCH_BYTES,
                            tokens_host: torch.Tensor | None = None,
                            offs: torch.Tensor | None = None,
                            bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                            eid: torch.Tensor | None = None,
                            act: str = "swiglu") -> torch.Tensor:
    """out[tokens[r]] += weights[r] · expert_j(x[tokens[r]]) for groups known on the host:
    expert j (slot slots[j] >= 0 of the slot views) takes the next counts[j] rows of tokens
    (int64 [R]) and weights (float32 [R]), both on x's device; slots int32 [n]. x [T, D]
    bf16/f32, out float32 [T, D]. A token appears at most once per expert. tokens_host: the
    same tokens on the host (CPU tensors are their own): the sums then go in a few rounds of
    distinct tokens (`token_rounds`) instead of one accumulating index_put_ (the same sums, in
    the same order per token). offs: the cumulative counts (int32 [n], on x's device), sent
    by the caller; with it and no tokens_host the call copies nothing to the device (a small
    copy here would queue behind any large host-to-device copy issued before it, on another
    stream too: the copy engine takes them in issue order). bias (gpt-oss: gate [E, F], up
    [E, F], down [E, D] float32 on x's device, rows by expert id) with eid (int64 [R] on x's
    device: each row's expert id) and act: as moe_forward's, each row's expert's biases and
    activation."""
    qtypes = tuple(QType(q) for q in qtypes)
    if bias is not None and (eid is None or eid.shape != tokens.shape):
        raise ValueError("experts_forward_grouped: biases need eid, each row's expert id, "
                         f"[{tokens.shape[0]}]")
    if sum(counts) != tokens.shape[0] or weights.shape != tokens.shape:
        raise ValueError(f"counts add up to {sum(counts)} rows, tokens has {tokens.shape[0]} "
                         f"and weights {tuple(weights.shape)}")
    if len(counts) != slots.shape[0]:
        raise ValueError(f"{len(counts)} groups but {slots.shape[0]} slots")
    if not counts:
        return out
    dev, d, f = x.device, d_model, d_expert
    dtype = compute_dtype(dev)
    nb = experts_per_batch(len(counts), d, f, scratch_bytes, dtype.itemsize)
    wbuf = _weight_buffer(min(nb, len(counts)), d, f, dtype, dev)
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    for j0 in range(0, len(counts), nb):
        j1 = min(len(counts), j0 + nb)
        r0, r1 = starts[j0], starts[j1]
        if r1 == r0:
            continue
        if offs is not None:
            batch_offs = offs[j0:j1] - r0 if r0 else offs[j0:j1]
        else:
            ends = [s - r0 for s in starts[j0 + 1:j1 + 1]]
            batch_offs = to_device(torch.tensor(ends, dtype=torch.int32), dev)  # pinned: async
        y = _experts(x, tokens[r0:r1], weights[r0:r1].float(), batch_offs, slots[j0:j1],
                     (gate_slots, up_slots, down_slots), qtypes, d, f, wbuf, bias,
                     eid[r0:r1] if eid is not None else None, act)
        y = y.to(out.dtype)
        host = tokens_host if tokens.device.type != "cpu" else tokens
        if host is None:
            # index_put_ with accumulate sorts the rows by token (stably) and adds each token's
            # rows in row order: the sums of one index_add_ per expert, bit for bit, in a few
            # launches instead of one per expert (tests/test_moe_grouped.py compares them)
            out.index_put_((tokens[r0:r1],), y, accumulate=True)
            continue
        tok = host[r0:r1].numpy()
        for sel in token_rounds(tok):  # distinct tokens in each round: no two adds meet
            idx = to_device(torch.from_numpy(sel), dev)
            out.index_add_(0, to_device(torch.from_numpy(tok[sel]), dev), y.index_select(0, idx))
    return out


def token_rounds(tokens: np.ndarray) -> list[np.ndarray]:
    """Row indices of `tokens` in rounds: round r holds each token's r-th row, so no token
    appears twice in a round and adding a round with index_add_ is deterministic (distinct
    targets), as is the order of the rounds. As many rounds as a token has rows at most."""
    order = np.argsort(tokens, kind="stable")
    ranked = tokens[order]
    n = len(ranked)
    starts = np.flatnonzero(np.r_[True, ranked[1:] != ranked[:-1]])
    first = np.repeat(starts, np.diff(np.r_[starts, n]))  # segment start of each sorted row
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - first
    return [np.flatnonzero(rank == r) for r in range(int(rank.max()) + 1)] if n else []

