"""A dense matrix in its GGUF blocks multiplied on ggml's CPU kernels: x @ W.T with W read as
stored (ggml quantizes each row of x to 8 bits for its dot products, as llama.cpp does on the
CPU), for the offload runtime's dense matrices on the CPU under --kernels fused.

Why: the CPU path otherwise keeps dense matrices in float32 and reads 4 bytes a weight every
token; the output head of a 151,936-token vocabulary alone is 1.2 GiB a token in float32 and
0.25 GiB as Q6_K.

    out = ggml_mul_mat(W [K, N] in blocks, x [K, T] f32) -> [N, T] f32     (ggml order)

One graph per token count T (a few kept), its tensors' data pointed at the call's own x and a new
output each call (nothing a caller holds is written again); the weight points at the matrix's
bytes where they are.

Importing this module raises ImportError when ggml-python is not installed.
"""

from __future__ import annotations

import ctypes
from collections import OrderedDict

import ggml
import torch

from strata.kernels.cpu.ggml_lib import Context, ThreadPool, point, supported

F32 = ggml.GGML_TYPE_F32
_GRAPHS = 8  # token counts kept per matrix (a decode token's and a few prompt chunks')
_pool: ThreadPool | None = None


def _threads() -> ThreadPool:
    global _pool
    n = torch.get_num_threads()
    if _pool is None or _pool.n_threads != n:
        _pool = ThreadPool(n)
    return _pool


class _Graph:
    def __init__(self, raw: torch.Tensor, qtype: int, k: int, t: int) -> None:
        n = raw.shape[0]
        self.ctx = Context(3, 4)
        self.w = self.ctx.tensor(qtype, (k, n, 1), raw)
        self.x = self.ctx.tensor(F32, (k, t, 1))
        self.out = ggml.ggml_mul_mat(self.ctx.ptr, self.w, self.x)  # [N, T]
        self.graph = ggml.ggml_new_graph_custom(self.ctx.ptr, 4, False)
        ggml.ggml_build_forward_expand(self.graph, self.out)
        pool = _threads()
        self.plan = ggml.ggml_graph_plan(self.graph, pool.n_threads, pool.ptr)
        self.work = torch.empty(max(self.plan.work_size, 1), dtype=torch.uint8)
        self.plan.work_data = ctypes.cast(self.work.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        self.plan_ref = ctypes.byref(self.plan)
        self.raw = raw  # (kept alive with the graph that reads it)


class GgmlMatmul:
    """x @ W.T for W [N, K] in GGUF blocks `raw` (uint8 [N, row bytes], on the CPU)."""

    def __init__(self, raw: torch.Tensor, qtype: int, n_cols: int) -> None:
        if not supported(qtype):
            raise ValueError(f"ggml has no CPU dot kernel for type {qtype}")
        self.raw, self.qtype, self.k = raw.contiguous(), qtype, n_cols
        self._graphs: OrderedDict[int, _Graph] = OrderedDict()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] float32 -> [T, N] float32 (a new tensor)."""
        t = x.shape[0]
        g = self._graphs.get(t)
        if g is None:
            g = self._graphs[t] = _Graph(self.raw, self.qtype, self.k, t)
            if len(self._graphs) > _GRAPHS:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(t)
        x = x.float().contiguous()
        out = torch.empty(t, self.raw.shape[0], dtype=torch.float32)
        point(g.x.contents, x)
        point(g.out.contents, out)
        status = ggml.ggml_graph_compute(g.graph, g.plan_ref)
        if status != ggml.GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")
        return out
