"""Compute experts from packed records with torch: dequantize, then batched matmuls.

This is the portable hit path (and the staging path): correct on any device and any type. The
fused Triton kernels replace it on CUDA where they cover a layer's types.

Legend: n experts in a group, M the most tokens any of them got, D hidden, F expert hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.experts.layout import ExpertLayout
from strata.kernels.torch_ops import glu
from strata.quant import DEQUANT_CHUNK_BYTES, DEQUANT_PEAK, dequantize_into


@dataclass
class Group:
    """The tokens routed to one expert and their routing weights."""

    expert: int
    tokens: torch.Tensor  # int64 [m] (host)
    weights: torch.Tensor  # float32 [m] (host)


def group_pairs(ids: torch.Tensor, weights: torch.Tensor) -> list[Group]:
    """ids, weights [T, K] (host tensors) -> one Group per routed expert, in expert order.
    NumPy throughout: a decode step calls this once per host layer, and torch's CPU ops cost
    ~10 us each on inputs this small."""
    K = ids.shape[1]
    flat = ids.numpy().ravel()
    w = weights.numpy().ravel()
    order = np.argsort(flat, kind="stable")
    ranked = flat[order]
    cuts = [0, *(np.flatnonzero(ranked[1:] != ranked[:-1]) + 1).tolist(), len(ranked)]
    tok = order // K
    return [Group(int(ranked[a]), torch.from_numpy(tok[a:b]), torch.from_numpy(w[order[a:b]]))
            for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


def windows(tokens: int, rows: int | None) -> list[tuple[int, int]]:
    """(first, end) of each window of at most `rows` tokens (None: one window of all)."""
    if rows is None or rows >= tokens:
        return [(0, tokens)]
    return [(a, min(a + rows, tokens)) for a in range(0, tokens, rows)]


def within(groups: list[Group], a: int, b: int) -> list[Group]:
    """Each group's pairs of tokens a .. b-1 (a group may come back empty), token indices kept;
    the tokens ascending in each group (group_pairs')."""
    out = []
    for g in groups:
        if a == 0 and (len(g.tokens) == 0 or int(g.tokens[-1]) < b):
            out.append(g)
            continue
        lo, hi = torch.searchsorted(g.tokens, torch.tensor([a, b])).tolist()
        out.append(Group(g.expert, g.tokens[lo:hi], g.weights[lo:hi]))
    return out


def run_records(layout: ExpertLayout, records: torch.Tensor, groups: list[Group], h: torch.Tensor,
                out: torch.Tensor, workspace_bytes: int, rows: int | None = None) -> None:
    """out[t] += Σ_g w * expert_g(h[t]) for records [n, stride] holding the groups' experts,
    within workspace_bytes: as many experts at once as leave room, beside their float32 gate,
    up and down, to dequantize one of those matrices whole (DEQUANT_PEAK times its size; each
    dequantize call is a few dozen torch operations, so fewer, larger calls are faster), else
    one expert at a time, its matrices dequantized in pieces of what is left. rows: the tokens
    of h computed at once, in windows of at most this many (a layer-major prompt's: its
    activations bounded as a chunk's), each expert dequantized once for all of them."""
    D, F = layout.d_model, layout.d_expert
    per_expert = 3 * D * F * 4  # float32 gate, up, down
    step = max(1, workspace_bytes // ((3 + DEQUANT_PEAK) * D * F * 4))
    pieces = max(DEQUANT_CHUNK_BYTES, workspace_bytes - step * per_expert)
    for s in range(0, len(groups), step):
        _run_chunk(layout, records[s:s + step], groups[s:s + step], h, out, pieces, rows)


def _run_chunk(layout: ExpertLayout, records: torch.Tensor, groups: list[Group], h: torch.Tensor,
               out: torch.Tensor, pieces: int, rows: int | None = None) -> None:
    D, F = layout.d_model, layout.d_expert
    qg, qu, qd = layout.qtypes
    g, u, d = layout.views(records)
    n = len(groups)
    dev = records.device
    w_gate = dequantize_into(g, qg, D, torch.empty(n, F, D, device=dev), pieces)
    w_up = dequantize_into(u, qu, D, torch.empty(n, F, D, device=dev), pieces)
    w_down = dequantize_into(d, qd, F, torch.empty(n, D, F, device=dev), pieces)
    for a, b in windows(h.shape[0], rows):
        part = within(groups, a, b)
        if any(len(gr.tokens) for gr in part):
            _run_window(layout, part, (w_gate, w_up, w_down), h, out)


def _run_window(layout: ExpertLayout, groups: list[Group], w: tuple[torch.Tensor, ...],
                h: torch.Tensor, out: torch.Tensor) -> None:
    """out += the groups' experts (dequantized: w = gate, up, down [n, F, D], [n, F, D],
    [n, D, F]) over their tokens."""
    D = layout.d_model
    w_gate, w_up, w_down = w
    n, M = len(groups), max(len(gr.tokens) for gr in groups)
    idx = torch.zeros(n, M, dtype=torch.int64)
    wts = torch.zeros(n, M, dtype=torch.float32)
    for j, gr in enumerate(groups):  # padded on the host, sent in one copy each
        idx[j, : len(gr.tokens)] = gr.tokens
        wts[j, : len(gr.tokens)] = gr.weights
    idx, wts = idx.to(h.device, non_blocking=True), wts.to(h.device, non_blocking=True)
    x = h[idx]  # [n, M, D]; padding rows read token 0 and get weight 0
    b = layout.bias
    if b is None:
        act = torch.nn.functional.silu(torch.bmm(x, w_gate.transpose(1, 2))) * torch.bmm(
            x, w_up.transpose(1, 2))  # [n, M, F]
        y = torch.bmm(act, w_down.transpose(1, 2)) * wts[..., None]  # [n, M, D]
    else:  # the experts' biases and activation (gpt-oss)
        e = torch.tensor([gr.expert for gr in groups])
        bg, bu, bd = (t[e][:, None].to(h.device, non_blocking=True)
                      for t in (b.gate, b.up, b.down))  # [n, 1, F], [n, 1, F], [n, 1, D]
        act = glu(torch.bmm(x, w_gate.transpose(1, 2)) + bg,
                  torch.bmm(x, w_up.transpose(1, 2)) + bu, b.act)  # [n, M, F]
        y = (torch.bmm(act, w_down.transpose(1, 2)) + bd) * wts[..., None]  # [n, M, D]
    out.index_add_(0, idx.flatten(), y.reshape(-1, D))
