"""The offload executor: hits from cache slots, misses on the CPU pool or copied over PCIe.

It is built whole: its parts (arena, cache, planner, CPU pool, staging rows, ring) and one frozen
OffloadOptions from the memory plan and the flags (engine/build.py). Its ways of running a layer
are named paths (strata.experts.paths) behind one interface, picked in one place each:

    choose(layer, tokens, topk)     a pass:  resident | streamed_routed | streamed | planned
    decode_paths(topk, routed)      a decode step's layers: resident | gathered | host_hits |
                                    host | none (a layer without routed experts)

and every pair and byte is counted through one call (`account`); a decode step says which slots
its graphs read through `slots_read`.

One layer of a planned pass (`run`):
    1. route -> groups of (expert, tokens); the policy sees them
    2. hits: experts resident in slots; misses split by the planner into CPU and copy
    3. copies: each copy-miss is admitted into a slot (evicting per policy, never an expert this
       step uses) or, when the layer has no slot to give, staged through a small buffer
    4. the GPU computes hits and copied experts while the CPU pool computes its share from the arena
    5. the two outputs are added; CPU-computed experts may be admitted for later steps (async)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from strata.experts.arena import Arena
from strata.experts.cache import ExpertCache
from strata.experts.compute import Group, group_pairs, run_records, windows
from strata.experts.gpu_hits import FusedHits
from strata.experts.paths import (
    DeviceHits,
    Gathered,
    Path,
    Planned,
    Resident,
    StepAids,
    Streamed,
    StreamedRouted,
)
from strata.experts.planner import MissPlanner
from strata.experts.ring import Ring
from strata.experts.stats import OffloadStats
from strata.kernels import tuning
from strata.model.weights import ExpertWeights
from strata.runtime.waits import to_device, to_host

ROUTED_MIN = tuning.ROUTED_MIN

# a decode step's layer: in the piece with every expert in a slot; in the piece, its misses
# gathered by the GPU; after the piece, the host planning its misses while a short graph
# computes its hits (host_hits) or the host running it whole; none: no routed experts
DECODE_PATHS = ("resident", "gathered", "host_hits", "host", "none")


@dataclass(frozen=True)
class OffloadOptions:
    """Everything the executor is built with besides its parts."""

    workspace_bytes: int = 0  # the dequantizing paths' scratch (the memory plan's workspace)
    stream_min: int = 1 << 30  # passes of this many tokens stream their misses (the ring)
    fused_max_t: int = 1 << 30  # the most tokens a call may have for the fused kernels
    x8: bool = False  # decode calls round activations to 8 bits (--kernels fused)
    prompt_scratch: int | None = None  # the prompt path's bf16 weight scratch
    ring_borrow: int = 0  # VRAM the ring may add to itself for passes that stream
    # the cache's lent slots take the ring's VRAM too while they live (memory plan: one
    # decoding sequence); the ring is then empty
    lend_ring: bool = False
    cpu_share: int = 0  # a decode token's last missed pairs the CPU takes (--cpu-share)
    cpu_share_threads: int | None = None  # its pool's threads (--threads, if given)
    prefetch: int = 0  # experts of the next gathered layer copied ahead (--prefetch)
    prefetch_auto: bool = False  # --prefetch auto: off without a warning where it cannot run
    # a verify window's next layer: its likeliest uncached experts copied ahead (copy_ahead)
    window_prefetch: int = 0
    # the most tokens one computation takes (the memory plan's prompt chunk; None: any): a
    # longer pass (a layer-major prompt's layer, strata.model.layer_major) runs in windows of
    # this many, its streamed experts copied once for all of them
    pass_rows: int | None = None
    debug: bool = False  # check the cache's integrity after each layer


class OffloadExperts:
    def __init__(self, arena: Arena, cache: ExpertCache, planner: MissPlanner, cpu_pool,  # noqa: ANN001
                 staging: list[torch.Tensor], ring: Ring | None = None,
                 options: OffloadOptions | None = None):
        options = options or OffloadOptions()
        self.arena, self.cache, self.planner, self.pool = arena, cache, planner, cpu_pool
        self.staging, self.ring, self.options = staging, ring, options
        self.ring_base = ring.nbytes if ring else 0
        self.device = cache.device
        self.fused = FusedHits(arena.layouts, self.device, options.fused_max_t,
                               options.prompt_scratch, x8=options.x8)
        if ring is not None and ring.grouped:  # the banks read the hits' device biases
            ring.use_biases(arena.layouts, self.fused.biases)
        self.stats = OffloadStats(len(arena.layers), arena.n_experts)
        self.paths: dict[str, Path] = {p.name: p(self) for p in (
            Resident, StreamedRouted, Streamed, Planned, DeviceHits, Gathered)}
        # device-routed prompt chunks: counts kept on the device until the stats are read
        self._dev_counts: tuple[torch.Tensor, torch.Tensor] | None = None
        self._dev_pending = False
        self._gathered_dev: torch.Tensor | None = None  # see gather_counts
        # per layer: the fraction of its uncached experts a streamed chunk routed to, last seen
        # (_streams_routed copies them all only when nearly all are used)
        self.routed_fraction: dict[int, float] = {}
        self.stats.settlers.append(self.settle_routed)
        # a verify window's pass (strata.engine.spec sets it around the window's forward): its
        # misses are split per expert by the tokens each serves (planned), never all streamed
        self.window = False
        # the window's guess of the next layer's experts: (layer, ids [T, K] on the device),
        # set by the model's trunk (wants_ahead), copied ahead by copy_ahead; what was copied
        # ahead for a layer, counted when that layer routes (settle_ahead)
        self.guessed: tuple[int, torch.Tensor] | None = None
        self._ahead: dict[int, list[int]] = {}

    # ---- the options, by name -----------------------------------------------------------------

    stream_min = property(lambda self: self.options.stream_min)
    workspace_bytes = property(lambda self: self.options.workspace_bytes)
    debug = property(lambda self: self.options.debug)
    ring_borrow = property(lambda self: self.options.ring_borrow)
    cpu_share = property(lambda self: self.options.cpu_share)
    cpu_share_threads = property(lambda self: self.options.cpu_share_threads)
    prefetch = property(lambda self: self.options.prefetch)
    prefetch_auto = property(lambda self: self.options.prefetch_auto)
    pass_rows = property(lambda self: self.options.pass_rows)

    @property
    def lend_ring(self) -> bool:
        return self.options.lend_ring

    # ---- a pass -------------------------------------------------------------------------------

    def before_pass(self, tokens: int) -> None:
        """Called before each forward pass or decode step of `tokens` tokens: a pass whose
        chunks stream (tokens >= stream_min) gets the ring with what it may borrow, any other
        the ring's own size (the borrowed bytes go back to the allocator for the decode steps,
        the cache and the KV cache). Lent cache slots live while passes need neither the
        workspace (at most DECODE_MAX_T tokens, or a verify window where the fused kernels
        cover every layer with experts: its hits run the per-pair kernels as a decode step's,
        its copied misses go through staging) nor, where the plan lends the ring too
        (lend_ring), the ring (fewer than stream_min): the ring then gives all its bytes back
        first. (Taken back for a window, the lent slots would be lent again at the next decode
        step: the cache's rows moved, a refill over PCIe and the decode graphs captured again
        over the new slot tensors, after every window.)"""
        lend = False
        if self.cache.lends:
            from strata.kernels.tuning import DECODE_MAX_T

            small = tokens <= DECODE_MAX_T or (self.window and all(
                covered or lay.empty for covered, lay in zip(self.fused.covered,
                                                             self.arena.layouts, strict=True)))
            lend = small and not (self.lend_ring and tokens >= self.stream_min)
            if not lend:
                self.cache.lend(False)  # (before the ring takes its bytes back)
        if self.ring is not None and (self.ring_borrow or self.lend_ring):
            self.ring.resize(0 if lend and self.lend_ring else self.ring_base + (
                self.ring_borrow if tokens >= self.stream_min else 0))
        if lend:
            n, nbytes = self.cache.lend(True)
            self.account(None, nbytes=nbytes, admissions=n)

    def choose(self, layer: int, tokens: int, topk: int) -> str:
        """The path of a layer in a pass of `tokens` tokens (strata.experts.paths)."""
        if self.resident(layer, tokens):
            return "resident"
        if self.window:
            return "planned"
        if self._streams_routed(layer, tokens, topk):
            return "streamed_routed"
        if self.ring is not None and tokens >= self.stream_min:
            return "streamed"
        return "planned"

    def run(self, layer: int, experts: ExpertWeights | None, h: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor, host: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """Σ_k weights[t, k] * expert_{ids[t, k]}(h[t]): [T, D]. host: (ids, weights, h)
        already copied to the host (the decode step's pinned buffers), saving the syncs of
        copying them here."""
        path = self.choose(layer, h.shape[0], ids.shape[1])
        if path != "planned":  # (the planned path copies ahead after its own misses' copies)
            self.copy_ahead()
        if path == "streamed_routed":
            return self._run_streamed_routed(layer, h, ids, weights)
        cuts = windows(h.shape[0], self.pass_rows)
        if path == "streamed" or len(cuts) == 1:  # (streamed: its experts once, in windows)
            return self.paths[path].run(layer, h, ids, weights, host)
        # a layer-major prompt's layer on a path that streams nothing: window by window
        return torch.cat([self.paths[path].run(layer, h[a:b], ids[a:b], weights[a:b])
                          for a, b in cuts])

    def _run_streamed_routed(self, layer: int, h: torch.Tensor, ids: torch.Tensor,
                             weights: torch.Tensor) -> torch.Tensor:
        """(The streamed_routed path, by a name of its own: tests count the layers it runs.)"""
        return self.paths["streamed_routed"].run(layer, h, ids, weights)

    def streams(self, tokens: int) -> bool:
        """A pass of `tokens` tokens streams some layer's experts through the ring (`choose`:
        streamed or streamed_routed): a prompt that then runs layer by layer copies each
        streamed expert once, not once per chunk (Generator.layer_major)."""
        return (self.ring is not None and tokens >= self.stream_min and not self.window
                and any(not lay.empty and not self.resident(i, tokens)
                        for i, lay in enumerate(self.arena.layouts)))

    def resident(self, layer: int, tokens: int) -> bool:
        """Every expert of the layer has a slot (for good: a full layer never evicts) and the
        fused kernels cover its types: the layer runs without the host."""
        return (self.cache.layers[layer].capacity == self.arena.n_experts
                and self.fused.covers(layer, tokens))

    def _streams_routed(self, layer: int, tokens: int, topk: int) -> bool:
        """A prompt chunk so large that nearly every expert is routed to (4 pairs per expert on
        average), on the ring's bank path: the layer's uncached experts are all streamed, the
        next layer's are queued behind them (copied as this layer's banks free, while attention
        runs), and the routing stays on the device."""
        return (self.ring is not None and self.ring.grouped and tokens >= self.stream_min
                and tokens * topk >= 4 * self.arena.n_experts
                and self.routed_fraction.get(layer, 1.0) >= ROUTED_MIN)

    def prefetch_next(self, layer: int, tokens: int, topk: int) -> None:
        """Queue the next layer's uncached experts behind this layer's banks when that layer
        will stream them all (_streams_routed): copied as this layer's banks free."""
        if layer + 1 < len(self.arena.layouts) and self._streams_routed(layer + 1, tokens, topk):
            uncached = np.flatnonzero(self.cache.layers[layer + 1].slot_of < 0)
            self.ring.prefetch(self.arena, layer + 1, uncached.tolist())

    def wants_ahead(self, layer: int, tokens: int) -> bool:
        """A verify window's pass guesses this layer's experts ahead (--prefetch in windows):
        the layer has experts outside VRAM."""
        return (self.window and self.options.window_prefetch > 0
                and 0 <= layer < len(self.arena.layouts) and not self.resident(layer, tokens))

    def copy_ahead(self) -> None:
        """A verify window's guess of the next layer's experts (`guessed`, from the residual
        after this layer's attention): its likeliest experts without a slot, by the guessed
        tokens each serves, up to options.window_prefetch, admitted into that layer's slots
        now. Their copies queue on the copy stream behind this layer's own and run while this
        layer computes; that layer's routing then finds them in VRAM (or the guess was wrong
        and cost its bytes)."""
        g, self.guessed = self.guessed, None
        if g is None:
            return
        layer, ids = g
        flat = to_host(ids, f"layer {layer} guessed experts").numpy().ravel()
        experts, counts = np.unique(flat, return_counts=True)
        ls = self.cache.layers[layer]
        served = dict(zip(experts.tolist(), counts.tolist(), strict=True))
        missing = sorted((-c, e) for e, c in served.items() if ls.slot_of[e] < 0)
        done: list[int] = []
        for c, e in missing[:self.options.window_prefetch]:
            # (never evicting a guessed expert at least as likely, nor one just copied)
            keep = {x for x, n in served.items() if n >= -c} | set(done)
            if self.cache.admit(layer, e, self.arena.record(layer, e), keep, force=True) is None:
                break  # (no slot to give)
            done.append(e)
        if done:
            self._ahead[layer] = done
            self.account(None, nbytes=len(done) * self.arena.layouts[layer].nbytes,
                         admissions=len(done))

    def settle_ahead(self, layer: int, routed: Collection[int]) -> None:
        """The layer routed to `routed`: count the experts copied ahead for it as used or not."""
        ahead = self._ahead.pop(layer, None)
        if ahead:
            used = sum(e in routed for e in ahead)
            self.stats.ahead_used[layer] += used
            self.stats.ahead_unused[layer] += len(ahead) - used

    # ---- accounting -----------------------------------------------------------------------------

    def account(self, layer: int | Sequence[int] | slice | None, hits: int | np.ndarray = 0,
                streamed: int | np.ndarray = 0, cpu: int | np.ndarray = 0, nbytes: int = 0,
                admissions: int = 0) -> None:
        """The one place pairs and bytes are counted: pairs of `layer` (a layer, several, or
        a slice of them) served from cache slots, computed from copied records, computed by the
        CPU pool; expert bytes copied to the device and cache admissions (any layer)."""
        st = self.stats
        if layer is not None:
            st.hits[layer] += hits
            st.streamed[layer] += streamed
            st.cpu[layer] += cpu
        st.bytes_h2d += nbytes
        st.admissions += admissions

    def slots_read(self, layers: Sequence[int], event: torch.cuda.Event) -> None:
        """A decode step queued reads of these layers' slots up to `event`: no copy overwrites
        one of them before it."""
        for i in layers:
            self.cache.layers[int(i)].used = event

    def routed(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> dict[int, Group]:
        """A step's pairs of one layer grouped by expert (host tensors); the policy and the
        routing counters see them."""
        groups = group_pairs(ids, weights)
        experts, counts = [g.expert for g in groups], [len(g.tokens) for g in groups]
        self.cache.layers[layer].policy.touch(experts, counts)
        self.stats.count(layer, experts, counts)
        return {g.expert: g for g in groups}

    def count_routed(self, layer: int, ids: torch.Tensor, table: torch.Tensor) -> None:
        """Count a device-routed layer's pairs on the device: routed per expert (for the stats'
        routing counters and the policy, at settle_routed) and hits / streamed per layer
        (against the table of the chunk: the cache may change before the counts are read)."""
        flat = ids.reshape(-1).long()
        if self._dev_counts is None:
            n_layers, n_experts = len(self.arena.layouts), self.arena.n_experts
            self._dev_counts = (torch.zeros(n_layers, n_experts, dtype=torch.int64,
                                            device=ids.device),
                                torch.zeros(2, n_layers, dtype=torch.int64, device=ids.device))
        touch, split = self._dev_counts
        touch[layer].scatter_add_(0, flat, torch.ones_like(flat))
        hit = (table[flat] >= 0).long().sum()
        split[0, layer] += hit
        split[1, layer] += flat.numel() - hit
        self._dev_pending = True

    def settle_routed(self) -> None:
        """Device-routed layers' counts to the host: hits and streamed pairs per layer, and
        the routing for the policies (one bounded wait)."""
        if not self._dev_pending:
            return
        self._dev_pending = False
        touch_dev, split_dev = self._dev_counts
        # copies: on the CPU device to_host returns the tensor itself, zeroed next
        touch = to_host(touch_dev, "the prompt's routing counts").numpy().copy()
        split = to_host(split_dev, "the prompt's hit counts").numpy().copy()
        with torch.inference_mode():  # the counters were made in it
            touch_dev.zero_()
            split_dev.zero_()
        self.account(slice(None), hits=split[0], streamed=split[1])
        for layer in np.flatnonzero(touch.sum(1)):
            experts = np.flatnonzero(touch[layer])
            ls = self.cache.layers[layer]
            self.stats.count(layer, experts, touch[layer][experts])
            ls.policy.touch(experts.tolist(), touch[layer][experts].tolist())
            uncached = ls.slot_of < 0
            if uncached.any():  # (the chunks since the last settle, together)
                self.routed_fraction[layer] = float((touch[layer][uncached] > 0).mean())

    # ---- a decode step --------------------------------------------------------------------------

    def decode_paths(self, topk: int, routed: Sequence[bool]) -> list[str]:
        """Each layer's path in a decode step (DECODE_PATHS), chosen once from the plan: on
        CUDA resident where every expert has a slot and the fused kernels cover the layer,
        else gathered where the GPU can gather its misses (gathers), else host_hits where
        the fused kernels cover its hits, else host; on the CPU resident where every expert
        has a slot, else host. routed[l]: layer l has routed experts."""
        cuda = self.device.type == "cuda"
        out = []
        for i, has in enumerate(routed):
            if not has:
                out.append("none")
            elif (cuda and self.resident(i, 1)) or (
                    not cuda and self.cache.layers[i].capacity == self.arena.n_experts):
                out.append("resident")
            elif cuda and self.gathers(i, topk):
                out.append("gathered")
            else:
                out.append("host_hits" if cuda and self.fused.covers(i, 1) else "host")
        return out

    def begin_step(self, gathered: Sequence[int]) -> tuple[np.ndarray | None, tuple]:
        """Before a decode step: the cache's pending changes land (the step's graphs read
        tables that then hold for the whole step). Returns the slot tables (slot_of, [G, E])
        of the gathered layers as the step reads them (None without any), and the slot
        tensors' key (ExpertCache.slots_key: what captured graphs hold)."""
        self.cache.flush()
        tables = (np.stack([self.cache.layers[i].slot_of for i in gathered]) if len(gathered)
                  else None)
        return tables, self.cache.slots_key()

    def step_experts(self, path: str, layer: int, h: torch.Tensor, ids: torch.Tensor,
                     weights: torch.Tensor, sum_pairs: bool, aids: StepAids) -> torch.Tensor:
        """A decode step's layer inside its piece, on its decode path (resident: device_hits,
        gathered: gathered), device work only on CUDA."""
        name = {"resident": "device_hits", "gathered": "gathered"}[path]
        return self.paths[name].run(layer, h, ids, weights, sum_pairs=sum_pairs, aids=aids)

    def step_counter(self, layer: int, path: str, ends_piece: bool) -> torch.Tensor | None:
        """Where a decode step's route_topk counts a layer's routing on the device: a gathered
        layer's own counter (read by the step's settle: after_gathered), the stats' for layers
        whose routing the host never reads; None where the host counts (a layer that ends its
        piece, the CPU device)."""
        if path == "gathered":
            return self.gather_counts(self.device)[layer]
        if self.device.type == "cuda" and not ends_piece:
            return self.stats.routed_on_device(self.device)[layer]
        return None

    def device_hits(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    count: bool, sum_pairs: bool = True, step: bool = False) -> torch.Tensor:
        """The pairs whose expert has a slot in the device table, with device work only (safe
        to capture in a CUDA graph; the caller counts hits on the host). count: also count the
        routing on the device (layers whose routing the host never reads). sum_pairs=False:
        [T, K, D] rows may come back for the caller to sum; step: a decode step's call
        (FusedHits.run)."""
        ls = self.cache.layers[layer]
        out = self.fused.run(ls.layout, ls.slots, ls.table, h, ids, weights, None,
                             sum_pairs=sum_pairs, step=step)
        if count:
            self.stats.count_on_device(layer, ids)
        return out

    def gathers(self, layer: int, topk: int) -> bool:
        """A decode token's misses in this layer can be gathered by the GPU itself (gathered):
        the fused kernels cover the layer, the arena is page-locked (so mapped for the
        device), the staging rows hold topk records of it, and the planner sends one-token
        misses over PCIe rather than to the CPU."""
        lay = self.arena.layouts[layer]
        st = self.staging[0] if self.staging else None
        return (self.device.type == "cuda" and self.fused.covers(layer, 1)
                and self.arena.layers[layer].is_pinned() and st is not None
                and st.shape[0] >= topk and st.shape[1] >= lay.stride
                and self.planner.copies_one_token(lay.nbytes))

    def gathered(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 staging: torch.Tensor, sum_pairs: bool = True, host_from: int | None = None,
                 prefetched: tuple[torch.Tensor, torch.Tensor] | None = None,
                 then: Callable[[], None] | None = None) -> torch.Tensor:
        """One decode token's experts of a layer, with device work only (a CUDA graph holds
        it): hits from their slots; each missed pair's record read from the mapped arena over
        PCIe into staging row p by a kernel that reads the slot table, then computed from
        there. The caller counts the routing on the device (gather_counts: the decode step's
        route_topk); the host reads it after the step (after_gathered). host_from: the token's
        missed pairs from there on are the CPU's (strata.experts.cpu_share): not gathered.
        prefetched: records copied ahead (strata.engine.decode_prefetch), taken from there;
        then: called once the gather is queued (the next layer's prefetch starts there)."""
        from strata.kernels.gpu import gather_misses

        ls = self.cache.layers[layer]
        lay = ls.layout
        rows = staging[: ids.numel(), : lay.stride]  # (rows after them: --prefetch's)
        gather_misses(ids, ls.table, self.arena.layers[layer], rows, lay.nbytes, host_from,
                      prefetched=prefetched)
        if then is not None:
            then()
        slots = ls.slots if ls.capacity else rows  # (no slot: the table sends every pair to rows)
        return self.fused.run(lay, slots, ls.table, h, ids, weights, None,
                              miss=lay.views(rows), sum_pairs=sum_pairs, host_from=host_from)

    def gather_counts(self, device: torch.device) -> torch.Tensor:
        """[L, E] int32 on the device: gathered layers' routing since the decode step last read
        it (its own counter: after_gathered adds it to the stats)."""
        if self._gathered_dev is None:
            self._gathered_dev = torch.zeros(len(self.arena.layouts), self.arena.n_experts,
                                             dtype=torch.int32, device=device)
        return self._gathered_dev

    def after_gathered(self, layer: int, counts: np.ndarray, slot_of: np.ndarray,
                       on_cpu: list[int] = (), ahead: np.ndarray | None = None) -> None:
        """The host's part of a gathered layer, one step late: counters, the policy's view of
        the routing (counts [E] of that step, slot_of [E] the table it read) and up to one
        admission. on_cpu: the missed experts the CPU pool computed (one token each); ahead:
        the experts a prefetch copied for this layer in that step (-1: none)."""
        ls = self.cache.layers[layer]
        experts = np.flatnonzero(counts)
        n = counts[experts]
        ls.policy.touch(experts.tolist(), n.tolist())
        self.stats.count(layer, experts, n)
        hit = slot_of[experts] >= 0
        missed = experts[~hit].tolist()
        copied = len(missed) - len(on_cpu)  # records that crossed PCIe for this layer
        if ahead is not None:  # (a guess the CPU share computed was copied for nothing)
            ahead = {int(e) for e in ahead if e >= 0 and slot_of[e] < 0}
            used = len(ahead.intersection(missed).difference(on_cpu))
            self.stats.ahead_used[layer] += used
            self.stats.ahead_unused[layer] += len(ahead) - used
            copied += len(ahead) - used
        self.account(layer, hits=int(n[hit].sum()), streamed=int(n[~hit].sum()) - len(on_cpu),
                     cpu=len(on_cpu), nbytes=copied * ls.layout.nbytes)
        if missed:
            self._admit_after(layer, missed, set(experts.tolist()))

    def decode_misses(self, layer: int, host: tuple[torch.Tensor, ...],
                      staging: torch.Tensor | None, table: np.ndarray) -> torch.Tensor | None:
        """The misses of one decode token in a layer whose hits the decode step computed on the
        device (the table as the step began: ExpertCache.flush). Copied misses go to staging
        rows (copies queued on the compute stream; `table` [E] gets expert -> row, -1
        elsewhere) for the next piece to compute; CPU misses are computed here and returned
        summed (host [1, D]), or None when the CPU had none. One missed expert per layer and
        step may then enter the cache for later steps (policy permitting).
        host: (ids, weights, h) on the host."""
        lay, ls = self.arena.layouts[layer], self.cache.layers[layer]
        table.fill(-1)
        flat = host[0].numpy().ravel()
        if (ls.slot_of[flat] >= 0).all():  # every pair hits (the common case)
            experts, counts = np.unique(flat, return_counts=True)
            ls.policy.touch(experts.tolist(), counts.tolist())
            self.stats.count(layer, experts, counts)
            self.account(layer, hits=flat.size)
            return None
        by_expert = self.routed(layer, host[0], host[1])
        hits = [e for e in by_expert if ls.slot_of[e] >= 0]
        misses = [(e, len(by_expert[e].tokens)) for e in by_expert if ls.slot_of[e] < 0]
        to_cpu, to_copy = self.planner.split(misses, lay.nbytes)
        rows = 0 if staging is None else staging.shape[0]
        to_cpu, to_copy = to_cpu + to_copy[rows:], to_copy[:rows]  # (rows >= K in the plan)
        for j, e in enumerate(to_copy):
            staging[j, : lay.stride].copy_(self.arena.record(layer, e), non_blocking=True)
            table[e] = j
        n = {e: len(by_expert[e].tokens) for e in by_expert}
        self.account(layer, hits=sum(n[e] for e in hits), streamed=sum(n[e] for e in to_copy),
                     cpu=sum(n[e] for e in to_cpu), nbytes=len(to_copy) * lay.nbytes)
        out = None
        if to_cpu:
            out = self._run_cpu(layer, [by_expert[e] for e in to_cpu], host[2])
        self._admit_after(layer, to_cpu + to_copy, set(hits) | set(to_cpu) | set(to_copy))
        if self.debug:
            self.cache.check_integrity()
        return out

    # ---- what the paths share -----------------------------------------------------------------

    def _run_hits(self, layer: int, hits: list[int], by_expert: dict[int, Group],
                  h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  out: torch.Tensor) -> None:
        """Every pair whose expert has a slot now (hits and just-copied misses)."""
        if not hits:
            return
        ls = self.cache.layers[layer]
        if self.fused.covers(layer, h.shape[0]):  # (a window: as a decode step, Resident)
            self.fused.run(ls.layout, ls.slots, ls.table, h, ids, weights, out, step=self.window)
            return
        groups = [by_expert[e] for e in hits]
        if self.device.type == "cpu":  # slots are host memory: the CPU kernel library runs them
            records = [ls.slots[int(ls.slot_of[e])] for e in hits]
            self.pool.run_records(ls.layout, records, groups, h, out)
            return
        slots = torch.tensor([int(ls.slot_of[e]) for e in hits], device=self.device)
        run_records(ls.layout, ls.slots[slots], groups, h, out, self.workspace_bytes)

    def _run_staged(self, layer: int, groups: list[Group], h: torch.Tensor, out: torch.Tensor,
                    ids: torch.Tensor, weights: torch.Tensor) -> None:
        """Experts with no slot to land in go through the staging buffer, a round at a time:
        on the fused kernels (a table of the round's experts) where they cover the layer."""
        if not groups:
            return
        lay = self.arena.layouts[layer]
        cap = self.staging[0].shape[0] if self.staging else 0
        fused = self.fused.covers(layer, h.shape[0])
        for s in range(0, len(groups), max(cap, 1)):
            chunk = groups[s:s + cap]
            buf = self.staging[0][: len(chunk), : lay.stride]
            for j, g in enumerate(chunk):
                buf[j].copy_(self.arena.record(layer, g.expert), non_blocking=True)
            if not fused:
                run_records(lay, buf, chunk, h, out, self.workspace_bytes)
                continue
            table = np.full(self.arena.n_experts, -1, dtype=np.int32)
            table[[g.expert for g in chunk]] = np.arange(len(chunk), dtype=np.int32)
            self.fused.run(lay, buf, to_device(torch.from_numpy(table), self.device), h, ids,
                           weights, out, step=self.window)

    def _run_cpu(self, layer: int, groups: list[Group], h_host: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = torch.zeros_like(h_host)
        self.pool.run(layer, self.arena, groups, h_host, out)
        spent = time.perf_counter() - t0
        self.stats.cpu_s += spent
        self.planner.observe_cpu(self.arena.layouts[layer].nbytes, len(groups),
                                 sum(len(g.tokens) for g in groups), spent)
        return out

    def _admit_after(self, layer: int, experts: list[int], keep: set[int]) -> None:
        """Let the policy pull one missed expert (computed on the CPU or from staging) into the
        cache per layer and step; the copy runs on the copy stream and is first used by a later
        step."""
        ls = self.cache.layers[layer]
        if ls.capacity == 0:
            return
        best = max(experts, key=lambda e: ls.policy.counts[e] if hasattr(ls.policy, "counts")
                   else 0)
        if self.cache.admit(layer, best, self.arena.record(layer, best), keep) is not None:
            self.account(None, nbytes=self.arena.layouts[layer].nbytes, admissions=1)
