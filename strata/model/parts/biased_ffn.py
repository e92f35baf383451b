"""Routed experts with a biased router (gpt-oss): logits = h router^T + b, the top K of them,
softmax over those K (llama.cpp's SOFTMAX_WEIGHT gating; the same weights as a softmax over all
E renormalized over the top K). The experts' own biases and activation travel with the layer's
expert weights (weights.ExpertBias), so every executor path computes the same expert. A
routing hook (strata check's trace or pin: parts/routing.py) sees the bias as one more router
column over [h, 1], so its probabilities are the layer's.

Legend: T tokens, D hidden, E experts, K used a token.
"""

from __future__ import annotations

import torch

from strata.model.parts.context import Context, decode_ops
from strata.model.parts.ffn import RoutedExperts, Routing
from strata.model.parts.norm import add_norm


def route_biased(h: torch.Tensor, router: torch.Tensor, bias: torch.Tensor,
                 k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """h [T, D], router [E, D], bias [E] -> ids int64 [T, K], weights float32 [T, K]: the top K
    logits, softmax over them."""
    top, ids = torch.topk(h.float() @ router.float().T + bias, k, dim=-1)  # [T, K]
    return ids, torch.softmax(top, dim=-1)


class BiasedRoutedExperts(RoutedExperts):
    def _route(self, h: torch.Tensor, counts: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, weights) of the biased router on h (counts: unused, a static step counts in
        route_topk)."""
        return route_biased(h, self.lw.router, self.lw.router_logit_bias, self.k)

    def begin(self, x: torch.Tensor, attn: torch.Tensor, ctx: Context) -> Routing:
        lw = self.lw
        h = add_norm(x, attn, lw.ffn_norm, self.eps, ctx)
        if ctx.static:  # torch ops over the static buffers (norm_route has no bias)
            ops = decode_ops()
            logits = ops.router_logits(h, lw.router, bias=lw.router_logit_bias)  # [1, E]
            ids, wts = ops.route_topk(logits, self.k, True, counts=ctx.counts(self.layer))
        else:
            ids, wts = self._route(h)
        if self.hook is not None:  # (strata check) the bias as a router column over [h, 1]
            one = torch.ones(h.shape[0], 1, dtype=h.dtype, device=h.device)
            router = torch.cat([lw.router, lw.router_logit_bias[:, None]], dim=1)  # [E, D + 1]
            r = self.hook(self.layer, Routing(torch.cat([h, one], 1), ids, wts), router,
                          self.k, True)
            return Routing(h, r.ids, r.wts)
        return Routing(h, ids, wts)
