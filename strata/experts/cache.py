"""The expert cache: VRAM slots holding copies of hot experts (host tensors on --device cpu).

    layer l: slots uint8 [n_slots_l, stride_l]     one packed record per slot (layout.py)
             slot_of[E]   host int32, -1 = not resident      } always agree
             table[E]     device int32 copy, for kernels     }
             expert_in[n_slots_l]  host int32, -1 = free

Copies into slots run on a copy stream. A slot is overwritten only after the compute that last read
that layer's slots is done (`used` event), and the next compute of the layer waits for the copies
(`ready` event), so the hit path never reads a half-written slot and never blocks on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from strata.engine.waits import to_device
from strata.experts.layout import ExpertLayout
from strata.experts.policy import Policy


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

    @property
    def capacity(self) -> int:
        return self.slots.shape[0]

    def resident(self) -> list[int]:
        return [int(e) for e in self.expert_in if e >= 0]


class IntegrityError(AssertionError):
    pass


class ExpertCache:
    def __init__(self, layouts: list[ExpertLayout], slots_per_layer: list[int], n_experts: int,
                 policies: list[Policy], device: torch.device):
        self.device, self.n_experts = device, n_experts
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.layers = []
        for lay, n, pol in zip(layouts, slots_per_layer, policies, strict=True):
            n = min(n, n_experts)
            self.layers.append(LayerSlots(
                lay, torch.empty(n, lay.stride, dtype=torch.uint8, device=device),
                np.full(n_experts, -1, np.int32), np.full(n, -1, np.int32),
                torch.full((n_experts,), -1, dtype=torch.int32, device=device), pol))

    @property
    def nbytes(self) -> int:
        return sum(ls.slots.numel() for ls in self.layers)

    @property
    def capacity(self) -> int:
        return sum(ls.capacity for ls in self.layers)

    def warm(self, arena_layers: list[torch.Tensor]) -> None:
        """Fill every layer's slots with its best-ranked experts (policy.rank)."""
        for i, ls in enumerate(self.layers):
            for e in ls.policy.rank()[: ls.capacity]:
                self.admit(i, e, arena_layers[i][e], keep=set())
        self.sync()

    def admit(self, layer: int, expert: int, record: torch.Tensor, keep: set[int],
              force: bool = False) -> int | None:
        """Copy `expert`'s record into a free slot, or over the policy's victim (never one in
        `keep`). Returns the slot, or None when the layer has no slot to give."""
        ls = self.layers[layer]
        if ls.slot_of[expert] >= 0:
            return int(ls.slot_of[expert])
        free = np.flatnonzero(ls.expert_in < 0)
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
        if not self.cuda:
            ls.slots[slot].copy_(record)
            return
        with torch.cuda.stream(self.copy_stream):
            if ls.used is not None:
                self.copy_stream.wait_event(ls.used)
            ls.slots[slot].copy_(record, non_blocking=True)
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
        for i, ls in enumerate(self.layers):
            if ls.dirty or ls.ready is not None:
                self.before_compute(i)

    def sync(self) -> None:
        if self.cuda:
            self.copy_stream.synchronize()
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
