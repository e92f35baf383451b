"""Lookup tables of the i-quants and MXFP4, taken from gguf-py (llama.cpp's own Python package).

Torch tables are built once per device (base.device_table); numpy statistics feed random_blocks.
"""

from __future__ import annotations

import functools

import gguf.quants as gq
import numpy as np
import torch

from strata.quant.base import device_table


def _grid_np(ref: type) -> np.ndarray:
    """float32 [G, W]: gguf-py's decoded grid for one i-quant class (e.g. gq.IQ2_XXS)."""
    ref.init_grid()
    return np.asarray(ref.grid, dtype=np.float32).reshape(ref.grid_shape)


def grid(ref: type, device: torch.device) -> torch.Tensor:
    """float32 [G, W] on `device`: row g is the W values that grid index g stands for."""
    return device_table(f"grid/{ref.__name__}", device, lambda: _grid_np(ref))


@functools.cache
def grid_ms(ref: type) -> float:
    """Mean square of all grid values (every index equally likely)."""
    g = _grid_np(ref).astype(np.float64)
    return float(np.mean(g * g))


def _ksigns_np() -> np.ndarray:
    """float32 [128, 8]: +-1 for the 8 sign bits of each 7-bit ksigns index (bit 7 = parity)."""
    ks = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8)
    bits = (ks[:, None] >> np.arange(8, dtype=np.uint8)) & 1
    return np.where(bits == 0, np.float32(1), np.float32(-1))


def ksigns(device: torch.device) -> torch.Tensor:
    """float32 [128, 8] on `device`."""
    return device_table("ksigns", device, _ksigns_np)


def kvalues(ref: type, device: torch.device) -> torch.Tensor:
    """float32 [16]: the non-linear 4-bit code book of gq.IQ4_NL or gq.MXFP4 (doubled E2M1)."""
    return device_table(
        f"kvalues/{ref.__name__}", device, lambda: np.array(ref.kvalues, dtype=np.float32)
    )


def kvalues_ms(ref: type) -> float:
    k = np.array(ref.kvalues, dtype=np.float64)
    return float(np.mean(k * k))
