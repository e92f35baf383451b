"""One KV pool for the sequences a batched decode step runs together (strata.engine.batch_step):
allocated once, so the step's CUDA graphs hold fixed addresses and serve any sequences in it.

    kv store  [2, L, R, Hkv, hd]   R = blocks * block + 1 rows (+ q8_0 scales [.., hd/32])
    latent    [L, R, kv_lora + rope]                           (MLA, in place of the kv store)
    conv      [Ll, S + 1, K-1, C], ssm [Ll, S + 1, Hv, dk, dv] (hybrids: recurrent state)

    rows:   | block 0 | block 1 | ... | block n-1 | scratch row |
    state:  | seq 0 | seq 1 | ... | seq S-1 | scratch |

A sequence takes a slot: `blocks_per_seq` blocks for its rows (its block table) and one state
entry. Here a slot's blocks are contiguous, so its cache is a plain view of the pool (KVCache,
LatentCache, DeltaState over it): the plain forward, the one-sequence decode step and the prefix
cache run on it unchanged, and the batched step reads its rows through the block table. The
scratch row and the scratch state are where the padded rows of a batch write (a batch of 3 runs
as 4): never a sequence's rows. Accounting: free + used == slots, checked by check_integrity.

Legend: L kv layers, Ll linear layers, R pool rows, S slots, Hkv kv heads, hd head dim.
"""

from __future__ import annotations

import weakref

import torch

from strata.errors import StrataError
from strata.runtime.delta_state import DeltaState
from strata.runtime.kv_cache import Q8_BLOCK, KVCache
from strata.runtime.latent_cache import LatentCache


class PoolFull(StrataError):
    """Every slot of the pool holds a sequence."""


class KVSlots:
    def __init__(self, cfg, device: torch.device, slots: int, capacity: int,  # noqa: ANN001
                 dtype: torch.dtype = torch.float32):
        """cfg: the ModelConfig; slots: sequences at once (--batch); capacity: rows a sequence
        may hold (--ctx: the memory plan's)."""
        if slots < 1 or capacity < 1:
            raise StrataError(f"the KV pool needs at least one slot and one row (--batch {slots}, "
                              f"--ctx {capacity})")
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.n_slots, self.capacity = slots, capacity
        self.block = capacity  # rows a block: one block a slot (contiguous rows)
        self.blocks_per_seq = 1
        rows = slots * capacity + 1
        self.scratch_row = rows - 1
        self.scratch_state = slots
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
        if cfg.full_attn_interval:  # hybrid: one recurrent state a slot, and the scratch's
            n = cfg.n_layers - cfg.n_kv_layers
            channels = (2 * cfg.ssm_groups + cfg.ssm_heads) * cfg.ssm_state
            self.conv = torch.zeros(n, slots + 1, cfg.ssm_conv - 1, channels, **z)
            self.ssm = torch.zeros(n, slots + 1, cfg.ssm_heads, cfg.ssm_state, cfg.ssm_state,
                                   **z)
        self.free = list(range(slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._release: dict[int, weakref.finalize] = {}

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
        if self.latent is not None:
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
        self._release[slot] = weakref.finalize(kv, self._free, slot)
        return kv

    def give(self, kv: KVCache | LatentCache) -> None:
        """The cache's slot back to the free list now (the cache must not be used after)."""
        if getattr(kv, "slots", None) is not self:
            raise ValueError("the cache is not from this pool")
        release = self._release.get(kv.slot)
        if release is not None:
            release()
        kv.slots = None

    def _free(self, slot: int) -> None:
        self._release.pop(slot, None)
        self.free.append(slot)

    def check_integrity(self) -> None:
        """free + used == slots; no slot twice; every used slot has its release."""
        if len(set(self.free)) != len(self.free) or not set(self.free) <= set(
                range(self.n_slots)):
            raise RuntimeError(f"KV pool: bad free list {self.free}")
        if set(self._release) & set(self.free) or \
                len(self._release) + len(self.free) != self.n_slots:
            raise RuntimeError(f"KV pool: {len(self._release)} used + {len(self.free)} free != "
                               f"{self.n_slots} slots")

    # ---- what a batched step reads -------------------------------------------------------------

    def table(self, slot: int) -> list[int]:
        """The slot's block table: block ids, in order of its rows."""
        return [slot * self.blocks_per_seq + j for j in range(self.blocks_per_seq)]

    def row(self, slot: int, position: int) -> int:
        """The pool row of a slot's position."""
        block = self.table(slot)[position // self.block]
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
