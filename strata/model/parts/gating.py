"""Sigmoid routing with a selection bias (glm4moe, deepseek2; or softmax with groups and a
scale), in torch ops: the reference path
and, over the decode step's static buffers, a capturable branch (no host sync, no shape that
depends on data). decode_ops.norm_route fuses softmax routing only.

    s = sigmoid(h @ router.T)                    [T, E] the experts' scores
    c = s + bias                                 chooses the experts, never weights them
    groups (deepseek2): the G groups of E/G experts ranked by the sum of their best two c; the
        experts outside the best `used` groups are masked out (-inf)
    ids = top K of c; wts = s[ids], / their sum (norm), * scale

As llama.cpp's build_moe_ffn computes it (the sum clamped at 2^-14 before dividing).
Legend: T tokens, D hidden, E experts, K used a token, G groups.
"""

from __future__ import annotations

import torch

SUM_MIN = 6.103515625e-5  # llama.cpp clamps the top-K weights' sum here before dividing


def route_biased(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor | None, k: int,
                 norm: bool, scale: float, groups: int = 1, groups_used: int = 1,
                 gating: str = "sigmoid", counts: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, D], router [E, D], bias [E] or None -> ids int64 [T, K], weights float32 [T, K].
    gating: sigmoid, or softmax over the E experts (deepseek2 v2: groups and a scale, no bias).
    counts: int32 [E], += 1 for every pair routed to an expert."""
    logits = h.float() @ router.float().T
    scores = torch.sigmoid(logits) if gating == "sigmoid" else torch.softmax(logits, -1)  # [T, E]
    choice = scores if bias is None else scores + bias
    if groups > 1 and groups_used < groups:
        T, E = choice.shape
        grouped = choice.view(T, groups, E // groups)
        best = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(
            1, best.topk(groups_used, dim=-1).indices, True)  # [T, G]
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    ids = choice.topk(k, dim=-1).indices  # [T, K]
    wts = _weights(scores, ids, norm, scale)
    if counts is not None:
        flat = ids.reshape(-1)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return ids, wts


def biased_weights(h: torch.Tensor, router: torch.Tensor, ids: torch.Tensor, norm: bool,
                   scale: float, gating: str = "sigmoid") -> torch.Tensor:
    """route_biased's weights for given experts (routing pinned: strata check) -> [T, K]"""
    logits = h.float() @ router.float().T
    scores = torch.sigmoid(logits) if gating == "sigmoid" else torch.softmax(logits, -1)
    return _weights(scores, ids, norm, scale)


def _weights(scores: torch.Tensor, ids: torch.Tensor, norm: bool, scale: float) -> torch.Tensor:
    wts = scores.gather(1, ids)
    if norm:
        wts = wts / wts.sum(-1, keepdim=True).clamp_min(SUM_MIN)
    return wts * scale if scale != 1.0 else wts
