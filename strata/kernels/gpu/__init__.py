"""Triton kernels that compute straight from GGUF quant blocks (no dequantized copy in VRAM).

    from strata.kernels.gpu import quant_matmul, moe_forward, dequantize_gpu, has_fused
    y = quant_matmul(x, w, QType.Q4_K)              # [M, K] x [N, K]-in-blocks -> f32 [M, N]
    out = moe_forward(x, ids, weights, slot_of_expert, gate_slots, up_slots, down_slots,
                      (qg, qu, qd), d_model, d_expert)   # a layer's resident experts, 2 launches
    gather_misses(ids, slot_of_expert, arena_records, rows, nbytes)  # misses over PCIe, for
    moe_forward(..., miss=views of rows)                             # every pair at once

quant_matmul: FMA GEMV up to 4 tokens, fused tl.dot up to 63, dequantize -> cuBLAS from 64.
Modules: bits (byte/PTX helpers) -> tiles_* (one dequantize tile per GGML type) -> tiles
(dispatch) -> skeletons (FMA and tensor-core K loops) -> matmul, moe (kernels + launchers);
formats (per-type constants and tile sizes); reference (the torch ground truth).
The kernels need triton, which a CPU-only install lacks: importing this package, formats,
has_fused and FUSED_TYPES does not load it; the launchers below load their module (and Triton)
on first use. docs/kernels.md has the design, the tolerances and the measured benchmark.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

from strata.kernels.gpu.formats import FORMATS, kernel_format
from strata.quant import QType

# launcher -> the module defining it, imported on first access (PEP 562)
_LAZY = {"dequantize_gpu": "matmul", "quant_matmul": "matmul", "gather_misses": "moe",
         "moe_forward": "moe", "resident_pairs": "moe"}


def __getattr__(name: str) -> Any:  # noqa: ANN401 (a launcher or a submodule)
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def has_fused(qtype: int | QType) -> bool:
    """True when quant_matmul / moe_forward run a fused kernel for this GGML type (it has a
    tile, and Triton imports)."""
    return kernel_format(qtype) is not None and triton_available()


@functools.cache
def triton_available() -> bool:
    """Whether Triton imports (the CPU torch wheel comes without it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


FUSED_TYPES: tuple[QType, ...] = tuple(FORMATS)

__all__ = ["quant_matmul", "moe_forward", "gather_misses", "resident_pairs", "dequantize_gpu",
           "has_fused", "triton_available", "FUSED_TYPES"]
