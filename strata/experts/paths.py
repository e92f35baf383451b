"""The offload executor's paths: each a way for one layer's experts to run, behind one interface,

    run(layer, h, ids, weights, host=None, sum_pairs=True, aids=None) -> [T, D]

(or, for a decode token with sum_pairs=False, the K pairs' rows [1, K, D]). OffloadExperts picks
them in one place each: `choose` per layer and pass, `decode_paths` per layer of a decode step.

    a pass (OffloadExperts.run, a forward of T tokens):
      resident         every expert has a slot: the fused kernels read the slot table on the
                       device (no host sync)
      streamed_routed  a large prompt chunk: every uncached expert through the ring's banks, the
                       routing left on the device
      streamed         a prompt chunk whose routing the host reads: the routed misses through
                       the ring
      planned          the host reads the routing; the planner sends each miss to the CPU pool
                       or over PCIe (into a cache slot, or through the staging rows)
    a decode step's layer inside a piece (device work only: a CUDA graph captures it):
      device_hits      every expert has a slot (on the CPU device: the planned path, all hits)
      gathered         the GPU gathers each missed record from the mapped arena itself; with
                       the step's aids, the CPU pool takes the last missed pairs (cpu_share)
                       and the next layer's likely experts are copied ahead (prefetch)

Every path counts its pairs and bytes through OffloadExperts.account. A pass longer than one
computation holds (a layer-major prompt's layer: OffloadExperts.pass_rows) runs the streamed
paths once, each streamed expert copied once and computed window by window; any other path
window by window (OffloadExperts.run).

Legend: T tokens, D hidden, K experts per token, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from strata.experts.compute import Group, windows, within
from strata.runtime.waits import to_device, to_host


@dataclass
class StepAids:
    """What a decode step lends its gathered layers: its staging rows, the CPU share
    (strata.experts.cpu_share.CpuShare) and the prefetch (strata.engine.decode_prefetch)."""

    staging: torch.Tensor | None
    share: object | None = None
    prefetch: object | None = None


class Path:
    name = ""

    def __init__(self, ex) -> None:  # noqa: ANN001 (the OffloadExperts)
        self.ex = ex

    def run(self, layer: int, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            host: tuple[torch.Tensor, ...] | None = None, sum_pairs: bool = True,
            aids: StepAids | None = None) -> torch.Tensor:
        raise NotImplementedError


class Resident(Path):
    """Every expert of the layer has a slot: the fused kernels read the slot table on the
    device, with no routing sync to the host (the routing counted there too)."""

    name = "resident"

    def run(self, layer, h, ids, weights, host=None, sum_pairs=True, aids=None):  # noqa: ANN001, ANN201
        ex = self.ex
        ex.cache.before_compute(layer)
        # (a verify window's tokens on the decode step's per-pair kernels too: up to
        # PAIRS_MAX_T, faster than the grouped ones there and rounded as a decode step rounds)
        out = ex.device_hits(layer, h, ids, weights, count=True,
                             step=aids is not None or ex.window)
        ex.cache.after_compute(layer)
        ex.account(layer, hits=ids.numel())
        return out


class StreamedRouted(Path):
    """A prompt chunk with no host sync: hits from their slots and every uncached expert through
    the ring (moe_forward_grouped for both, which sort the pairs on the device); the counters
    and the policy see the routing when they are read (OffloadExperts.settle_routed)."""

    name = "streamed_routed"

    def run(self, layer, h, ids, weights, host=None, sum_pairs=True, aids=None):  # noqa: ANN001, ANN201
        from strata.kernels.gpu.moe_grouped import GROUPED_SCRATCH_BYTES, moe_forward_grouped

        ex = self.ex
        ls = ex.cache.layers[layer]
        lay = ls.layout
        copied = ex.ring.streamed_bytes
        ex.ring.prefetch(ex.arena, layer, np.flatnonzero(ls.slot_of < 0).tolist())
        ex.prefetch_next(layer, h.shape[0], ids.shape[1])
        out = torch.zeros_like(h)
        scratch = ex.fused.scratch_bytes
        kw = {} if scratch is None else {"scratch_bytes": scratch}
        rows, wts = ex.pass_rows, weights.float()
        ex.cache.before_compute(layer)
        if ls.capacity:
            for a, b in windows(h.shape[0], rows):
                moe_forward_grouped(h[a:b], ids[a:b], wts[a:b], ls.table, *lay.views(ls.slots),
                                    lay.qtypes, lay.d_model, lay.d_expert, out=out[a:b], **kw)
        ex.ring.stream_routed(ex.arena, layer, h, ids, wts, out,
                              scratch if scratch is not None else GROUPED_SCRATCH_BYTES, rows)
        ex.cache.after_compute(layer)
        ex.count_routed(layer, ids, ls.table)
        ex.account(None, nbytes=ex.ring.streamed_bytes - copied)
        if ex.options.debug:
            ex.cache.check_integrity()
        return out


def read_routing(ex, layer: int, ids: torch.Tensor, weights: torch.Tensor,  # noqa: ANN001
                 host: tuple | None) -> tuple[tuple, dict[int, Group]]:
    """The host's copy of the routing (host: the decode step's pinned buffers, if given) and
    the pairs grouped by expert (the policy and the routing counters see them)."""
    if host is None:
        host = (to_host(ids, f"layer {layer} routing ids"),
                to_host(weights.float(), f"layer {layer} routing weights"), None)
    return host, ex.routed(layer, host[0], host[1])


class Streamed(Path):
    """A prompt chunk whose routing the host reads (chunks too small for streamed_routed, or the
    ring's per-buffer path): hits from their slots, every routed miss through the ring; the
    cache is left as it is for decode."""

    name = "streamed"

    def run(self, layer, h, ids, weights, host=None, sum_pairs=True, aids=None):  # noqa: ANN001, ANN201
        ex = self.ex
        _, by_expert = read_routing(ex, layer, ids, weights, host)
        slot_of = ex.cache.layers[layer].slot_of
        hits = [e for e in by_expert if slot_of[e] >= 0]
        misses = [e for e in by_expert if slot_of[e] < 0]
        copied = ex.ring.streamed_bytes
        uncached = int((slot_of < 0).sum())
        ex.routed_fraction[layer] = len(misses) / uncached if uncached else 1.0
        ex.ring.prefetch(ex.arena, layer, misses)  # (queued before the next layer's)
        ex.prefetch_next(layer, h.shape[0], ids.shape[1])
        out = torch.zeros_like(h)
        ex.cache.before_compute(layer)
        rows = ex.pass_rows
        for a, b in windows(h.shape[0], rows):  # (one window but in a layer-major prompt)
            part = {g.expert: Group(g.expert, g.tokens - a if a else g.tokens, g.weights)
                    for g in within([by_expert[e] for e in hits], a, b) if len(g.tokens)}
            ex._run_hits(layer, list(part), part, h[a:b], ids[a:b], weights[a:b], out[a:b])
        ex.ring.stream(ex.arena, layer, [by_expert[e] for e in misses], h, out,
                       ex.options.workspace_bytes, rows)
        ex.cache.after_compute(layer)
        ex.account(layer, hits=sum(len(by_expert[e].tokens) for e in hits),
                   streamed=sum(len(by_expert[e].tokens) for e in misses),
                   nbytes=ex.ring.streamed_bytes - copied)  # (prefetched copies too)
        if ex.options.debug:
            ex.cache.check_integrity()
        return out


class Planned(Path):
    """The host reads the routing; the planner splits the misses between the CPU pool and
    copies. Each copy-miss is admitted into a slot (evicting per policy, never an expert this
    step uses) or, when the layer has no slot to give, staged; the GPU computes hits and copied
    experts while the CPU pool computes its share from the arena; CPU-computed experts may be
    admitted for later steps (async)."""

    name = "planned"

    def run(self, layer, h, ids, weights, host=None, sum_pairs=True, aids=None):  # noqa: ANN001, ANN201
        ex = self.ex
        host, by_expert = read_routing(ex, layer, ids, weights, host)
        ex.settle_ahead(layer, by_expert)
        ls, lay = ex.cache.layers[layer], ex.arena.layouts[layer]
        hits = [e for e in by_expert if ls.slot_of[e] >= 0]
        misses = [(e, len(by_expert[e].tokens)) for e in by_expert if ls.slot_of[e] < 0]
        to_cpu, to_copy = ex.planner.split(misses, lay.nbytes)
        keep = set(hits) | set(to_copy)
        staged = []
        for e in to_copy:
            slot = ex.cache.admit(layer, e, ex.arena.record(layer, e), keep, force=True)
            (hits if slot is not None else staged).append(e)
        ex.copy_ahead()  # (a verify window's next layer: behind these copies, beside the compute)
        out = torch.zeros_like(h)
        h_host = h
        if to_cpu and ex.device.type != "cpu":
            h_host = host[2] if host[2] is not None else to_host(h, f"layer {layer} activations")
        ex.cache.before_compute(layer)
        ex._run_hits(layer, hits, by_expert, h, ids, weights, out)
        ex._run_staged(layer, [by_expert[e] for e in staged], h, out, ids, weights)
        ex.cache.after_compute(layer)
        if to_cpu:
            out += to_device(ex._run_cpu(layer, [by_expert[e] for e in to_cpu], h_host),
                             ex.device)
            ex._admit_after(layer, to_cpu, keep)
        n = {e: len(g.tokens) for e, g in by_expert.items()}
        n_copy, n_cpu = sum(n[e] for e in to_copy), sum(n[e] for e in to_cpu)
        ex.account(layer, hits=sum(n.values()) - n_copy - n_cpu, streamed=n_copy, cpu=n_cpu,
                   nbytes=len(to_copy) * lay.nbytes)
        if ex.options.debug:
            ex.cache.check_integrity()
        return out


class DeviceHits(Path):
    """A decode step's layer whose every expert has a slot, inside the piece: the fused kernels
    (the step's route_topk counts the routing; OffloadExperts.account the hits, per step). On
    the CPU device (slots in host memory) the planned path, every pair a hit."""

    name = "device_hits"

    def run(self, layer, h, ids, weights, host=None, sum_pairs=True, aids=None):  # noqa: ANN001, ANN201
        ex = self.ex
        if ex.device.type == "cuda":
            return ex.device_hits(layer, h, ids, weights, count=False, sum_pairs=sum_pairs,
                                  step=aids is not None)
        return ex.run(layer, None, h, ids, weights)


class Gathered(Path):
    """One decode token's experts of a layer whose misses the GPU gathers itself, with device
    work only (a CUDA graph holds it): hits from their slots; each missed pair's record read from
    the mapped arena over PCIe into a staging row by a kernel that reads the slot table, then
    computed from there. The step's route_topk counts the routing on the device
    (OffloadExperts.gather_counts); the host reads it after the step (after_gathered).

    aids.share: the token's last missed pairs are the CPU pool's (posted to the mailbox before
    the gather, their sum taken after); aids.prefetch: records copied ahead for this layer are
    taken from VRAM, and the next layer's copy starts once this gather is queued."""

    name = "gathered"

    def run(self, layer, h, ids, weights, host=None, sum_pairs=True, aids=None):  # noqa: ANN001, ANN201
        share, pf = aids.share, aids.prefetch
        if share is not None:
            share.post(layer, ids, weights, h)
        out = self.ex.gathered(
            layer, h, ids, weights, aids.staging, sum_pairs=sum_pairs,
            host_from=share.host_from if share is not None else None,
            prefetched=pf.ready(layer) if pf is not None else None,
            then=(lambda: pf.issue(layer)) if pf is not None else None)
        if share is not None:
            share.take(layer, out[0, -1] if out.dim() == 3 else out[0])
        return out


PATHS = (Resident, StreamedRouted, Streamed, Planned, DeviceHits, Gathered)
