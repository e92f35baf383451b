"""Feed-forward parts: what a layer runs after its mixer. Each has a verb pair, so that a decode
step can stop in between (a layer whose experts need the host ends a CUDA graph after routing):

    begin(x, attn, ctx) -> Routing     x += attn (in place); h = rms_norm(x); the routing of h
    finish(r, ctx) -> [T, D]           the part's output (added by the next residual step)

RoutedExperts: softmax routing over E experts, the top K (renormalized where cfg.norm_topk), the
experts run by the context's expert executor, plus a gated shared expert where the layer has one
(qwen2moe); or sigmoid routing with a selection bias, groups and a scale (gating.py: glm4moe,
deepseek2), whose shared expert has no gate. In a static step the residual step, the norm, the
router and its top K are one launch (decode_ops.norm_route; sigmoid routing: torch ops), and
with no shared expert the K rows may come back unsummed for the next residual step to add (one
launch fewer a layer).
DenseFFN: one SwiGLU over every token, for the dense first layers (glm4moe, deepseek2:
spec.layer_spec).

Legend: T tokens, D hidden, E experts, K used a token, F / S expert / shared hidden.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from strata.config import ModelConfig
from strata.kernels import tuning
from strata.model.layers import rms_norm, route
from strata.model.parts.context import Context, decode_ops
from strata.model.parts.gating import biased_weights, route_biased
from strata.model.parts.norm import SharedRows, add_norm
from strata.model.weights import LayerWeights, Weight, linear


class Routing(NamedTuple):
    h: torch.Tensor  # [T, D] the feed-forward's input (the normed residual)
    ids: torch.Tensor | None  # int64 [T, K] (None: a dense part)
    wts: torch.Tensor | None  # float32 [T, K]
    # float32 [T, 1]: the shared expert's gate, sigmoid(h . g), where the routing computed it
    # with the router's logits (LayerWeights.router_gate); None: the shared expert computes it
    shared_w: torch.Tensor | None = None


def swiglu(h: torch.Tensor, gate: Weight, up: Weight, down: Weight) -> torch.Tensor:
    """down(silu(gate h) * up h), each weight dense or in GGUF blocks. h [T, D] -> [T, D]"""
    return linear(torch.nn.functional.silu(linear(h, gate)) * linear(h, up), down)


class SharedExpert:
    """The gated shared expert (qwen2moe, qwen35moe): sigmoid(h . g) * swiglu(h); without a gate
    (glm4moe, deepseek2) swiglu(h). One token on CUDA with the three matrices in GGUF blocks of
    fused types runs as one expert through the MoE decode kernels (moe_forward, float32
    activations), its gate (a sigmoid in the rows-dot launch) as the pair's routing weight: three
    launches for the gate, gate/up/silu and down with the gate's product, where the GEMVs and
    torch ops took seven (Qwen3.6's profile: 160 torch launches a step,
    bench/2026-12-06-h100-glue.md). With tuning.SHARED_X8 and weights loaded for the 8-bit
    kernels (--kernels fused) x and h are rounded to 8 bits for them, as the routed experts'."""

    def __init__(self, lw: LayerWeights):
        self.lw = lw
        self._one: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None | bool = False

    def forward(self, h: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """h [T, D] -> [T, D]; gate: sigmoid(h . g) [T, 1] where the routing computed it
        (Routing.shared_w), else computed here."""
        lw = self.lw
        if h.shape[0] == 1 and h.is_cuda and self._one_token(h.device) is not None:
            return self._as_expert(h, gate)
        act = torch.nn.functional.silu(linear(h, lw.shared_w1)) * linear(h, lw.shared_w3)
        if lw.shared_gate is None:
            return linear(act, lw.shared_w2)
        if gate is None:
            # (the gate's one row through the rows-dot kernel for a decode token on CUDA:
            # cuBLAS's split-K GEMV took two launches, ~15 us a layer, on Qwen3.6's)
            gate = decode_ops().router_logits(h, lw.shared_gate[None], sigmoid=True)  # [T, 1]
        return gate * linear(act, lw.shared_w2)

    def _one_token(self, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(ids [1, 1], slot_of [1], ones [1, 1]) on the device for _as_expert, or None where
        the matrices are not all in GGUF blocks of types the decode kernels read (worked out
        once)."""
        if self._one is False:
            from strata.kernels.gpu.formats import kernel_format

            ws = (self.lw.shared_w1, self.lw.shared_w3, self.lw.shared_w2)
            ok = all(hasattr(w, "raw") and w.raw.dim() == 2 and w.raw.is_contiguous()
                     and w.raw.device == device and kernel_format(w.qtype) is not None
                     for w in ws) and ws[0].raw.shape[0] == ws[1].raw.shape[0]
            self._one = (torch.zeros(1, 1, dtype=torch.int32, device=device),
                         torch.zeros(1, dtype=torch.int32, device=device),
                         torch.ones(1, 1, dtype=torch.float32, device=device)) if ok else None
        return self._one

    def _as_expert(self, h: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """One token's shared expert as expert 0 of a one-expert layer: [1, D] (its one pair's
        row as it comes: no launch to sum one row); gate: its weight where the routing
        computed it."""
        from strata.kernels.gpu import moe_forward

        lw = self.lw
        ids, slot_of, ones = self._one
        w1, w3, w2 = lw.shared_w1, lw.shared_w3, lw.shared_w2
        if gate is None:
            gate = ones if lw.shared_gate is None else decode_ops().router_logits(
                h, lw.shared_gate[None], sigmoid=True)  # [1, 1]
        return moe_forward(h.contiguous(), ids, gate, slot_of, w1.raw[None], w3.raw[None],
                           w2.raw[None], (w1.qtype, w3.qtype, w2.qtype), h.shape[1],
                           w1.raw.shape[0], sum_pairs=False,
                           x8=tuning.SHARED_X8 and w1.x8).reshape(1, -1)


class RoutedExperts:
    routed = True
    # strata check's RoutingTrace or RoutingPin (parts/routing.py): called after the router
    # with (layer, routing, router, k, norm_topk), returns the routing to go on with
    hook = None

    def __init__(self, cfg: ModelConfig, lw: LayerWeights, layer: int):
        self.lw, self.layer = lw, layer
        self.k, self.norm_topk, self.eps = cfg.n_experts_used, cfg.norm_topk, cfg.rms_eps
        self.shared = SharedExpert(lw) if lw.shared_w1 is not None else None
        # sigmoid gating, a selection bias, groups or a scale: gating.route_biased
        self.biased = (cfg.gating != "softmax" or cfg.expert_bias or cfg.n_groups > 1
                       or cfg.expert_scale != 1.0)
        self.gating, self.scale = cfg.gating, cfg.expert_scale
        self.groups = (cfg.n_groups, cfg.n_groups_used)

    def begin(self, x: torch.Tensor, attn: torch.Tensor, ctx: Context) -> Routing:
        lw = self.lw
        # the shared expert's gate beside the routing logits (one GEMV, the route launch writes
        # its sigmoid): on the fused paths where the router and gate are one matrix
        joint = lw.router_gate if self.shared is not None and not self.biased else None
        router, gate = lw.router, None
        if joint is not None and (ctx.static or ctx.fused_attention):
            router = joint
            gate = torch.empty((x.shape[0], 1), dtype=torch.float32, device=x.device)
        if self.biased:  # torch ops on every path (gating.py; capturable in a static step)
            h = add_norm(x, attn, lw.ffn_norm, self.eps, ctx)
            ids, wts = self._route(h, ctx.counts(self.layer) if ctx.static else None)
        elif ctx.static:  # one launch on CUDA (decode_ops.norm_route)
            h, ids, wts = decode_ops().norm_route(
                x, attn, lw.ffn_norm, self.eps, router, self.k, self.norm_topk, ctx.sync,
                counts=ctx.counts(self.layer), fuse=ctx.fuse_route, gate=gate)
        elif ctx.fused_attention:  # (CUDA, --kernels fused) softmax and top k in one launch
            h = add_norm(x, attn, lw.ffn_norm, self.eps, ctx)
            ops = decode_ops()
            ids, wts = ops.route_topk(ops.router_logits(h, router), self.k, self.norm_topk,
                                      gate=gate)
        else:
            h = add_norm(x, attn, lw.ffn_norm, self.eps, ctx)
            ids, wts = self._route(h)  # [T, K]
        if self.hook is not None:  # (never set in a captured step: see routing.attach)
            r = self.hook(self.layer, Routing(h, ids, wts), lw.router, self.k, self.norm_topk)
            if self.biased:  # (a pin's weights: this gating's, not the softmax's)
                r = Routing(r.h, r.ids, biased_weights(r.h, lw.router, r.ids, self.norm_topk,
                                                       self.scale, self.gating))
            return r
        return Routing(h, ids, wts, gate)

    def guess(self, x: torch.Tensor) -> torch.Tensor:
        """The experts this layer's router would pick for the residual x [T, D] (normed here;
        nothing counted, no hook): a prefetch's guess, ids int64 [T, K]."""
        return self._route(rms_norm(x, self.lw.ffn_norm, self.eps))[0]

    def _route(self, h: torch.Tensor, counts: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's torch form on the normed input h: (ids [T, K], weights [T, K]); counts
        (biased gating in a static step): where the routed pairs are counted."""
        lw = self.lw
        if self.biased:
            return route_biased(h, lw.router, lw.router_bias, self.k, self.norm_topk,
                                self.scale, *self.groups, gating=self.gating, counts=counts)
        return route(h, lw.router, self.k, self.norm_topk)

    def finish(self, r: Routing, ctx: Context) -> torch.Tensor | SharedRows:
        """The routed experts' weighted sum, plus the shared expert: [T, D] (or, in a static
        step, possibly the K rows [1, K, D], with the shared expert's row beside them)."""
        out = ctx.run_experts(self.layer, self.lw.experts, r.h, r.ids, r.wts,
                              sum_pairs=self.shared is not None and not ctx.static)
        if self.shared is not None:
            shared = self.shared.forward(r.h, r.shared_w)
            if out.dim() == 3:  # a static step's K rows unsummed: the next residual step sums
                # them and the shared expert's row in one launch (no torch sum and add: ~6 us
                # a layer; nor a copy joining the rows: ~1.2 us, Qwen3.6's profile)
                return SharedRows(out, shared)
            out = out + shared
        return out


class DenseFFN:
    """One SwiGLU for every token (lw.ffn_gate, ffn_up [F, D], ffn_down [D, F])."""

    routed = False
    shared = None

    def __init__(self, cfg: ModelConfig, lw: LayerWeights, layer: int):
        self.lw, self.layer, self.eps = lw, layer, cfg.rms_eps

    def begin(self, x: torch.Tensor, attn: torch.Tensor, ctx: Context) -> Routing:
        return Routing(add_norm(x, attn, self.lw.ffn_norm, self.eps, ctx), None, None)

    def finish(self, r: Routing, ctx: Context) -> torch.Tensor:
        lw = self.lw
        return swiglu(r.h, lw.ffn_gate, lw.ffn_up, lw.ffn_down)
