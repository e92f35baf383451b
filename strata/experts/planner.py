"""The miss planner: for each missed expert of a step, compute it on the CPU from the arena or
copy it over PCIe and compute it on the GPU — whichever the measured costs say finishes first.

Costs, per expert of `nbytes` with `n` tokens routed to it:
    cpu(n) = nbytes / cpu_gbs + n * cpu_s_per_token      (a GEMV reads the weights once; more
                                                          tokens add arithmetic)
    dma    = nbytes / pcie_gbs                            (the GPU's compute is small beside it)
`auto` assigns misses, most tokens first, to whichever link would finish its queue sooner, so both
links work at once. `cpu` and `dma` send everything one way.
"""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import StrataError

MISS_MODES = ("auto", "cpu", "dma")


@dataclass
class LinkCosts:
    cpu_gbs: float  # expert bytes per second at one token, CPU pool (GB/s)
    cpu_s_per_token: float  # extra seconds per token per expert on the CPU
    pcie_gbs: float  # host -> device copy rate (GB/s)

    def cpu(self, nbytes: int, n: int) -> float:
        return nbytes / (self.cpu_gbs * 1e9) + n * self.cpu_s_per_token

    def dma(self, nbytes: int) -> float:
        return nbytes / (self.pcie_gbs * 1e9)


def check_miss_mode(mode: str) -> None:
    if mode not in MISS_MODES:
        raise StrataError(f"--miss {mode}: choose from {', '.join(MISS_MODES)}")


class MissPlanner:
    def __init__(self, mode: str, costs: LinkCosts | None):
        check_miss_mode(mode)
        if mode == "auto" and costs is None:
            raise ValueError("auto needs measured link costs")
        self.mode, self.costs = mode, costs

    def split(self, misses: list[tuple[int, int]], nbytes: int) -> tuple[list[int], list[int]]:
        """misses: (expert, tokens routed to it) -> (experts for the CPU, experts to copy)."""
        if self.mode == "cpu":
            return [e for e, _ in misses], []
        if self.mode == "dma":
            return [], [e for e, _ in misses]
        cpu, dma, t_cpu, t_dma = [], [], 0.0, 0.0
        dma_cost = self.costs.dma(nbytes)
        for e, n in sorted(misses, key=lambda m: -m[1]):
            c = self.costs.cpu(nbytes, n)
            if t_cpu + c <= t_dma + dma_cost:
                cpu.append(e)
                t_cpu += c
            else:
                dma.append(e)
                t_dma += dma_cost
        return cpu, dma
