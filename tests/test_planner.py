"""The miss planner: cpu / dma send everything one way; auto balances the two links by cost, most
tokens first, and follows the CPU pool's observed times."""

from __future__ import annotations

import pytest

from strata.errors import StrataError
from strata.experts.planner import LinkCosts, MissPlanner

MB = 1_000_000
COSTS = LinkCosts(cpu_gbs=10.0, cpu_s_per_token=50e-6, pcie_gbs=10.0)  # 1 MB: 100 us each way


def test_fixed_modes_send_every_miss_one_way() -> None:
    misses = [(3, 1), (7, 2), (9, 1)]
    assert MissPlanner("cpu", None).split(misses, MB) == ([3, 7, 9], [])
    assert MissPlanner("dma", None).split(misses, MB) == ([], [3, 7, 9])
    with pytest.raises(StrataError, match="--miss fast"):
        MissPlanner("fast", None)


def test_auto_balances_the_links_most_tokens_first() -> None:
    p = MissPlanner("auto", COSTS)
    # one token: CPU 150 us, copy 100 us per expert; the busiest expert is placed first
    cpu, dma = p.split([(1, 1), (2, 1), (3, 1), (4, 1), (5, 8)], MB)
    assert 5 in dma  # 8 tokens: 500 us on the CPU against a 100 us copy
    assert sorted(cpu + dma) == [1, 2, 3, 4, 5] and 0 < len(cpu) < len(dma)
    t_cpu = sum(COSTS.cpu(MB, 1) for _ in cpu)
    t_dma = COSTS.dma(MB) * len(dma)
    assert abs(t_cpu - t_dma) <= COSTS.cpu(MB, 1)  # neither queue is longer by a whole expert


def test_observed_cpu_time_moves_misses_to_the_copy_link() -> None:
    p = MissPlanner("auto", COSTS)
    misses = [(e, 1) for e in range(12)]
    before, _ = p.split(misses, MB)
    for _ in range(40):  # every call takes 3x what the start-up rate predicts
        p.observe_cpu(MB, 2, 2, 3 * 2 * COSTS.cpu(MB, 1))
    assert 2.5 < p.cpu_scale < 3.0
    after, _ = p.split(misses, MB)
    assert len(after) < len(before)
    for _ in range(80):  # faster again: the scale follows, within its bounds
        p.observe_cpu(MB, 1, 1, 1e-9)
    assert p.cpu_scale == pytest.approx(MissPlanner.SCALE_BOUNDS[0], rel=0.1)
