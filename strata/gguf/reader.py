"""Read GGUF files: header, metadata and tensor table, with the tensor data memory-mapped.

A GGUF file (version 2 or 3, little-endian):

    magic "GGUF" | version u32 | n_tensors u64 | n_kv u64
    n_kv   x  key (string) | value type u32 | value
    n_tensors x name (string) | n_dims u32 | ne[n_dims] u64 | ggml type u32 | offset u64
    padding to general.alignment (default 32)
    tensor data, each tensor at data_start + offset

Strings are a u64 length followed by UTF-8 bytes. `ne` lists dimensions fastest-first (ggml order);
`TensorInfo.shape` gives them in torch order (slowest first), so a matrix is [rows, cols].
Nothing is copied: tensor data is a view into a memory map of the file.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from strata.errors import ModelFileError

MAGIC = b"GGUF"
MAX_NAME = 64  # bytes of a tensor's name, its NUL included (ggml's GGML_MAX_NAME)
DEFAULT_ALIGNMENT = 32

# value type id -> struct format for scalars
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


class _Truncated(Exception):
    pass


class _Cursor:
    """Sequential reads from a buffer; running past its end raises _Truncated."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise _Truncated
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        return bytes(self.take(n)).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            item_type, n = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY:
                width = np.dtype(_NUMPY[item_type]).itemsize
                return np.frombuffer(self.take(n * width), dtype=_NUMPY[item_type]).tolist()
            if item_type == _ARRAY:
                raise ValueError("an array of arrays, which GGUF models do not use")
            if item_type != _STRING:
                raise ValueError(f"an array of unknown value type {item_type}")
            if n * 8 > len(self.buf) - self.pos:  # every string takes 8 bytes at least
                raise _Truncated
            return [self.string() for _ in range(n)]
        raise ValueError(f"unknown value type {vtype}")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of one file: its type, shape (torch order) and where its bytes are."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in its file
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.qtype).name
        except ValueError:
            return f"type {self.qtype}"

    @property
    def n_cols(self) -> int:
        return self.shape[-1]


class GGUFFile:
    """One GGUF file, memory-mapped. `metadata` holds python values; arrays are lists."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFileError(self.path, "no such file")
        if self.path.is_dir():
            raise ModelFileError(self.path, "is a directory; give the path of a .gguf file")
        self.size = self.path.stat().st_size
        if self.size < 24:
            raise ModelFileError(self.path, f"not a GGUF file ({self.size} bytes, too short)")
        with open(self.path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        buf = memoryview(self._mmap)
        if bytes(buf[:4]) != MAGIC:
            raise ModelFileError(self.path, "not a GGUF file (bad magic bytes)")
        try:
            self._parse(_Cursor(buf))
        except _Truncated:
            raise ModelFileError(self.path, "truncated file: the header ends early") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise ModelFileError(self.path, f"corrupt GGUF header: {e}") from None

    def _parse(self, cur: _Cursor) -> None:
        cur.take(4)
        self.version = cur.scalar("<I")
        if self.version in (2 << 24, 3 << 24):  # (2 or 3 read the other way round)
            raise ModelFileError(self.path, f"a big-endian GGUF file (version {self.version >> 24}"
                                            "); Strata reads little-endian ones: convert it "
                                            "again without --bigendian")
        if self.version not in (2, 3):
            raise ModelFileError(self.path, f"GGUF version {self.version} is not supported (2, 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        left = self.size - cur.pos
        # each key takes 12 bytes at least (length, type), each tensor 24 (length, dims, type,
        # offset): counts the file cannot hold are refused before anything is sized from them
        for what, n, least in (("metadata key", n_kv, 12), ("tensor", n_tensors, 24)):
            if n * least > left:
                raise ModelFileError(self.path, f"the header says {n:,} {what}s but the file has "
                                                f"only {left:,} bytes left for them (corrupt)")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            try:
                value = cur.value(cur.scalar("<I"))
            except ValueError as e:
                raise ModelFileError(self.path, f"metadata key {key[:80]}: {e}") from None
            except _Truncated:  # (a cut file, or a length or count past any file's)
                raise ModelFileError(self.path, "truncated file: the header ends inside metadata "
                                                f"key {key[:80]} (or its length is corrupt)"
                                     ) from None
            if key in self.metadata:
                raise ModelFileError(self.path, f"metadata key {key[:80]} appears twice")
            self.metadata[key] = value
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            if len(name.encode()) >= MAX_NAME:  # (ggml's buffer, with its NUL: llama.cpp's rule)
                raise ModelFileError(self.path, f"tensor {name[:80]}... has a name of "
                                                f"{len(name.encode()):,} bytes (GGUF allows "
                                                f"{MAX_NAME - 1})")
            n_dims = cur.scalar("<I")
            if n_dims > 8:
                raise ValueError(f"tensor {name[:80]} has {n_dims} dimensions")
            ne = [cur.scalar("<Q") for _ in range(n_dims)]
            raw.append((name, ne, cur.scalar("<I"), cur.scalar("<Q")))
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        # llama.cpp's rule: an integer power of two (and a u32)
        if isinstance(align, bool) or not isinstance(align, int) or not 0 < align < 2**32 \
                or align & (align - 1):
            raise ModelFileError(self.path, f"metadata key general.alignment is {align!r}: "
                                            "expected a power of two (default 32)")
        self.alignment = align
        data_start = (cur.pos + align - 1) // align * align
        self._data_start = data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, ne, qtype, offset in raw:
            info = self._tensor_info(name, ne, qtype, data_start + offset)
            if name in self.tensors:
                raise ModelFileError(self.path, f"tensor {name} appears twice")
            self.tensors[name] = info
        # llama.cpp reads tensors packed in table order; any order is read here, but no two
        # tensors may share bytes
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in self.tensors.values()
                       if t.nbytes)
        for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise ModelFileError(self.path, f"tensors {a} and {b} overlap in the file (a "
                                                "corrupt tensor table)")

    def _tensor_info(self, name: str, ne: list[int], qtype: int, offset: int) -> TensorInfo:
        if qtype not in GGML_QUANT_SIZES:
            raise ModelFileError(self.path, f"tensor {name} has unknown ggml type {qtype}")
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        shape = tuple(int(n) for n in reversed(ne)) or (1,)
        type_name = GGMLQuantizationType(qtype).name
        if shape[-1] % block:
            raise ModelFileError(
                self.path, f"tensor {name}: row length {shape[-1]} is not a multiple of the "
                f"{type_name} block size {block}")
        if (offset - self._data_start) % self.alignment:
            raise ModelFileError(self.path, f"tensor {name}: data offset "
                                 f"{offset - self._data_start} is not a multiple of "
                                 f"general.alignment {self.alignment}")
        nbytes = math.prod(shape) // block * type_size  # python ints: no overflow
        if offset + nbytes > self.size:
            raise ModelFileError(
                self.path, f"truncated file: tensor {name} needs bytes up to {offset + nbytes:,} "
                f"but the file has {self.size:,} (an interrupted download?)")
        return TensorInfo(name, qtype, shape, offset, nbytes)

    def data(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes as a writable (copy-on-write) uint8 view [..., row_nbytes]."""
        rows = info.shape[:-1]
        arr = np.frombuffer(self._mmap, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        return arr.reshape(*rows, -1) if rows else arr.reshape(1, -1)
