"""A sequence's cache over fixed-size blocks of a KVSlots pool (strata.runtime.kv_slots): its
rows are where its block table says, blocks taken as it grows, given back when it leaves.

    table:  [b0, b1, b2]          position j lives in pool row table[j // P] * P + j % P
    refs:   a block shared by several sequences (a common prompt prefix) is written by none:
            a write into a shared block copies it first (copy on write)

The verbs of KVCache (append returns every row so far, gathered from the pool; advance,
truncate, rollback, reserve) and of LatentCache, so the plain forward runs on it as on any
cache; the decode steps read its rows through the table (BatchRows).

Legend: P rows a block, L layers, Hkv kv heads, hd head dim.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.errors import StrataError
from strata.runtime.kv_cache import KVCache, dequantize_q8_0, quantize_q8_0
from strata.runtime.latent_cache import LatentCache


class _Blocks:
    """What the two paged caches share: the table, row indices, growth and copy on write."""

    paged = True

    def _init_blocks(self, pool, slot: int) -> None:  # noqa: ANN001 (a KVSlots)
        self.slots, self.slot = pool, slot
        self.table: list[int] = []
        self.limit = pool.capacity
        self._idx: dict[tuple[int, int], torch.Tensor] = {}  # row indices for this table

    @property
    def capacity(self) -> int:
        return self.limit

    def reserve(self, need: int) -> None:
        """Blocks for `need` rows (a full pool: PoolFull, this cache as it was)."""
        if need > self.limit:
            raise StrataError(f"the sequence needs {need} KV cache rows, and a sequence of the "
                              f"pool holds {self.limit} (--ctx): give a larger --ctx, or a "
                              "smaller --kv-type (f16, q8_0)")
        blocks = -(-need // self.slots.block)
        got = []
        try:
            while len(self.table) + len(got) < blocks:
                got.append(self.slots.alloc_block())
        except StrataError:
            for b in got:
                self.slots.unref(b)
            raise
        if got:
            self.table += got
            self._idx.clear()

    def rows(self, start: int, end: int) -> torch.Tensor:
        """int64 [end - start] on the device: the pool rows of positions start .. end-1 (kept
        while the table holds: a forward asks the same of every layer)."""
        t = self._idx.get((start, end))
        if t is None:
            p = self.slots.block
            j = np.arange(start, end)
            idx = np.asarray(self.table, dtype=np.int64)[j // p] * p + j % p
            t = torch.from_numpy(idx)
            if self.slots.device.type == "cuda":  # (pinned, queued: no wait on the GPU's work)
                t = t.pin_memory().to(self.slots.device, non_blocking=True)
            if len(self._idx) > 8:
                self._idx.clear()
            self._idx[(start, end)] = t
        return t

    def own(self, start: int, end: int) -> None:
        """The blocks rows start .. end-1 lie in, this sequence's alone (shared ones copied)."""
        p = self.slots.block
        for i in range(start // p, -(-end // p)):
            if self.slots.refs[self.table[i]] > 1:
                self.table[i] = self.slots.copy_block(self.table[i])
                self._idx.clear()

    @property
    def nbytes(self) -> int:
        return len(self.table) * self.slots.block_bytes


class PagedKVCache(_Blocks, KVCache):
    """Keys and values of every layer in blocks of the pool's store ([2, L, R, Hkv, hd], q8_0's
    scales beside)."""

    def __init__(self, pool, slot: int):  # noqa: ANN001 (a KVSlots)
        cfg = pool.cfg
        self.shape = (cfg.n_kv_heads, cfg.head_dim)
        self.dtype = pool.dtype
        self.quantized = pool.dtype == torch.int8
        self.n_layers, self.device = cfg.n_kv_layers, pool.device
        self.length = 0
        self.pool = self._release = None  # (KVCache's storage pool: none, the blocks are)
        self.state = None
        self.store = self.scales = self.k = self.v = self.ks = self.vs = None
        self._init_blocks(pool, slot)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor,
               read: bool = True) -> tuple[torch.Tensor, ...]:
        """KVCache.append through the table: rows length.. written, all rows so far gathered."""
        end = self.length + k.shape[0]
        self.reserve(end)
        self.own(self.length, end)
        new = self.rows(self.length, end)
        kp, vp, ks, vs = self.slots.layer(layer)
        if self.quantized:
            for pool, scales, x in ((kp, ks, k), (vp, vs, v)):
                qx, dx = quantize_q8_0(x)
                pool.index_copy_(0, new, qx)
                scales.index_copy_(0, new, dx)
            if not read:
                return None, None
            rows = self.rows(0, end)
            return dequantize_q8_0(kp[rows], ks[rows]), dequantize_q8_0(vp[rows], vs[rows])
        kp.index_copy_(0, new, k.to(self.dtype))
        vp.index_copy_(0, new, v.to(self.dtype))
        rows = self.rows(0, end)
        return kp[rows], vp[rows]


class PagedLatentCache(_Blocks, LatentCache):
    """MLA's latent rows in blocks of the pool's latent store ([L, R, row])."""

    def __init__(self, pool, slot: int):  # noqa: ANN001 (a KVSlots)
        cfg = pool.cfg
        self.n_layers, self.row, self.device, self.dtype = cfg.n_layers, cfg.kv_row, \
            pool.device, pool.dtype
        self.length = 0
        self.state = None
        self.pool = self._release = None
        self.store = None
        self._init_blocks(pool, slot)

    def append(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        end = self.length + rows.shape[0]
        self.reserve(end)
        self.own(self.length, end)
        store = self.slots.latent[layer]
        store.index_copy_(0, self.rows(self.length, end), rows.to(store.dtype))
        return store[self.rows(0, end)]
