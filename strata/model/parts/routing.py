"""Hooks on a routed feed-forward's routing, for `strata check` only: record it, or pin it.

    trace = RoutingTrace()
    with attach(model, trace):             # every routed layer's top K, per token, in order
        ...                                # a prompt, decode steps
    with attach(model, RoutingPin(trace.ids())):
        ...                                # the same tokens routed to the recorded experts

A hook is called by RoutedExperts.begin after the router with (layer, routing, router, k,
norm_topk) and returns the routing the layer goes on with. attach sets it on the model's routed
parts and, while it is set, runs a decode step eagerly (the graphs would replay without it);
with no hook the parts and the captured step are as before.

Legend: T tokens, D hidden, E experts, K used a token, N tokens recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch

from strata.kernels.torch_ops import route_weights, router_probs
from strata.model.parts.ffn import Routing

RoutingHook = Callable[[int, Routing, torch.Tensor, int, bool], Routing]


class RoutingTrace:
    """Each routed layer's expert ids [N, K] (as routed) and the router's probability margin
    between its K-th and (K+1)-th expert [N], for the tokens in the order they ran."""

    def __init__(self) -> None:
        self._ids: dict[int, list[np.ndarray]] = {}
        self._margin: dict[int, list[np.ndarray]] = {}

    def __call__(self, layer: int, r: Routing, router: torch.Tensor, k: int,
                 norm_topk: bool) -> Routing:
        probs = router_probs(r.h, router)  # [T, E] float32
        top = probs.topk(min(k + 1, probs.shape[-1]), dim=-1).values  # [T, K+1]
        margin = top[:, k - 1] - top[:, k] if top.shape[-1] > k else top[:, k - 1]
        self._ids.setdefault(layer, []).append(r.ids.cpu().numpy().copy())
        self._margin.setdefault(layer, []).append(margin.cpu().numpy().copy())
        return r

    def ids(self) -> dict[int, np.ndarray]:
        """layer -> int64 [N, K]"""
        return {layer: np.concatenate(v) for layer, v in self._ids.items()}

    def margins(self) -> dict[int, np.ndarray]:
        """layer -> float32 [N]: p_K - p_K+1 of the router's softmax (a near-tie: tiny)."""
        return {layer: np.concatenate(v) for layer, v in self._margin.items()}


class RoutingPin:
    """Routing pinned to recorded ids (layer -> int64 [N, K], RoutingTrace.ids): each routed
    layer's tokens, in the order they run, take the next recorded rows; their weights are this
    router's probabilities of those experts (renormalized where the model does)."""

    def __init__(self, ids: dict[int, np.ndarray]):
        self.ids = ids
        self.pos = dict.fromkeys(ids, 0)

    def __call__(self, layer: int, r: Routing, router: torch.Tensor, k: int,
                 norm_topk: bool) -> Routing:
        t, i = r.h.shape[0], self.pos[layer]
        rows = self.ids[layer][i:i + t]
        if rows.shape[0] != t:
            raise ValueError(f"layer {layer}: {i + t} tokens routed, {len(self.ids[layer])} "
                             "recorded")
        self.pos[layer] = i + t
        ids = torch.from_numpy(np.ascontiguousarray(rows)).to(r.h.device)  # [T, K]
        return Routing(r.h, ids, route_weights(r.h, router, ids, norm_topk))


@contextmanager
def attach(model, hook: RoutingHook) -> Iterator[None]:  # noqa: ANN001 (MoETransformer)
    """Set `hook` on every routed layer of `model` (and its decode step eager) for the block."""
    parts = [layer.ffn for layer in model.layers if layer.ffn.routed]
    step = model.step
    graphs = step.graphs if step is not None else False
    for p in parts:
        p.hook = hook
    if step is not None:
        step.graphs = False
    try:
        yield
    finally:
        for p in parts:
            p.hook = None
        if step is not None:
            step.graphs = graphs
