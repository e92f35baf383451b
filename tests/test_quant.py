"""strata.quant against gguf-py's numpy dequantizers (llama.cpp's reference), bit for bit."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch

from strata.errors import UnsupportedError
from strata.quant import (
    QUANTS,
    SUPPORTED,
    QType,
    dequantize,
    get_quant,
    is_supported,
    random_rows,
    row_nbytes,
)

FLOATS = (QType.F32, QType.F16, QType.BF16)
# byte offsets of the f16 scale fields in a block (IQ1_M and MXFP4 are patched separately)
F16_FIELDS = {
    QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2), QType.Q8_0: (0,),
    QType.Q2_K: (80, 82), QType.Q3_K: (108,), QType.Q4_K: (0, 2), QType.Q5_K: (0, 2),
    QType.Q6_K: (208,), QType.IQ1_S: (0,), QType.IQ2_XXS: (0,), QType.IQ2_XS: (0,),
    QType.IQ2_S: (0,), QType.IQ3_XXS: (0,), QType.IQ3_S: (0,), QType.IQ4_NL: (0,),
    QType.IQ4_XS: (0,),
}  # fmt: skip
SHAPES = [(r, b) for r in (1, 3, 7) for b in (1, 5)]  # (rows, blocks per row): odd on purpose
IDS = [t.name for t in SUPPORTED]


def n_cols(qtype: QType, n_blocks: int) -> int:
    # float types have 1-value "blocks": give their rows a few more values
    return get_quant(qtype).block_size * n_blocks * (16 if qtype in FLOATS else 1)


def small_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """uint8 [n, 2]: finite f16 of either sign in about +-2^-4, subnormals and zeros included."""
    x = rng.uniform(-1, 1, n) * 2.0 ** rng.integers(-20, -3, n)
    x[rng.random(n) < 0.05] = 0
    return x.astype("<f2").reshape(n, 1).view(np.uint8)


def raw_rows(qtype: QType, n_rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n_rows, row_nbytes]: random bytes, with finite small scales patched in."""
    quant = get_quant(qtype)
    x = rng.integers(0, 256, (n_rows, row_nbytes(qtype, cols)), dtype=np.uint8)
    blocks = x.reshape(-1, quant.type_size)  # a view: patches land in x
    n = blocks.shape[0]
    for off in F16_FIELDS.get(qtype, ()):
        blocks[:, off : off + 2] = small_f16(rng, n)
    if qtype == QType.IQ1_M:  # the f16 d sits in the top nibbles of the 4 scale words
        d = small_f16(rng, n).view("<u2")  # [n, 1]
        nibbles = ((d >> np.array([0, 4, 8, 12], dtype=np.uint16)) & 15).astype(np.uint8)
        odd = blocks[:, 49:56:2]  # high bytes of the words
        blocks[:, 49:56:2] = (odd & 0x0F) | (nibbles << 4)
    if qtype == QType.MXFP4:  # keep 2^(e - 128) * 12 finite; e = 0 and 1 take the subnormal path
        blocks[:, 0] = rng.integers(0, 160, n, dtype=np.uint8)
    return x


def assert_bit_exact(got: torch.Tensor, want: np.ndarray, allow_nan: bool = False) -> None:
    """Same shape, dtype and bits; NaNs (raw float data only) must sit in the same places."""
    got = got.cpu().numpy()
    assert got.dtype == np.float32 and want.dtype == np.float32
    assert got.shape == want.shape
    nan = np.isnan(want)
    assert allow_nan or not nan.any()
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got.view(np.int32)[~nan], want.view(np.int32)[~nan])


