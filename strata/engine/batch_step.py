"""One decode token of each of B sequences (or a few tokens of some: a prompt's chunk beside
the others' tokens), on the decode step's machinery, captured as CUDA graphs per batch size
where the plan allows.

The same pieces as the one-sequence step (decode_step.cut_pieces: cut after each layer whose
experts need the host), the model's own layers in a StaticStep context, the executor's paths;
the static buffers hold B rows, and the context's BatchRows say where each row's sequence lives
in the one KV pool (strata.runtime.kv_slots.KVSlots): the pool row its new keys and values go to,
the rows it reads (through its block table), its recurrent-state entry. Position and KV length
are [B] device tensors, so one graph per batch size serves any sequences of the pool.

    rows        a sequence taking t tokens fills t rows at positions length .. length+t-1, each
                with KV length position + 1 and the sequence's block table: every layer stores
                all rows' keys and values before any row attends, so the rows of a prompt's
                chunk attend causally among themselves. Refused where the pool holds recurrent
                state (hybrids: their state moves one token a step)
    sizes       1, 2, 4, 8, 16 below the pool's slots, and the slots (--batch 16: all five;
                --batch 6: 1, 2, 4, 6), then, without recurrent state, powers of two on to
                tuning.MIXED_STEP_ROWS (--batch 6: 8, 16, 32; steps that carry a prompt's
                tokens): a step runs at the next size; its padded rows take token 0 at
                position 0, write the pool's scratch row and (hybrids) a free slot's
                recurrent state, route as row 0 with zero weights (no expert more is read) and
                are never counted
    logits      each sequence's last row's; past the slots the head runs over those rows only
    experts     a layer's experts run once for the batch (the fused kernels take the B tokens'
                pairs; a host layer's misses are planned for the batch: each missed expert is
                copied or computed on the CPU from the tokens it serves)
    attention   each row over its own sequence's rows (decode_ops.paged_attention)

Layers the one-sequence step gathers on the GPU (their staging rows hold one token's K
records) are host layers here. On the CPU (or with --decode-step eager) the pieces run eagerly
over the real rows only; CI checks them against each sequence decoded alone.

Legend: B rows (the batch size), n real rows, S sequences, D hidden, K experts per token,
V vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from strata.engine.decode_step import DECODE_STEP_MODES, Piece, capture_pieces, cut_pieces
from strata.experts.paths import StepAids
from strata.kernels.gpu import decode_ops as ops
from strata.kernels.tuning import MIXED_STEP_ROWS
from strata.model.parts import StaticStep
from strata.model.parts.context import BatchRows
from strata.runtime.kv_slots import KVSlots
from strata.runtime.waits import wait_event

log = logging.getLogger("strata")

BATCH_SIZES = (1, 2, 4, 8, 16)


def padded_size(n: int, sizes: tuple[int, ...] = BATCH_SIZES) -> int:
    """The batch size n rows run at: the smallest of `sizes` >= n."""
    for s in sizes:
        if s >= n:
            return s
    raise ValueError(f"{n} rows: the batched step runs at most {sizes[-1]}")


def step_sizes(slots: int, recurrent: bool) -> tuple[int, ...]:
    """The batch sizes of a pool of `slots` sequences: BATCH_SIZES below the slots and the slots
    themselves (a padded row of a hybrid then always has a free slot's state entry to write);
    without recurrent state, powers of two past the slots up to MIXED_STEP_ROWS, for steps
    that carry a prompt's tokens beside the decoding sequences' (more rows than sequences)."""
    if slots > BATCH_SIZES[-1]:
        raise ValueError(f"{slots} sequences: the batched step runs at most {BATCH_SIZES[-1]}")
    sizes = [s for s in BATCH_SIZES if s < slots] + [slots]
    while not recurrent and sizes[-1] < MIXED_STEP_ROWS:  # (the next power of two, capped)
        sizes.append(min(MIXED_STEP_ROWS, 1 << sizes[-1].bit_length()))
    return tuple(sizes)


def rows_bytes(cfg, size: int, slots: int) -> int:  # noqa: ANN001 (a ModelConfig)
    """Device bytes of one batch size's static buffers (Rows) but its block table (int64
    [B, blocks a sequence]): the inputs, five float32 [B, D] rows, the routing [B, K], the
    staging table [E], the last rows and the logits [min(B, slots), V] float32."""
    logit_rows = min(size, slots)
    return (8 * 5 * size + size + 4 * 5 * size * cfg.d_model + 12 * size * cfg.n_experts_used
            + 4 * cfg.n_experts + 8 * logit_rows + 4 * logit_rows * cfg.n_vocab)


@dataclass(frozen=True)
class Plan:
    """A batch size's layers: each one's path, the pieces cut after its host layers."""

    paths: list[str]
    pieces: list[Piece]
    hits_in_piece: list[bool]  # a host layer whose hits the tail graph computes
    resident: np.ndarray  # the layers without the host

    @classmethod
    def make(cls, paths: list[str]) -> Plan:
        host = [p in ("host", "host_hits") for p in paths]
        return cls(paths, cut_pieces(len(paths), host), [p == "host_hits" for p in paths],
                   np.array([i for i, p in enumerate(paths) if p == "resident"],
                            dtype=np.int64))


@dataclass
class Rows:
    """The static buffers of one batch size."""

    size: int
    inputs_host: torch.Tensor  # int64 [5, B] pinned: token, position, length, write row, state
    inputs: torch.Tensor  # the same on the device
    table_host: torch.Tensor  # int64 [B, nb] pinned: each row's block table
    table: torch.Tensor
    valid: torch.Tensor  # bool [B]: a real row
    valid_host: torch.Tensor
    x: torch.Tensor  # [B, D] the residual stream
    h: torch.Tensor  # [B, D] a host layer's expert input
    ids: torch.Tensor  # int64 [B, K]
    wts: torch.Tensor  # [B, K]
    moe_out: torch.Tensor  # [B, D] a host layer's experts, from the host
    carry: torch.Tensor  # [B, D] its part done on the device (hits, shared expert)
    cpu_out: torch.Tensor  # [B, D] its CPU misses
    cpu_out_host: torch.Tensor
    staged_table: torch.Tensor  # int32 [E]: expert -> staging row of its copied misses
    staged_host: torch.Tensor
    host_bufs: tuple[torch.Tensor, ...]  # pinned (ids, weights, h) of a host layer
    last: torch.Tensor  # int64 [min(B, slots)]: each sequence's last row
    last_host: torch.Tensor
    logits: torch.Tensor  # [B, V]; past the slots [slots, V], the last rows' only
    plan: Plan | None = None
    graphs: tuple | None = None  # (key, [(main, tail)] per piece)
    warm: bool = False  # an eager step ran at this size
    n: int = 0  # real rows of the current step
    span: int = 0  # pool rows each row reads in the current step
    read: torch.Tensor | None = None  # eagerly: the step's pool rows [B, span], made once
    events: dict = field(default_factory=dict)

    @property
    def last_only(self) -> bool:
        """The head runs over each sequence's last row only (sizes past the pool's slots)."""
        return self.logits.shape[0] < self.size


class BatchStep:
    def __init__(self, model, pool: KVSlots, mode: str = "graphs"):  # noqa: ANN001
        """model: the MoETransformer (offload runtime); pool: the KV pool its sequences live
        in (its batch sizes: step_sizes)."""
        from strata.experts.offload import OffloadExperts

        if mode not in DECODE_STEP_MODES[:2]:
            raise ValueError(f"decode step mode {mode!r}")
        ex = model.experts
        if not isinstance(ex, OffloadExperts):
            raise TypeError("the batched decode step runs on the offload runtime")
        self.model, self.ex, self.cfg, self.pool = model, ex, model.cfg, pool
        # (a hybrid's sizes end at the slots: the pool needs no state beyond the plan's)
        self.sizes = step_sizes(pool.n_slots, pool.conv is not None)
        self.rows_max = self.sizes[-1]  # the most rows a step carries
        dev = self.device = model.device
        self.cuda = dev.type == "cuda"
        self.graphs = mode == "graphs" and self.cuda
        cfg = model.cfg
        self._base_paths = ex.decode_paths(cfg.n_experts_used,
                                           [layer.ffn.routed for layer in model.layers])
        self.plans = {size: Plan.make(self._paths(size)) for size in self.sizes}
        largest = self.plans[self.sizes[-1]]
        self.staging = ex.staging[0] if ex.staging else None
        self.aids = StepAids(self.staging)
        self.inv_freq = ops.rope_inv_freq(cfg.rope_dim, cfg.rope_theta, dev)
        if cfg.yarn is not None:
            from strata.kernels.torch_ops import yarn_inv_freq

            self.inv_freq = yarn_inv_freq(cfg.rope_dim, cfg.rope_theta, cfg.yarn, dev)
        self.sync = torch.zeros(1, dtype=torch.int32, device=dev)
        self._rows: dict[int, Rows] = {}
        self._cur: Rows | None = None
        self._host_read: torch.cuda.Event | None = None
        self._failed = False
        self.steps = {"replayed": 0, "eager": 0, "captured": 0, "rows": 0, "padded": 0}
        log.info(f"batched decode step: batch sizes {', '.join(map(str, self.sizes))}, "
                 f"{len(largest.pieces)} piece(s), {len(largest.resident)} of {cfg.n_layers} "
                 f"layers without the host at {self.sizes[-1]}; "
                 + ("CUDA graphs" if self.graphs else "eager"))

    def _paths(self, size: int) -> list[str]:
        """Each layer's path at a batch size: resident layers run in the piece where the fused
        kernels cover `size` tokens (on the CPU, always); every other routed layer waits on
        the host, its hits on the device where the fused kernels cover them (host_hits)."""
        out = []
        for i, p in enumerate(self._base_paths):
            covered = self.cuda and self.ex.fused.covers(i, size)
            if p == "resident" and self.cuda and not covered:
                p = "host"  # (e.g. --kernels exact past 4 tokens: the executor's own path)
            elif p not in ("resident", "none"):
                p = "host_hits" if covered else "host"
            out.append(p)
        return out

    # ---- a step: each sequence's tokens as rows -------------------------------------------------

    @torch.inference_mode()
    def __call__(self, tokens: list[int], caches: list,  # noqa: ANN001
                 takes: list[int] | None = None) -> torch.Tensor:
        """logits [S, V] of each of the S sequences' last row: caches[i] (of this step's pool)
        takes takes[i] tokens (default 1 each) at positions caches[i].length on, flattened in
        `tokens` in order; the rows are sum(takes). Possibly a static buffer: copy to keep."""
        takes = [1] * len(caches) if takes is None else list(takes)
        n = len(tokens)
        if not caches or len(takes) != len(caches) or min(takes) < 1 or sum(takes) != n:
            raise ValueError(f"{n} tokens for {len(caches)} sequences taking {takes} tokens "
                             "each (one or more each, as many in all)")
        if len({id(kv) for kv in caches}) != len(caches):
            raise ValueError("a sequence appears twice in one batched step (one entry a "
                             "sequence, with the tokens it takes)")
        if max(takes) > 1 and self.pool.conv is not None:
            raise ValueError(f"a sequence takes {max(takes)} tokens in one batched step, and "
                             "the KV pool holds recurrent state (a hybrid model's): its state "
                             "moves one token a step, so a prompt's chunk runs on the plain "
                             "forward")
        b = self._buffers(padded_size(n, self.sizes))
        for kv, t in zip(caches, takes, strict=True):
            if getattr(kv, "slots", None) is not self.pool:
                raise ValueError("the batched decode step decodes caches of its own KV pool "
                                 "(KVSlots.take)")
            kv.reserve(kv.length + t)  # (past the pool's rows: refused with the numbers)
            if self.pool.paged:
                kv.own(kv.length, kv.length + t)  # (a shared block is copied before the write)
        self._fill(b, tokens, caches, takes)
        self.ex.before_pass(n)
        _, slots = self.ex.begin_step([])
        key = (slots,)
        self._cur = b  # (what _experts reads, captured or eager)
        graphs = self._graphs(b, key) if self.graphs and not self._failed else None
        self.steps["replayed" if graphs is not None else "eager"] += 1
        self.steps["rows"] += n
        self.steps["padded"] += b.size - n
        timer = self.ex.stats.timer
        t0 = timer.start() if timer else None
        for i, piece in enumerate(b.plan.pieces):
            if graphs is not None:
                graphs[i][0].replay()
            else:
                self._piece(piece, b)
            if piece.host_layer < 0:
                continue
            routed = self._record() if self.cuda else None
            if graphs is not None:
                graphs[i][1].replay()
            else:
                self._tail(piece.host_layer, b)
            if routed is not None:
                self.ex.slots_read([piece.host_layer], self._record())
            self._host_layer(piece.host_layer, routed, b)
        if self.cuda:  # the device counted the resident layers' routing (real rows only)
            self.ex.account(b.plan.resident, hits=self.cfg.n_experts_used * n)
            self.ex.slots_read(b.plan.resident, self._record())
        if timer:
            timer.stop(t0)
        for kv, t in zip(caches, takes, strict=True):
            kv.advance(t)
        s = len(caches)
        if b.last_only or s == n:  # (the head ran over the last rows; or each row is one's)
            return b.logits[:s]
        return b.logits.index_select(0, b.last[:s])

    def line(self) -> str:
        """One line for --stats."""
        why = "; capture failed" if self._failed else ""
        s = self.steps
        return (f"batched decode step: {s['rows']} token(s) in {s['replayed'] + s['eager']} "
                f"step(s) ({s['padded']} padded row(s)), {s['replayed']} replayed from CUDA "
                f"graphs ({s['captured']} capture(s)), {s['eager']} eager{why}")

    def _buffers(self, size: int) -> Rows:
        if size in self._rows:
            return self._rows[size]
        cfg, dev, K = self.cfg, self.device, self.cfg.n_experts_used
        pin = self.cuda
        f32 = dict(dtype=torch.float32, device=dev)
        nb = self.pool.blocks_per_seq
        logit_rows = min(size, self.pool.n_slots)  # (a step's sequences: at most the slots)
        b = Rows(
            size, torch.zeros(5, size, dtype=torch.int64, pin_memory=pin),
            torch.zeros(5, size, dtype=torch.int64, device=dev),
            torch.zeros(size, nb, dtype=torch.int64, pin_memory=pin),
            torch.zeros(size, nb, dtype=torch.int64, device=dev),
            torch.zeros(size, dtype=torch.bool, device=dev),
            torch.zeros(size, dtype=torch.bool, pin_memory=pin),
            torch.zeros(size, cfg.d_model, **f32), torch.zeros(size, cfg.d_model, **f32),
            torch.zeros(size, K, dtype=torch.int64, device=dev), torch.zeros(size, K, **f32),
            torch.zeros(size, cfg.d_model, **f32), torch.zeros(size, cfg.d_model, **f32),
            torch.zeros(size, cfg.d_model, **f32),
            torch.zeros(size, cfg.d_model, dtype=torch.float32, pin_memory=pin),
            torch.full((cfg.n_experts,), -1, dtype=torch.int32, device=dev),
            torch.full((cfg.n_experts,), -1, dtype=torch.int32, pin_memory=pin),
            (torch.zeros(size, K, dtype=torch.int64, pin_memory=pin),
             torch.zeros(size, K, dtype=torch.float32, pin_memory=pin),
             torch.zeros(size, cfg.d_model, dtype=torch.float32, pin_memory=pin)),
            torch.zeros(logit_rows, dtype=torch.int64, device=dev),
            torch.zeros(logit_rows, dtype=torch.int64, pin_memory=pin),
            torch.zeros(logit_rows, cfg.n_vocab, **f32), self.plans[size])
        self._rows[size] = b
        return b

    def _fill(self, b: Rows, tokens: list[int], caches: list,  # noqa: ANN001
              takes: list[int]) -> None:
        """The step's inputs to the device: real rows from their sequences (a sequence's rows
        at its next positions), padded rows at token 0, position 0, writing the pool's scratch
        row and (hybrids) the state of a free slot each, reading row 0's first row; each
        sequence's last row."""
        read = b.events.pop("inputs", None)
        if read is not None:  # the last step's copy has read the pinned buffers
            wait_event(read, "the batched step's input copy")
        n, pool = len(tokens), self.pool
        inp, table, last = b.inputs_host.numpy(), b.table_host.numpy(), b.last_host.numpy()
        inp[:, :] = 0
        inp[2, :] = 1
        inp[3, :] = pool.scratch_row
        if pool.conv is not None and b.size > n:  # a free slot's state entry each (reset when
            free = pool.free[: b.size - n]  # the slot is taken)
            if len(free) < b.size - n:
                raise ValueError(f"{b.size - n} padded row(s) and {len(pool.free)} free slot(s): "
                                 "a batch of a hybrid model is padded only into free slots")
            inp[4, n:] = free
        last[:] = 0
        i = 0
        for j, (kv, take) in enumerate(zip(caches, takes, strict=True)):
            table[i:i + take] = pool.table(kv)
            for p in range(kv.length, kv.length + take):
                inp[:, i] = (tokens[i], p, p + 1, pool.row(kv, p), kv.slot)
                i += 1
            last[j] = i - 1
        table[n:] = table[0]
        b.valid_host[:] = False
        b.valid_host[:n] = True
        b.n = n
        # graphs read every row a slot may hold; eagerly, up to the longest sequence
        b.span = (pool.blocks_per_seq * pool.block if self.graphs
                  else max(kv.length + t for kv, t in zip(caches, takes, strict=True)))
        b.inputs.copy_(b.inputs_host, non_blocking=True)
        b.table.copy_(b.table_host, non_blocking=True)
        b.valid.copy_(b.valid_host, non_blocking=True)
        b.last.copy_(b.last_host, non_blocking=True)
        if self.cuda:
            b.events["inputs"] = self._record()
        # (a graph computes the rows in each piece, from the table as it is at the replay)
        b.read = None if self.graphs else ops.block_rows(b.table, pool.block, b.span)

    # ---- graphs ---------------------------------------------------------------------------------

    def _graphs(self, b: Rows, key: tuple) -> list | None:
        """This size's pieces captured for these cache slot tensors: the first step at a size
        runs eagerly (kernels compiled and warmed), the second captures, later ones replay; when
        only the slot tensors changed (lent slots) the step captures at once."""
        if b.graphs is not None and b.graphs[0] == key:
            return b.graphs[1]
        if b.warm:
            return self._capture(b, key)
        b.warm = True
        return None

    def _capture(self, b: Rows, key: tuple) -> list | None:
        b.graphs = None
        try:
            graphs = capture_pieces(b.plan.pieces, lambda p: self._piece(p, b),
                                    lambda layer: self._tail(layer, b), self.device)
        except Exception as e:  # noqa: BLE001 (any capture failure: run eagerly, say why)
            log.warning(f"batched decode step: CUDA graph capture at batch size {b.size} failed "
                        f"({type(e).__name__}: {e}); decoding eagerly")
            self._failed = True
            torch.cuda.synchronize(self.device)
            return None
        b.graphs = (key, graphs)
        self.steps["captured"] += 1
        return graphs

    # ---- pieces (captured or eager) -------------------------------------------------------------

    def _piece(self, piece: Piece, b: Rows) -> None:
        """The piece's layers, the model's own, over this size's static buffers."""
        w, x = self.model.w, b.x
        read = b.read if b.read is not None else ops.block_rows(b.table, self.pool.block,
                                                                  b.span)  # [B, span]
        rows = BatchRows(self.pool, b.inputs[3], read, b.inputs[4])
        ctx = StaticStep(None, b.inputs[1], b.inputs[2], self.inv_freq, self.sync, False,
                         lambda i: None, self._experts, self.model.fused_attention, rows)
        if piece.first:
            x.copy_(w.embed.rows(b.inputs[0]))
        delta = None
        if piece.after_host:
            prev = piece.layers.start - 1
            if b.plan.hits_in_piece[prev]:
                lay = self.ex.arena.layouts[prev]
                delta = b.carry + b.cpu_out
                if self.staging is not None:
                    delta = self.ex.fused.run(lay, self.staging[:, : lay.stride],
                                              b.staged_table, b.h, b.ids, b.wts, delta)
            else:
                delta = b.moe_out + b.carry
        for i in piece.layers:
            layer = self.model.layers[i]
            r = layer.begin(x, delta, ctx)
            if i == piece.host_layer:
                # (on the CPU only the real rows run: no mask, no host copies)
                ids, wts = self._masked(r.ids, r.wts, b) if self.cuda else (r.ids, r.wts)
                b.h.copy_(r.h)
                b.ids.copy_(ids)
                b.wts.copy_(wts)
                if self.cuda:
                    for buf, src in zip(b.host_bufs, (ids, wts, r.h), strict=True):
                        buf.copy_(src, non_blocking=True)
                return
            delta = layer.finish(r, ctx)
        if b.last_only:  # each sequence's last row: x, delta [slots, D] (delta [slots, R, D]
            x = x.index_select(0, b.last)  # where a static step's experts left R rows unsummed)
            delta = None if delta is None else delta.index_select(0, b.last)
        b.logits.copy_(self.model.head.forward(x, delta, ctx))

    def _masked(self, ids: torch.Tensor, wts: torch.Tensor,
                b: Rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded rows routed as row 0 with zero weights: they read no other expert and add
        nothing."""
        return (torch.where(b.valid[:, None], ids, ids[:1]),
                torch.where(b.valid[:, None], wts, 0.0))

    def _experts(self, i: int, h: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
                 sum_pairs: bool) -> torch.Tensor:
        """A resident layer's experts inside a piece, once for the batch. On CUDA all B rows
        (padded ones masked; the routing counted on the device for the real rows); eagerly on
        the CPU the real rows only (the executor counts them), the padded rows' output zero."""
        b = self._cur
        if self.cuda:
            ids, wts = self._masked(ids, wts, b)
            counter = self.ex.stats.routed_on_device(self.device)[i]
            flat = ids.reshape(-1)
            counter.index_add_(0, flat, b.valid.repeat_interleave(ids.shape[1]).int())
            return self.ex.step_experts(b.plan.paths[i], i, h, ids, wts, sum_pairs, self.aids)
        n = b.n
        out = self.ex.step_experts(b.plan.paths[i], i, h[:n], ids[:n], wts[:n], True,
                                   self.aids)
        return torch.nn.functional.pad(out, (0, 0, 0, h.shape[0] - n))

    def _tail(self, layer: int, b: Rows) -> None:
        """A host layer's device part: the shared expert and (host_hits) the hits."""
        shared = self.model.layers[layer].ffn.shared
        carry = shared.forward(b.h) if shared is not None else torch.zeros_like(b.h)
        if b.plan.hits_in_piece[layer]:
            carry = carry + self.ex.device_hits(layer, b.h, b.ids, b.wts, count=False,
                                                step=True)
        b.carry.copy_(carry)

    def _host_layer(self, layer: int, routed: torch.cuda.Event | None, b: Rows) -> None:
        """A host layer's experts for the batch's real rows, planned by the executor: whole
        (host), or its misses only (host_hits: copied ones to staging rows for the next piece,
        CPU ones summed here)."""
        n = b.n
        if not self.cuda:
            b.moe_out[:n].copy_(self.ex.run(layer, None, b.h[:n], b.ids[:n], b.wts[:n],
                                            host=(b.ids[:n], b.wts[:n], b.h[:n])))
            b.moe_out[n:].zero_()
            return
        wait_event(routed, f"layer {layer} routing (batched decode step)")
        host = tuple(t[:n] for t in b.host_bufs)
        if not b.plan.hits_in_piece[layer]:
            b.moe_out[:n].copy_(self.ex.run(layer, None, b.h[:n], b.ids[:n], b.wts[:n],
                                            host=host))
            return
        if self._host_read is not None:
            wait_event(self._host_read, "the batched step's miss uploads")
        table = b.staged_host.numpy()
        cpu = self.ex.decode_misses(layer, host, self.staging, table)
        b.cpu_out_host.zero_()
        if cpu is not None:
            b.cpu_out_host[:n].copy_(cpu)
        b.staged_table.copy_(b.staged_host, non_blocking=True)
        b.cpu_out.copy_(b.cpu_out_host, non_blocking=True)
        self._host_read = self._record()

    def _record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev
