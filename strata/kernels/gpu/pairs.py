"""What the MoE kernel files (moe.py, gemv_q8.py, moe_grouped.py, moe_mmq.py) share: which pairs
a kernel computes, where a pair's expert record is, pairs sorted by expert and a program's share
of them, the experts' activation and biases, row alignment, and moe_forward's argument checks.

Legend: T tokens, K routed experts per token, E experts, D d_model, F d_expert, P = T·K pairs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from strata.arch.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT
from strata.kernels.gpu.matmul import check_weights
from strata.quant import QType

ACTS = ("swiglu", "swiglu_oai")  # the experts' activations the kernels compute (OAI: the second)
_ALPHA = tl.constexpr(SWIGLU_ALPHA)
_LIMIT = tl.constexpr(SWIGLU_LIMIT)


def sort_pairs(ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, ...]:
    """The pairs of ids [T, K] grouped by expert on the device, no host sync (bincount would
    read the max): (counts int32 [E], starts int32 [E], order int32 [P]: pair ids sorted by
    expert, stably)."""
    flat = ids.reshape(-1).long()  # [P]
    counts = torch.zeros(n_experts, dtype=torch.int32, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    starts = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    return counts, starts, torch.argsort(flat, stable=True).to(torch.int32)


@triton.jit
def expert_chunk(pid, NC, counts, starts, order, BM: tl.constexpr):
    """The BM-pair chunk c of expert e that program pid handles (NC chunks an expert): (e, the
    chunk holds pairs, its expert's first sorted position, row indices r [BM] among the
    expert's pairs, their mask, pair ids)."""
    e = pid // NC
    c = pid % NC
    cnt = tl.load(counts + e)
    start = tl.load(starts + e)
    r = c * BM + tl.arange(0, BM)
    rm = r < cnt
    pair = tl.load(order + start + r, mask=rm, other=0)
    return e, c * BM < cnt, start, r, rm, pair


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


@triton.jit
def glu(g, u, OAI: tl.constexpr):
    """The gated activation of gate g and up u (float32, any shape): silu(g) · u, or with OAI
    gpt-oss's clamped SwiGLU, g' = min(g, LIMIT), u' = clamp(u, -LIMIT, LIMIT),
    (u' + 1) · g' · sigmoid(ALPHA g') (strata.kernels.torch_ops.glu)."""
    if OAI:
        gc = tl.minimum(g, _LIMIT)
        uc = tl.minimum(tl.maximum(u, -_LIMIT), _LIMIT)
        a = (uc + 1.0) * (gc / (1.0 + tl.exp(-_ALPHA * gc)))
    else:
        a = g / (1.0 + tl.exp(-g)) * u
    return a


@triton.jit
def bias_row(b, e, n, N):
    """float32 [BN]: entries n of row e of the expert biases b [E, N] (0 past N)."""
    return tl.load(b + e.to(tl.int64) * N + n, mask=n < N, other=0.0)


def check_bias(bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, act: str,
               n_experts: int, d_model: int, d_expert: int, device: torch.device) -> None:
    """moe_forward's bias (gate [E, F], up [E, F], down [E, D], contiguous float32 on x's
    device, indexed by expert id) and act (ACTS)."""
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    if bias is None:
        return
    for name, b, n in zip(("gate", "up", "down"), bias, (d_expert, d_expert, d_model),
                          strict=True):
        if (b.shape != (n_experts, n) or b.dtype != torch.float32 or not b.is_contiguous()
                or b.device != device):
            raise ValueError(f"bias {name} must be contiguous float32 [{n_experts}, {n}] on "
                             f"{device}, got {b.dtype} {tuple(b.shape)} on {b.device}")


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
