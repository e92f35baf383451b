"""The residual step before a norm: x += delta in place (the part before's output; none before
the first layer), then rms_norm(x). In a static step one fused launch (decode_ops.add_rms_norm),
which also sums a delta of K unsummed expert rows [1, K, D], and the shared expert's row beside
them (SharedRows); elsewhere the reference ops."""

from __future__ import annotations

from typing import NamedTuple

import torch

from strata.kernels.torch_ops import sum_rows
from strata.model.layers import rms_norm
from strata.model.parts.context import Context, decode_ops


class SharedRows(NamedTuple):
    """A static step's feed-forward output for the next residual step to add: the routed
    experts' K rows [1, K, D] unsummed and the shared expert's row [1, D], added after them
    (as a row K + 1 would be, without the copy that would join them)."""

    rows: torch.Tensor
    shared: torch.Tensor

    def total(self) -> torch.Tensor:
        """[T, D]: the rows in the fused residual step's order."""
        return sum_rows(self.rows) + self.shared

    def index_select(self, dim: int, index: torch.Tensor) -> SharedRows:
        return SharedRows(self.rows.index_select(dim, index),
                          self.shared.index_select(dim, index))


Delta = torch.Tensor | SharedRows


def summed(delta: Delta) -> torch.Tensor:
    """A residual step's delta as [T, D], its rows added in the fused step's order."""
    return delta.total() if isinstance(delta, SharedRows) else sum_rows(delta)


def add_norm(x: torch.Tensor, delta: Delta | None, weight: torch.Tensor, eps: float,
             ctx: Context) -> torch.Tensor:
    """x [T, D] += delta (in place), then -> rms_norm(x, weight) [T, D]. One launch in a static
    step and in a pass under --kernels fused on CUDA (the fused norm, float32 as the reference)."""
    if ctx.static or ctx.fused_attention:
        ops = decode_ops()
        if delta is None:
            return ops.rms_norm(x, weight, eps)
        if isinstance(delta, SharedRows):
            return ops.add_rms_norm(x, delta.rows, weight, eps, extra=delta.shared)
        return ops.add_rms_norm(x, delta, weight, eps)
    if delta is not None:
        x.add_(summed(delta))
    return rms_norm(x, weight, eps)
