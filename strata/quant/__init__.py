"""GGML block formats: bit-exact torch dequantization, and random valid blocks for synthetic models.

    quant = get_quant(QType.Q4_K)                       # the registered QuantType
    w = dequantize(data, QType.Q4_K, n_cols)            # u8 [..., row_nbytes] -> f32 [..., n_cols]
    rows = random_rows(QType.Q4_K, 8, 4096, rng, 0.02)  # u8 [8, row_nbytes]

One QuantType subclass per format, registered in QUANTS by subclassing:
    legacy.py   F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0
    kquants.py  Q2_K Q3_K Q4_K Q5_K Q6_K
    iq1.py      IQ1_S IQ1_M            iquants.py  IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S
    iq4.py      IQ4_NL IQ4_XS          mxfp4.py    MXFP4
Code books (grids, signs, levels) come from gguf-py (grids.py); results match
`gguf.quants.dequantize` bit for bit. Every other GGML type is refused with UnsupportedError.
"""

from gguf import GGMLQuantizationType as QType

from strata.quant import iq1, iq4, iquants, kquants, legacy, mxfp4  # noqa: F401 (registration)
from strata.quant.base import (
    DEQUANT_CHUNK_BYTES,
    DEQUANT_PEAK,
    QUANTS,
    QuantType,
    dequant_rows,
    dequantize,
    dequantize_into,
    get_quant,
    is_supported,
    row_nbytes,
)
from strata.quant.random import random_rows

SUPPORTED: tuple[QType, ...] = (
    QType.F32, QType.F16, QType.BF16,
    QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0,
    QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K,
    QType.IQ1_S, QType.IQ1_M, QType.IQ2_XXS, QType.IQ2_XS, QType.IQ2_S,
    QType.IQ3_XXS, QType.IQ3_S, QType.IQ4_NL, QType.IQ4_XS,
    QType.MXFP4,
)  # fmt: skip
assert set(SUPPORTED) == set(QUANTS), "SUPPORTED and the registered QuantTypes disagree"

__all__ = [
    "QType", "QuantType", "QUANTS", "SUPPORTED",
    "get_quant", "is_supported", "row_nbytes", "dequantize", "random_rows", "DEQUANT_PEAK",
    "DEQUANT_CHUNK_BYTES", "dequant_rows", "dequantize_into",
]  # fmt: skip
