"""The miss planner: for each missed expert of a step, compute it on the CPU from the arena or
copy it over PCIe and compute it on the GPU — whichever the measured costs say finishes first.

Costs, per expert of `nbytes` with `n` tokens routed to it:
    cpu(n) = nbytes / cpu_gbs + n * cpu_s_per_token      (a GEMV reads the weights once; more
                                                          tokens add arithmetic)
    dma    = nbytes / pcie_gbs                            (the GPU's compute is small beside it)
`auto` assigns misses, most tokens first, to whichever link would finish its queue sooner, so both
links work at once. `cpu` and `dma` send everything one way.

The CPU cost is measured again in use: every pool call reports its time (`observe_cpu`), and the
ratio of observed to predicted time, averaged over recent calls, scales the CPU cost of later
splits (a pool call costs more than its bytes at the start-up rate: waking the threads, small
matrices).
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
    SCALE_BOUNDS = (0.25, 16.0)
    SCALE_WEIGHT = 0.1  # of each new observation in the running ratio

    def __init__(self, mode: str, costs: LinkCosts | None):
        check_miss_mode(mode)
        if mode == "auto" and costs is None:
            raise ValueError("auto needs measured link costs")
        self.mode, self.costs = mode, costs
        self.cpu_scale = 1.0  # observed / predicted CPU pool time, running average

    def observe_cpu(self, nbytes: int, experts: int, tokens: int, seconds: float) -> None:
        """One CPU pool call: `experts` experts of `nbytes` each with `tokens` tokens in all took
        `seconds`."""
        if self.costs is None or experts <= 0 or seconds <= 0:
            return
        predicted = experts * nbytes / (self.costs.cpu_gbs * 1e9) + (
            tokens * self.costs.cpu_s_per_token)
        if predicted <= 0:
            return
        lo, hi = self.SCALE_BOUNDS
        ratio = min(hi, max(lo, seconds / predicted))
        self.cpu_scale += self.SCALE_WEIGHT * (ratio - self.cpu_scale)

    def copies_one_token(self, nbytes: int) -> bool:
        """A missed expert with one token goes over PCIe (not to the CPU) under this mode and
        the costs measured so far."""
        if self.mode != "auto":
            return self.mode == "dma"
        return self.costs.dma(nbytes) <= self.costs.cpu(nbytes, 1) * self.cpu_scale

    def split(self, misses: list[tuple[int, int]], nbytes: int) -> tuple[list[int], list[int]]:
        """misses: (expert, tokens routed to it) -> (experts for the CPU, experts to copy)."""
        if self.mode == "cpu":
            return [e for e, _ in misses], []
        if self.mode == "dma":
            return [], [e for e, _ in misses]
        cpu, dma, t_cpu, t_dma = [], [], 0.0, 0.0
        dma_cost = self.costs.dma(nbytes)
        for e, n in sorted(misses, key=lambda m: -m[1]):
            c = self.costs.cpu(nbytes, n) * self.cpu_scale
            if t_cpu + c <= t_dma + dma_cost:
                cpu.append(e)
                t_cpu += c
            else:
                dma.append(e)
                t_dma += dma_cost
        return cpu, dma
