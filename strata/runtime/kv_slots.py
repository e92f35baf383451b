"""One KV pool for the sequences a batched decode step runs together (strata.engine.batch_step):
allocated once, so the step's CUDA graphs hold fixed addresses and serve any sequences in it.

    kv store  [2, L, R, Hkv, hd]   R = blocks * block + 1 rows (+ q8_0 scales [.., hd/32])
    latent    [L, R, kv_lora + rope]                           (MLA, in place of the kv store)
    conv      [Ll, S, K-1, C], ssm [Ll, S, Hv, dk, dv]  (hybrids: recurrent state, a slot each)

    rows:   | block 0 | block 1 | ... | block n-1 | scratch row |

A sequence takes a slot (one state entry; at most `slots` sequences) and blocks for its rows,
two ways:

    slots (block = capacity)   each slot one fixed block: its cache is a plain view of the pool
                               (KVCache, LatentCache, DeltaState over it), so the plain forward,
                               the one-sequence decode step and the host prefix cache run on it
                               unchanged
    paged (block < capacity)   blocks of `block` rows from one free list as the sequence grows
                               (PagedKVCache, PagedLatentCache: strata.runtime.paged_kv), given
                               back when it leaves; refcounted, so sequences that start alike
                               share their prefix's full blocks (copy on write)

Either way the decode steps read a sequence's rows through its block table. The scratch row is
where the padded rows of a batch write their keys and values (a batch of 3 runs as 4), and a
free slot's state entry their recurrent state (reset when the slot is taken): never a
sequence's. Accounting, checked by check_integrity: free + used == slots, and in paged form
free + used == blocks (a block used by as many holders as its refcount).

Legend: L kv layers, Ll linear layers, R pool rows, S slots, Hkv kv heads, hd head dim.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import numpy as np
import torch

from strata.errors import StrataError
from strata.runtime.delta_state import DeltaState
from strata.runtime.kv_cache import Q8_BLOCK, KVCache
from strata.runtime.latent_cache import LatentCache

# rows a block of the server's batch pool (the unit of prefix sharing); the memory plan counts
# each sequence's rows rounded up to it, and the pool's one scratch row
POOL_BLOCK = 16


class PoolFull(StrataError):
    """The pool has no slot (or, paged, no block) left."""


class KVSlots:
    def __init__(self, cfg, device: torch.device, slots: int, capacity: int,  # noqa: ANN001
                 dtype: torch.dtype = torch.float32, block: int | None = None):
        """cfg: the ModelConfig; slots: sequences at once (--batch); capacity: rows a sequence
        may hold (--ctx: the memory plan's, which counts slots x capacity rows); block: rows a
        block (None: the capacity, one block a slot)."""
        if slots < 1 or capacity < 1 or (block is not None and block < 1):
            raise StrataError(f"the KV pool needs at least one slot, one row and one row a block "
                              f"(--batch {slots}, --ctx {capacity}, block {block})")
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.n_slots, self.capacity = slots, capacity
        self.paged = block is not None and block < capacity
        self.block = block if self.paged else capacity  # rows a block
        self.blocks_per_seq = -(-capacity // self.block)
        self.n_blocks = slots * self.blocks_per_seq
        self.refs = np.zeros(self.n_blocks, dtype=np.int64)  # holders of each block
        self.free_blocks = list(range(self.n_blocks - 1, -1, -1))  # (popped: block 0 first)
        rows = self.n_blocks * self.block + 1
        self.scratch_row = rows - 1
        self.latent = self.store = self.scales = None
        self.conv = self.ssm = None
        z = dict(device=device)
        if cfg.kv_lora:  # (zeros: rows never written hold finite values, read masked)
            self.latent = torch.zeros(cfg.n_layers, rows, cfg.kv_row, dtype=dtype, **z)
        else:
            if dtype == torch.int8 and cfg.head_dim % Q8_BLOCK:
                raise StrataError(f"--kv-type q8_0: the head dimension {cfg.head_dim} is not a "
                                  f"multiple of {Q8_BLOCK}; pick f16 or bf16")
            shape = (2, cfg.n_kv_layers, rows, cfg.n_kv_heads, cfg.head_dim)
            self.store = torch.zeros(shape, dtype=dtype, **z)
            if dtype == torch.int8:
                self.scales = torch.zeros((*shape[:-1], cfg.head_dim // Q8_BLOCK),
                                          dtype=torch.float16, **z)
        if cfg.full_attn_interval:  # hybrid: one recurrent state a slot
            n = cfg.n_layers - cfg.n_kv_layers
            self.conv = torch.zeros(n, slots, cfg.ssm_conv - 1, cfg.conv_channels, **z)
            self.ssm = torch.zeros(n, slots, cfg.ssm_heads, cfg.ssm_state, cfg.ssm_state, **z)
        self.free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._release: dict[int, weakref.finalize] = {}
        self.index: OrderedDict[tuple, int] = OrderedDict()  # prefix sharing (keep, lookup)
        self.children: dict[int, set[tuple]] = {}
        self._indexed: set[int] = set()
        # bytes a block holds in every layer (rows and q8_0's scales)
        self.block_bytes = self.block * sum(t.numel() * t.element_size() // rows for t in (
            self.store, self.scales, self.latent) if t is not None)

    # ---- slots --------------------------------------------------------------------------------

    @property
    def used(self) -> int:
        return self.n_slots - len(self.free)

    def can_take(self) -> bool:
        return bool(self.free)

    def take(self) -> KVCache | LatentCache:
        """A fresh cache (length 0) over a free slot; its slot returns when it is given back
        (`give`) or dropped. A full pool is refused (PoolFull), nothing else changes."""
        if not self.free:
            raise PoolFull(f"the KV pool is full: {self.n_slots} sequences hold its "
                           f"{self.n_slots} slots (--batch {self.n_slots}); retry later")
        slot = self.free.pop()
        rows = slice(slot * self.capacity, (slot + 1) * self.capacity)
        cfg = self.cfg
        if self.paged:
            from strata.runtime.paged_kv import PagedKVCache, PagedLatentCache

            kv = (PagedLatentCache if self.latent is not None else PagedKVCache)(self, slot)
            if self.conv is not None:
                kv.state = DeltaState(cfg, self.device,
                                      storage=(self.conv[:, slot], self.ssm[:, slot]))
        elif self.latent is not None:
            kv = LatentCache(cfg.n_layers, cfg.kv_row, self.device, dtype=self.dtype,
                             storage=self.latent[:, rows])
        else:
            kv = KVCache(cfg.n_kv_layers, cfg.n_kv_heads, cfg.head_dim, self.device,
                         dtype=self.dtype, storage=(
                             self.store[:, :, rows],
                             None if self.scales is None else self.scales[:, :, rows]))
            if self.conv is not None:
                kv.state = DeltaState(cfg, self.device,
                                      storage=(self.conv[:, slot], self.ssm[:, slot]))
        kv.limit = self.capacity
        kv.slot, kv.slots = slot, self
        table = kv.table if self.paged else None  # (the finalizer must not hold the cache)
        self._release[slot] = weakref.finalize(kv, self._free, slot, table)
        return kv

    def give(self, kv: KVCache | LatentCache) -> None:
        """The cache's slot back to the free list now (the cache must not be used after)."""
        if getattr(kv, "slots", None) is not self:
            raise ValueError("the cache is not from this pool")
        release = self._release.get(kv.slot)
        if release is not None:
            release()
        kv.slots = None

    def _free(self, slot: int, table: list[int] | None) -> None:
        self._release.pop(slot, None)
        self.free.append(slot)
        for b in table or ():
            self.unref(b)
        if table:
            table.clear()

    # ---- blocks (paged) -----------------------------------------------------------------------

    @property
    def used_blocks(self) -> int:
        return int((self.refs > 0).sum()) if self.paged else self.used

    def alloc_block(self) -> int:
        """A free block, held once (PoolFull when none is left): the prefix index gives back
        its least recently used block that nothing else holds first."""
        if not self.free_blocks:
            self._evict()
        if not self.free_blocks:
            raise PoolFull(f"the KV pool is full: its {self.n_blocks} blocks of {self.block} rows "
                           "are held by the running sequences; retry later")
        b = self.free_blocks.pop()
        self.refs[b] = 1
        return b

    def ref(self, b: int) -> None:
        self.refs[b] += 1

    def unref(self, b: int) -> None:
        self.refs[b] -= 1
        if self.refs[b] == 0:
            self.free_blocks.append(b)

    def copy_block(self, b: int) -> int:
        """Copy on write: a new block holding block b's rows in every layer (one holder of b
        moves to it)."""
        self.ref(b)  # (kept while a block is found for the copy)
        try:
            new = self.alloc_block()
        finally:
            self.refs[b] -= 1
        src = slice(b * self.block, (b + 1) * self.block)
        dst = slice(new * self.block, (new + 1) * self.block)
        for t, dim in ((self.store, 2), (self.scales, 2), (self.latent, 1)):
            if t is not None:
                t.narrow(dim, dst.start, self.block).copy_(t.narrow(dim, src.start, self.block))
        self.unref(b)
        return new

    def check_integrity(self) -> None:
        """free + used == slots; no slot twice; every used slot has its release; in paged form
        free + used == blocks, and each block's refcount is the number of tables holding it."""
        if len(set(self.free)) != len(self.free) or not set(self.free) <= set(
                range(self.n_slots)):
            raise RuntimeError(f"KV pool: bad free list {self.free}")
        if set(self._release) & set(self.free) or \
                len(self._release) + len(self.free) != self.n_slots:
            raise RuntimeError(f"KV pool: {len(self._release)} used + {len(self.free)} free != "
                               f"{self.n_slots} slots")
        if not self.paged:
            return
        if len(set(self.free_blocks)) != len(self.free_blocks) or \
                (self.refs[self.free_blocks] != 0).any() or (self.refs < 0).any():
            raise RuntimeError("KV pool: a free block is held, or listed twice")
        if len(self.free_blocks) + self.used_blocks != self.n_blocks:
            raise RuntimeError(f"KV pool: {len(self.free_blocks)} free + {self.used_blocks} used "
                               f"blocks != {self.n_blocks}")
        held = np.zeros(self.n_blocks, dtype=np.int64)
        for rel in self._release.values():
            table = rel.peek()[2][1] if rel.alive else None
            for b in table or ():
                held[b] += 1
        held += self._held_elsewhere()
        if (held != self.refs).any():
            bad = int(np.flatnonzero(held != self.refs)[0])
            raise RuntimeError(f"KV pool: block {bad} has refcount {self.refs[bad]}, held by "
                               f"{held[bad]}")

    def _held_elsewhere(self) -> np.ndarray:
        """Holds on blocks other than the sequences' tables: the prefix index's."""
        held = np.zeros(self.n_blocks, dtype=np.int64)
        for b in self.index.values():
            held[b] += 1
        return held

    # ---- prefix sharing (paged) -----------------------------------------------------------------
    #
    #   index  (parent block, the block's tokens) -> block: the blocks of finished sequences,
    #          each under the block before it (-1: the first), so a key names its whole prefix;
    #          full blocks, and a sequence's last partial one. The index holds each once.

    def keep(self, tokens: list[int], kv) -> None:  # noqa: ANN001 (a paged cache of this pool)
        """Index the blocks of a sequence about to leave: its rows for `tokens` (one a token,
        as fed). Sequences with recurrent state are not kept (it cannot be cut)."""
        if not self.paged or kv.state is not None or getattr(kv, "slots", None) is not self:
            return
        n, p, parent = min(len(tokens), kv.length), self.block, -1
        for i in range(-(-n // p)):
            key = (parent, tuple(tokens[i * p:min((i + 1) * p, n)]))
            b = self.index.get(key)
            if b is None:
                b = kv.table[i]
                if b in self._indexed:  # (a block indexed under other tokens already)
                    return
                self.index[key] = b
                self._indexed.add(b)
                self.children.setdefault(parent, set()).add(key)
                self.ref(b)
            self.index.move_to_end(key)
            parent = b

    def lookup(self, ids: list[int], kv) -> int:  # noqa: ANN001 (a fresh paged cache)
        """Start kv (empty) with the longest indexed prefix of ids, leaving at least the last
        token to compute: full blocks shared, the rows of a partly matching block copied into
        a block of its own; -> the rows reused (0: none)."""
        if not self.paged or not self.index or kv.length or kv.table or kv.state is not None:
            return 0
        limit, p, parent, n = len(ids) - 1, self.block, -1, 0
        while n + p <= limit:
            b = self.index.get((parent, tuple(ids[n:n + p])))
            if b is None:
                break
            self.index.move_to_end((parent, tuple(ids[n:n + p])))
            self.ref(b)
            kv.table.append(b)
            parent, n = b, n + p
        best, best_m = None, 0
        for key in self.children.get(parent, ()):
            m = _common(key[1], ids[n:min(n + p, limit)])
            if m > best_m:
                best, best_m = key, m
        if best is not None:  # copy on write, at once: the sequence writes there next
            b = self.index[best]
            self.ref(b)
            try:
                kv.table.append(self.copy_block(b))
                n += best_m
            except PoolFull:
                self.unref(b)  # (the shared full blocks stand)
        kv._idx.clear()
        kv.advance(n)
        return n

    def _evict(self) -> None:
        """The least recently used indexed block that nothing else holds and no indexed block
        follows, back to the free list."""
        for key, b in self.index.items():
            if self.refs[b] == 1 and not self.children.get(b):
                del self.index[key]
                self._indexed.discard(b)
                self.children[key[0]].discard(key)
                if not self.children[key[0]]:
                    del self.children[key[0]]
                self.unref(b)
                return

    # ---- what a batched step reads -------------------------------------------------------------

    def table(self, kv) -> list[int]:  # noqa: ANN001 (a cache of this pool)
        """The cache's block table, blocks_per_seq entries (block 0 past what it holds: those
        positions are never read unmasked)."""
        if not self.paged:
            return [kv.slot]
        return kv.table + [0] * (self.blocks_per_seq - len(kv.table))

    def row(self, kv, position: int) -> int:  # noqa: ANN001
        """The pool row of a cache's position (its block there reserved)."""
        block = kv.slot if not self.paged else kv.table[position // self.block]
        return block * self.block + position % self.block

    def layer(self, i: int) -> tuple[torch.Tensor, ...]:
        """Layer i's rows of the whole pool: keys, values [R, Hkv, hd], and their q8_0 scales
        (or None, None)."""
        if self.scales is None:
            return self.store[0, i], self.store[1, i], None, None
        return self.store[0, i], self.store[1, i], self.scales[0, i], self.scales[1, i]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (
            self.store, self.scales, self.latent, self.conv, self.ssm) if t is not None)


def _common(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
