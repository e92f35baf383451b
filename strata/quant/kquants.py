"""K-quants: 256-value super-blocks of 16 or 8 sub-blocks, each with its own small scale.

Shapes: N super-blocks; S sub-blocks per super-block. Packed 2-bit, 4-bit and high-bit fields are
laid out in runs of 32 (64 for Q6_K's low nibbles): see base.unpack for the order.
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
)

_RMS_2U = rms(np.arange(4) - 1.5)
_RMS_3 = rms(range(-3, 4))
_RMS_4U = rms(np.arange(16) - 7.5)
_RMS_5U = rms(np.arange(32) - 15.5)
_RMS_6 = rms(range(-31, 32))


def scale_min_k4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, 12] -> 6-bit (scale, min), each uint8 [N, 8].

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3; scales/mins 4-7 keep their
    low nibbles in bytes 8-11 (scale low, min high) and their top 2 bits in bits 6-7 of bytes 0-7.
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = torch.cat([a & 63, (c & 15) | ((a >> 2) & 48)], dim=1)
    mn = torch.cat([b & 63, (c >> 4) | ((b >> 2) & 48)], dim=1)
    return sc, mn


def pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of scale_min_k4: 6-bit uint8 [n, 8] each -> uint8 [n, 12]."""
    lo_sc, hi_sc, lo_mn, hi_mn = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    a = lo_sc | ((hi_sc >> 4) << 6)
    b = lo_mn | ((hi_mn >> 4) << 6)
    c = (hi_sc & 15) | ((hi_mn & 15) << 4)
    return concat(a, b, c)


def _sub_scales_and_d(
    rng: np.random.Generator, n: int, std: float, code_rms: float, lo: int, hi: int, sub: int
) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block scales uniform in lo..hi ([n, sub]) and the f16-rounded super-block d ([n, 1])
    that gives values of rms `std` when the codes have rms `code_rms`."""
    sc = codes(rng, (n, sub), lo, hi)
    return sc, f16_round(jitter(rng, n, std / (code_rms * rms(range(lo, hi + 1)))))


class Q2_K(QuantType, qtype=QType.Q2_K):
    """[scales 16 | qs 64 | d | dmin]: x = d * (sc & 15) * q - dmin * (sc >> 4), q 2-bit, S=16."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        scales, qs, d, dmin = split(blocks, 16, 64, 2, 2)
        dl = (f16(d) * (scales & 15).float()).view(n, 16, 1)
        ml = (f16(dmin) * (scales >> 4).float()).view(n, 16, 1)
        q = unpack(qs, 2, 32).float().view(n, 16, 16)
        return (dl * q - ml).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        sc, d = _sub_scales_and_d(rng, n_blocks, std, _RMS_2U, 4, 15, 16)
        # uniform codes = random bytes; min nibble = scale nibble and dmin = 1.5 d:
        # each sub-block is d * sc * (q - 1.5)
        qs = random_bytes(rng, (n_blocks, 64))
        return concat(sc | (sc << 4), qs, f16_bytes(d), f16_bytes(1.5 * d))


class Q3_K(QuantType, qtype=QType.Q3_K):
    """[hmask 32 | qs 64 | scales 12 | d]: x = d * (sc - 32) * (q2 - 4 * !hbit), S=16.

    6-bit scales: low nibbles in bytes 0-7 (scale j in byte j % 8, nibble j // 8), top 2 bits
    in bytes 8-11 (scale j in byte j % 4, bits 2 * (j // 4)).
    """

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        hmask, qs, scales, d = split(blocks, 32, 64, 12, 2)
        sc = unpack(scales[:, :8], 4, 8) | (unpack(scales[:, 8:], 2, 4) << 4)  # [N, 16]
        dl = (f16(d) * (sc.to(torch.int8) - 32).float()).view(n, 16, 1)
        offset = (unpack(hmask, 1, 32) ^ 1) << 2  # 4 where the high bit is clear
        q = unpack(qs, 2, 32).to(torch.int8) - offset.to(torch.int8)  # [N, 256]
        return (dl * q.float().view(n, 16, 16)).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        s, d = _sub_scales_and_d(rng, n_blocks, std, _RMS_3, 8, 31, 16)
        u = s + 32  # stored 6-bit scales
        q = codes(rng, (n_blocks, 256), 1, 7)  # q - 4 in -3..3: centred
        scales = concat(pack(u & 15, 4, 8), pack(u >> 4, 2, 4))
        return concat(pack(q >> 2, 1, 32), pack(q & 3, 2, 32), scales, f16_bytes(d))


class Q4_K(QuantType, qtype=QType.Q4_K):
    """[d | dmin | scales 12 | qs 128]: x = d * sc * q - dmin * m, q 4-bit, S=8."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, dmin, scales, qs = split(blocks, 2, 2, 12, 128)
        sc, mn = scale_min_k4(scales)
        dl = (f16(d) * sc.float()).view(n, 8, 1)
        ml = (f16(dmin) * mn.float()).view(n, 8, 1)
        q = unpack(qs, 4, 32).float().view(n, 8, 32)
        return (dl * q - ml).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        sc, d = _sub_scales_and_d(rng, n_blocks, std, _RMS_4U, 16, 31, 8)
        # m = sc and dmin = 7.5 d: each sub-block is d * sc * (q - 7.5), q = random nibbles
        head = concat(f16_bytes(d), f16_bytes(7.5 * d), pack_scale_min_k4(sc, sc))
        return concat(head, random_bytes(rng, (n_blocks, 128)))


class Q5_K(QuantType, qtype=QType.Q5_K):
    """[d | dmin | scales 12 | qh 32 | qs 128]: as Q4_K with q = nibble | hbit << 4."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        d, dmin, scales, qh, qs = split(blocks, 2, 2, 12, 32, 128)
        sc, mn = scale_min_k4(scales)
        dl = (f16(d) * sc.float()).view(n, 8, 1)
        ml = (f16(dmin) * mn.float()).view(n, 8, 1)
        q = unpack(qs, 4, 32) | (unpack(qh, 1, 32) << 4)  # [N, 256]
        return (dl * q.float().view(n, 8, 32) - ml).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        sc, d = _sub_scales_and_d(rng, n_blocks, std, _RMS_5U, 16, 31, 8)
        head = concat(f16_bytes(d), f16_bytes(15.5 * d), pack_scale_min_k4(sc, sc))
        return concat(head, random_bytes(rng, (n_blocks, 160)))  # qh, qs: uniform 5-bit q


class Q6_K(QuantType, qtype=QType.Q6_K):
    """[ql 128 | qh 64 | scales int8 16 | d]: x = d * sc * (q - 32), q = nibble | crumb << 4."""

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        n = blocks.shape[0]
        ql, qh, scales, d = split(blocks, 128, 64, 16, 2)
        dl = (f16(d) * scales.view(torch.int8).float()).view(n, 16, 1)
        q = (unpack(ql, 4, 64) | (unpack(qh, 2, 32) << 4)).to(torch.int8) - 32  # [N, 256]
        return (dl * q.float().view(n, 16, 16)).view(n, 256)

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        sc, d = _sub_scales_and_d(rng, n_blocks, std, _RMS_6, 4, 15, 16)
        q = codes(rng, (n_blocks, 256), 1, 63)  # q - 32 in -31..31: centred
        return concat(pack(q & 15, 4, 64), pack(q >> 4, 2, 32), sc, f16_bytes(d))
