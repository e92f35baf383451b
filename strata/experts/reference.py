"""The reference expert executor: dequantize each routed expert, matmul in float32."""

from __future__ import annotations

from typing import Protocol

import torch

from strata.kernels.torch_ops import expert_mlp
from strata.model.layers import swiglu
from strata.model.weights import ExpertWeights


class ExpertExecutor(Protocol):
    def run(self, layer: int, experts: ExpertWeights, h: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        """Σ_k weights[t, k] * expert_{ids[t, k]}(h[t]). h: [T, D], ids/weights: [T, K] -> [T, D]"""
        ...

    def before_pass(self, tokens: int) -> None:
        """Called before each forward pass or decode step of `tokens` tokens."""
        ...


class ReferenceExperts:
    """Ground truth for every fast path: one expert at a time, dequantized to float32."""

    def before_pass(self, tokens: int) -> None:
        pass

    def run(self, layer: int, experts: ExpertWeights, h: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)  # tokens routed to e
            b = experts.bias
            if b is None:
                y = swiglu(h[tok], experts.gate.rows(e), experts.up.rows(e), experts.down.rows(e))
            else:  # biases and the activation of the layer's experts (gpt-oss)
                y = expert_mlp(h[tok], experts.gate.rows(e), experts.up.rows(e),
                               experts.down.rows(e), b.gate[e], b.up[e], b.down[e], b.act)
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out
