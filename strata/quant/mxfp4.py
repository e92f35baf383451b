"""MXFP4 (OCP microscaling): 32 E2M1 values sharing one E8M0 power-of-two scale.

Block [e u8 | qs 16]: x = d * k[q], k = the E2M1 values doubled (0, 1, 2, 3, 4, 6, 8, 12 and
their negatives, from gguf-py) and d = 2^(e - 128), half the E8M0 scale, built from its bits:
    bits(d) = e >= 2 ? (e - 1) << 23 : 0x00200000 << e      (e < 2: subnormal)
"""

from __future__ import annotations

import gguf.quants as gq
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from strata.quant.base import QuantType, lookup, split, unpack
from strata.quant.grids import kvalues, kvalues_ms
from strata.quant.random import concat, random_bytes


class MXFP4(QuantType, qtype=QType.MXFP4):
    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        e, qs = split(blocks, 1, 16)
        e = e.int()  # [N, 1]
        bits = torch.where(e < 2, 0x00200000 * (e + 1), (e.clamp(min=1) - 1) << 23)
        d = bits.view(torch.float32)  # [N, 1]
        return d * lookup(kvalues(gq.MXFP4, blocks.device), unpack(qs, 4, 16))  # [N, 32]

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        # codes are symmetric about 0; d = 2^(e - 128) is rounded up or down at random in the
        # log domain so that scales average out near std / rms(k)
        t = np.log2(std / np.sqrt(kvalues_ms(gq.MXFP4))) + 128
        e = np.floor(t) + (rng.random((n_blocks, 1)) < t - np.floor(t))
        e = np.clip(e, 2, 254).astype(np.uint8)
        return concat(e, random_bytes(rng, (n_blocks, 16)))
