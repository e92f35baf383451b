"""Non-linear 4-bit i-quants IQ4_NL (32-value blocks) and IQ4_XS (256-value super-blocks).

Each 4-bit code picks one of 16 fixed levels (kvalues, -127..113, from gguf-py): x = d * k[q].
N blocks; codes are packed in runs of 16 bytes (low nibbles first, then high nibbles).
"""

from __future__ import annotations

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from strata.quant.base import QuantType, f16, lookup, split, unpack
from strata.quant.grids import kvalues, kvalues_ms
from strata.quant.random import codes, concat, f16_bytes, jitter, pack, random_bytes, rms


def _levels(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [N, M] packed codes -> float32 [N, 2M] levels."""
    return lookup(kvalues(gq.IQ4_NL, qs.device), unpack(qs, 4, 16))


class IQ4_NL(QuantType, qtype=QType.IQ4_NL):
    """[d | qs 16]: x = d * k[q]."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        d, qs = split(blocks, 2, 16)
        return f16(d) * _levels(qs)  # [N, 32]

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        # the levels' mean is -5.9: a random sign on d centres the values
        sign = np.where(rng.random((n_blocks, 1)) < 0.5, -1, 1).astype(np.float32)
        d = sign * jitter(rng, n_blocks, std / np.sqrt(kvalues_ms(gq.IQ4_NL)))
        return concat(f16_bytes(d), random_bytes(rng, (n_blocks, 16)))


_S_MAG = (8, 31)  # random |sub-block scale| range
_S_RMS = rms(range(_S_MAG[0], _S_MAG[1] + 1))


class IQ4_XS(QuantType, qtype=QType.IQ4_XS):
    """[d | scales_h u16 | scales_l 4 | qs 128]: x = d * (s - 32) * k[q], 8 sub-blocks of 32;
    6-bit s = nibble j of scales_l | bits 2j..2j+1 of scales_h << 4."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, sh, sl, qs = split(blocks, 2, 2, 4, 128)
        s = (unpack(sl, 4, 1) | (unpack(sh, 2, 1) << 4)).to(torch.int8) - 32  # [N, 8]
        dl = (f16(d) * s.float()).view(n, 8, 1)
        return (dl * _levels(qs).view(n, 8, 32)).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        mag = codes(rng, (n_blocks, 8), *_S_MAG).astype(np.int16)
        s = np.where(rng.random((n_blocks, 8)) < 0.5, -mag, mag)  # random signs centre the values
        u = (s + 32).astype(np.uint8)
        d = jitter(rng, n_blocks, std / (_S_RMS * np.sqrt(kvalues_ms(gq.IQ4_NL))))
        sub = concat(pack(u >> 4, 2, 1), pack(u & 15, 4, 1))
        return concat(f16_bytes(d), sub, random_bytes(rng, (n_blocks, 128)))
