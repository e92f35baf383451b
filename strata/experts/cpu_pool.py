"""The CPU miss path: computes a layer's missed experts from the arena on the host.

It hands the kernel library in strata.kernels.cpu (ggml's CPU backend where installed, torch
otherwise) one batch per layer and step: every missed expert with its tokens and weights.
"""

from __future__ import annotations

import logging

import torch

from strata.config import cpu_threads
from strata.experts.arena import Arena
from strata.experts.compute import Group, run_records
from strata.experts.layout import ExpertLayout

log = logging.getLogger("strata.cpu_pool")


def default_threads(drives_gpu: bool = True) -> int:
    """The CPU pool's threads when --threads is not given. Beside a GPU: the cores this process
    may use (its affinity mask) less those other processes keep busy (strata.config.cpu_threads),
    less one for the thread that drives the GPU, at least 1. On the CPU device the calling
    thread is one of the pool's, and torch's count (OMP_NUM_THREADS, which `strata` sets from
    the same measure) is the process's one choice: ggml shares torch's OpenMP threads."""
    if not drives_gpu:
        return torch.get_num_threads()
    return max(1, cpu_threads() - 1)


class CpuPool:
    def __init__(self, kind: str = "auto", threads: int | None = None,
                 workspace_bytes: int = 256 << 20):
        self.workspace_bytes, self.threads = workspace_bytes, threads
        self.kernels = None
        self.kind = "torch"
        if threads:  # first: ggml shares torch's OpenMP runtime and wants the same thread count
            torch.set_num_threads(threads)
        try:
            from strata.kernels.cpu import make_cpu_experts
        except ImportError:
            if kind == "ggml":
                raise
        else:
            self.kernels = make_cpu_experts(kind, threads)
            self.kind = getattr(self.kernels, "name", kind)

    def run(self, layer: int, arena: Arena, groups: list[Group], h: torch.Tensor,
            out: torch.Tensor) -> None:
        """out[t] += Σ w * expert(h[t]) over the groups' experts, read from the arena."""
        records = [arena.record(layer, g.expert) for g in groups]
        self.run_records(arena.layouts[layer], records, groups, h, out)

    def run_records(self, lay: ExpertLayout, records: list[torch.Tensor], groups: list[Group],
                    h: torch.Tensor, out: torch.Tensor) -> None:
        """The same for experts in any host records (arena rows, or cache slots on the CPU)."""
        if self.kernels is None:
            run_records(lay, torch.stack(records), groups, h, out, self.workspace_bytes)
            return
        from strata.kernels.cpu import ExpertJob

        jobs, b = [], lay.bias  # (b: the experts' biases and activation, gpt-oss)
        for g, rec in zip(groups, records, strict=True):
            gate, up, down = lay.views(rec)
            bias = None if b is None else (b.gate[g.expert], b.up[g.expert], b.down[g.expert])
            jobs.append(ExpertJob(gate, up, down, lay.qtypes, g.tokens, g.weights, bias,
                                  "swiglu" if b is None else b.act))
        self.kernels.run(h, jobs, out)
