"""Files the CLI writes: to a temporary name in the same folder, renamed into place only when
complete (a stopped or failed write leaves nothing behind), with one-line errors that name the
flag and the path."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from strata.errors import StrataError
from strata.units import fmt_bytes

FREE_MARGIN = 64 << 20  # left free on the disk after a write


def _folder(path: Path, flag: str) -> Path:
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise StrataError(f"{flag} {path}: the folder {parent} does not exist")
    if path.is_dir():
        raise StrataError(f"{flag} {path}: is a folder; give a file name")
    if path.exists() and not path.is_file():  # (a rename would replace /dev/null itself)
        raise StrataError(f"{flag} {path}: not a regular file (a device, pipe or socket); give "
                          "the name of a file to write")
    if not os.access(parent, os.W_OK | os.X_OK):  # (checked before a long run, not after)
        raise StrataError(f"{flag} {path}: cannot write in {parent} (permission denied)")
    return parent


def check_folder(path: str | Path, flag: str) -> None:
    """The folder `path` is to be written in exists (checked before a long run, not after)."""
    _folder(Path(path), flag)


def check_free(path: str | Path, nbytes: int, flag: str) -> None:
    """Refuse a write of `nbytes` that the disk holding `path` has no room for."""
    parent = _folder(Path(path), flag)
    free = shutil.disk_usage(parent).free
    if nbytes + FREE_MARGIN > free:
        raise StrataError(f"{flag} {path}: needs {fmt_bytes(nbytes)} but {parent} has only "
                          f"{fmt_bytes(free)} free")


@contextmanager
def atomic_path(path: str | Path, flag: str = "--out") -> Iterator[Path]:
    """A temporary path beside `path` to write to; renamed to `path` when the block ends
    without an error, removed otherwise (KeyboardInterrupt included)."""
    path = Path(path)
    parent = _folder(path, flag)
    try:
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp" + path.suffix,
                                        dir=parent)
    except OSError as e:
        raise StrataError(f"{flag} {path}: cannot write in {parent} "
                          f"({e.strerror or e})") from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        raise StrataError(f"{flag} {path}: the write failed ({e.strerror or e})") from None
    finally:
        tmp.unlink(missing_ok=True)


@contextmanager
def atomic_folder(path: str | Path, flag: str) -> Iterator[Path]:
    """A temporary folder beside `path`: the block writes files there, named as they should be
    beside `path`; they are moved into place when it ends without an error, and the folder is
    removed in every case."""
    path = Path(path)
    parent = _folder(path, flag)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    except OSError as e:
        raise StrataError(f"{flag} {path}: cannot write in {parent} "
                          f"({e.strerror or e})") from None
    try:
        yield tmp
        for f in sorted(tmp.iterdir()):
            os.replace(f, parent / f.name)
    except OSError as e:
        raise StrataError(f"{flag} {path}: the write failed ({e.strerror or e})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
