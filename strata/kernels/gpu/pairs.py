"""What the MoE kernel files (moe.py, gemv_q8.py, moe_grouped.py) share: which pairs a kernel
computes, where a pair's expert record is, row alignment, and moe_forward's argument checks.

Legend: T tokens, K routed experts per token, E experts, D d_model, F d_expert, P = T·K pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.kernels.gpu.matmul import check_weights
from strata.quant import QType


@triton.jit
def pair_computed(slot, p, MISS: tl.constexpr, TOPK: tl.constexpr, HOST_FROM: tl.constexpr):
    """Whether pair p is computed: its expert has a slot, or every pair with MISS (the record of
    one without a slot is in its miss row) except the token's pairs from HOST_FROM on that have
    no slot (the host computes those: strata.experts.cpu_share; HOST_FROM = TOPK: none)."""
    if MISS:
        live = slot > -(1 << 30)
        if HOST_FROM < TOPK:
            live = live & ((slot >= 0) | (p % TOPK < HOST_FROM))
    else:
        live = slot >= 0
    return live


@triton.jit
def record_part(slots, slot, stride_s, miss_rows, p, stride_m, MISS: tl.constexpr):
    """uint8 pointer to pair p's part (gate, up or down) of its expert's record: in slot `slot`
    of `slots`, or with MISS and no slot (slot < 0) in row p of `miss_rows`."""
    base = slots + tl.maximum(slot, 0).to(tl.int64) * stride_s
    if MISS:
        base = tl.where(slot >= 0, base, miss_rows + p.to(tl.int64) * stride_m)
    return base


def words_aligned(*parts: torch.Tensor, rows: bool = True, align: int = 4) -> bool:
    """Whether every row (rows False: every record) of these uint8 views starts align-byte
    aligned (gemv_q8.py reads Q4_K rows as int32 words, a part after a Q6_K part of an odd
    number of blocks would not be; its run forms read aligned 16-byte words)."""
    return all(t.data_ptr() % align == 0
               and all(st % align == 0 for st in t.stride()[:-1 if rows else 1]) for t in parts)


def check_moe_args(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                   slot_of_expert: torch.Tensor, gate_slots: torch.Tensor,
                   up_slots: torch.Tensor, down_slots: torch.Tensor, qtypes: tuple[int, int, int],
                   d_model: int, d_expert: int, out: torch.Tensor | None,
                   zero: bool = True) -> tuple[tuple[QType, QType, QType], torch.Tensor]:
    """The (gate, up, down) QTypes and `out` (when None: zeros, or uninitialized with
    zero=False), after checking every argument of moe_forward (shared by the grouped path,
    moe_grouped.py)."""
    qg, qu, qd = (QType(q) for q in qtypes)
    t, d = x.shape if x.dim() == 2 else (-1, -1)
    if d != d_model or x.stride(-1) != 1 or x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x must be bf16/f32 [T, {d_model}] with contiguous rows, got "
                         f"{x.dtype} {tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != t or weights.shape != ids.shape:
        raise ValueError(f"ids and weights must be [T={t}, K], got {tuple(ids.shape)} and "
                         f"{tuple(weights.shape)}")
    if slot_of_expert.dtype != torch.int32 or slot_of_expert.dim() != 1:
        raise TypeError("slot_of_expert must be int32 [E] (-1: not resident)")
    for name, sl, n_rows, q, cols in (("gate", gate_slots, d_expert, qg, d_model),
                                      ("up", up_slots, d_expert, qu, d_model),
                                      ("down", down_slots, d_model, qd, d_expert)):
        check_weights(sl, q, cols, dims=3)
        if sl.shape[1] != n_rows:
            raise ValueError(f"{name} slots must hold {n_rows} rows per expert, got "
                             f"{tuple(sl.shape)}")
    if out is None:
        out = (torch.zeros if zero else torch.empty)(t, d_model, dtype=torch.float32,
                                                     device=x.device)
    elif out.shape != (t, d_model) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [{t}, {d_model}] with contiguous rows")
    return (qg, qu, qd), out
