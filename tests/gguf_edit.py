"""Rewrite a GGUF file with changes, through gguf-py (for the bad-input tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def rewrite(src: Path, dst: Path, meta: dict[str, Any] | None = None,
            tensor_types: dict[str, int] | None = None,
            tensor_shapes: dict[str, list[int]] | None = None) -> Path:
    """Copy src to dst, setting metadata strings/ints (or (value, GGUFValueType) pairs) in `meta`
    (None deletes the key), and
    relabelling tensors' types or shapes (their bytes are copied as they are)."""
    meta, tensor_types, tensor_shapes = meta or {}, tensor_types or {}, tensor_shapes or {}
    r = GGUFReader(src)
    arch = meta.get("general.architecture", r.fields["general.architecture"].contents())
    w = GGUFWriter(dst, arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in meta:
            continue
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    for key, value in meta.items():
        if value is None or key == "general.architecture":
            continue
        if isinstance(value, tuple):  # (value, GGUFValueType): a type of one's choosing
            value, vtype = value
        else:
            vtype = GGUFValueType.STRING if isinstance(value, str) else GGUFValueType.UINT32
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        data = np.asarray(t.data).view(np.uint8).reshape(-1)
        shape = tensor_shapes.get(t.name, [int(n) for n in reversed(t.shape.tolist())])
        qtype = tensor_types.get(t.name, t.tensor_type)
        w.add_tensor_info(t.name, shape, np.dtype(np.float32), data.nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in r.tensors:
        w.write_tensor_data(np.asarray(t.data).view(np.uint8).reshape(-1))
    w.close()
    return dst
