"""What the kernels need to know about each fused GGML type, on the Python side.

    fmt = kernel_format(QType.Q4_K)   # None: no fused kernel (F32/F16/BF16 go to torch.matmul)
    fmt.group                         # S: values per tile group (see tiles_legacy.py)
    tab, tab2 = fmt.tables(device)    # float32 lookup tables the tile reads (dummies if none)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType

import gguf.quants as gq
import torch

from strata.kernels.tuning import GEMV_DEFAULT_TILE, GEMV_TYPE_TILES
from strata.quant import QType, get_quant
from strata.quant.grids import grid, ksigns, kvalues


@dataclass(frozen=True)
class KernelFormat:
    qtype: QType
    group: int  # S: values per tile group; a power of two dividing the block
    gemv: tuple[int, int, int, int] = GEMV_DEFAULT_TILE  # FMA kernel: BN, BK, stages, warps
    grid: type | None = None  # gguf-py class whose grid `tab` holds
    signs: bool = False  # `tab2` = ksigns
    levels: type | None = None  # gguf-py class whose 16 levels `tab` (or tab2) holds

    @property
    def block(self) -> int:  # values per block
        return get_quant(self.qtype).block_size

    @property
    def block_bytes(self) -> int:
        return get_quant(self.qtype).type_size

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(tab, tab2): float32 tables on `device`, flattened; a 1-element dummy where unused."""
        dummy = _dummy(device)
        tab = grid(self.grid, device).reshape(-1) if self.grid is not None else dummy
        if self.levels is not None:
            tab = kvalues(self.levels, device)
        tab2 = ksigns(device).reshape(-1) if self.signs else dummy
        return tab, tab2


_DUMMIES: dict[torch.device, torch.Tensor] = {}


def _dummy(device: torch.device) -> torch.Tensor:
    t = _DUMMIES.get(device)
    if t is None:
        t = _DUMMIES[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return t


# gemv: strata.kernels.tuning.GEMV_TYPE_TILES (the fastest timed per type), else its default
FORMATS: MappingProxyType[QType, KernelFormat] = MappingProxyType({
    f.qtype: replace(f, gemv=GEMV_TYPE_TILES.get(f.qtype, f.gemv))
    for f in (
        KernelFormat(QType.Q4_0, 16),
        KernelFormat(QType.Q4_1, 16),
        KernelFormat(QType.Q5_0, 16),
        KernelFormat(QType.Q5_1, 16),
        KernelFormat(QType.Q8_0, 32),
        KernelFormat(QType.Q2_K, 16),
        KernelFormat(QType.Q3_K, 16),
        KernelFormat(QType.Q4_K, 32),
        KernelFormat(QType.Q5_K, 32),
        KernelFormat(QType.Q6_K, 16),
        KernelFormat(QType.IQ1_S, 8, grid=gq.IQ1_S),
        KernelFormat(QType.IQ1_M, 8, grid=gq.IQ1_M),
        KernelFormat(QType.IQ2_XXS, 8, grid=gq.IQ2_XXS, signs=True),
        KernelFormat(QType.IQ2_XS, 8, grid=gq.IQ2_XS, signs=True),
        KernelFormat(QType.IQ2_S, 8, grid=gq.IQ2_S),
        KernelFormat(QType.IQ3_XXS, 8, grid=gq.IQ3_XXS, signs=True),
        KernelFormat(QType.IQ3_S, 8, grid=gq.IQ3_S),
        KernelFormat(QType.IQ4_NL, 16, levels=gq.IQ4_NL),
        KernelFormat(QType.IQ4_XS, 16, levels=gq.IQ4_NL),
        KernelFormat(QType.MXFP4, 16),  # (values computed: bits.mx_scaled)
    )
})
FLOAT_TYPES = (QType.F32, QType.F16, QType.BF16)  # read by torch.matmul (cuBLAS), no tile


def kernel_format(qtype: int | QType) -> KernelFormat | None:
    """The fused-kernel description of `qtype`, or None when it has no dequantize tile."""
    try:
        return FORMATS.get(QType(qtype))
    except ValueError:
        return None
