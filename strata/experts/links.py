"""Measure the two miss links at start: the CPU pool's rate on this model's experts and the
host -> device copy rate of expert records. The planner splits misses with these numbers."""

from __future__ import annotations

import time

import torch

from strata.experts.arena import Arena
from strata.experts.compute import Group
from strata.experts.cpu_pool import CpuPool
from strata.experts.layout import first_routed
from strata.experts.planner import LinkCosts


def _time(fn, repeats: int = 3) -> float:  # noqa: ANN001
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_links(arena: Arena, pool: CpuPool, staging: torch.Tensor,
                  n_experts: int = 4) -> LinkCosts:
    lay = first_routed(arena.layouts)
    D = lay.d_model
    n = min(n_experts, arena.n_experts)
    h = torch.randn(16, D)
    out = torch.zeros_like(h)

    def cpu(tokens: int) -> None:
        groups = [Group(e, torch.arange(tokens), torch.full((tokens,), 0.1)) for e in range(n)]
        pool.run(lay.layer, arena, groups, h[:tokens], out[:tokens])

    t1, t16 = _time(lambda: cpu(1)), _time(lambda: cpu(16))
    cpu_gbs = n * lay.nbytes / t1 / 1e9
    per_token = max(0.0, (t16 - t1) / 15 / n)
    m = min(n, staging.shape[0])

    def copy() -> None:
        for e in range(m):
            staging[e, : lay.stride].copy_(arena.record(lay.layer, e), non_blocking=True)
        if staging.is_cuda:
            torch.cuda.synchronize(staging.device)

    pcie_gbs = m * lay.stride / _time(copy) / 1e9
    return LinkCosts(cpu_gbs=cpu_gbs, cpu_s_per_token=per_token, pcie_gbs=pcie_gbs)
