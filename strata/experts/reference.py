"""The reference expert executor: dequantize each routed expert, matmul in float32.

On the CPU the dequantized experts are kept. A few tokens together (the batched decode of
several sequences: 2 .. REFERENCE_DENSE_TOKENS) that route to more than half a layer's experts
run them all in two matmuls over the layer's stacked experts, instead of one expert at a time:

    gate_up [E, 2F, D]  each expert's gate rows, then its up rows
    down    [E, D, F]
    a = silu(g) * u                 g, u = h @ gate_up_e^T: [E, T, F] (every token, every expert)
    y = a_e @ down_e^T              [E, T, D]  (both batched matmuls over the experts)
    out[t] = sum_e w[t, e] y[e, t]  w zero where t does not route to e; added in expert order,
                                    as one expert at a time adds them

A stacked layer's experts are views of its stack (one copy in memory), so one token alone reads
the same values one expert at a time.

Legend: T tokens, D hidden, E experts, F expert hidden, K used a token.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Protocol

import torch

from strata.kernels.torch_ops import expert_mlp
from strata.kernels.tuning import REFERENCE_CACHE_BYTES, REFERENCE_DENSE_TOKENS
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
    step spent 78% of its time dequantizing them again). A layer that a batch of 2 ..
    dense_tokens tokens routes to more than half of is stacked whole (at most half of
    cache_bytes in stacks; never evicted) and runs as the module doc says. On a GPU nothing is
    kept: that memory would be outside the plan."""

    def __init__(self, cache_bytes: int = REFERENCE_CACHE_BYTES,
                 dense_tokens: int = REFERENCE_DENSE_TOKENS):
        self.cache_bytes, self.dense_tokens = cache_bytes, dense_tokens
        self._kept: OrderedDict[tuple[int, int], tuple[torch.Tensor, ...]] = OrderedDict()
        self._kept_bytes = 0
        self._stacks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (gate_up, down)
        self._stack_bytes = 0

    def before_pass(self, tokens: int) -> None:
        pass

    def run(self, layer: int, experts: ExpertWeights, h: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        used = torch.unique(ids).tolist()
        n_experts = experts.gate.raw.shape[0]
        if (2 <= h.shape[0] <= self.dense_tokens and 2 * len(used) > n_experts
                and experts.bias is None):
            stack = self.stacked(layer, experts)
            if stack is not None:
                return dense_experts(*stack, h, ids, weights)
        out = torch.zeros_like(h)
        for e in used:
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
        """Expert e of the layer dequantized: (gate, up, down) float32, kept where it fits (a
        stacked layer's: views of its stack)."""
        stack = self._stacks.get(layer)
        if stack is not None:
            gate_up, down = stack
            f = gate_up.shape[1] // 2
            return gate_up[e, :f], gate_up[e, f:], down[e]
        key = (layer, e)
        kept = self._kept.get(key)
        if kept is not None:
            self._kept.move_to_end(key)
            return kept
        w = (experts.gate.rows(e), experts.up.rows(e), experts.down.rows(e))
        n = _nbytes(w)
        if w[0].device.type != "cpu" or n > self.cache_bytes - self._stack_bytes:
            return w
        self._evict(n)
        self._kept[key] = w
        self._kept_bytes += n
        return w

    def stacked(self, layer: int, experts: ExpertWeights,
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's experts stacked (gate_up [E, 2F, D], down [E, D, F] float32), made at
        the first call where they fit (on the CPU, stacks within half of cache_bytes), else
        None. Its experts kept one by one are dropped (the stack holds the same values)."""
        stack = self._stacks.get(layer)
        if stack is not None or experts.gate.raw.device.type != "cpu":
            return stack
        e, f = experts.gate.raw.shape[:2]
        n = 4 * 3 * e * f * experts.gate.n_cols
        if self._stack_bytes + n > self.cache_bytes // 2:
            return None
        for key in [k for k in self._kept if k[0] == layer]:
            self._kept_bytes -= _nbytes(self._kept.pop(key))
        self._evict(n)
        every = slice(None)
        stack = (torch.cat([experts.gate.rows(every), experts.up.rows(every)], 1),
                 experts.down.rows(every).contiguous())
        self._stacks[layer] = stack
        self._stack_bytes += n
        return stack

    def _evict(self, n: int) -> None:
        """Least recently used experts out until n more bytes fit."""
        while self._kept and self._kept_bytes + self._stack_bytes + n > self.cache_bytes:
            _, old = self._kept.popitem(last=False)
            self._kept_bytes -= _nbytes(old)


def dense_experts(gate_up: torch.Tensor, down: torch.Tensor, h: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """Σ_k weights[t, k] * expert_{ids[t, k]}(h[t]) over a layer's stacked experts: every token
    through every expert in two matmuls, the pairs not routed weighted zero (the module doc).
    gate_up [E, 2F, D], down [E, D, F]; h [T, D]; ids, weights [T, K] -> [T, D]"""
    n_experts, f2, _ = gate_up.shape
    t, f = h.shape[0], f2 // 2
    # (batched matmuls, h broadcast over the experts: on the 2-core CPU machine 0.2 ms for the
    # tiny preset's 8 experts at 8 tokens, where one [T, D] x [D, E*2F] matmul took 0.4-0.5)
    gu = torch.matmul(h, gate_up.transpose(1, 2))  # [E, T, 2F]
    a = torch.nn.functional.silu(gu[..., :f]) * gu[..., f:]  # [E, T, F]
    y = torch.bmm(a, down.transpose(1, 2))  # [E, T, D]
    w = torch.zeros(t, n_experts, dtype=weights.dtype).scatter_(1, ids, weights)  # [T, E]
    return (y * w.T[:, :, None]).sum(0)


def _nbytes(tensors: tuple[torch.Tensor, ...]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
