"""Random valid quantized rows for synthetic models, and the numpy packing helpers behind them.

Each QuantType.random_blocks draws codes that are symmetric about zero (centred integer codes,
random sign bits, or a block min set to cancel the codes' mean) and picks the f16 scales so the
values' standard deviation comes out near the requested one. Everything is vectorized numpy, so
multi-GB files can be written chunk by chunk; a given rng state always gives the same bytes.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType

from strata.quant.base import get_quant, row_nbytes


def random_rows(
    qtype: int | QType, n_rows: int, n_cols: int, rng: np.random.Generator, std: float
) -> np.ndarray:
    """uint8 [n_rows, row_nbytes]: random blocks of `qtype` with finite values of mean ~0, std ~std.

    Sub-block scales vary within a block, so the std matches to within ~10-20%. Scales are f16
    normals for std >= ~0.01; much smaller std may give subnormal (still valid) scales.
    """
    quant = get_quant(qtype)
    nbytes = row_nbytes(quant.qtype, n_cols)
    blocks = quant.random_blocks(rng, n_rows * (n_cols // quant.block_size), float(std))
    assert blocks.dtype == np.uint8 and blocks.shape[1] == quant.type_size
    return blocks.reshape(n_rows, nbytes)


def codes(rng: np.random.Generator, shape: tuple[int, ...], lo: int, hi: int) -> np.ndarray:
    """uint8 codes drawn uniformly from lo..hi inclusive."""
    return rng.integers(lo, hi + 1, size=shape, dtype=np.uint8)


def random_bytes(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 uniform over all 256 values: random grid indices and sign bits."""
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def rms(values: np.ndarray | range) -> float:
    """Root mean square of equally likely values."""
    v = np.asarray(values, dtype=np.float64)
    return float(np.sqrt(np.mean(v * v)))


def jitter(rng: np.random.Generator, n: int, scale: float) -> np.ndarray:
    """float32 [n, 1]: per-block scales spread +-20% around `scale` (rms ~1.01 x scale)."""
    return (scale * rng.uniform(0.8, 1.2, size=(n, 1))).astype(np.float32)


def f16_bytes(x: np.ndarray) -> np.ndarray:
    """float [n, 1] -> uint8 [n, 2]: little-endian f16."""
    return np.ascontiguousarray(x, dtype="<f2").reshape(-1, 1).view(np.uint8)


def f16_round(x: np.ndarray) -> np.ndarray:
    """x as the f16 that will be stored, back in float32."""
    return np.asarray(x, dtype=np.float16).astype(np.float32)


def u16_bytes(x: np.ndarray) -> np.ndarray:
    """int [n, m] -> uint8 [n, 2m]: little-endian u16 words."""
    return np.ascontiguousarray(x, dtype="<u2").view(np.uint8)


def u32_bytes(x: np.ndarray) -> np.ndarray:
    """int [n, m] -> uint8 [n, 4m]: little-endian u32 words."""
    return np.ascontiguousarray(x, dtype="<u4").view(np.uint8)


def pack(fields: np.ndarray, width: int, group: int) -> np.ndarray:
    """Inverse of base.unpack: uint8 [n, M * 8 // width] fields -> uint8 [n, M] bytes."""
    n, m = fields.shape
    k = 8 // width
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(1, 1, k, 1)
    f = fields.astype(np.uint8).reshape(n, m // (k * group), k, group) << shifts
    return np.bitwise_or.reduce(f, axis=2).reshape(n, m // k)


def concat(*fields: np.ndarray) -> np.ndarray:
    """Join byte fields [n, w_i] into blocks [n, sum w_i]."""
    return np.concatenate(fields, axis=1)