def check_against_gguf(qtype: QType, device: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for rows, blocks in SHAPES:
        cols = n_cols(qtype, blocks)
        for x in (random_rows(qtype, rows, cols, rng, 0.05), raw_rows(qtype, rows, cols, rng)):
            want = gguf.quants.dequantize(x, qtype)
            got = dequantize(torch.from_numpy(x).to(device), qtype, cols)
            assert got.device.type == device
            assert_bit_exact(got, want, allow_nan=qtype in FLOATS)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
def test_matches_gguf(qtype: QType) -> None:
    check_against_gguf(qtype, "cpu", seed=int(qtype))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
def test_matches_gguf_cuda(qtype: QType) -> None:
    check_against_gguf(qtype, "cuda", seed=int(qtype) + 1000)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
def test_leading_dims_and_strides(qtype: QType) -> None:
    rng = np.random.default_rng(1)
    cols = n_cols(qtype, 2)
    x = raw_rows(qtype, 6, cols, rng)
    want = gguf.quants.dequantize(x, qtype)
    # [2, 3, row_nbytes] -> [2, 3, n_cols]
    got = dequantize(torch.from_numpy(x).view(2, 3, -1), qtype, cols)
    assert got.shape == (2, 3, cols)
    assert_bit_exact(got.reshape(6, cols), want, allow_nan=qtype in FLOATS)
    # every other row of a bigger tensor: non-contiguous input; int qtype accepted
    wide = torch.from_numpy(np.repeat(x, 2, axis=0))[::2]
    assert_bit_exact(dequantize(wide, int(qtype), cols), want, allow_nan=qtype in FLOATS)
    # no rows at all
    assert dequantize(torch.from_numpy(x[:0]), qtype, cols).shape == (0, cols)


@pytest.mark.parametrize("std", [0.02, 1.0])
@pytest.mark.parametrize("qtype", SUPPORTED, ids=IDS)
def test_random_rows_statistics(qtype: QType, std: float) -> None:
    cols = max(get_quant(qtype).block_size, 32) * 32
    x = random_rows(qtype, 8, cols, np.random.default_rng(7), std)
    assert x.dtype == np.uint8 and x.shape == (8, row_nbytes(qtype, cols))
    v = gguf.quants.dequantize(x, qtype).astype(np.float64)
    assert np.isfinite(v).all()
    assert abs(v.mean()) < 0.05 * std
    assert 1 / 1.25 < v.std() / std < 1.25
    # deterministic for a given rng state
    assert np.array_equal(x, random_rows(qtype, 8, cols, np.random.default_rng(7), std))


def test_registry() -> None:
    assert len(SUPPORTED) == 23 and set(QUANTS) == set(SUPPORTED)
    for qtype in SUPPORTED:
        quant = get_quant(int(qtype))
        assert quant is QUANTS[qtype] and quant.qtype == qtype
        assert is_supported(qtype) and is_supported(int(qtype))
        assert (quant.block_size, quant.type_size) == gguf.GGML_QUANT_SIZES[qtype]


@pytest.mark.parametrize("qtype", [QType.Q8_1, QType.TQ1_0, QType.Q8_K, 999])
def test_unsupported_types_are_named(qtype: int) -> None:
    name = QType(qtype).name if qtype in QType._value2member_map_ else str(qtype)
    assert not is_supported(qtype)
    for call in (
        lambda: get_quant(qtype),
        lambda: dequantize(torch.zeros(1, 64, dtype=torch.uint8), qtype, 32),
        lambda: random_rows(qtype, 1, 256, np.random.default_rng(0), 1.0),
    ):
        with pytest.raises(UnsupportedError, match=rf"tensor type {name} .*supported: F32, F16"):
            call()


def test_row_nbytes() -> None:
    assert row_nbytes(QType.F32, 7) == 28
    assert row_nbytes(QType.BF16, 7) == 14
    assert row_nbytes(int(QType.Q4_0), 64) == 36
    assert row_nbytes(QType.Q6_K, 512) == 420
    # sizes are known even for unsupported types
    assert row_nbytes(QType.Q8_1, 64) == 2 * gguf.GGML_QUANT_SIZES[QType.Q8_1][1]
    for qtype, cols in [(QType.Q4_0, 48), (QType.Q4_K, 32), (QType.MXFP4, 1)]:
        with pytest.raises(ValueError, match=str(cols)):
            row_nbytes(qtype, cols)


def test_dequantize_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="Q4_0"):
        dequantize(torch.zeros(2, 20, dtype=torch.uint8), QType.Q4_0, 32)  # 18 bytes expected
    with pytest.raises(TypeError):
        dequantize(torch.zeros(2, 18, dtype=torch.int8), QType.Q4_0, 32)
