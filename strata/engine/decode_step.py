"""One decode token of one sequence, captured as CUDA graphs where the plan allows.

The step is cut into pieces at the layers whose experts need the host: a layer with experts
outside the VRAM cache must read its routing on the host to plan its misses. A piece runs, for
its layers, attention and the router and, for a layer whose every expert is resident, the fused
MoE kernels (they read the slot table on the device); it ends after the routing of the next host
layer, its ids, weights and activations copied to pinned host buffers. A short second graph (the
tail) computes that layer's hits and shared expert while the host plans its misses (CPU pool,
staging copies); the next piece starts by adding both.

    piece 0: embed; layers 0 .. m0 (m0's experts left out)     host: experts of m0
    piece 1: x += moe(m0); layers m0+1 .. m1                   host: experts of m1
    ...
    last:    x += moe(mk); layers .. L-1; norm; logits

A piece runs the model's own layers (strata.model.parts.Layer: begin, then finish) in a
StaticStep context, the same part objects as the plain forward's: each picks the fused decode
kernels there (qk_rope_store and decode_attention, norm_route, add_rms_norm) over the static
buffers; a host layer's piece stops after its begin. The experts of a layer inside a piece are
the executor's device paths (`_experts`).

A paged cache (strata.runtime.paged_kv: blocks of a KVSlots pool) is read through its block
table (the context's BatchRows, as the batched step reads B of them): the graphs are captured
once for the pool and serve each of its sequences.

With every expert resident the step is one graph: one launch per token. Each tensor that crosses
a piece boundary is static; the token, position and KV length are device tensors, so a piece is
captured once per KV storage (KVCache.store) and replayed for every later token. A step whose
capture fails runs eagerly, with one warning. On the CPU (or with --decode-step eager) the same
pieces run eagerly: CI checks them against the plain forward.

Legend: D hidden, H heads, Hkv kv heads, hd head dim, K experts per token, V vocab.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from strata.experts.paths import StepAids
from strata.kernels.gpu import decode_ops as ops
from strata.model.parts import StaticStep
from strata.model.parts.context import BatchRows
from strata.runtime.kv_cache import KVCache, KVPool
from strata.runtime.waits import wait_event

log = logging.getLogger("strata")

DECODE_STEP_MODES = ("graphs", "eager", "off")


@dataclass(frozen=True)
class Piece:
    layers: range  # the layers whose attention and routing this piece runs
    host_layer: int  # the last of them when its experts run on the host after the piece; else -1
    first: bool  # embeds the token
    after_host: bool  # starts by adding the previous host layer's expert output


def cut_pieces(n_layers: int, host: list[bool]) -> list[Piece]:
    """Pieces for the layers whose experts need the host (`host[l]`)."""
    pieces, start = [], 0
    for layer in range(n_layers):
        if host[layer]:
            pieces.append(Piece(range(start, layer + 1), layer, start == 0,
                                bool(pieces)))
            start = layer + 1
    pieces.append(Piece(range(start, n_layers), -1, start == 0, bool(pieces)))
    return pieces


def capture_pieces(pieces: list[Piece], run_piece: Callable[[Piece], None],
                   run_tail: Callable[[int], None], device: torch.device) -> list[tuple]:
    """Each piece, and the tail of its host layer, captured as CUDA graphs in one memory pool:
    [(main, tail or None)] (what a capture raises goes to the caller: it decodes eagerly)."""
    torch.cuda.synchronize(device)
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for piece in pieces:
        main = torch.cuda.CUDAGraph()
        with torch.cuda.graph(main, pool=pool):
            run_piece(piece)
        tail = None
        if piece.host_layer >= 0:
            tail = torch.cuda.CUDAGraph()
            with torch.cuda.graph(tail, pool=pool):
                run_tail(piece.host_layer)
        graphs.append((main, tail))
    return graphs


class DecodeStep:
    # the residual step and routing of a layer in one launch (decode_ops.norm_route); False:
    # three (scripts/profile_decode.py --unfused-route times both)
    fuse_route = True

    def __init__(self, model, mode: str = "graphs", kv_capacity: int = 0):  # noqa: ANN001
        """model: the MoETransformer; kv_capacity: the planned context (caches at least this
        large share one storage pool, see KVPool)."""
        from strata.experts.offload import OffloadExperts

        if mode not in DECODE_STEP_MODES[:2]:
            raise ValueError(f"decode step mode {mode!r}")
        ex = model.experts
        if not isinstance(ex, OffloadExperts):
            raise TypeError("the decode step runs on the offload runtime")
        self.model, self.ex, self.cfg = model, ex, model.cfg
        self.kv_capacity, self.kv_pool = kv_capacity, KVPool()
        cfg, dev = model.cfg, model.device
        self.device = dev
        self.graphs = mode == "graphs" and dev.type == "cuda"
        # each layer's path, chosen by the executor from its plan (OffloadExperts.decode_paths):
        # resident (in the piece), gathered (in the piece: the GPU gathers its misses from
        # the mapped arena, no host round trip), host_hits / host (the piece ends after its
        # routing: the host plans its misses, a short graph computes its hits in host_hits)
        self.paths = ex.decode_paths(cfg.n_experts_used,
                                     [layer.ffn.routed for layer in model.layers])
        self.gathered = [p == "gathered" for p in self.paths]
        self.host = [p in ("host", "host_hits") for p in self.paths]
        self.gathered_layers = np.flatnonzero(self.gathered).astype(np.int64)
        # the gathered layers' routing counts of the last step, read on the host at the next
        self._counts_host = torch.zeros(len(self.gathered_layers), cfg.n_experts,
                                        dtype=torch.int32, pin_memory=dev.type == "cuda")
        self._gathered_rows = torch.from_numpy(self.gathered_layers).to(dev)
        self._counts_copied: tuple[torch.cuda.Event, np.ndarray, int] | None = None
        ex.stats.settlers.append(self.settle)  # counters are complete whenever read
        # host layers whose hits the piece computes on the device (the host adds the misses)
        self.hits_in_piece = [p == "host_hits" for p in self.paths]
        self.pieces = cut_pieces(cfg.n_layers, self.host)
        self.resident_layers = np.array([i for i, p in enumerate(self.paths)
                                         if p == "resident"], dtype=np.int64)
        f32 = dict(dtype=torch.float32, device=dev)
        K = cfg.n_experts_used
        # inputs: token, position of the new token, KV length after it
        self.inputs_host = torch.zeros(3, dtype=torch.int64, pin_memory=dev.type == "cuda")
        self.inputs = torch.zeros(3, dtype=torch.int64, device=dev)
        self.x = torch.zeros(1, cfg.d_model, **f32)  # the residual stream
        self.h = torch.zeros(1, cfg.d_model, **f32)  # a host layer's expert input
        self.ids = torch.zeros(1, K, dtype=torch.int64, device=dev)
        self.wts = torch.zeros(1, K, **f32)
        self.moe_out = torch.zeros(1, cfg.d_model, **f32)  # a host layer's part, from the host
        self.carry = torch.zeros(1, cfg.d_model, **f32)  # its part done in the piece
        # a host layer's misses: copied ones are computed at the start of the next piece from
        # the staging rows its table names; the CPU pool's sum arrives in cpu_out
        self.staging = ex.staging[0] if ex.staging else None
        self.staged_table = torch.full((cfg.n_experts,), -1, dtype=torch.int32, device=dev)
        self.cpu_out = torch.zeros(1, cfg.d_model, **f32)
        self.logits = torch.zeros(1, cfg.n_vocab, **f32)
        # --cpu-share: the CPU pool computes a gathered layer's last missed pairs meanwhile
        self.share = None
        opt = ex.options
        if opt.cpu_share and len(self.gathered_layers):
            if any(self.host):  # the pool would serve two threads at once
                log.warning("--cpu-share %d: off, %d layer(s) of this plan wait on the host",
                            opt.cpu_share, sum(self.host))
            else:
                from strata.experts.cpu_share import CpuShare

                self.share = CpuShare(ex, self.gathered_layers.tolist(), opt.cpu_share, K,
                                      cfg.d_model, dev)
                # its worker thread and mapped mailbox go with the step
                weakref.finalize(self, self.share.close)
        # --prefetch: the next gathered layer's likely experts copied while a layer computes
        self.prefetch = None
        if opt.prefetch and dev.type == "cuda":
            pairs = np.intersect1d(self.gathered_layers, self.gathered_layers + 1).size
            # --prefetch auto (which the memory plan keeps only where the cache is small): said
            # as a plan line; given N: a warning
            say = log.info if opt.prefetch_auto else log.warning
            flag = "--prefetch " + ("auto" if opt.prefetch_auto else str(opt.prefetch))
            if any(self.host):  # (a piece ends at a host layer: the side stream would dangle)
                say("%s: off, %d layer(s) of this plan wait on the host", flag, sum(self.host))
            elif not pairs:
                say("%s: off, no layer gathering its misses follows another (%d of them)", flag,
                    len(self.gathered_layers))
            else:
                from strata.engine.decode_prefetch import DecodePrefetch

                self.prefetch = DecodePrefetch(model, self.gathered_layers.tolist(),
                                               opt.prefetch, self.staging)
                # the experts copied ahead for each gathered layer, read with the counts
                self._ahead_host = torch.full((len(self.gathered_layers), opt.prefetch), -1,
                                              dtype=torch.int64, pin_memory=True)
        self.aids = StepAids(self.staging, self.share, self.prefetch)  # (for gathered layers)
        pin = dev.type == "cuda"
        self.host_bufs = (torch.zeros(1, K, dtype=torch.int64, pin_memory=pin),
                          torch.zeros(1, K, dtype=torch.float32, pin_memory=pin),
                          torch.zeros(1, cfg.d_model, dtype=torch.float32, pin_memory=pin))
        self.table_host = torch.full((cfg.n_experts,), -1, dtype=torch.int32, pin_memory=pin)
        self.cpu_out_host = torch.zeros(1, cfg.d_model, dtype=torch.float32, pin_memory=pin)
        self._host_read: torch.cuda.Event | None = None  # the last uploads read the buffers
        self.sync = torch.zeros(1, dtype=torch.int32, device=dev)  # norm_route's count
        self.inv_freq = ops.rope_inv_freq(cfg.rope_dim, cfg.rope_theta, dev)
        if cfg.yarn is not None:  # (its scales: the mixers, SinkAttention and MLAttention)
            from strata.kernels.torch_ops import yarn_inv_freq

            self.inv_freq = yarn_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.yarn, dev)
        self._captured: tuple[tuple[int, int], list[torch.cuda.CUDAGraph]] | None = None
        self._warm: tuple[int, int] | None = None  # the storage whose eager step ran
        self._inputs_read: torch.cuda.Event | None = None
        self._paged: tuple | None = None  # a paged cache's inputs (_paged_inputs)
        self._paged_read: torch.cuda.Event | None = None
        self._span = 0
        self._failed = False
        self.steps = {"replayed": 0, "eager": 0, "captured": 0}  # steps run each way; captures
        log.info(f"decode step: {len(self.pieces)} piece(s), {len(self.resident_layers)} of "
                 f"{cfg.n_layers} layers without the host ({len(self.gathered_layers)} of them "
                 "gathering their missed experts from the arena over PCIe"
                 + (f", the last {self.share.pairs} missed pairs of each on the CPU pool"
                    if self.share is not None else "")
                 + (f", {self.prefetch.n} expert(s) of each copied ahead while the layer "
                    "before computes" if self.prefetch is not None else "") + "); "
                 + ("CUDA graphs" if self.graphs else "eager"))

    # ---- one token --------------------------------------------------------------------------

    @torch.inference_mode()
    def __call__(self, token: int, kv: KVCache) -> torch.Tensor:
        """logits [1, V] of `token` at position kv.length (a static buffer: copy to keep)."""
        kv.reserve(kv.length + 1)
        if self._inputs_read is not None:  # the last step's copy has read the pinned buffer
            wait_event(self._inputs_read, "the decode step's input copy")
        self.inputs_host[0], self.inputs_host[1], self.inputs_host[2] = token, kv.length, \
            kv.length + 1
        self.inputs.copy_(self.inputs_host, non_blocking=True)
        if self.device.type == "cuda":
            self._inputs_read = self._record()
        # the tables the graphs read hold for the whole step; the gathered layers', for their
        # counters; what the graphs hold of the slot tensors
        tables, slots = self.ex.begin_step(self.gathered_layers)
        if getattr(kv, "paged", False):  # blocks of a pool: one graph serves its sequences
            store = self._paged_inputs(kv)
        else:
            store = kv.store.data_ptr() if kv.state is None else (  # (+ a recurrent state)
                kv.store.data_ptr(), kv.state.conv.data_ptr(), kv.state.ssm.data_ptr())
        key = (store, kv.capacity, slots)
        graphs = self._graphs(key, kv) if self.graphs and not self._failed else None
        self.steps["replayed" if graphs is not None else "eager"] += 1
        timer = self.ex.stats.timer
        t0 = timer.start() if timer else None
        step = self.share.begin() if self.share is not None else 0
        for i, piece in enumerate(self.pieces):
            if graphs is not None:
                graphs[i][0].replay()
            else:
                self._piece(piece, kv)
            if piece.host_layer < 0:
                continue
            routed = self._record() if self.device.type == "cuda" else None
            if graphs is not None:  # the layer's hits run while the host plans its misses
                graphs[i][1].replay()
            else:
                self._tail(piece.host_layer)
            if routed is not None:  # a slot the hits read is overwritten only after them
                self.ex.slots_read([piece.host_layer], self._record())
            self._host_layer(piece.host_layer, routed)
        if self.device.type == "cuda":  # device_hits leaves the counting to the host
            self.ex.account(self.resident_layers, hits=self.cfg.n_experts_used)
            if len(self.gathered_layers):
                # slots this step reads are overwritten after it
                self.ex.slots_read(self.gathered_layers, self._record())
                self.settle()  # the last step's routing, while the GPU runs this one
                self._copy_counts(tables, step)
        if self.share is not None:
            self.share.end(self._record() if self.device.type == "cuda" else None)
        if timer:
            timer.stop(t0)
        kv.advance(1)
        return self.logits

    def _paged_inputs(self, kv) -> tuple:  # noqa: ANN001 (a paged cache: runtime/paged_kv.py)
        """A paged cache's pool row for the new token, its recurrent-state entry and its block
        table to the device (the attention reads its rows through them: BatchRows); -> the
        graphs' key for its pool."""
        pool = kv.slots
        kv.own(kv.length, kv.length + 1)  # (a shared block is copied before the write)
        if self._paged is None or self._paged[0] is not pool:
            pin = self.device.type == "cuda"
            nb = pool.blocks_per_seq
            self._paged = (pool, torch.zeros(2, dtype=torch.int64, pin_memory=pin),
                           torch.zeros(2, dtype=torch.int64, device=self.device),
                           torch.zeros(1, nb, dtype=torch.int64, pin_memory=pin),
                           torch.zeros(1, nb, dtype=torch.int64, device=self.device))
        _, inp_host, inp, table_host, table = self._paged
        if self._paged_read is not None:  # the last step's copies have read the buffers
            wait_event(self._paged_read, "the decode step's block table copy")
        inp_host[0], inp_host[1] = pool.row(kv, kv.length), kv.slot
        table_host[0] = torch.tensor(pool.table(kv))
        inp.copy_(inp_host, non_blocking=True)
        table.copy_(table_host, non_blocking=True)
        if self.device.type == "cuda":
            self._paged_read = self._record()
        # (the graphs read every row a sequence may hold; eagerly, up to this one's length)
        self._span = pool.blocks_per_seq * pool.block if self.graphs else kv.length + 1
        base = pool.store if pool.store is not None else pool.latent
        return ("paged", base.data_ptr(), None if pool.conv is None else pool.conv.data_ptr())

    def line(self) -> str:
        """One line for --stats."""
        host = len(self.pieces) - 1
        why = "; capture failed" if self._failed else ""
        return (f"decode step: {len(self.pieces)} piece(s) ({host} layer(s) waiting on the "
                f"host, {len(self.gathered_layers)} gathering misses over PCIe), "
                f"{self.steps['replayed']} step(s) replayed from CUDA graphs "
                f"({self.steps['captured']} capture(s)), {self.steps['eager']} eager{why}")

    def _graphs(self, key: tuple, kv: KVCache) -> list[torch.cuda.CUDAGraph] | None:
        """The pieces captured for this KV storage and these cache slot tensors (key: the
        storage, its capacity, ExpertCache.slots_key). The first step on a storage runs eagerly
        (that compiles and warms up every kernel); the second captures, then replays. When only
        the slot tensors changed (lent slots, ExpertCache.lend) the step captures at once."""
        if self._captured is not None and self._captured[0] == key:
            return self._captured[1]
        if self._warm == key[:2]:
            return self._capture(key, kv)
        self._warm = key[:2]
        return None

    def _capture(self, key: tuple, kv: KVCache) -> list[torch.cuda.CUDAGraph] | None:
        self._captured = None
        try:
            graphs = capture_pieces(self.pieces, lambda p: self._piece(p, kv), self._tail,
                                    self.device)
        except Exception as e:  # noqa: BLE001 (any capture failure: run eagerly, say why)
            log.warning(f"decode step: CUDA graph capture failed ({type(e).__name__}: {e}); "
                        "decoding eagerly")
            self._failed = True
            if self.prefetch is not None:  # its streams may be left in the failed capture
                self.prefetch.new_streams()
            torch.cuda.synchronize(self.device)
            return None
        self._captured = (key, graphs)
        self.steps["captured"] += 1
        return graphs

    # ---- pieces (captured or eager) ---------------------------------------------------------

    def _piece(self, piece: Piece, kv: KVCache) -> None:
        """The piece's layers, each the model's own Layer over the static buffers."""
        w, x = self.model.w, self.x
        rows = None
        if getattr(kv, "paged", False):  # its rows through its block table
            pool, _, inp, _, table = self._paged
            rows = BatchRows(pool, inp[0:1], ops.block_rows(table, pool.block, self._span),
                             inp[1:2])
        ctx = StaticStep(kv, self.inputs[1:2], self.inputs[2:3], self.inv_freq, self.sync,
                         self.fuse_route, lambda i: self._counter(i, piece), self._experts,
                         self.model.fused_attention, rows)
        if piece.first:
            x.copy_(w.embed.rows(self.inputs[0:1]))
            if self.share is not None:
                self.share.tick()
        delta = None
        if piece.after_host:
            prev = piece.layers.start - 1  # the host layer before this piece
            if self.hits_in_piece[prev]:
                lay = self.ex.arena.layouts[prev]
                delta = self.carry + self.cpu_out
                if self.staging is not None:
                    delta = self.ex.fused.run(lay, self.staging[:, : lay.stride],
                                              self.staged_table, self.h, self.ids, self.wts,
                                              delta)
            else:
                delta = self.moe_out + self.carry
        pf = self.prefetch
        for i in piece.layers:
            layer = self.model.layers[i]
            # x += delta; attention; x += attn; h = its norm; the router and its top K (the
            # last three one launch on CUDA)
            r = layer.begin(x, delta, ctx)
            if pf is not None:
                pf.guess(i, x)
            if i == piece.host_layer:
                self.h.copy_(r.h)
                self.ids.copy_(r.ids)
                self.wts.copy_(r.wts)
                for buf, src in zip(self.host_bufs, (r.ids, r.wts, r.h), strict=True):
                    buf.copy_(src, non_blocking=True)
                return  # the layer's hits and shared expert: _tail
            delta = layer.finish(r, ctx)  # (_experts, + the shared expert)
        self.logits.copy_(self.model.head.forward(x, delta, ctx))

    def _experts(self, i: int, h: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
                 sum_pairs: bool) -> torch.Tensor:
        """A layer's routed experts inside a piece (StaticStep.experts): the executor's path
        for the layer (resident or gathered, with the step's staging rows, CPU share and
        prefetch). Without a shared expert (not sum_pairs) the K rows of the token may come
        back unsummed: the next residual step (add_rms_norm) adds them, one launch fewer a
        layer."""
        return self.ex.step_experts(self.paths[i], i, h, ids, wts, sum_pairs, self.aids)

    def _counter(self, layer: int, piece: Piece) -> torch.Tensor | None:
        """Where route_topk counts a layer's routing on the device (OffloadExperts.
        step_counter; None where the host counts: a host layer, the CPU)."""
        return self.ex.step_counter(layer, self.paths[layer], layer == piece.host_layer)

    def _tail(self, layer: int) -> None:
        """A host layer's device part, after its routing went to the host: the shared expert and
        (where the fused kernels cover it) the hits, into `carry` for the next piece. Its own
        graph, so the host plans the misses meanwhile."""
        shared = self.model.layers[layer].ffn.shared
        carry = shared.forward(self.h) if shared is not None else torch.zeros_like(self.h)
        if self.hits_in_piece[layer]:
            carry = carry + self.ex.device_hits(layer, self.h, self.ids, self.wts, count=False)
        self.carry.copy_(carry)

    def _copy_counts(self, tables: np.ndarray, step: int) -> None:
        """The gathered layers' routing counts of the step just queued go to the host (read by
        settle at the next step, or by the counters' reader), with the slot tables it read
        (and the step's number for the CPU share's record of what it computed)."""
        counts = self.ex.gather_counts(self.device)
        self._counts_host.copy_(counts[self._gathered_rows], non_blocking=True)
        if self.prefetch is not None:  # the experts copied ahead for each layer
            self._ahead_host.copy_(self.prefetch.pred[self._gathered_rows], non_blocking=True)
        counts.index_fill_(0, self._gathered_rows, 0)  # the host adds them to its counters
        self._counts_copied = (self._record(), tables, step)

    def settle(self) -> None:
        """The routing of the last step's gathered layers, on the host: hit and gather
        counters, the policy's view, and up to one admission per layer (copied on the copy
        stream after the slots' last reader; the next flush makes the step wait for it)."""
        if self._counts_copied is None:
            return
        event, tables, step = self._counts_copied
        self._counts_copied = None
        wait_event(event, "the decode step's routing counts")
        taken = self.share.taken.get(step, {}) if self.share is not None else {}
        ahead = self._ahead_host.numpy() if self.prefetch is not None else None
        for j, (i, counts, table) in enumerate(zip(self.gathered_layers,
                                                   self._counts_host.numpy(), tables,
                                                   strict=True)):
            self.ex.after_gathered(int(i), counts, table, taken.get(int(i), []),
                                   ahead[j] if ahead is not None else None)

    def _record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _host_layer(self, layer: int, routed: torch.cuda.Event | None) -> None:
        """The experts of a layer with misses, run by the offload executor: only the misses
        when the piece computed the hits. Copied misses land in the staging rows and are
        computed by the next piece (its table uploaded here); CPU misses are summed here."""
        if self.device.type != "cuda":
            host = (self.ids, self.wts, self.h)
            self.moe_out.copy_(self.ex.run(layer, None, self.h, self.ids, self.wts, host=host))
            return
        wait_event(routed, f"layer {layer} routing (decode step)")
        if not self.hits_in_piece[layer]:
            self.moe_out.copy_(self.ex.run(layer, None, self.h, self.ids, self.wts,
                                           host=self.host_bufs))
            return
        if self._host_read is not None:  # (done: the piece after the last upload has run)
            wait_event(self._host_read, "the decode step's miss uploads")
        table = self.table_host.numpy()
        cpu = self.ex.decode_misses(layer, self.host_bufs, self.staging, table)
        if cpu is None:
            self.cpu_out_host.zero_()
        else:
            self.cpu_out_host.copy_(cpu)
        self.staged_table.copy_(self.table_host, non_blocking=True)
        self.cpu_out.copy_(self.cpu_out_host, non_blocking=True)
        self._host_read = self._record()
