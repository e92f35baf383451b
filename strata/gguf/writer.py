"""Streamed GGUF writing on top of gguf-py's GGUFWriter.

Tensor data goes out in chunks of rows, so a file of many GB is written with little RAM.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from gguf import GGUFWriter
from gguf.gguf_writer import WriterState


def add_tensor(writer: GGUFWriter, name: str, shape: Sequence[int], qtype: int,
               nbytes: int) -> None:
    """Declare a tensor of `shape` (torch order) and ggml type `qtype`, before the header."""
    writer.add_tensor_info(name, list(shape), np.dtype(np.float32), nbytes, raw_dtype=qtype)


def write_tensor_chunks(writer: GGUFWriter, nbytes: int, chunks: Iterable[np.ndarray]) -> None:
    """Write the next declared tensor's data from an iterable of byte chunks (in declaration order).

    GGUFWriter.write_tensor_data wants the whole tensor in memory; this does the same bookkeeping
    (padding, which shard) for data that arrives in pieces.
    """
    if writer.state not in (WriterState.TI_DATA, WriterState.WEIGHTS):
        raise ValueError(f"tensor data before the tensor table (writer state {writer.state})")
    assert writer.fout is not None
    file_id = next(i for i, t in enumerate(writer.tensors) if t)
    fout = writer.fout[file_id]
    name = next(iter(writer.tensors[file_id]))
    info = writer.tensors[file_id].pop(name)
    if info.nbytes != nbytes:
        raise ValueError(f"tensor {name}: declared {info.nbytes} bytes, writing {nbytes}")
    writer.write_padding(fout, fout.tell())
    written = 0
    for chunk in chunks:
        chunk = np.ascontiguousarray(chunk)
        chunk.tofile(fout)
        written += chunk.nbytes
    if written != nbytes:
        raise ValueError(f"tensor {name}: wrote {written} bytes of {nbytes}")
    writer.write_padding(fout, nbytes)
    writer.state = WriterState.WEIGHTS
