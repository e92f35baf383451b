"""The building blocks of the reference forward pass, in float32 (strata.kernels.torch_ops: the
kernels' torch paths share them, so they live below the model)."""

from strata.kernels.torch_ops import (
    apply_rope,
    attention,
    attention_bf16,
    attention_last,
    rms_norm,
    rope_tables,
    route,
    swiglu,
)

__all__ = ["apply_rope", "attention", "attention_bf16", "attention_last", "rms_norm", "rope_tables",
           "route", "swiglu"]
