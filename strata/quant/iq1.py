"""1.5-bit i-quants IQ1_S and IQ1_M: ternary grid rows (2048 x 8, values -1/0/1) plus a shift.

    x = dl * (grid[index] + delta),   dl = d * (2s + 1),   delta = +-1/8
N super-blocks of 256 values; an 11-bit grid index covers 8 values.
"""

from __future__ import annotations

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from strata.quant.base import QuantType, device_table, f16, lookup, split, u16, unpack
from strata.quant.grids import grid, grid_ms
from strata.quant.random import codes, concat, f16_bytes, jitter, random_bytes, u16_bytes

_S_LO = 2  # random sub-block scales are drawn from _S_LO..7


def _delta(bit_set: torch.Tensor) -> torch.Tensor:
    """bool -> float32 -1/8 where set, +1/8 where clear."""
    return torch.where(bit_set, -0.125, 0.125).float()


def _fields3(words: torch.Tensor) -> torch.Tensor:
    """int32 [N, M] words -> int32 [N, 4M]: their 3-bit fields at bits 0, 3, 6, 9."""
    shifts = device_table("iq1_shifts", words.device, lambda: np.array([0, 3, 6, 9], np.int32))
    return ((words[..., None] >> shifts) & 7).flatten(1)


def _random_d(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    """f32 [n, 1]: d for values of rms `std` (random delta signs: E[(g + delta)^2] = ms + 1/64)."""
    dl_rms = np.sqrt(np.mean((2 * np.arange(_S_LO, 8) + 1.0) ** 2))
    return jitter(rng, n, std / (dl_rms * np.sqrt(grid_ms(gq.IQ1_S) + 1 / 64)))


class IQ1_S(QuantType, qtype=QType.IQ1_S):
    """[d | qs 32 | 8 x u16 qh]: qh = 4 x 3 high index bits | s << 12 | delta sign << 15."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs, qh = split(blocks, 2, 32, 16)
        h = u16(qh)  # [N, 8]
        dl = (f16(d) * (2 * ((h >> 12) & 7) + 1).float()).view(n, 8, 1, 1)
        delta = _delta((h & 0x8000) != 0).view(n, 8, 1, 1)
        idx = qs.int() | (_fields3(h) << 8)  # [N, 32]: 8 low bits in qs, 3 high bits in qh
        g = lookup(grid(gq.IQ1_S, blocks.device), idx).view(n, 8, 4, 8)
        return (dl * (g + delta)).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        s = codes(rng, (n_blocks, 8), _S_LO, 7).astype(np.uint16)
        h = rng.integers(0, 1 << 16, size=(n_blocks, 8), dtype=np.uint16) & 0x8FFF | (s << 12)
        d = _random_d(rng, n_blocks, std)
        return concat(f16_bytes(d), random_bytes(rng, (n_blocks, 32)), u16_bytes(h))


class IQ1_M(QuantType, qtype=QType.IQ1_M):
    """[qs 32 | qh 16 | 4 x u16 scales]: each qh nibble = 3 high index bits | delta sign << 3;
    each scales word = four 3-bit s (one per 16 values) | one nibble of the f16 d << 12."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        qs, qh, scales = split(blocks, 32, 16, 8)
        w = u16(scales)  # [N, 4]
        top = w >> 12  # [N, 4]: nibble k of the f16 d is the top of word k
        d = f16((top[:, 0::2] | (top[:, 1::2] << 4)).to(torch.uint8))  # [N, 1]
        dl = (d * (2 * _fields3(w) + 1).float()).view(n, 8, 2, 1, 1)
        nib = unpack(qh, 4, 1)  # [N, 32]
        delta = _delta((nib & 8) != 0).view(n, 8, 2, 2, 1)
        idx = qs.int() | ((nib & 7).int() << 8)
        g = lookup(grid(gq.IQ1_M, blocks.device), idx).view(n, 8, 2, 2, 8)
        return (dl * (g + delta)).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        s = codes(rng, (n_blocks, 4, 4), _S_LO, 7).astype(np.uint16)
        dbits = f16_bytes(_random_d(rng, n_blocks, std)).view("<u2")  # [n, 1]
        words = (s << np.array([0, 3, 6, 9], dtype=np.uint16)).sum(axis=2, dtype=np.uint16)
        words |= ((dbits >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 15) << 12
        return concat(random_bytes(rng, (n_blocks, 48)), u16_bytes(words))
