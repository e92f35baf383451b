"""The expert cache: VRAM slots holding copies of hot experts (host tensors on --device cpu).

    layer l: slots uint8 [n_slots_l, stride_l]     one packed record per slot (layout.py)
             slot_of[E]   host int32, -1 = not resident      } always agree
             table[E]     device int32 copy, for kernels     }
             expert_in[n_slots_l]  host int32, -1 = free, -2 = filling (a refill's copy is in
                                   flight)

Lent slots: the memory plan may give a layer more slots in the VRAM of the prompt workspace
(and the ring), which only passes of more than a few tokens use. `lend(True)` grows each such
layer's slot tensor by them (the resident rows copied over, the new slots filled with the
policy's best-ranked experts on the copy stream, entering the maps once landed); `lend(False)`
shrinks it back, keeping the best-ranked residents. Each change bumps `generation`; a decode
step's CUDA graphs hold the slot tensors' addresses (`slots_key`) and are captured again where
they moved.

Copies into slots run on a copy stream. A slot is overwritten only after the compute that last read
that layer's slots is done (`used` event), and the next compute of the layer waits for the copies
(`ready` event), so the hit path never reads a half-written slot and never blocks on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from strata.experts.layout import ExpertLayout
from strata.experts.policy import Policy
from strata.runtime.waits import to_device


@dataclass
class LayerSlots:
    layout: ExpertLayout
    slots: torch.Tensor  # uint8 [n, stride] on the device
    slot_of: np.ndarray  # int32 [E]
    expert_in: np.ndarray  # int32 [n]
    table: torch.Tensor  # int32 [E] on the device
    policy: Policy
    ready: torch.cuda.Event | None = None
    used: torch.cuda.Event | None = None
    dirty: bool = field(default=False)  # table needs an upload
    lent: int = 0  # slots it holds in the workspace while lent (ExpertCache.lend)

    @property
    def capacity(self) -> int:
        return self.slots.shape[0]

    def resident(self) -> list[int]:
        return [int(e) for e in self.expert_in if e >= 0]


class IntegrityError(AssertionError):
    pass


# expert_in of a slot holding no expert; of one a refill's copy is filling (ExpertCache.land)
FREE, FILLING = -1, -2


class ExpertCache:
    def __init__(self, layouts: list[ExpertLayout], slots_per_layer: list[int], n_experts: int,
                 policies: list[Policy], device: torch.device, lent: Sequence[int] = ()):
        """lent: per layer, slots the workspace holds while lent (memory_plan.lend_slots)."""
        self.device, self.n_experts = device, n_experts
        self.generation, self.lending = 0, False  # see lend
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.layers = []
        for lay, n, pol in zip(layouts, slots_per_layer, policies, strict=True):
            n = min(n, n_experts)
            self.layers.append(LayerSlots(
                lay, torch.empty(n, lay.stride, dtype=torch.uint8, device=device),
                np.full(n_experts, -1, np.int32), np.full(n, -1, np.int32),
                torch.full((n_experts,), -1, dtype=torch.int32, device=device), pol))
        for ls, n in zip(self.layers, lent or [0] * len(self.layers), strict=True):
            ls.lent = max(0, min(n, n_experts - ls.capacity))
        self.arena_layers: list[torch.Tensor] | None = None  # warm's: lent slots fill from it
        self._filling: tuple[torch.cuda.Event | None, list[tuple[int, int, int]]] | None = None

    @property
    def nbytes(self) -> int:
        return sum(ls.slots.numel() for ls in self.layers)

    @property
    def capacity(self) -> int:
        return sum(ls.capacity for ls in self.layers)

    def slots_key(self) -> tuple[tuple[int, int], ...]:
        """Each layer's slot tensor (address, slots): what a CUDA graph reading them holds. A
        tensor lend() makes anew often lands where its predecessor was: the graphs then stay."""
        return tuple((ls.slots.data_ptr(), ls.capacity) for ls in self.layers)

    @property
    def lends(self) -> bool:
        return any(ls.lent for ls in self.layers)

    def line(self) -> str:
        """One line for --stats on the lent slots."""
        lent = sum(ls.lent for ls in self.layers)
        return (f"expert cache: {self.capacity} slots now ({'with' if self.lending else 'without'}"
                f" the {lent} lent while decoding); lent {self.generation // 2 + self.lending} "
                f"time(s), given back {self.generation // 2}")

    def warm(self, arena_layers: list[torch.Tensor]) -> None:
        """Fill every layer's slots with its best-ranked experts (policy.rank)."""
        self.arena_layers = arena_layers
        for i, ls in enumerate(self.layers):
            for e in ls.policy.rank()[: ls.capacity]:
                self.admit(i, e, arena_layers[i][e], keep=set())
        self.sync()

    def lend(self, on: bool) -> tuple[int, int]:
        """Grow (on) or shrink every layer with lent slots. Growing fills the new slots with the
        experts the policy now ranks best among those not resident (copy stream; returns the
        records and bytes it copies in); shrinking keeps the best-ranked residents (device copies)
        and forgets the rest."""
        if on == self.lending or not self.lends:
            return 0, 0
        self.sync()  # no copy in flight into the tensors replaced below
        with torch.inference_mode(False):  # (plain tensors: admit copies into them anywhere)
            for ls in self.layers:
                if ls.lent:
                    (self._grow if on else self._shrink)(ls)
        if self.cuda:  # copies into the new tensors wait for the rows moved into them (and for
            ev = torch.cuda.Event()  # whatever last used their memory on the compute stream)
            ev.record(torch.cuda.current_stream(self.device))
            for ls in self.layers:
                if ls.lent:
                    ls.used = ev
        self.lending = on
        self.generation += 1
        return self._refill() if on and self.arena_layers is not None else (0, 0)

    def _refill(self) -> tuple[int, int]:
        """Copy the experts the policy ranks best into the free slots (copy stream), FILLING
        until the copies have landed (`land`): decode steps run meanwhile, without them."""
        n = nbytes = 0
        landing = []
        for i, ls in enumerate(self.layers):
            free = np.flatnonzero(ls.expert_in == FREE)
            best = [e for e in ls.policy.current() if ls.slot_of[e] < 0][: free.size]
            for slot, e in zip(free.tolist()[: len(best)], best, strict=True):
                self._copy_in(ls, slot, self.arena_layers[i][e])
                ls.expert_in[slot] = FILLING
                landing.append((i, slot, int(e)))
                n, nbytes = n + 1, nbytes + ls.layout.nbytes
        if landing:
            self._filling = (self._event(), landing)
            self.land()
        return n, nbytes

    def _event(self) -> torch.cuda.Event | None:
        """Recorded on the copy stream after what it was given (None on the CPU: copies there
        are done when issued)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(self.copy_stream)
        return ev

    def land(self) -> None:
        """Slots a refill is filling enter the maps once their copies have landed (the next
        flush uploads the tables); an expert that found a slot meanwhile frees its copy's."""
        if self._filling is None:
            return
        ev, landing = self._filling
        if ev is not None and not ev.query():
            return
        self._filling = None
        for i, slot, e in landing:
            ls = self.layers[i]
            if slot >= ls.capacity or ls.expert_in[slot] != FILLING:
                continue
            if ls.slot_of[e] >= 0:
                ls.expert_in[slot] = FREE
                continue
            ls.slot_of[e], ls.expert_in[slot] = slot, e
            ls.dirty = True

    def _copy_in(self, ls: LayerSlots, slot: int, record: torch.Tensor) -> None:
        """A record into a slot no kernel reads yet: on the copy stream, after the layer's last
        reader, with no `ready` for the compute stream to wait on."""
        if not self.cuda:
            ls.slots[slot].copy_(record)
            return
        with torch.cuda.stream(self.copy_stream):
            if ls.used is not None:
                self.copy_stream.wait_event(ls.used)
            ls.slots[slot].copy_(record, non_blocking=True)

    def _grow(self, ls: LayerSlots) -> None:
        n = ls.capacity
        slots = torch.empty(n + ls.lent, ls.layout.stride, dtype=torch.uint8, device=self.device)
        slots[:n].copy_(ls.slots)
        ls.slots = slots
        ls.expert_in = np.concatenate([ls.expert_in, np.full(ls.lent, FREE, np.int32)])

    def _shrink(self, ls: LayerSlots) -> None:
        n = ls.capacity - ls.lent
        rank = ls.policy.current()
        order = {e: r for r, e in enumerate(rank)}
        kept = sorted(ls.resident(), key=lambda e: order.get(e, len(rank)))[:n]
        rows = torch.tensor([int(ls.slot_of[e]) for e in kept], dtype=torch.long)
        slots = torch.empty(n, ls.layout.stride, dtype=torch.uint8, device=self.device)
        if kept:
            torch.index_select(ls.slots, 0, rows.to(self.device), out=slots[: len(kept)])
        ls.slots = slots
        ls.slot_of[:] = -1
        ls.expert_in = np.full(n, FREE, np.int32)
        for s, e in enumerate(kept):
            ls.slot_of[e], ls.expert_in[s] = s, e
        ls.dirty = True

    def admit(self, layer: int, expert: int, record: torch.Tensor, keep: set[int],
              force: bool = False) -> int | None:
        """Copy `expert`'s record into a free slot, or over the policy's victim (never one in
        `keep`). Returns the slot, or None when the layer has no slot to give."""
        ls = self.layers[layer]
        if ls.slot_of[expert] >= 0:
            return int(ls.slot_of[expert])
        free = np.flatnonzero(ls.expert_in == FREE)  # (not a FILLING one)
        if free.size:
            slot = int(free[0])
        else:
            victim = ls.policy.victim(ls.resident(), keep | {expert})
            if victim is None or not (force or ls.policy.admit(expert, victim)):
                return None
            slot = int(ls.slot_of[victim])
            ls.slot_of[victim] = -1
        self._copy(ls, slot, record)
        ls.slot_of[expert], ls.expert_in[slot] = slot, expert
        ls.dirty = True
        return slot

    def _copy(self, ls: LayerSlots, slot: int, record: torch.Tensor) -> None:
        """_copy_in, and the layer's next compute waits for it (`ready`)."""
        self._copy_in(ls, slot, record)
        if self.cuda:
            ls.ready = torch.cuda.Event()
            ls.ready.record(self.copy_stream)

    def before_compute(self, layer: int) -> LayerSlots:
        """Make the compute stream see this layer's finished copies and current table."""
        ls = self.layers[layer]
        if ls.dirty:
            ls.table.copy_(to_device(torch.from_numpy(ls.slot_of), self.device))
            ls.dirty = False
        if self.cuda and ls.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(ls.ready)
            ls.ready = None
        return ls

    def after_compute(self, layer: int) -> None:
        """Mark the point after which this layer's slots may be overwritten."""
        if self.cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            self.layers[layer].used = ev

    def flush(self) -> None:
        """Bring every layer's device table and finished copies to the compute stream (a decode
        step's graphs then read tables that agree with the host maps for the whole step)."""
        self.land()
        for i, ls in enumerate(self.layers):
            if ls.dirty or ls.ready is not None:
                self.before_compute(i)

    def sync(self) -> None:
        if self.cuda:
            self.copy_stream.synchronize()
        self.land()
        for i in range(len(self.layers)):
            self.before_compute(i)

    def check_integrity(self) -> None:
        """resident + free == capacity; slot_of and expert_in are inverse; the device table
        equals the host map. Raises IntegrityError naming the layer."""
        for i, ls in enumerate(self.layers):
            res = np.flatnonzero(ls.slot_of >= 0)
            free = int((ls.expert_in < 0).sum())
            if len(res) + free != ls.capacity:
                raise IntegrityError(f"layer {i}: {len(res)} resident + {free} free != "
                                     f"{ls.capacity} slots")
            for e in res:
                if ls.expert_in[ls.slot_of[e]] != e:
                    raise IntegrityError(f"layer {i}: expert {e} -> slot {ls.slot_of[e]} holds "
                                         f"{ls.expert_in[ls.slot_of[e]]}")
            if not ls.dirty and not np.array_equal(ls.table.cpu().numpy(), ls.slot_of):
                raise IntegrityError(f"layer {i}: the device slot table differs from the host map")
