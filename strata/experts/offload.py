"""The offload executor: hits from cache slots, misses on the CPU pool or copied over PCIe.

One layer of one step (`run`):
    1. route -> groups of (expert, tokens); the policy sees them
    2. hits: experts resident in slots; misses split by the planner into CPU and copy
    3. copies: each copy-miss is admitted into a slot (evicting per policy, never an expert this
       step uses) or, when the layer has no slot to give, staged through a small buffer
    4. the GPU computes hits and copied experts while the CPU pool computes its share from the arena
    5. the two outputs are added; CPU-computed experts may be admitted for later steps (async)
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from strata.experts.arena import Arena
from strata.experts.cache import ExpertCache
from strata.experts.compute import Group, group_pairs, run_records
from strata.experts.gpu_hits import FusedHits
from strata.experts.planner import MissPlanner
from strata.experts.ring import Ring
from strata.experts.stats import OffloadStats
from strata.model.weights import ExpertWeights
from strata.runtime.waits import to_device, to_host

# a layer streams every uncached expert of a chunk (routing on the device) while the chunks seen
# routed to at least this fraction of them; below, the host reads the routing and copies only
# those routed. On the H200 an 8K prompt whose 4096-token chunks routed to 72% of the experts
# took 0.65 s streaming them all with the routing on the device and 1.31 s copying the 72% with
# the routing read per layer (2.8x its own copy time, the host's syncs): the host path only pays
# below about a third
ROUTED_MIN = 0.4


class OffloadExperts:
    def __init__(self, arena: Arena, cache: ExpertCache, planner: MissPlanner, cpu_pool,  # noqa: ANN001
                 workspace_bytes: int, staging: list[torch.Tensor], ring: Ring | None = None,
                 stream_min: int = 1 << 30, debug: bool = False, fused_max_t: int = 1 << 30,
                 prompt_scratch: int | None = None, ring_borrow: int = 0):
        """ring_borrow: VRAM the ring may add to itself for passes that stream (before_pass)."""
        self.arena, self.cache, self.planner, self.pool = arena, cache, planner, cpu_pool
        self.workspace_bytes, self.staging, self.debug = workspace_bytes, staging, debug
        self.ring, self.stream_min = ring, stream_min
        self.ring_base, self.ring_borrow = (ring.nbytes if ring else 0), ring_borrow
        self.cpu_share = 0  # a decode token's last missed pairs the CPU takes (--cpu-share)
        self.cpu_share_threads: int | None = None  # its pool's threads (--threads, if given)
        self.prefetch = 0  # experts of the next gathered layer copied ahead (--prefetch)
        self.prefetch_auto = False  # --prefetch auto: off without a warning where it cannot run
        self.device = cache.device
        self.fused = FusedHits(arena.layouts, self.device, fused_max_t, prompt_scratch)
        self.stats = OffloadStats(len(arena.layers), arena.n_experts)
        # device-routed prompt chunks: counts kept on the device until the stats are read
        self._dev_counts: tuple[torch.Tensor, torch.Tensor] | None = None
        self._dev_pending = False
        self._gathered_dev: torch.Tensor | None = None  # see gather_counts
        # the cache's lent slots take the ring's VRAM too while they live (memory plan: one
        # decoding sequence); the ring is then empty
        self.lend_ring = False
        # per layer: the fraction of its uncached experts a streamed chunk routed to, last seen
        # (_streams_routed copies them all only when nearly all are used)
        self.routed_fraction: dict[int, float] = {}
        self.stats.settlers.append(self._settle)

    def before_pass(self, tokens: int) -> None:
        """Called before each forward pass or decode step of `tokens` tokens: a pass whose
        chunks stream (tokens >= stream_min) gets the ring with what it may borrow, any other
        the ring's own size (the borrowed bytes go back to the allocator for the decode steps,
        the cache and the KV cache). Lent cache slots live while passes need neither the
        workspace (at most DECODE_MAX_T tokens) nor, where the plan lends the ring too
        (lend_ring), the ring (fewer than stream_min): the ring then gives all its bytes back
        first."""
        lend = False
        if self.cache.lends:
            from strata.kernels.gpu.moe import DECODE_MAX_T

            lend = tokens <= DECODE_MAX_T and not (self.lend_ring and tokens >= self.stream_min)
            if not lend:
                self.cache.lend(False)  # (before the ring takes its bytes back)
        if self.ring is not None and (self.ring_borrow or self.lend_ring):
            self.ring.resize(0 if lend and self.lend_ring else self.ring_base + (
                self.ring_borrow if tokens >= self.stream_min else 0))
        if lend:
            n, nbytes = self.cache.lend(True)
            self.stats.admissions += n
            self.stats.bytes_h2d += nbytes

    def run(self, layer: int, experts: ExpertWeights | None, h: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor, host: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """host: (ids, weights, h) already copied to the host (the decode step's pinned
        buffers), saving the syncs of copying them here."""
        lay = self.arena.layouts[layer]
        ls = self.cache.layers[layer]
        if self.resident(layer, h.shape[0]):
            return self._run_resident(layer, h, ids, weights)
        if self._streams_routed(layer, h.shape[0], ids.shape[1]):
            return self._run_streamed_routed(layer, h, ids, weights)
        if host is None:
            host = (to_host(ids, f"layer {layer} routing ids"),
                    to_host(weights.float(), f"layer {layer} routing weights"), None)
        by_expert = self._routed(layer, host[0], host[1])
        hits = [e for e in by_expert if ls.slot_of[e] >= 0]
        misses = [(e, len(by_expert[e].tokens)) for e in by_expert if ls.slot_of[e] < 0]
        if self.ring is not None and h.shape[0] >= self.stream_min:
            return self._run_streamed(layer, hits, [e for e, _ in misses], by_expert, h, ids,
                                      weights)
        to_cpu, to_copy = self.planner.split(misses, lay.nbytes)

        keep = set(hits) | set(to_copy)
        staged = []
        for e in to_copy:
            slot = self.cache.admit(layer, e, self.arena.record(layer, e), keep, force=True)
            (hits if slot is not None else staged).append(e)
            self.stats.bytes_h2d += lay.nbytes
        out = torch.zeros_like(h)
        h_host = h
        if to_cpu and self.device.type != "cpu":
            h_host = host[2] if host[2] is not None else to_host(h, f"layer {layer} activations")
        self.cache.before_compute(layer)
        self._run_hits(layer, hits, by_expert, h, ids, weights, out)
        self._run_staged(layer, [by_expert[e] for e in staged], h, out, ids, weights)
        self.cache.after_compute(layer)
        if to_cpu:
            out += to_device(self._run_cpu(layer, [by_expert[e] for e in to_cpu], h_host),
                             self.device)
            self._admit_after(layer, to_cpu, keep)
        n_copy = sum(len(by_expert[e].tokens) for e in to_copy)
        self.stats.hits[layer] += sum(len(g.tokens) for g in by_expert.values()) - n_copy - sum(
            len(by_expert[e].tokens) for e in to_cpu)
        self.stats.streamed[layer] += n_copy
        self.stats.cpu[layer] += sum(len(by_expert[e].tokens) for e in to_cpu)
        if self.debug:
            self.cache.check_integrity()
        return out

    def _routed(self, layer: int, ids: torch.Tensor, weights: torch.Tensor) -> dict[int, Group]:
        """A step's pairs of one layer grouped by expert (host tensors); the policy and the
        routing counters see them."""
        groups = group_pairs(ids, weights)
        experts, counts = [g.expert for g in groups], [len(g.tokens) for g in groups]
        self.cache.layers[layer].policy.touch(experts, counts)
        self.stats.count(layer, experts, counts)
        return {g.expert: g for g in groups}

    def resident(self, layer: int, tokens: int) -> bool:
        """Every expert of the layer has a slot (for good: a full layer never evicts) and the
        fused kernels cover its types: the layer runs without the host."""
        return (self.cache.layers[layer].capacity == self.arena.n_experts
                and self.fused.covers(layer, tokens))

    def _run_resident(self, layer: int, h: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """Every expert of the layer has a slot: the fused kernels read the slot table on the
        device, with no routing sync to the host."""
        self.cache.before_compute(layer)
        out = self.device_hits(layer, h, ids, weights, count=True)
        self.cache.after_compute(layer)
        self.stats.hits[layer] += ids.numel()
        return out

    def device_hits(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                    count: bool, sum_pairs: bool = True) -> torch.Tensor:
        """The pairs whose expert has a slot in the device table, with device work only (safe
        to capture in a CUDA graph; the caller counts hits on the host). count: also count the
        routing on the device (layers whose routing the host never reads). sum_pairs=False:
        [T, K, D] rows may come back for the caller to sum (FusedHits.run)."""
        ls = self.cache.layers[layer]
        out = self.fused.run(ls.layout, ls.slots, ls.table, h, ids, weights, None,
                             sum_pairs=sum_pairs)
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
        self.stats.hits[layer] += int(n[hit].sum())
        self.stats.streamed[layer] += int(n[~hit].sum()) - len(on_cpu)
        self.stats.cpu[layer] += len(on_cpu)
        missed = experts[~hit].tolist()
        copied = len(missed) - len(on_cpu)  # records that crossed PCIe for this layer
        if ahead is not None:  # (a guess the CPU share computed was copied for nothing)
            ahead = {int(e) for e in ahead if e >= 0 and slot_of[e] < 0}
            used = len(ahead.intersection(missed).difference(on_cpu))
            self.stats.ahead_used[layer] += used
            self.stats.ahead_unused[layer] += len(ahead) - used
            copied += len(ahead) - used
        self.stats.bytes_h2d += copied * ls.layout.nbytes
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
            self.stats.hits[layer] += flat.size
            return None
        by_expert = self._routed(layer, host[0], host[1])
        hits = [e for e in by_expert if ls.slot_of[e] >= 0]
        misses = [(e, len(by_expert[e].tokens)) for e in by_expert if ls.slot_of[e] < 0]
        to_cpu, to_copy = self.planner.split(misses, lay.nbytes)
        rows = 0 if staging is None else staging.shape[0]
        to_cpu, to_copy = to_cpu + to_copy[rows:], to_copy[:rows]  # (rows >= K in the plan)
        for j, e in enumerate(to_copy):
            staging[j, : lay.stride].copy_(self.arena.record(layer, e), non_blocking=True)
            table[e] = j
        n = {e: len(by_expert[e].tokens) for e in by_expert}
        self.stats.hits[layer] += sum(n[e] for e in hits)
        self.stats.streamed[layer] += sum(n[e] for e in to_copy)
        self.stats.cpu[layer] += sum(n[e] for e in to_cpu)
        self.stats.bytes_h2d += len(to_copy) * lay.nbytes
        out = None
        if to_cpu:
            out = self._run_cpu(layer, [by_expert[e] for e in to_cpu], host[2])
        self._admit_after(layer, to_cpu + to_copy, set(hits) | set(to_cpu) | set(to_copy))
        if self.debug:
            self.cache.check_integrity()
        return out

    def _run_hits(self, layer: int, hits: list[int], by_expert: dict[int, Group],
                  h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                  out: torch.Tensor) -> None:
        """Every pair whose expert has a slot now (hits and just-copied misses)."""
        if not hits:
            return
        ls = self.cache.layers[layer]
        if self.fused.covers(layer, h.shape[0]):
            self.fused.run(ls.layout, ls.slots, ls.table, h, ids, weights, out)
            return
        groups = [by_expert[e] for e in hits]
        if self.device.type == "cpu":  # slots are host memory: the CPU kernel library runs them
            records = [ls.slots[int(ls.slot_of[e])] for e in hits]
            self.pool.run_records(ls.layout, records, groups, h, out)
            return
        slots = torch.tensor([int(ls.slot_of[e]) for e in hits], device=self.device)
        run_records(ls.layout, ls.slots[slots], groups, h, out, self.workspace_bytes)

    def _run_streamed(self, layer: int, hits: list[int], misses: list[int],
                      by_expert: dict[int, Group], h: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor) -> torch.Tensor:
        """A prompt chunk whose routing the host reads (chunks too small for _streams_routed, or
        the ring's per-buffer path): hits from their slots, every routed miss through the ring;
        the cache is left as it is for decode."""
        copied = self.ring.streamed_bytes
        uncached = int((self.cache.layers[layer].slot_of < 0).sum())
        self.routed_fraction[layer] = len(misses) / uncached if uncached else 1.0
        self.ring.prefetch(self.arena, layer, misses)  # (queued before the next layer's)
        self._prefetch_next(layer, h.shape[0], ids.shape[1])
        out = torch.zeros_like(h)
        self.cache.before_compute(layer)
        self._run_hits(layer, hits, by_expert, h, ids, weights, out)
        self.ring.stream(self.arena, layer, [by_expert[e] for e in misses], h, out,
                         self.workspace_bytes)
        self.cache.after_compute(layer)
        self.stats.hits[layer] += sum(len(by_expert[e].tokens) for e in hits)
        self.stats.streamed[layer] += sum(len(by_expert[e].tokens) for e in misses)
        self.stats.bytes_h2d += self.ring.streamed_bytes - copied  # prefetched copies too
        if self.debug:
            self.cache.check_integrity()
        return out

    def _streams_routed(self, layer: int, tokens: int, topk: int) -> bool:
        """A prompt chunk so large that nearly every expert is routed to (4 pairs per expert on
        average), on the ring's bank path: the layer's uncached experts are all streamed, the
        next layer's are queued behind them (copied as this layer's banks free, while attention
        runs), and the routing stays on the device."""
        return (self.ring is not None and self.ring.grouped and tokens >= self.stream_min
                and tokens * topk >= 4 * self.arena.n_experts
                and self.routed_fraction.get(layer, 1.0) >= ROUTED_MIN)

    def _prefetch_next(self, layer: int, tokens: int, topk: int) -> None:
        """Queue the next layer's uncached experts behind this layer's banks when that layer
        will stream them all (_streams_routed): copied as this layer's banks free."""
        if layer + 1 < len(self.arena.layouts) and self._streams_routed(layer + 1, tokens, topk):
            uncached = np.flatnonzero(self.cache.layers[layer + 1].slot_of < 0)
            self.ring.prefetch(self.arena, layer + 1, uncached.tolist())

    def _run_streamed_routed(self, layer: int, h: torch.Tensor, ids: torch.Tensor,
                             weights: torch.Tensor) -> torch.Tensor:
        """A prompt chunk with no host sync: hits from their slots and every uncached expert
        through the ring (moe_forward_grouped for both, which sort the pairs on the device);
        the counters and the policy see the routing when they are read (_settle)."""
        from strata.kernels.gpu.moe_grouped import GROUPED_SCRATCH_BYTES, moe_forward_grouped

        ls = self.cache.layers[layer]
        lay = ls.layout
        copied = self.ring.streamed_bytes
        self.ring.prefetch(self.arena, layer, np.flatnonzero(ls.slot_of < 0).tolist())
        self._prefetch_next(layer, h.shape[0], ids.shape[1])
        out = torch.zeros_like(h)
        scratch = self.fused.scratch_bytes
        kw = {} if scratch is None else {"scratch_bytes": scratch}
        self.cache.before_compute(layer)
        if ls.capacity:
            moe_forward_grouped(h, ids, weights.float(), ls.table, *lay.views(ls.slots),
                                lay.qtypes, lay.d_model, lay.d_expert, out=out, **kw)
        self.ring.stream_routed(self.arena, layer, h, ids, weights.float(), out,
                                scratch if scratch is not None else GROUPED_SCRATCH_BYTES)
        self.cache.after_compute(layer)
        self._count_routed(layer, ids, ls.table)
        self.stats.bytes_h2d += self.ring.streamed_bytes - copied
        if self.debug:
            self.cache.check_integrity()
        return out

    def _count_routed(self, layer: int, ids: torch.Tensor, table: torch.Tensor) -> None:
        """Count a device-routed layer's pairs on the device: routed per expert (for the stats'
        routing counters and the policy, at _settle) and hits / streamed per layer (against
        the table of the chunk: the cache may change before the counts are read)."""
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

    def _settle(self) -> None:
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
        self.stats.hits += split[0]
        self.stats.streamed += split[1]
        for layer in np.flatnonzero(touch.sum(1)):
            experts = np.flatnonzero(touch[layer])
            ls = self.cache.layers[layer]
            self.stats.count(layer, experts, touch[layer][experts])
            ls.policy.touch(experts.tolist(), touch[layer][experts].tolist())
            uncached = ls.slot_of < 0
            if uncached.any():  # (the chunks since the last settle, together)
                self.routed_fraction[layer] = float((touch[layer][uncached] > 0).mean())

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
                           weights, out)

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
            self.stats.admissions += 1
            self.stats.bytes_h2d += self.arena.layouts[layer].nbytes
