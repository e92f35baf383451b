"""Cache policies: which experts of a layer stay resident. One small interface, a registry.

A policy sees every routed expert (`touch`) and picks victims (`victim`) among the resident ones
it may evict; `rank` orders experts for the initial fill (best first).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from strata.errors import StrataError


class Policy:
    name = ""

    def __init__(self, n_experts: int, profile: np.ndarray | None = None):
        self.n_experts = n_experts
        self.profile = profile  # routing frequency of this layer's experts, [E], or None

    def touch(self, experts: list[int], counts: list[int]) -> None:
        """The experts routed in one step, with how many tokens went to each."""

    def victim(self, resident: list[int], keep: set[int]) -> int | None:
        """The resident expert to evict (not in `keep`), or None when none may go."""
        raise NotImplementedError

    def admit(self, expert: int, victim: int) -> bool:
        """Whether a missed expert should replace `victim`."""
        return True

    def rank(self) -> list[int]:
        if self.profile is None:
            return list(range(self.n_experts))
        return [int(e) for e in np.argsort(-self.profile, kind="stable")]

    def current(self) -> list[int]:
        """Every expert, the one this policy would keep longest first (what it has seen so far;
        rank() before any touch): which experts a cache that grows or shrinks holds."""
        return self.rank()


class LRU(Policy):
    name = "lru"

    def __init__(self, n_experts: int, profile: np.ndarray | None = None):
        super().__init__(n_experts, profile)
        self.order: OrderedDict[int, None] = OrderedDict((e, None) for e in reversed(self.rank()))

    def touch(self, experts: list[int], counts: list[int]) -> None:
        for e in experts:
            self.order.move_to_end(e)

    def victim(self, resident: list[int], keep: set[int]) -> int | None:
        res = set(resident) - keep
        return next((e for e in self.order if e in res), None)

    def current(self) -> list[int]:
        return list(reversed(self.order))  # most recently used first


class LFU(Policy):
    """Least frequently used, with counts halved every `half_life` touches so it can adapt."""

    name = "lfu"
    half_life = 4096

    def __init__(self, n_experts: int, profile: np.ndarray | None = None):
        super().__init__(n_experts, profile)
        self.counts = np.zeros(n_experts) if profile is None else profile * 1.0
        self.touches = 0

    def touch(self, experts: list[int], counts: list[int]) -> None:
        self.counts[experts] += counts
        self.touches += 1
        if self.touches % self.half_life == 0:
            self.counts *= 0.5

    def victim(self, resident: list[int], keep: set[int]) -> int | None:
        cands = [e for e in resident if e not in keep]
        return min(cands, key=lambda e: self.counts[e]) if cands else None

    def admit(self, expert: int, victim: int) -> bool:
        return self.counts[expert] >= self.counts[victim]

    def current(self) -> list[int]:
        return [int(e) for e in np.argsort(-self.counts, kind="stable")]


class ProfilePolicy(LFU):
    """Ranked by the routing frequency recorded with `strata profile`; adapts like LFU after."""

    name = "profile"

    def __init__(self, n_experts: int, profile: np.ndarray | None = None):
        if profile is None:
            raise StrataError("--cache-policy profile needs --expert-profile FILE "
                              "(record one with `strata profile`)")
        super().__init__(n_experts, profile * LFU.half_life)


POLICIES = {p.name: p for p in (LRU, LFU, ProfilePolicy)}


def make_policy(name: str, n_experts: int, profile: np.ndarray | None) -> Policy:
    if name not in POLICIES:
        raise StrataError(f"--cache-policy {name}: choose from {', '.join(POLICIES)}")
    return POLICIES[name](n_experts, profile)
