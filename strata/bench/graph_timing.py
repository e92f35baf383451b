"""Kernel timing without launch overhead: calls captured in a CUDA graph, replays timed with CUDA
events (scripts/bench_mapped.py, scripts/bench_moe_decode.py)."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import torch


def graph_seconds(fn: Callable[[int], object], calls: int = 16, reps: int = 8) -> float:
    """Median seconds of one call: fn(0) .. fn(calls - 1) (call i may use its own inputs, so
    the L2 cannot hold them all) captured in one CUDA graph after a warm-up, `reps` replays."""
    for i in range(2):
        fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / calls)
    return statistics.median(times)
