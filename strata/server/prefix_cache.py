"""Prompt prefix reuse across requests, in the engine process: a prompt that starts like an earlier
request's tokens (a shared system prompt, a chat's history sent again with one more turn) takes
that request's keys and values for the common part and computes only the rest.

    entries   the KV rows of finished requests (prompt + the generated tokens that were fed), a
              host copy each, least recently used first, at most --prefix-cache GiB in all
    lookup    the entry with the longest common prefix with the new prompt: its first n rows
              copied into the new sequence's cache (n < the prompt's length: the last prompt
              token is always computed, for its logits)

Keys and values at positions < n depend only on tokens 0..n-1 (causal attention), so a reused
row is the row a fresh prompt would compute, up to the rounding of a different chunking.
Sequences whose layers keep more than keys and values (recurrent state, latent caches) are not
cached: their state after n tokens cannot be cut from a longer run.

Legend: L layers, n reused rows, Hkv kv heads, hd head dim.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from strata.runtime.kv_cache import KVCache


@dataclass
class Entry:
    tokens: tuple[int, ...]
    rows: torch.Tensor  # [2, L, n, Hkv, hd] on the host, the cache's element type

    def __post_init__(self) -> None:
        self.ids = np.asarray(self.tokens, dtype=np.int64)  # (for _common: one vector compare)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int = 1):
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # id -> entry, oldest first
        self._next = 0
        self.nbytes = 0
        self.hits = self.lookups = self.reused_tokens = 0

    @staticmethod
    def usable(kv: object) -> bool:
        """Only plain key/value caches: their rows are all a position's state (not a hybrid
        model's recurrent state beside them, nor q8_0 rows with their scales)."""
        return (type(kv) is KVCache and getattr(kv, "state", None) is None
                and kv.scales is None)

    def store(self, tokens: list[int], kv: KVCache) -> None:
        """Keep kv's rows for `tokens` (the tokens fed, one row each), dropping entries that are
        a prefix of it and the least recently used beyond the budget."""
        n = min(len(tokens), kv.length)
        if self.max_bytes <= 0 or n < self.min_tokens or not self.usable(kv):
            return
        key = tuple(tokens[:n])
        for i, e in list(self.entries.items()):
            if len(e.tokens) <= n and key[:len(e.tokens)] == e.tokens:
                self._drop(i)  # (the new entry holds all of it)
            elif len(e.tokens) > n and e.tokens[:n] == key:
                self.entries.move_to_end(i)  # a longer one holds this already
                return
        rows = kv.store[:, :, :n].to("cpu", copy=True)
        entry = Entry(key, rows)
        if entry.nbytes > self.max_bytes:
            return
        self.entries[self._next] = entry
        self._next += 1
        self.nbytes += entry.nbytes
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def lookup(self, ids: list[int], kv: KVCache) -> int:
        """Fill kv (a fresh cache) with the longest cached prefix of ids, leaving at least the
        last token to compute; -> the rows reused (0: none)."""
        self.lookups += 1
        if not self.entries or not self.usable(kv):
            return 0
        best, best_n = None, 0
        query = np.asarray(ids, dtype=np.int64)
        for i, e in self.entries.items():
            n = _common(e.ids, query)
            if n > best_n:
                best, best_n = i, n
        n = min(best_n, len(ids) - 1)
        if best is None or n < self.min_tokens:
            return 0
        rows = self.entries[best].rows
        if rows.dtype != kv.store.dtype or rows.shape[3:] != kv.store.shape[3:]:
            return 0
        self.entries.move_to_end(best)
        kv.reserve(n + 1)
        kv.store[:, :, :n] = rows[:, :, :n].to(kv.store.device)
        kv.advance(n)
        self.hits += 1
        self.reused_tokens += n
        return n

    def _drop(self, i: int) -> None:
        self.nbytes -= self.entries.pop(i).nbytes


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the common prefix of a and b (int64 [n], [m])."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
