"""The reference expert executor: dequantize each routed expert, matmul in float32."""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import torch

from strata.kernels.torch_ops import expert_mlp
from strata.kernels.tuning import REFERENCE_CACHE_BYTES
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
    """Ground truth for every fast path: one expert at a time, dequantized to float32.

    On the CPU the dequantized experts are kept, up to cache_bytes (REFERENCE_CACHE_BYTES),
    least recently used out: the same float32 values, computed once (a small model's decode
    step spent 78% of its time dequantizing them again). On a GPU nothing is kept: that
    memory would be outside the plan."""

    def __init__(self, cache_bytes: int = REFERENCE_CACHE_BYTES):
        self.cache_bytes = cache_bytes
        self._kept: OrderedDict[tuple[int, int], tuple[torch.Tensor, ...]] = OrderedDict()
        self._kept_bytes = 0

    def before_pass(self, tokens: int) -> None:
        pass

    def run(self, layer: int, experts: ExpertWeights, h: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(h)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)  # tokens routed to e
            gate, up, down = self.expert(layer, experts, e)
            b = experts.bias
            if b is None:
                y = swiglu(h[tok], gate, up, down)
            else:  # biases and the activation of the layer's experts (gpt-oss)
                y = expert_mlp(h[tok], gate, up, down, b.gate[e], b.up[e], b.down[e], b.act)
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return out

    def expert(self, layer: int, experts: ExpertWeights, e: int) -> tuple[torch.Tensor, ...]:
        """Expert e of the layer dequantized: (gate, up, down) float32, kept where it fits."""
        key = (layer, e)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            return kept
        w = (experts.gate.rows(e), experts.up.rows(e), experts.down.rows(e))
        n = _nbytes(w)
        if w[0].device.type != "cpu" or n > self.cache_bytes:
            return w
        while self._kept and self._kept_bytes + n > self.cache_bytes:
            _, old = self._kept.popitem(last=False)
            self._kept_bytes -= _nbytes(old)
        self._kept[key] = w
        self._kept_bytes += n
        return w


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
