"""ggml-python plumbing: the library, which GGML types its CPU backend multiplies, a persistent
thread pool, and ggml tensors whose data points at memory that Python owns.

Importing this module raises ImportError when ggml-python is not installed.
"""

from __future__ import annotations

import ctypes
import functools
import weakref
from pathlib import Path

import ggml
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QType

Tensor = ggml.ggml_tensor  # the C struct (ptr.contents): fields ne, nb, data, ...


@functools.cache
def supported(qtype: int) -> bool:
    """ggml's CPU backend has a dot kernel for `qtype`, with the block layout gguf-py knows."""
    try:
        block, size = GGML_QUANT_SIZES[QType(qtype)]
    except (ValueError, KeyError):
        return False
    if not 0 <= qtype < ggml.GGML_TYPE_COUNT:
        return False
    traits = ggml.ggml_get_type_traits(qtype).contents
    cpu = ggml.ggml_get_type_traits_cpu(qtype).contents
    has_dot = ctypes.cast(cpu.vec_dot, ctypes.c_void_p).value is not None
    return has_dot and (traits.blck_size, traits.type_size) == (block, size)


@functools.cache
def uses_openmp() -> bool:
    """ggml was built with OpenMP (the default where the compiler has it). Its graphs then run on
    the process's one OpenMP runtime, which torch shares (torch's wheel ships libgomp.so.1 too)."""
    lib = Path(ggml.__file__).parent / "lib" / "libggml-cpu.so"
    try:
        return hasattr(ctypes.CDLL(str(lib)), "omp_get_max_threads")
    except OSError:
        return False


def cpu_features() -> list[str]:
    """The SIMD features ggml's CPU kernels were built with (ggml_cpu_has_*), e.g. ["avx2", "fma"]:
    a build without the host's widest ones computes experts at a fraction of the memory rate."""
    names = ("avx", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8",
             "fma", "f16c", "neon", "sve")
    return [n for n in names if getattr(ggml, f"ggml_cpu_has_{n}", lambda: 0)()]


class ThreadPool:
    """ggml's compute threads, made once and reused by every graph (making them per call cost
    ~20 ms here). Built with OpenMP, ggml runs its graphs on OpenMP's own persistent threads and
    this pool holds only their state; built without, the pool owns the worker threads."""

    def __init__(self, n_threads: int) -> None:
        params = ggml.ggml_threadpool_params_default(n_threads)
        self.ptr = ggml.ggml_threadpool_new(ctypes.byref(params))
        if not self.ptr:
            raise RuntimeError(f"ggml_threadpool_new({n_threads}) failed")
        self.n_threads = n_threads
        self._free = weakref.finalize(self, ggml.ggml_threadpool_free, self.ptr)

    def close(self) -> None:
        self._free()


class Context:
    """A ggml context holding only tensor headers and graphs (no_alloc): every tensor's data is
    set by the caller to memory it keeps alive (torch buffers, arena bytes)."""

    def __init__(self, n_tensors: int, graph_size: int) -> None:
        mem = (n_tensors * ggml.ggml_tensor_overhead()
               + ggml.ggml_graph_overhead_custom(graph_size, False) + 4096)
        params = ggml.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True)
        self.ptr = ggml.ggml_init(params)
        if not self.ptr:
            raise MemoryError(f"ggml_init({mem} bytes) failed")
        self._free = weakref.finalize(self, ggml.ggml_free, self.ptr)

    def tensor(self, qtype: int, ne: tuple[int, int, int], data: torch.Tensor | None = None):
        """A 3-D ggml tensor [ne0, ne1, ne2] (ggml order: ne0 is the contiguous axis)."""
        t = ggml.ggml_new_tensor_3d(self.ptr, qtype, *ne)
        if data is not None:
            point(t.contents, data)
        return t

    def close(self) -> None:
        self._free()


def point(t: Tensor, data: torch.Tensor) -> None:
    """Make tensor `t` use `data`'s memory, which must be contiguous and exactly as large."""
    nbytes = ggml.ggml_nbytes(ctypes.pointer(t))
    assert data.is_contiguous() and data.numel() * data.element_size() == nbytes, \
        (tuple(data.shape), data.dtype, nbytes)
    t.data = data.data_ptr()
