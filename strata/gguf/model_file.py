"""A model as one GGUF file or a split set (`name-00001-of-00003.gguf`), given any one shard.

Split sets carry `split.no` (0-based), `split.count` and `split.tensors.count` in every shard;
the first shard holds the model's metadata. Every shard must be present, agree on the count, and
together hold exactly `split.tensors.count` tensors; a key that two shards both carry must
have one value. (Shards of two sets that agree on all of that cannot be told apart.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from strata.errors import ModelFileError
from strata.gguf.reader import GGUFFile, TensorInfo

_SPLIT_NAME = re.compile(r"^(?P<prefix>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the model and the file that holds it."""

    info: TensorInfo
    file: GGUFFile

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def qtype(self) -> int:
        return self.info.qtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.info.shape

    def data(self) -> np.ndarray:
        """Raw bytes, uint8 [..., row_nbytes], a view of the memory map."""
        return self.file.data(self.info)


class ModelFile:
    """All shards of a model: `metadata` from the first shard, `tensors` from all."""

    def __init__(self, files: list[GGUFFile]):
        self.files = files
        self.path = files[0].path
        self.metadata: dict[str, Any] = files[0].metadata
        self.tensors: dict[str, TensorRef] = {}
        for f in files:
            for name, info in f.tensors.items():
                if name in self.tensors:
                    other = self.tensors[name].file.path.name
                    raise ModelFileError(f.path, f"tensor {name} is also in {other}")
                self.tensors[name] = TensorRef(info, f)

    @property
    def nbytes(self) -> int:
        return sum(t.info.nbytes for t in self.tensors.values())

    def meta(self, key: str, default: Any = ModelFileError) -> Any:
        """A metadata value; without a default, a missing key is an error naming file and key."""
        if key in self.metadata:
            return self.metadata[key]
        if default is ModelFileError:
            raise ModelFileError(self.path, f"metadata key {key} is missing")
        return default


def shard_paths(path: Path) -> list[Path]:
    """The paths of every shard of the set that `path` belongs to (just `path` if not split)."""
    m = _SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if count < 1 or int(m["no"]) > count:
        raise ModelFileError(path, f"shard number {m['no']} of {count} makes no sense")
    prefix = m["prefix"]
    return [path.with_name(f"{prefix}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def open_model(path: str | Path) -> ModelFile:
    """Open a model from a file or any shard of a split set; checks that the set is complete."""
    path = Path(path)
    paths = shard_paths(path)
    missing = [p.name for p in paths if not p.exists()]
    if missing and path.exists() and len(paths) > 1:
        raise ModelFileError(path, f"split set is incomplete: missing {', '.join(missing)} "
                                   f"(put all {len(paths)} shards in {path.parent})")
    files = [GGUFFile(p) for p in paths]
    first = files[0]
    count = first.metadata.get("split.count")
    if count is None:
        if len(files) > 1:
            raise ModelFileError(first.path,
                                 "named like a split shard but has no split.count metadata")
        return ModelFile(files)
    for key in ("split.count", "split.tensors.count"):
        v = first.metadata.get(key, 0)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ModelFileError(first.path, f"metadata key {key} is {v!r}: expected a count")
    if len(files) == 1 and count > 1:  # a shard renamed, or given without the name of its set
        no = first.metadata.get("split.no")
        which = f"shard {no + 1} of {count}" if type(no) is int else f"a shard of {count}"
        raise ModelFileError(first.path, f"is {which} of a split set (split.no, split.count) but "
                                         "is not named like one: keep the set's names "
                                         f"(NAME-00001-of-{count:05d}.gguf, ...) and give any "
                                         "one of them")
    if int(count) != len(files):
        raise ModelFileError(first.path, f"split.count says {count} shards but the file names say "
                                         f"{len(files)}")
    for i, f in enumerate(files):
        no, cnt = f.metadata.get("split.no"), f.metadata.get("split.count")
        if no != i or cnt != count:
            raise ModelFileError(f.path, f"is shard {no} of {cnt} by its metadata, expected shard "
                                         f"{i} of {count}: the shards come from different sets")
    for f in files[1:]:  # what the shards share must agree (split.no aside)
        for key, value in f.metadata.items():
            if key != "split.no" and key in first.metadata and first.metadata[key] != value:
                raise ModelFileError(f.path, f"metadata key {key} differs from {first.path.name}'s:"
                                             " the shards come from different sets")
    model = ModelFile(files)
    expected = int(first.metadata.get("split.tensors.count", len(model.tensors)))
    if expected != len(model.tensors):
        raise ModelFileError(first.path, f"split set holds {len(model.tensors)} tensors but "
                                         f"split.tensors.count says {expected}")
    return model
