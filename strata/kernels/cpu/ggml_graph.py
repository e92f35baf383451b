"""One reusable ggml graph: the swiglu experts of one call shape, computed in one ggml call.

Legend: N rows = (job, token) pairs of a call, ordered group by group, job by job; S slots.
A call's jobs fall into groups that share (qtypes, F). For a group, each of gate / up / down is
seen by ggml as one 3-D weight tensor of S expert slots, [D, F, S] (ggml order), whose data is
the lowest job address and whose slot stride is the common spacing of the jobs' matrices:

    arena layer:  | rec 0 | rec 1 | rec 2 | ... |     rec = | gate | up | down |
    gate tensor:    data = &rec[lo].gate, nb[2] = record stride, slot s = rec[lo + s].gate

so mul_mat_id reads each job's bytes where they are, with no copy. Per group:

    x   [D, 1, N_g]  f32  gathered rows of h         ids_{g,u,d} [1, N_g] i32  slot per row
    g = mul_mat_id(gate, x, ids_g)   u = mul_mat_id(up, x, ids_u)         [F, 1, N_g]
    a = swiglu_split(g, u)           # silu(g) * u                          [F, 1, N_g]
    y = mul_mat_id(down, a, ids_d)                                          [D, 1, N_g]
    out_g = y * w                    # w [1, 1, N_g]: routing weight of each row   [D, 1, N_g]

A group of experts with biases (gpt-oss, GroupShape.oai) adds each row's expert biases b_g, b_u
[F, 1, N_g] and b_d [D, 1, N_g] to g, u and y, and takes ggml's swiglu_oai (the clamped SwiGLU
of strata.arch.gpt_oss) for a.

Every tensor's memory is a torch buffer the graph owns (x, ids, w, out are views of one buffer
each for all groups); only the weight tensors are re-pointed per call, by writing their headers'
data and nb fields through numpy views (a ctypes field write costs several times more). The
graph, its plan and its work buffer live as long as the graph is cached.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import ggml
import numpy as np
import torch

from strata.arch.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT
from strata.kernels.cpu.ggml_lib import Context, ThreadPool, point

F32, I32 = ggml.GGML_TYPE_F32, ggml.GGML_TYPE_I32
_TENSORS_PER_GROUP = 19  # 3 weights, x, 3 ids, w, g, u, a, y, out (+ 3 biases, 3 sums)
_U64 = 8
_DATA = ggml.ggml_tensor.data.offset // _U64  # header fields, in uint64 words
_NB2 = ggml.ggml_tensor.nb.offset // _U64 + 2
_NB3 = _NB2 + 1


class GroupShape(NamedTuple):
    """What fixes a group's graph nodes (a NamedTuple: built and hashed on every call)."""

    qtypes: tuple[int, int, int]  # gate, up, down
    d_model: int  # D
    d_expert: int  # F
    slots: tuple[int, int, int]  # S of gate, up, down (a power of two >= the highest slot + 1)
    rows: int  # N_g
    oai: bool = False  # biases and the clamped SwiGLU (gpt-oss)


class ExpertGraph:
    """The graph for a tuple of group shapes: fill x, ids and w, point the weights, compute,
    read out."""

    def __init__(self, shapes: tuple[GroupShape, ...], pool: ThreadPool) -> None:
        self.shapes = shapes
        d_model = shapes[0].d_model
        n = sum(s.rows for s in shapes)
        self.x = torch.empty(n, d_model)  # [N, D] gathered rows of h
        self.ids = torch.zeros(3, n, dtype=torch.int32)  # [3, N] gate/up/down slot of each row
        self.ids_np = self.ids.numpy()  # the same memory, for cheap scalar fills
        self.w = torch.empty(n)  # [N] routing weight of each row
        self.out = torch.empty(n, d_model)  # [N, D] weighted expert outputs
        # per group with biases: each row's expert biases, gate / up [N_g, F], down [N_g, D]
        self.biases: list[tuple[torch.Tensor, ...] | None] = []
        self.x_np, self.w_np, self.out_np = self.x.numpy(), self.w.numpy(), self.out.numpy()
        self._buffers: list[torch.Tensor] = []  # intermediates g, u, a, y
        self._ctx = Context(_TENSORS_PER_GROUP * len(shapes), 16 * len(shapes))
        self._headers: list[np.ndarray] = []  # per group: uint64 [3, words] gate/up/down headers
        self._graph = ggml.ggml_new_graph_custom(self._ctx.ptr, 16 * len(shapes), False)
        r = 0
        for s in shapes:
            y = self._add_group(s, r)
            ggml.ggml_build_forward_expand(self._graph, y)
            r += s.rows
        self._check_allocated()
        self._plan = ggml.ggml_graph_plan(self._graph, pool.n_threads, pool.ptr)
        self._work = torch.empty(max(self._plan.work_size, 1), dtype=torch.uint8)
        self._plan.work_data = ctypes.cast(self._work.data_ptr(), ctypes.POINTER(ctypes.c_uint8))
        self._plan_ref = ctypes.byref(self._plan)

    @property
    def nbytes(self) -> int:
        bufs = [self.x, self.ids, self.w, self.out, self._work, *self._buffers,
                *(b for group in self.biases if group is not None for b in group)]
        return sum(b.numel() * b.element_size() for b in bufs)

    def _add_group(self, s: GroupShape, r: int):
        ctx, d, f, rows = self._ctx, s.d_model, s.d_expert, s.rows
        qg, qu, qd = s.qtypes
        w = (ctx.tensor(qg, (d, f, s.slots[0])), ctx.tensor(qu, (d, f, s.slots[1])),
             ctx.tensor(qd, (f, d, s.slots[2])))  # data: set per call
        words = ctypes.sizeof(ggml.ggml_tensor) // _U64
        self._headers.append([np.ctypeslib.as_array(ctypes.cast(t, ctypes.POINTER(
            ctypes.c_uint64)), (words,)) for t in w])
        x = ctx.tensor(F32, (d, 1, rows), self.x[r:r + rows])
        ids = [ggml.ggml_new_tensor_2d(ctx.ptr, I32, 1, rows) for _ in range(3)]
        for p, t in enumerate(ids):
            point(t.contents, self.ids[p, r:r + rows])
        g = ggml.ggml_mul_mat_id(ctx.ptr, w[0], x, ids[0])  # [F, 1, N_g]
        u = ggml.ggml_mul_mat_id(ctx.ptr, w[1], x, ids[1])
        nodes = [(g, f), (u, f)]
        self.biases.append(None)
        if s.oai:  # + each row's biases; the clamped SwiGLU
            self.biases[-1] = (torch.zeros(rows, f), torch.zeros(rows, f), torch.zeros(rows, d))
            bg, bu, bd = (ctx.tensor(F32, (b.shape[1], 1, rows), b) for b in self.biases[-1])
            g, u = ggml.ggml_add(ctx.ptr, g, bg), ggml.ggml_add(ctx.ptr, u, bu)
            nodes += [(g, f), (u, f)]
            a = ggml.ggml_swiglu_oai(ctx.ptr, g, u, SWIGLU_ALPHA, SWIGLU_LIMIT)
        else:
            a = ggml.ggml_swiglu_split(ctx.ptr, g, u)  # silu(g) * u
        y = ggml.ggml_mul_mat_id(ctx.ptr, w[2], a, ids[2])  # [D, 1, N_g]
        nodes += [(a, f), (y, d)]
        if s.oai:
            y = ggml.ggml_add(ctx.ptr, y, bd)
            nodes.append((y, d))
        wt = ctx.tensor(F32, (1, 1, rows), self.w[r:r + rows])
        out = ggml.ggml_mul(ctx.ptr, y, wt)  # [D, 1, N_g]
        for t, cols in nodes:
            buf = torch.empty(rows, cols)
            self._buffers.append(buf)
            point(t.contents, buf)
        point(out.contents, self.out[r:r + rows])
        return out

    def _check_allocated(self) -> None:
        for i in range(ggml.ggml_graph_n_nodes(self._graph)):
            node = ggml.ggml_graph_node(self._graph, i).contents
            assert node.data, f"graph node {i} ({node.op}) has no memory"

    def point_weights(self, group: int, part: int, base: int, stride: int) -> None:
        """Slot s of `part` (0 gate, 1 up, 2 down) of `group` is at base + s * stride."""
        header = self._headers[group][part]
        header[_DATA] = base
        header[_NB2] = stride
        header[_NB3] = stride * self.shapes[group].slots[part]

    def compute(self) -> None:
        """Run the graph on the pool's threads (the GIL is released meanwhile)."""
        status = ggml.ggml_graph_compute(self._graph, self._plan_ref)
        if status != ggml.GGML_STATUS_SUCCESS:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    def close(self) -> None:
        self._ctx.close()

