"""The residual step before a norm: x += delta in place (the part before's output; none before
the first layer), then rms_norm(x). In a static step one fused launch (decode_ops.add_rms_norm),
which also sums a delta of K unsummed expert rows [1, K, D]; elsewhere the reference ops."""

from __future__ import annotations

import torch

from strata.model.layers import rms_norm
from strata.model.parts.context import Context, decode_ops


def add_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
             ctx: Context) -> torch.Tensor:
    """x [T, D] += delta (in place), then -> rms_norm(x, weight) [T, D]. One launch in a static
    step and in a pass under --kernels fused on CUDA (the fused norm, float32 as the reference)."""
    if ctx.static or ctx.fused_attention:
        ops = decode_ops()
        return (ops.rms_norm(x, weight, eps) if delta is None
                else ops.add_rms_norm(x, delta, weight, eps))
    if delta is not None:
        x.add_(delta)
    return rms_norm(x, weight, eps)
