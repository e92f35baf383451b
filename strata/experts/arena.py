"""The arena: every expert of every layer in host RAM, page-locked where the GPU will read it.

    layer l: uint8 [E, stride_l]   one packed record per expert (see layout.py)

Memory comes from anonymous mmap with transparent huge pages advised, then is registered with
CUDA (cudaHostRegister) so copies to the GPU run at full PCIe speed. Filling reads the GGUF with
preadv straight into the records, so there is no second host copy of the weights: peak host RAM is
the arena plus a little.
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from strata.experts.layout import ExpertLayout
from strata.gguf import ModelFile
from strata.progress import Meter
from strata.units import proc_kib

log = logging.getLogger("strata.arena")


@dataclass
class ArenaReport:
    nbytes: int
    fill_s: float
    pinned: bool
    huge_pages_bytes: int
    note: str

    @property
    def gib_s(self) -> float:
        return self.nbytes / (1 << 30) / self.fill_s if self.fill_s else 0.0


def _anon_buffer(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    buf = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return buf, np.frombuffer(buf, dtype=np.uint8, count=nbytes)


def anon_huge_bytes() -> int:
    """AnonHugePages of this process (Linux), in bytes; 0 where unknown."""
    return proc_kib("/proc/self/smaps_rollup", "AnonHugePages") or 0


class Arena:
    def __init__(self, layouts: list[ExpertLayout], n_experts: int, pin: bool):
        self.layouts, self.n_experts = layouts, n_experts
        self._maps, self.layers = [], []
        for lay in layouts:
            m, arr = _anon_buffer(n_experts * lay.stride)
            self._maps.append(m)
            self.layers.append(torch.from_numpy(arr).view(n_experts, lay.stride))
        self.pinned = False
        self.pin_note = "not pinned (CPU device)"
        if pin:
            self.pinned, self.pin_note = self._pin()
            if not self.pinned:  # torch's pinned allocator: no huge pages, but page-locked
                self._maps = []
                self.layers = [torch.empty(n_experts, lay.stride, dtype=torch.uint8,
                                           pin_memory=True) for lay in layouts]
                self.pin_note += "; using cudaHostAlloc memory instead"

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.layers)

    def record(self, layer: int, expert: int) -> torch.Tensor:
        return self.layers[layer][expert]

    def _pin(self) -> tuple[bool, str]:
        cudart = torch.cuda.cudart()
        done = []
        for t in self.layers:
            err = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
            if int(err) != 0:
                for d in done:
                    cudart.cudaHostUnregister(d.data_ptr())
                _consume_cuda_error()
                msg = f"cudaHostRegister failed (error {int(err)})"
                log.warning("arena: %s", msg)
                return False, msg
            done.append(t)
        return True, "page-locked (cudaHostRegister)"

    def fill(self, mf: ModelFile, progress: bool = False) -> ArenaReport:
        """Read every expert's gate, up and down rows from the GGUF into its record."""
        t0 = time.perf_counter()
        bar = Meter("expert arena", self.nbytes, "bytes") if progress else None  # GiB, GiB/s
        filled = 0
        fds: dict[str, int] = {}
        try:
            for lay, layer in zip(self.layouts, self.layers, strict=True):
                if lay.empty:  # (a dense layer)
                    continue
                start = 0
                for part, w in zip(lay.part_nbytes, ("gate", "up", "down"), strict=True):
                    ref = mf.tensors[f"blk.{lay.layer}.ffn_{w}_exps.weight"]
                    path = str(ref.file.path)
                    fd = fds.setdefault(path, os.open(path, os.O_RDONLY))
                    dst = layer.numpy()
                    for e in range(self.n_experts):
                        view = memoryview(dst[e, start:start + part])
                        _pread_exact(fd, view, ref.info.offset + e * part, path)
                    _drop_cache(fd, ref.info.offset, ref.info.nbytes)
                    start += part
                filled += layer.numel()
                if bar is not None:
                    bar.update(filled)
        finally:
            for fd in fds.values():
                os.close(fd)
            if bar is not None:
                bar.close()
        huge = anon_huge_bytes()
        note = (f"large pages: {huge / (1 << 30):.2f} GiB on transparent huge pages" if huge
                else "no large pages granted (4 KiB pages; see "
                "/sys/kernel/mm/transparent_hugepage/enabled)")
        return ArenaReport(self.nbytes, time.perf_counter() - t0, self.pinned, huge, note)

    def close(self) -> None:
        """Unregister the memory from CUDA; must happen before the mappings go away, or a later
        arena at the same addresses could not be registered."""
        if self.pinned:
            cudart = torch.cuda.cudart()
            for t in self.layers:
                cudart.cudaHostUnregister(t.data_ptr())
            self.pinned = False

    def __del__(self) -> None:
        self.close()


def _consume_cuda_error() -> None:
    """A failed cudaHostRegister leaves a (non-sticky) error that the next launch would report
    as its own; run a trivial op so it is consumed here."""
    try:
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
    except RuntimeError:
        pass


def _pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise OSError(f"{path}: unexpected end of file at byte {offset + got}")
        got += n


def _drop_cache(fd: int, offset: int, length: int) -> None:
    """Tell the OS the file pages just read are not needed again (keeps RAM for the arena)."""
    if hasattr(os, "posix_fadvise"):
        try:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass
