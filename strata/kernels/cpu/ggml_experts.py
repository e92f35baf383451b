"""The ggml CPU backend: a layer's missed experts in one ggml_graph_compute call.

    run(h, jobs, out):
      1. plan     group jobs by (qtypes, F); per group and part, the slot of each job's matrix
      2. graph    the cached ExpertGraph for the tuple of group shapes (built on first use)
      3. fill     x <- h[tokens of every job], ids <- slots, weight tensors -> the jobs' bytes
      4. compute  ggml (SIMD dot kernels for every GGUF type) on a persistent thread pool
      5. combine  out.index_add_(tokens, weights * y)  (the product inside the graph)

ggml multiplies quantized weights by activations it first rounds to 8 bits (q8_0 / q8_K
blocks; f16 or bf16 for f16 / bf16 weights): results differ from the float32 reference by ~1-3%
(relative norm), see docs/cpu_kernels.md. Jobs with a type ggml lacks go to the torch backend.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from strata.kernels.cpu.ggml_graph import ExpertGraph, GroupShape
from strata.kernels.cpu.ggml_lib import ThreadPool, supported, uses_openmp
from strata.kernels.cpu.jobs import ExpertJob, Raw, check_call
from strata.kernels.cpu.torch_experts import TorchExperts
from strata.kernels.tuning import GGML_CACHE_BYTES, GGML_CACHE_GRAPHS, GGML_MAX_SLOTS

log = logging.getLogger("strata.kernels")


@dataclass
class _Group:
    shape: GroupShape
    jobs: list[ExpertJob]
    bases: tuple[int, int, int]  # address of slot 0 of gate, up, down
    strides: tuple[int, int, int]  # bytes between slots
    slots: np.ndarray | None  # int32 [3, N_g]: gate, up, down slot of each row (None: all 0)


class GgmlExperts:
    """CpuExperts on ggml. Not thread-safe: one instance (and thread pool) per calling thread."""

    name = "ggml"

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or torch.get_num_threads()
        if uses_openmp() and self.threads != torch.get_num_threads():
            log.warning("ggml threads (%d) differ from torch's (%d) on a shared OpenMP runtime: "
                        "calls stalled 20-40 ms in that setting; keep them equal",
                        self.threads, torch.get_num_threads())
        self._pool: ThreadPool | None = ThreadPool(self.threads)
        self._graphs: OrderedDict[tuple[GroupShape, ...], ExpertGraph] = OrderedDict()
        self._fallback: TorchExperts | None = None
        self._warned: set[tuple[int, int, int]] = set()

    def run(self, h: torch.Tensor, jobs: list[ExpertJob], out: torch.Tensor) -> None:
        if self._pool is None:
            raise RuntimeError("GgmlExperts.run after close()")
        check_call(h, jobs, out)
        groups, rest = self._plan(jobs, h.shape[1])
        if rest:
            self._torch().run(h, rest, out)
        if not groups:
            return
        graph = self._graph(tuple(g.shape for g in groups))
        if len(groups) == 1 and len(groups[0].jobs) == 1:
            tokens = groups[0].jobs[0].tokens  # [N]
            graph.w.copy_(groups[0].jobs[0].weights)
        else:
            tokens = torch.cat([j.tokens for g in groups for j in g.jobs])  # [N]
            torch.cat([j.weights for g in groups for j in g.jobs], out=graph.w)  # [N]
        torch.index_select(h, 0, tokens, out=graph.x)  # [N, D]
        ids, r = graph.ids_np, 0  # [3, N]
        for gi, g in enumerate(groups):
            for part in range(3):
                graph.point_weights(gi, part, g.bases[part], g.strides[part])
            if g.slots is not None:  # else every id is 0, as the buffer was made
                ids[:, r:r + g.shape.rows] = g.slots
            if g.shape.oai:  # each row's expert biases
                counts = [j.tokens.shape[0] for j in g.jobs]
                for part, buf in enumerate(graph.biases[gi]):
                    rows = torch.stack([j.bias[part] for j in g.jobs])  # [k, F or D]
                    buf.copy_(rows if len(counts) == sum(counts)
                              else rows.repeat_interleave(torch.tensor(counts), 0))
            r += g.shape.rows
        graph.compute()
        out.index_add_(0, tokens, graph.out)

    def run_strided(self, x: np.ndarray, qtypes: tuple[int, int, int], d_expert: int,
                    bases: tuple[int, int, int], stride: int, n_slots: int, slots: np.ndarray,
                    weights: np.ndarray) -> np.ndarray:
        """Σ_n weights[n] * expert(slots[n])(x): [D] f32, for one row x [D] f32 and experts
        whose matrices lie at bases[part] + slot * stride (a layer's arena records), with no
        per-call tensors: three header writes, the inputs copied, one ggml call. The lean path
        of a decode step's CPU share, where the general run's planning cost more than the
        expert (types ggml lacks: the caller's to route elsewhere, see `supported`)."""
        n = len(slots)
        shape = GroupShape(qtypes, x.shape[0], d_expert, (n_slots,) * 3, n)
        graph = self._graph((shape,))
        for part in range(3):
            graph.point_weights(0, part, bases[part], stride)
        graph.x_np[:] = x
        graph.w_np[:] = weights
        graph.ids_np[:] = slots
        graph.compute()
        return graph.out_np[0].copy() if n == 1 else graph.out_np.sum(0)

    def close(self) -> None:
        for graph in self._graphs.values():
            graph.close()
        self._graphs.clear()
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    # ---- planning ------------------------------------------------------------------------

    def _plan(self, jobs: list[ExpertJob], d_model: int) -> tuple[list[_Group], list[ExpertJob]]:
        by_sig: dict[tuple, list[ExpertJob]] = defaultdict(list)
        rest = []
        for job in jobs:
            if job.tokens.shape[0]:
                by_sig[(job.qtypes, job.gate.shape[0], job.act)].append(job)
        groups = []
        for (qtypes, f, act), group in by_sig.items():
            if not all(supported(q) for q in qtypes):
                rest += group
                if qtypes not in self._warned:
                    self._warned.add(qtypes)
                    log.warning("ggml lacks one of the types %s: those experts run on torch",
                                qtypes)
                continue
            oai = act == "swiglu_oai"
            g = _group(qtypes, d_model, f, group, oai)
            if g is not None:
                groups.append(g)
            else:  # matrices not evenly spaced (separate buffers): one group per job
                groups += [_group(qtypes, d_model, f, [job], oai) for job in group]
        return groups, rest

    def _graph(self, key: tuple[GroupShape, ...]) -> ExpertGraph:
        graph = self._graphs.get(key)
        if graph is not None:
            self._graphs.move_to_end(key)
            return graph
        graph = ExpertGraph(key, self._pool)
        self._graphs[key] = graph
        while len(self._graphs) > 1 and (
                len(self._graphs) > GGML_CACHE_GRAPHS
                or sum(g.nbytes for g in self._graphs.values()) > GGML_CACHE_BYTES):
            self._graphs.popitem(last=False)[1].close()
        return graph

    def _torch(self) -> TorchExperts:
        if self._fallback is None:
            self._fallback = TorchExperts()
        return self._fallback


def _address(raw: Raw) -> int:
    if isinstance(raw, torch.Tensor):
        return raw.data_ptr()
    return raw.__array_interface__["data"][0]


def _group(qtypes: tuple[int, int, int], d_model: int, f: int, jobs: list[ExpertJob],
           oai: bool = False) -> _Group | None:
    """Slots of each job's gate/up/down in one strided tensor per part; None if too spread."""
    rows = sum(j.tokens.shape[0] for j in jobs)
    if len(jobs) == 1:  # one expert: slot 0 of a one-slot tensor
        j = jobs[0]
        shape = GroupShape(qtypes, d_model, f, (1, 1, 1), rows, oai)
        bases = (_address(j.gate), _address(j.up), _address(j.down))
        return _Group(shape, jobs, bases, (j.gate.nbytes, j.up.nbytes, j.down.nbytes), None)
    bases, strides, n_slots, part_slots = [], [], [], []
    for part in ("gate", "up", "down"):
        raws = [getattr(j, part) for j in jobs]
        addrs = [_address(r) for r in raws]
        base = min(addrs)
        diffs = [a - base for a in addrs]
        stride = math.gcd(*diffs) or raws[0].nbytes  # one distinct matrix: any stride will do
        slots = [d // stride for d in diffs]
        top = max(slots) + 1
        if top > GGML_MAX_SLOTS:
            return None
        bases.append(base)
        strides.append(stride)
        n_slots.append(1 << (top - 1).bit_length())  # a power of two: fewer distinct graphs
        part_slots.append(slots)
    shape = GroupShape(qtypes, d_model, f, tuple(n_slots), rows, oai)
    slots = np.array(part_slots, dtype=np.int32)  # [3, k]
    if rows != len(jobs):  # some job has several tokens: one column per row
        slots = np.repeat(slots, [j.tokens.shape[0] for j in jobs], axis=1)  # [3, N_g]
    return _Group(shape, jobs, tuple(bases), tuple(strides), slots)
