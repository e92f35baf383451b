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
Needs triton; docs/kernels.md has the design, the tolerances and the measured benchmark.
"""

from strata.kernels.gpu.formats import FORMATS, kernel_format
from strata.kernels.gpu.matmul import dequantize_gpu, quant_matmul
from strata.kernels.gpu.moe import gather_misses, moe_forward, resident_pairs
from strata.quant import QType


def has_fused(qtype: int | QType) -> bool:
    """True when quant_matmul / moe_forward run a fused kernel for this GGML type."""
    return kernel_format(qtype) is not None


FUSED_TYPES: tuple[QType, ...] = tuple(FORMATS)

__all__ = ["quant_matmul", "moe_forward", "gather_misses", "resident_pairs", "dequantize_gpu",
           "has_fused", "FUSED_TYPES"]
