"""Float types and the 32-value block formats: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.

Shapes: N blocks; decoders map uint8 [N, B] -> float32 [N, K]. In the 4-bit formats value i < 16
sits in the low nibble of byte i and value i >= 16 in the high nibble of byte i - 16.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from strata.quant.base import QuantType, f16, split, unpack
from strata.quant.random import (
    codes,
    concat,
    f16_bytes,
    f16_round,
    jitter,
    pack,
    random_bytes,
    rms,
    u16_bytes,
)

_RMS_4 = rms(range(-7, 8))  # centred 4-bit codes q - 8, q in 1..15
_RMS_4U = rms(np.arange(16) - 7.5)  # all 4-bit codes around their mean
_RMS_5 = rms(range(-15, 16))
_RMS_5U = rms(np.arange(32) - 15.5)
_RMS_8 = rms(range(-127, 128))


def _normal(rng: np.random.Generator, n: int, std: float) -> np.ndarray:
    return rng.standard_normal((n, 1), dtype=np.float32) * np.float32(std)  # [n, 1]


class F32(QuantType, qtype=QType.F32):
    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.view(torch.float32)  # [N, 4] -> [N, 1]

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        return _normal(rng, n_blocks, std).astype("<f4").view(np.uint8)


class F16(QuantType, qtype=QType.F16):
    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.view(torch.float16).float()  # [N, 2] -> [N, 1]

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        return f16_bytes(_normal(rng, n_blocks, std))


class BF16(QuantType, qtype=QType.BF16):
    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks.view(torch.bfloat16).float()  # [N, 2] -> [N, 1]; f32 bits = bf16 << 16

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        bits = _normal(rng, n_blocks, std).view(np.uint32) >> 16  # truncate to bf16
        return u16_bytes(bits)


class Q4_0(QuantType, qtype=QType.Q4_0):
    """Block [d f16 | qs 16]: x = d * (q - 8), q 4-bit."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d, qs = split(blocks, 2, 16)
        q = unpack(qs, 4, 16).to(torch.int8) - 8  # [N, 32]
        return f16(d) * q.float()

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        q = codes(rng, (n_blocks, 32), 1, 15)  # q - 8 in -7..7: centred
        d = jitter(rng, n_blocks, std / _RMS_4)
        return concat(f16_bytes(d), pack(q, 4, 16))


class Q4_1(QuantType, qtype=QType.Q4_1):
    """Block [d f16 | m f16 | qs 16]: x = d * q + m, q 4-bit."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d, m, qs = split(blocks, 2, 2, 16)
        q = unpack(qs, 4, 16).float()  # [N, 32]
        return f16(d) * q + f16(m)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        d = f16_round(jitter(rng, n_blocks, std / _RMS_4U))
        m = -7.5 * d  # cancels the mean 7.5 of uniform codes, i.e. of uniform random bytes
        return concat(f16_bytes(d), f16_bytes(m), random_bytes(rng, (n_blocks, 16)))


class Q5_0(QuantType, qtype=QType.Q5_0):
    """Block [d f16 | qh u32 | qs 16]: x = d * (q - 16), q = nibble | (bit i of qh) << 4."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d, qh, qs = split(blocks, 2, 4, 16)
        q = unpack(qs, 4, 16) | (unpack(qh, 1, 1) << 4)  # [N, 32]
        return f16(d) * (q.to(torch.int8) - 16).float()

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        q = codes(rng, (n_blocks, 32), 1, 31)  # q - 16 in -15..15
        d = jitter(rng, n_blocks, std / _RMS_5)
        return concat(f16_bytes(d), pack(q >> 4, 1, 1), pack(q & 15, 4, 16))


class Q5_1(QuantType, qtype=QType.Q5_1):
    """Block [d f16 | m f16 | qh u32 | qs 16]: x = d * q + m, q 5-bit as in Q5_0."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d, m, qh, qs = split(blocks, 2, 2, 4, 16)
        q = unpack(qs, 4, 16) | (unpack(qh, 1, 1) << 4)  # [N, 32]
        return f16(d) * q.float() + f16(m)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        d = f16_round(jitter(rng, n_blocks, std / _RMS_5U))
        m = -15.5 * d
        return concat(f16_bytes(d), f16_bytes(m), random_bytes(rng, (n_blocks, 20)))


class Q8_0(QuantType, qtype=QType.Q8_0):
    """Block [d f16 | qs int8 x 32]: x = q * d."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d, qs = split(blocks, 2, 32)
        return qs.view(torch.int8).float() * f16(d)  # [N, 32]

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        q = rng.integers(-127, 128, size=(n_blocks, 32), dtype=np.int8)  # centred
        d = jitter(rng, n_blocks, std / _RMS_8)
        return concat(f16_bytes(d), q.view(np.uint8))
