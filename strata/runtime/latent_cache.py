"""Per-sequence cache of multi-head latent attention (deepseek2): one row a token and layer, the
normed latent and the rotated rope part, in place of every head's keys and values (576 floats
a token and layer for DeepSeek-V3 against 2 x 128 x 192 = 49152 expanded), grown by doubling.

    store: [L, capacity, kv_lora + rope]      rows 0 .. length-1: the sequence so far

The same verbs as KVCache (append, advance, truncate, reserve, capacity, nbytes; a KVPool's
storage, a decode step's graphs keyed on `store`), so the generation loop, the server, the decode
step and the memory plan treat the two alike (config.kv_row sizes both).
"""

from __future__ import annotations

import weakref

import torch

from strata.runtime.kv_cache import KVPool, grown


class LatentCache:
    """pool: a KVPool the storage comes from and goes back to (a decode step's: its graphs,
    captured for one storage, serve the next request)."""

    def __init__(self, n_layers: int, row: int, device: torch.device, capacity: int = 256,
                 pool: KVPool | None = None, dtype: torch.dtype = torch.float32,
                 storage: torch.Tensor | None = None):
        """storage: [L, capacity, row] to hold the rows in (a view of a KVSlots pool)."""
        self.n_layers, self.row, self.device, self.dtype = n_layers, row, device, dtype
        self.length = 0
        self.state = None  # (no recurrent state: the decode step keys its graphs on it)
        self.pool = pool
        self._release = None
        self.limit: int | None = None  # rows the memory plan holds (model.new_cache), or none
        self.slot: int | None = None  # its slot of a KVSlots pool (`slots`), or None
        self.slots = None
        if storage is not None:
            self.store = storage
        else:
            self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        shape = (self.n_layers, capacity, self.row)
        if self.pool is None:
            self.store = torch.empty(shape, dtype=self.dtype, device=self.device)
        else:
            self.store = self.pool.take(shape, self.device, self.dtype)
            self._release = weakref.finalize(self, self.pool.give, self.store)

    @property
    def capacity(self) -> int:
        return self.store.shape[1]

    @property
    def nbytes(self) -> int:
        return self.store.numel() * self.store.element_size()

    def append(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Write rows [t, row] at length.. (not yet committed, rounded to the cache's type);
        return every row up to them, [length + t, row] in the cache's type."""
        end = self.length + rows.shape[0]
        if end > self.capacity:
            self._grow(end)
        self.store[layer, self.length:end] = rows
        return self.store[layer, :end]

    def advance(self, n: int) -> None:
        """Commit n rows written by append() in every layer."""
        self.length += n

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def reserve(self, need: int) -> None:
        if need > self.capacity:
            self._grow(need)

    def _grow(self, need: int) -> None:
        old, release = self.store, self._release
        self._alloc(grown(need, self.capacity, self.limit))
        self.store[:, : self.length] = old[:, : self.length]
        if release is not None:
            release()  # the old storage back to the pool
