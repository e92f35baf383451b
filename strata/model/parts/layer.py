"""A layer: a token mixer and a feed-forward, chosen per layer index from the architecture, with
the residual stream between them. Every path runs it: the reference forward, prompt chunks and
batched decode (a Segments context), and the decode step, eager or captured as CUDA graphs (a
StaticStep context over its static buffers).

    h = add_norm(x, delta, attn_norm)      x += the last layer's output; norm
    a = mixer.forward(h, ctx)              attention
    r = ffn.begin(x, a, ctx)               x += a; norm; routing
    delta = ffn.finish(r, ctx)             experts (+ shared), added by the next residual step

The output of a layer is left for the next one's norm to add (`delta`): in a static step that
add, the norm (and, before a routed feed-forward, the router and its top K) are one launch.

A new architecture's layer: its mixer in attention.py (or a file beside it) and its
feed-forward in ffn.py, each named in MIXERS / FFNS; spec.layer_spec says which a layer index
gets.
"""

from __future__ import annotations

import torch

from strata.config import ModelConfig
from strata.model.parts.attention import GatedAttention, GQAAttention
from strata.model.parts.biased_ffn import BiasedRoutedExperts
from strata.model.parts.context import Context
from strata.model.parts.delta_net import GatedDeltaNet
from strata.model.parts.ffn import DenseFFN, RoutedExperts, Routing
from strata.model.parts.mla import MLAttention
from strata.model.parts.norm import Delta, add_norm, summed
from strata.model.parts.sink_attention import SinkAttention
from strata.model.parts.spec import layer_spec
from strata.model.weights import LayerWeights, Weight, linear

MIXERS = {"gqa": GQAAttention, "mla": MLAttention, "gated": GatedAttention,
          "delta": GatedDeltaNet, "sinks": SinkAttention}
FFNS = {"routed": RoutedExperts, "dense": DenseFFN, "routed_bias": BiasedRoutedExperts}


class Layer:
    def __init__(self, index: int, mixer: GQAAttention | GatedDeltaNet,
                 ffn: RoutedExperts | DenseFFN, attn_norm: torch.Tensor, eps: float):
        self.index, self.mixer, self.ffn = index, mixer, ffn
        self.attn_norm, self.eps = attn_norm, eps

    @classmethod
    def build(cls, cfg: ModelConfig, lw: LayerWeights, index: int) -> Layer:
        spec = layer_spec(cfg, index)
        return cls(index, MIXERS[spec.mixer](cfg, lw, index), FFNS[spec.ffn](cfg, lw, index),
                   lw.attn_norm, cfg.rms_eps)

    def begin(self, x: torch.Tensor, delta: Delta | None, ctx: Context) -> Routing:
        """x [T, D] (the residual, updated in place) += delta; the mixer; the feed-forward's
        input and routing."""
        h = add_norm(x, delta, self.attn_norm, self.eps, ctx)
        return self.ffn.begin(x, self.mixer.forward(h, ctx), ctx)

    def finish(self, r: Routing, ctx: Context) -> Delta:
        """The feed-forward's output: the next residual step's delta."""
        return self.ffn.finish(r, ctx)

    def forward(self, x: torch.Tensor, delta: Delta | None, ctx: Context) -> Delta:
        return self.finish(self.begin(x, delta, ctx), ctx)


class Head:
    """The output norm and the vocabulary projection."""

    def __init__(self, norm: torch.Tensor, weight: Weight, eps: float):
        self.norm, self.weight, self.eps = norm, weight, eps

    def forward(self, x: torch.Tensor, delta: Delta | None, ctx: Context,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, D] += delta -> logits [T, V] float32; rows: only these positions' ([R, V])."""
        if rows is not None:
            if delta is not None:
                x.add_(summed(delta))
                delta = None
            x = x[rows]
        return linear(add_norm(x, delta, self.norm, self.eps, ctx), self.weight)
