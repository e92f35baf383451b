"""The CPU miss path: computes a layer's missed experts from the arena on the host.

It hands the kernel library in strata.kernels.cpu (ggml's CPU backend where installed, torch
otherwise) one batch per layer and step: every missed expert with its tokens and weights.
"""

from __future__ import annotations

import logging

import torch

from strata.experts.arena import Arena
from strata.experts.compute import Group, run_records

log = logging.getLogger("strata.cpu_pool")


class CpuPool:
    def __init__(self, kind: str = "auto", threads: int | None = None,
                 workspace_bytes: int = 256 << 20):
        self.workspace_bytes = workspace_bytes
        self.kernels = None
        self.kind = "torch"
        try:
            from strata.kernels.cpu import make_cpu_experts
        except ImportError:
            if kind == "ggml":
                raise
        else:
            self.kernels = make_cpu_experts(kind, threads)
            self.kind = getattr(self.kernels, "name", kind)
        if threads:
            torch.set_num_threads(threads)

    def run(self, layer: int, arena: Arena, groups: list[Group], h: torch.Tensor,
            out: torch.Tensor) -> None:
        """out[t] += Σ w * expert(h[t]) over the groups' experts, read from the arena."""
        lay = arena.layouts[layer]
        if self.kernels is None:
            records = arena.layers[layer][torch.tensor([g.expert for g in groups])]
            run_records(lay, records, groups, h, out, self.workspace_bytes)
            return
        from strata.kernels.cpu import ExpertJob

        jobs = []
        for g in groups:
            gate, up, down = lay.views(arena.record(layer, g.expert))
            jobs.append(ExpertJob(gate, up, down, lay.qtypes, g.tokens, g.weights))
        self.kernels.run(h, jobs, out)
