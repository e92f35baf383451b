"""Grid i-quants IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S: values are rows of a fixed code book.

A 256-value super-block (N of them) stores grid indices (each names 8 or 4 magnitudes), sign bits
(plain, or 7-bit ksigns indices whose 8th sign is the parity) and 4-bit sub-block scales:
    x = db * grid[index] * sign,   db = d * (0.5 + s) / 4   (IQ3_XXS: / 2;  IQ3_S: d * (1 + 2s)).
"""

from __future__ import annotations

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from strata.quant.base import QuantType, device_table, f16, lookup, split, u16, u32, unpack
from strata.quant.grids import grid, grid_ms, ksigns
from strata.quant.random import (
    codes,
    concat,
    f16_bytes,
    jitter,
    pack,
    random_bytes,
    rms,
    u32_bytes,
)

_S_LO = 4  # random sub-block scales are drawn from _S_LO..15


def _ksign_groups(words: torch.Tensor) -> torch.Tensor:
    """int64 [N, G] words with four 7-bit ksigns indices in bits 0-27 -> float32 [N, G, 4, 8]."""
    shifts = device_table("ksigns_shifts", words.device, lambda: np.array([0, 7, 14, 21], np.int64))
    return lookup(ksigns(words.device), (words[..., None] >> shifts) & 127)


def _bit_signs(field: torch.Tensor) -> torch.Tensor:
    """uint8 [N, M] sign bits -> float32 [N, 8M] of +1 (bit clear) / -1 (bit set)."""
    return 1 - 2 * unpack(field, 1, 1).float()


def _half_scale(s: torch.Tensor) -> torch.Tensor:
    """4-bit scale codes -> float32 0.5 + s."""
    return 0.5 + s.float()


def _random_d(
    rng: np.random.Generator, n: int, std: float, ref: type, scale_rms: float
) -> np.ndarray:
    """f32 [n, 1] super-block scale for values of rms `std` (random signs make the mean 0)."""
    return jitter(rng, n, std / (scale_rms * np.sqrt(grid_ms(ref))))


_HALF_RMS = rms(np.arange(_S_LO, 16) + 0.5)


class IQ2_XXS(QuantType, qtype=QType.IQ2_XXS):
    """[d | 8 x (4 grid bytes | u32 signs 0-27, s 28-31)], grid 256 x 8, db = d*(0.5+s)/4."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs = split(blocks, 2, 64)
        qs = qs.reshape(n, 8, 8)
        words = u32(qs[..., 4:].reshape(n, 32))  # [N, 8]
        db = (f16(d) * _half_scale(words >> 28) * 0.25).view(n, 8, 1, 1)
        g = lookup(grid(gq.IQ2_XXS, blocks.device), qs[..., :4])  # [N, 8, 4, 8]
        return (db * g * _ksign_groups(words)).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        s = codes(rng, (n_blocks, 8), _S_LO, 15).astype(np.uint32)
        words = rng.integers(0, 1 << 28, size=(n_blocks, 8), dtype=np.uint32) | (s << 28)
        idx = random_bytes(rng, (n_blocks, 8, 4))
        qs = np.concatenate([idx, u32_bytes(words).reshape(n_blocks, 8, 4)], axis=2)
        d = _random_d(rng, n_blocks, std, gq.IQ2_XXS, 0.25 * _HALF_RMS)
        return concat(f16_bytes(d), qs.reshape(n_blocks, 64))


class IQ2_XS(QuantType, qtype=QType.IQ2_XS):
    """[d | 32 x u16 (grid 0-8, ksigns 9-15) | scales 8], grid 512 x 8, 16 sub-blocks of 16."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs, scales = split(blocks, 2, 64, 8)
        words = u16(qs)  # [N, 32]
        db = (f16(d) * _half_scale(unpack(scales, 4, 1)) * 0.25).view(n, 16, 1, 1)
        g = lookup(grid(gq.IQ2_XS, blocks.device), words & 511).view(n, 16, 2, 8)
        signs = lookup(ksigns(blocks.device), words >> 9).view(n, 16, 2, 8)
        return (db * g * signs).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        s = codes(rng, (n_blocks, 16), _S_LO, 15)
        d = _random_d(rng, n_blocks, std, gq.IQ2_XS, 0.25 * _HALF_RMS)
        return concat(f16_bytes(d), random_bytes(rng, (n_blocks, 64)), pack(s, 4, 1))


class IQ2_S(QuantType, qtype=QType.IQ2_S):
    """[d | qs 32 | signs 32 | qh 8 | scales 8]: index = qs | 2 bits of qh << 8, grid 1024 x 8."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs, sg, qh, scales = split(blocks, 2, 32, 32, 8, 8)
        db = (f16(d) * _half_scale(unpack(scales, 4, 1)) * 0.25).view(n, 16, 1, 1)
        idx = qs.int() | (unpack(qh, 2, 1).int() << 8)  # [N, 32]
        g = lookup(grid(gq.IQ2_S, blocks.device), idx).view(n, 16, 2, 8)
        return (db * g * _bit_signs(sg).view(n, 16, 2, 8)).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        s = codes(rng, (n_blocks, 16), _S_LO, 15)
        d = _random_d(rng, n_blocks, std, gq.IQ2_S, 0.25 * _HALF_RMS)
        return concat(f16_bytes(d), random_bytes(rng, (n_blocks, 72)), pack(s, 4, 1))


class IQ3_XXS(QuantType, qtype=QType.IQ3_XXS):
    """[d | qs 64 | 8 x u32 (ksigns 0-27, s 28-31)], grid 256 x 4, db = d*(0.5+s)/2."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs, scales = split(blocks, 2, 64, 32)
        words = u32(scales)  # [N, 8]
        db = (f16(d) * _half_scale(words >> 28) * 0.5).view(n, 8, 1, 1)
        g = lookup(grid(gq.IQ3_XXS, blocks.device), qs).view(n, 8, 4, 8)
        return (db * g * _ksign_groups(words)).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        s = codes(rng, (n_blocks, 8), _S_LO, 15).astype(np.uint32)
        words = rng.integers(0, 1 << 28, size=(n_blocks, 8), dtype=np.uint32) | (s << 28)
        d = _random_d(rng, n_blocks, std, gq.IQ3_XXS, 0.5 * _HALF_RMS)
        return concat(f16_bytes(d), random_bytes(rng, (n_blocks, 64)), u32_bytes(words))


class IQ3_S(QuantType, qtype=QType.IQ3_S):
    """[d | qs 64 | qh 8 | signs 32 | scales 4]: index = qs | bit of qh << 8, grid 512 x 4,
    db = d * (1 + 2s), 8 sub-blocks of 32."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, qs, qh, sg, scales = split(blocks, 2, 64, 8, 32, 4)
        db = (f16(d) * (1 + 2 * unpack(scales, 4, 1)).float()).view(n, 8, 1, 1)
        idx = qs.int() | (unpack(qh, 1, 1).int() << 8)  # [N, 64]
        g = lookup(grid(gq.IQ3_S, blocks.device), idx).view(n, 8, 4, 8)
        return (db * g * _bit_signs(sg).view(n, 8, 4, 8)).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        s = codes(rng, (n_blocks, 8), _S_LO, 15)
        d = _random_d(rng, n_blocks, std, gq.IQ3_S, rms(1 + 2 * np.arange(_S_LO, 16)))
        return concat(f16_bytes(d), random_bytes(rng, (n_blocks, 104)), pack(s, 4, 1))
