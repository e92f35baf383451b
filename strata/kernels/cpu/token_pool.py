"""One token through a few experts on the CPU: ggml's dot kernels, driven by a small C pool of
spinning threads (token_pool.c) instead of a ggml graph.

The decode step's CPU share makes one such call per layer. A ggml graph for it pays a barrier
after each of its five nodes and wakes its threads at every call; the pool runs the call in
three phases with two barriers, on threads that spin between calls and sleep only after
`spin_us` without one. The weights are read where they lie (the arena's records), the
dot and quantize functions are ggml's (its type traits): no kernel is written here.

The C file is compiled at first use with the system's C compiler (or $CC) into the cache
directory (strata.cache.cache_dir: ~/.cache/strata unless $STRATA_CACHE or $XDG_CACHE_HOME
say); `TokenPool.available()` says why not where it cannot be (no compiler, no ggml-python),
and callers then keep the ggml graph.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from strata.cache import cache_dir
from strata.kernels.tuning import SPIN_US
from strata.quant import row_nbytes

log = logging.getLogger("strata")

SOURCE = Path(__file__).with_name("token_pool.c")
MAX_EXPERTS = 16  # token_pool.c's MAX_EXPERTS


@functools.cache
def _library() -> ctypes.CDLL | str:
    """The compiled pool, or the reason it is not there (a string)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler (cc) found"
    src = SOURCE.read_bytes()
    tag = hashlib.sha256(src + cc.encode()).hexdigest()[:16]
    lib = cache_dir() / f"token_pool-{tag}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
        os.close(fd)
        cmd = [cc, "-O2", "-fPIC", "-shared", "-pthread", "-o", tmp, str(SOURCE), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            os.unlink(tmp)
            first = (done.stderr.strip().splitlines() or ["(no message)"])[0]
            return f"{' '.join(cmd[:1])} failed on {SOURCE.name}: {first}"
        os.replace(tmp, lib)  # (another process may have built it meanwhile: same bytes)
    so = ctypes.CDLL(str(lib))
    so.token_pool_new.restype = ctypes.c_void_p
    so.token_pool_new.argtypes = [ctypes.c_int, ctypes.c_long]
    so.token_pool_threads.restype = ctypes.c_int
    so.token_pool_threads.argtypes = [ctypes.c_void_p]
    so.token_pool_free.argtypes = [ctypes.c_void_p]
    so.token_pool_run.restype = ctypes.c_int
    p = ctypes.c_void_p
    so.token_pool_run.argtypes = [p, ctypes.c_int, ctypes.c_int, ctypes.c_int, p, p, p, p, p, p,
                                  p, p]
    return so


@functools.cache
def _traits(qtype: int) -> tuple[int, int, int, int] | None:
    """(vec_dot, from_float of its activation type, the activation type, rows a dot takes) for a
    GGML type, or None where ggml's CPU backend has no dot for it."""
    import ggml
    from gguf import GGML_QUANT_SIZES

    from strata.kernels.cpu.ggml_lib import supported

    if not supported(qtype):
        return None
    cpu = ggml.ggml_get_type_traits_cpu(qtype).contents
    vdt = int(cpu.vec_dot_type)
    act = ggml.ggml_get_type_traits_cpu(vdt).contents
    dot = ctypes.cast(cpu.vec_dot, ctypes.c_void_p).value
    quant = ctypes.cast(act.from_float, ctypes.c_void_p).value
    if not dot or not quant or vdt not in {int(q) for q in GGML_QUANT_SIZES}:
        return None
    return dot, quant, vdt, int(cpu.nrows)


class TokenPool:
    """`run_strided` as GgmlExperts has it, on the C pool. One caller at a time."""

    name = "ggml-token-pool"

    @staticmethod
    def available() -> str | None:
        """None when the pool can run here, else why not."""
        try:
            import ggml  # noqa: F401
        except ImportError:
            return "ggml-python is not installed"
        lib = _library()
        return lib if isinstance(lib, str) else None

    def __init__(self, threads: int, spin_us: int = SPIN_US):
        why = self.available()
        if why is not None:
            raise RuntimeError(f"the token pool cannot run: {why}")
        import ggml

        if hasattr(ggml, "ggml_cpu_init"):
            ggml.ggml_cpu_init()  # (ggml's tables; idempotent)
        self._lib = _library()
        self._pool = self._lib.token_pool_new(threads, spin_us)
        if not self._pool:
            raise RuntimeError(f"the token pool could not start {threads} threads")
        self.threads = self._lib.token_pool_threads(self._pool)
        self._w = np.zeros(3 * MAX_EXPERTS, dtype=np.uintp)
        self._fn = np.zeros(6, dtype=np.uintp)
        self._sizes = np.zeros(6, dtype=np.uintp)
        self._key: tuple | None = None

    @staticmethod
    def supports(qtypes: tuple[int, int, int]) -> bool:
        return all(_traits(q) is not None and _traits(q)[3] == 1 for q in qtypes)

    def _types(self, qtypes: tuple[int, int, int], d: int, f: int) -> None:
        key = (qtypes, d, f)
        if key == self._key:
            return
        for part, (q, cols) in enumerate(zip(qtypes, (d, d, f), strict=True)):
            dot, quant, vdt, _ = _traits(q)
            self._fn[part], self._fn[3 + part] = dot, quant
            self._sizes[part] = row_nbytes(q, cols)
            self._sizes[3 + part] = row_nbytes(vdt, cols)
        self._key = key

    def run_strided(self, x: np.ndarray, qtypes: tuple[int, int, int], d_expert: int,
                    bases: tuple[int, int, int], stride: int, n_slots: int, slots: np.ndarray,
                    weights: np.ndarray) -> np.ndarray:
        """Σ_n weights[n] * expert(slots[n])(x): [D] f32, for one row x [D] f32 and experts
        whose matrices lie at bases[part] + slot * stride (a layer's arena records)."""
        if self._pool is None:
            raise RuntimeError("TokenPool.run_strided after close()")
        n, d = len(slots), x.shape[0]
        if not 1 <= n <= MAX_EXPERTS:
            raise ValueError(f"the token pool takes 1 to {MAX_EXPERTS} experts, not {n}")
        if any(not 0 <= int(s) < n_slots for s in slots):
            raise ValueError(f"slots {list(slots)} outside the layer's {n_slots} records")
        self._types(qtypes, d, d_expert)
        x = np.ascontiguousarray(x, dtype=np.float32)
        wt = np.ascontiguousarray(weights, dtype=np.float32)
        out = np.empty(d, dtype=np.float32)
        offs = np.asarray(slots, dtype=np.uintp) * np.uintp(stride)
        for part in range(3):
            self._w[part * n:(part + 1) * n] = np.uintp(bases[part]) + offs
        fn, sz = self._fn.ctypes.data, self._sizes.ctypes.data
        third = 3 * self._fn.itemsize  # (the second half of each: the activations')
        rc = self._lib.token_pool_run(self._pool, n, d, d_expert, x.ctypes.data,
                                      self._w.ctypes.data, wt.ctypes.data, out.ctypes.data,
                                      fn, fn + third, sz, sz + third)
        if rc:
            raise MemoryError(f"the token pool could not allocate its scratch (code {rc})")
        return out

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:  # (None too when __init__ raised)
            self._lib.token_pool_free(self._pool)
            self._pool = None

    def __del__(self) -> None:
        self.close()
