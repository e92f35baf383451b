"""The QuantType interface, its registry, and the torch helpers the block decoders share.

A GGML tensor row is a run of blocks; each block packs `block_size` values into `type_size` bytes.
Decoders take `blocks: uint8 [N, B]` and return `float32 [N, K]` (N blocks, B = type_size,
K = block_size). They follow gguf-py's numpy decoders operation for operation (f16 scales widened
to f32 first, the same products in the same order), so results are bit-identical to
`gguf.quants.dequantize`. Only torch ops on the input's device are used; lookup tables are
built once per device.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

from strata.errors import UnsupportedError

QUANTS: dict[QType, QuantType] = {}  # filled by subclassing QuantType, in definition order


class QuantType:
    """One GGML block format. Subclass with `qtype=...` to register a singleton in QUANTS."""

    qtype: QType
    block_size: int  # K: values per block
    type_size: int  # B: bytes per block

    def __init_subclass__(cls, qtype: QType | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if qtype is None:  # an intermediate base class, not a format
            return
        cls.qtype = qtype
        cls.block_size, cls.type_size = GGML_QUANT_SIZES[qtype]
        assert qtype not in QUANTS, f"{qtype.name} registered twice"
        QUANTS[qtype] = cls()

    def dequantize_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """uint8 [N, B] (contiguous) -> float32 [N, K] on the same device."""
        raise NotImplementedError

    def random_blocks(self, rng: np.random.Generator, n_blocks: int, std: float) -> np.ndarray:
        """uint8 [n_blocks, B]: valid blocks whose values have mean ~0 and std ~`std`."""
        raise NotImplementedError


# ---- registry lookups ------------------------------------------------------------------------


def _type_name(qtype: int | QType) -> str:
    try:
        return QType(qtype).name
    except ValueError:
        return str(qtype)


def get_quant(qtype: int | QType) -> QuantType:
    """The registered QuantType for `qtype`; UnsupportedError naming the type otherwise."""
    try:
        return QUANTS[QType(qtype)]
    except (ValueError, KeyError):
        names = ", ".join(t.name for t in sorted(QUANTS))  # in GGML type-id order
        raise UnsupportedError(
            f"tensor type {_type_name(qtype)} is not supported (supported: {names})"
        ) from None


def is_supported(qtype: int | QType) -> bool:
    try:
        return QType(qtype) in QUANTS
    except ValueError:
        return False


def row_nbytes(qtype: int | QType, n_cols: int) -> int:
    """Bytes in one row of `n_cols` values. Works for every GGML type, supported or not."""
    try:
        block_size, type_size = GGML_QUANT_SIZES[QType(qtype)]
    except (ValueError, KeyError):
        raise UnsupportedError(f"tensor type {_type_name(qtype)} is unknown") from None
    if n_cols < 0 or n_cols % block_size != 0:
        raise ValueError(
            f"{_type_name(qtype)} rows must hold a multiple of {block_size} values, got {n_cols}"
        )
    return n_cols // block_size * type_size


# Bytes a torch `dequantize` holds at its peak per byte of its float32 output, the output
# included: its intermediates (codes, scales, gathered grid rows) are full-size tensors. Measured
# on the CPU, live tensors only: IQ3_S 4.5, IQ2_XS 4.4, IQ2_XXS 4.3, IQ3_XXS 4.3, Q4_K 3.3,
# Q6_K 2.5, Q8_0 2.2 (tests/test_quant_memory.py holds every type to this bound); 6 leaves room
# for an allocator's slack (with glibc's own caching the resident peak reached 5.3). Callers that
# dequantize within a memory budget size their pieces by it (dequant_rows, dequantize_into).
DEQUANT_PEAK = 6
# what the float32 dequantizing paths hold at once beyond their outputs: one piece of rows at its
# peak (the memory plan's workspace covers it)
DEQUANT_CHUNK_BYTES = 64 << 20


def dequant_rows(n_cols: int, budget_bytes: int = DEQUANT_CHUNK_BYTES) -> int:
    """Rows of n_cols values one dequantize call may take while holding at most budget_bytes
    (at least 1)."""
    return max(1, budget_bytes // (n_cols * 4 * DEQUANT_PEAK))


def dequantize_into(data: torch.Tensor, qtype: int | QType, n_cols: int, out: torch.Tensor,
                    budget_bytes: int = DEQUANT_CHUNK_BYTES) -> torch.Tensor:
    """out [..., n_cols] float32 (contiguous) = dequantize(data [..., row_nbytes]), a piece of
    dequant_rows(n_cols, budget_bytes) rows at a time: beyond out, at most budget_bytes held.
    data may be on another device than out (a file's tensor in host memory): each piece goes to
    out's device on its own."""
    rows, flat = data.reshape(-1, data.shape[-1]), out.view(-1, n_cols)
    step = dequant_rows(n_cols, budget_bytes)
    for i in range(0, rows.shape[0], step):
        flat[i:i + step] = dequantize(rows[i:i + step].to(out.device), qtype, n_cols)
    return out


def dequantize(data: torch.Tensor, qtype: int | QType, n_cols: int) -> torch.Tensor:
    """uint8 [..., row_nbytes] -> float32 [..., n_cols] on data.device.

    F32 data that is already contiguous comes back as a view of `data`, as in gguf-py.
    """
    quant = get_quant(qtype)
    if data.dtype != torch.uint8:
        raise TypeError(f"quantized data must be a uint8 tensor, got {data.dtype}")
    nbytes = row_nbytes(quant.qtype, n_cols)
    if data.dim() == 0 or data.shape[-1] != nbytes:
        raise ValueError(
            f"{quant.qtype.name} rows of {n_cols} values take {nbytes} bytes, "
            f"got data of shape {tuple(data.shape)}"
        )
    blocks = data.contiguous().view(-1, quant.type_size)  # [N, B]
    values = quant.dequantize_blocks(blocks)  # [N, K]
    return values.view(*data.shape[:-1], n_cols)


# ---- helpers for decoders --------------------------------------------------------------------

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def device_table(name: str, device: torch.device, build: Callable[[], np.ndarray]) -> torch.Tensor:
    """A constant lookup table on `device`, built by `build()` on first use and then cached."""
    key = (name, device)
    table = _TABLES.get(key)
    if table is None:
        table = torch.from_numpy(np.ascontiguousarray(build())).to(device)
        _TABLES[key] = table
    return table


def split(blocks: torch.Tensor, *widths: int) -> tuple[torch.Tensor, ...]:
    """Cut [N, B] bytes into fields of the given byte widths (they must add up to B)."""
    assert sum(widths) == blocks.shape[1], (widths, blocks.shape)
    return torch.split(blocks, list(widths), dim=1)


def f16(field: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 2] little-endian f16 -> float32 [N, 1] (exact widening)."""
    return field.contiguous().view(torch.float16).float()


def u16(field: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 2M] little-endian u16 words -> int32 [N, M]."""
    n, m = field.shape
    b = field.reshape(n, m // 2, 2).int()
    return b[..., 0] | (b[..., 1] << 8)


def u32(field: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 4M] little-endian u32 words -> int64 [N, M] (int64 keeps bit 31 positive)."""
    n, m = field.shape
    b = field.reshape(n, m // 4, 4).long()
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def unpack(field: torch.Tensor, width: int, group: int) -> torch.Tensor:
    """uint8 [N, M] -> uint8 [N, M * 8 // width]: the `width`-bit fields of every byte.

    Bytes are read in runs of `group`; for byte j of a run, field s (bits s*width and up)
    lands at output s * group + j of that run:  out[r, s, j] = (x[r, j] >> s*width) & mask.
    """
    n, m = field.shape
    k = 8 // width
    shifts = device_table(
        f"unpack_shifts{width}", field.device, lambda: np.arange(0, 8, width, dtype=np.uint8)
    ).view(1, 1, k, 1)
    out = (field.reshape(n, m // group, 1, group) >> shifts) & ((1 << width) - 1)
    return out.reshape(n, m * k)


def lookup(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Entries of `table` [T] or rows of `table` [T, W] picked by integer `idx` [*I]
    -> [*I] or [*I, W]. A pure gather, so the method cannot change any bit: on CPU index_select
    of whole rows is fastest; GPUs gather single elements several times faster than rows."""
    shape = (*idx.shape, *table.shape[1:])
    flat_idx = idx.reshape(-1).int()
    if table.dim() == 2 and table.device.type != "cpu":
        w = table.shape[1]
        cols = torch.arange(w, dtype=torch.int32, device=table.device)
        flat_idx = (flat_idx[:, None] * w + cols).view(-1)  # [I * W] element indices
        table = table.view(-1)
    return table.index_select(0, flat_idx).view(shape)
