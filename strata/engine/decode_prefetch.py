"""--prefetch N: while a gathered layer computes, the GPU copies over PCIe the N experts the next
layer will most likely route to, so that the next layer's gather finds them in VRAM.

At a small VRAM budget a decode layer's time is mostly its gather (the missed experts' records
read from the mapped arena over PCIe, strata.kernels.gpu.gather_misses); between two gathers,
while a layer's experts, the next layer's attention and its router run, PCIe idles. Two side
streams inside the step's CUDA graph fill that gap:

    main:   attn_l  router_l -> snap[l % 2]  [wait copied_l] gather_l  moe_l  attn_l+1 ...
    guess:                        predict_l+1 (beside gather_l) -> guessed_l+1
    copy:                      (after gather_l and guessed_l+1) copy_l+1 -> copied_l+1

predict_l+1: layer l+1's router on rms_norm(x_l, ffn_norm_l+1), x_l the residual after layer l's
attention (what layer l+1's router will see, less layer l's experts and layer l+1's attention); the
N experts it ranks best, -1 in place of those with a cache slot, and pre_of[l+1][e] = the row each
will land in. It runs as soon as x_l exists, on a stream of its own, so that only the copy is left
when PCIe frees: one kernel (decode_ops.norm_route, with a count of its own: it may run beside
the main stream's; in a 2 GiB trace, with pre_of's small kernels on the copy stream, the
copy started 25 us after gather_l ended, while PCIe idled). copy_l+1: those records from the arena
into the staging rows K .. K+N-1 (after the K rows of the token's own misses), by a few looping
programs (PROGRAMS). gather_l+1 waits for that copy alone (an event per layer, not the whole stream:
a later guess queued behind it is not waited for) and takes a predicted expert from VRAM, the rest
over PCIe. A wrong guess costs its copy's time.

Every buffer a side stream shares with the main stream is written again only after the main
stream has waited for that use of it: snap is double-buffered (predict_l+1 reads snap[l % 2];
the main stream writes it again at layer l+2, after waiting for copied_l+1, which waited for
guessed_l+1); pre_of has a row per layer (predict_l+1 writes only layer l+1's, which no gather
reads before copied_l+1); the rows, which gather_l reads, are rewritten by copy_l+1, which
follows gather_l. The last target layer joins both side streams, so a captured graph ends with
every fork joined.

Counting: the experts copied ahead per layer (`pred`, [L, N]; -1 where nothing was) go to the host
with the step's routing counts; OffloadExperts.after_gathered counts the ones used and the ones
copied for nothing (their bytes crossed PCIe too).
"""

from __future__ import annotations

import torch

from strata.kernels.gpu import decode_ops as ops
from strata.kernels.tuning import PREFETCH_PROGRAMS as PROGRAMS


class DecodePrefetch:
    def __init__(self, model, layers: list[int], n: int, staging: torch.Tensor):  # noqa: ANN001
        """layers: the gathered layers (a prefetch serves a gathered layer after another);
        staging: the decode staging rows, K for the token's misses and n more for this."""
        cfg, ex = model.cfg, model.experts
        k = cfg.n_experts_used
        if staging.shape[0] < k + n:
            raise ValueError(f"prefetch: {staging.shape[0]} staging rows for {k} + {n}")
        self.model, self.ex, self.n = model, ex, n
        gathered = set(layers)
        self.next = {i: i + 1 for i in layers if i + 1 in gathered}  # layer -> the one it serves
        self.targets = set(self.next.values())
        self.last = max(self.targets, default=-1)
        dev = staging.device
        self.device = dev
        self.new_streams()
        self.guessed = {t: torch.cuda.Event() for t in self.targets}
        self.copied = {t: torch.cuda.Event() for t in self.targets}
        self.snap = torch.zeros(2, 1, cfg.d_model, dtype=torch.float32, device=dev)
        self.sync = torch.zeros(1, dtype=torch.int32, device=dev)  # the guess's norm_route
        # per layer: the prefetch row of each expert copied ahead, -1 for the others (the last
        # entry a spare that the experts not guessed write)
        self.pre_of = torch.full((cfg.n_layers, cfg.n_experts + 1), -1, dtype=torch.int32,
                                 device=dev)
        self.rows = staging[k:k + n]
        self.order = torch.arange(n, dtype=torch.int32, device=dev)
        self.pred = torch.full((cfg.n_layers, n), -1, dtype=torch.int64, device=dev)

    def new_streams(self) -> None:
        """The guess and copy streams (new ones after a failed capture, which may hold them)."""
        self.guess_stream = torch.cuda.Stream(self.device)
        self.copy_stream = torch.cuda.Stream(self.device)

    def guess(self, layer: int, x: torch.Tensor) -> None:
        """Main stream, after layer's attention (x: the residual): on the guess stream, the
        experts the next gathered layer will likely route to, into pred[next]."""
        nxt = self.next.get(layer)
        if nxt is None:
            return
        cfg = self.model.cfg
        lw = self.model.w.layers[nxt]
        table = self.ex.cache.layers[nxt].table  # (the step's tables hold for the whole step)
        self.snap[layer % 2].copy_(x)
        gs = self.guess_stream
        gs.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(gs):
            # the router's N best, -1 for those with a slot: not the best N without a slot,
            # which where most experts have one would mostly be copied for nothing (10 GiB,
            # 30B-A3B: 134 tok/s so, 170 with the best missing among the K picks, 185 with the
            # N best, 203 without prefetch). One launch: norm, router, top N.
            ops.norm_route(self.snap[layer % 2], None, lw.ffn_norm, cfg.rms_eps, lw.router,
                           self.n, False, self.sync, skip=table, ids=self.pred[nxt:nxt + 1],
                           store_h=False)
            pre_of, pred = self.pre_of[nxt], self.pred[nxt]
            pre_of.fill_(-1)
            pre_of.scatter_(0, torch.where(pred >= 0, pred, pre_of.numel() - 1), self.order)
            self.guessed[nxt].record(gs)

    def ready(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Main stream, before layer's gather: wait for its copy; (pre_of, rows) for
        gather_misses, or None when nothing was copied ahead for it."""
        if layer not in self.targets:
            return None
        main = torch.cuda.current_stream(self.device)
        main.wait_event(self.copied[layer])
        if layer == self.last:  # every fork joined (a captured graph must end so)
            main.wait_stream(self.guess_stream)
            main.wait_stream(self.copy_stream)
        return self.pre_of[layer], self.rows

    def issue(self, layer: int) -> None:
        """Main stream, right after layer's gather was queued: on the copy stream, once that
        gather and the next layer's guess are done, copy the guessed experts."""
        nxt = self.next.get(layer)
        if nxt is None:
            return
        cs = self.copy_stream
        cs.wait_stream(torch.cuda.current_stream(self.device))
        cs.wait_event(self.guessed[nxt])
        with torch.cuda.stream(cs):
            self.copy(nxt)
            self.copied[nxt].record(cs)

    def copy(self, layer: int) -> None:
        """On the copy stream: layer's guessed records from the arena into the rows."""
        from strata.kernels.gpu import gather_misses

        ex = self.ex
        lay = ex.arena.layouts[layer]
        gather_misses(self.pred[layer][None], ex.cache.layers[layer].table,
                      ex.arena.layers[layer], self.rows[:, : lay.stride], lay.nbytes,
                      programs=PROGRAMS)
