"""Per-sequence KV cache: one key and one value tensor per layer, grown by doubling.

    k[layer]: [capacity, Hkv, hd]   rows 0 .. length-1 hold the sequence's keys so far
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, device: torch.device,
                 capacity: int = 256):
        self.shape = (n_kv_heads, head_dim)
        self.device = device
        self.length = 0
        self.k = [self._alloc(capacity) for _ in range(n_layers)]
        self.v = [self._alloc(capacity) for _ in range(n_layers)]

    def _alloc(self, capacity: int) -> torch.Tensor:
        return torch.empty(capacity, *self.shape, dtype=torch.float32, device=self.device)

    @property
    def capacity(self) -> int:
        return self.k[0].shape[0]

    @property
    def nbytes(self) -> int:
        return 2 * len(self.k) * self.k[0].numel() * 4

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Write k, v [t, Hkv, hd] at rows length.. (not yet committed); return all keys/values
        up to them, [length + t, Hkv, hd]."""
        end = self.length + k.shape[0]
        if end > self.capacity:
            self._grow(end)
        self.k[layer][self.length:end] = k
        self.v[layer][self.length:end] = v
        return self.k[layer][:end], self.v[layer][:end]

    def advance(self, n: int) -> None:
        """Commit n rows written by append() in every layer."""
        self.length += n

    def truncate(self, length: int) -> None:
        """Forget everything after `length` tokens (e.g. rejected draft tokens)."""
        self.length = min(self.length, length)

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity)
        for kv in (self.k, self.v):
            for i, old in enumerate(kv):
                new = self._alloc(cap)
                new[: self.length] = old[: self.length]
                kv[i] = new
