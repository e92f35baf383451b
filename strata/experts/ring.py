"""The streaming ring: prompt chunks stream every missed expert through a VRAM buffer, the copies
running ahead of the compute.

    ring: uint8 [nbytes]     with grouped compute (CUDA): a circular run of banks, each bank
                             m records of one layer (m × that layer's stride, 256-aligned, m
                             chosen so a layer gets ~4 banks in the ring; a mixed pack sizes
                             each bank from its own layer, never from another layer's format)

The bank path (`grouped`): the ring keeps a FIFO of banks across calls and layers, first those
issued (copy enqueued on the copy stream), then those queued (experts decided, not copied yet).
`prefetch(layer, experts)` queues banks; `stream(layer, ...)` queues banks for routed misses
not covered yet, sends the layer's small index tensors (tokens, weights, slots, group ends) to
the device in one go, then computes the layer's banks in FIFO order, each one as a group on
tensor cores (strata.kernels.gpu.moe_grouped.experts_forward_grouped, reading the bank's
records through ExpertLayout.views like cache slots, with no copy to the device of its own),
issuing copies as banks free. The small copies go before any bank copy of the call because the
copy engine takes host-to-device copies in issue order, across streams (seen on the H200): a
small copy on the compute stream queued behind prefetched banks would hold up the compute.
Before streaming layer l, the executor queues l's misses, then (chunks large enough to route
nearly every expert) layer l + 1's uncached experts: their copies run as l's banks free, and
the copy engine keeps working while attention runs. Such chunks do not read the routing on the
host at all (`stream_routed`): every uncached expert is queued, and each bank's pairs are found
on the device (moe_forward_grouped with the bank's slot table), so the host queues a whole
chunk without waiting on the GPU.

What waits on what: a bank's compute waits for its `ready` event (copy stream). A bank is
placed at the write position, or at 0 when it does not fit before the end (`Regions`); every
bank it overwrites must be *consumed* (its compute enqueued and a `free` event recorded on the
compute stream after it), and the copy stream waits on those `free` events. A copy never waits
on a compute the host has not enqueued yet (stream.wait_event only sees records already made):
when an overlapping bank is not consumed, issuing stops until the next consume. Copies from the
arena need no other ordering (pinned host memory, written once). Banks of another layer standing
before the current layer's banks (a prefetch left by an exception) are dropped, never computed;
an expert is only computed when it is in the call's groups, once.

Otherwise (CPU, or `--kernels exact` on CUDA) the ring is carved per layer into
n_l = nbytes // stride_l single buffers within one call: buffer b is written only after the
compute that last read it (`free[b]`) and computed after its copy (`ready[b]`), each computed
alone by run_records (dequantize to float32 + bmm: exact weights). `prefetch` is a no-op there.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from strata.experts.arena import Arena
from strata.experts.compute import Group, run_records, windows, within
from strata.experts.layout import ExpertLayout
from strata.runtime.waits import to_device

log = logging.getLogger("strata.ring")

_ALIGN = 256  # bank starts; record strides are multiples of it (strata.experts.layout)


def ring_size(requested: int | None, layouts: list[ExpertLayout], default: int) -> int:
    """The ring's byte budget: at least the largest record of any layer (raised with a warning)."""
    largest = max(lay.stride for lay in layouts)
    size = default if requested is None else requested
    if size < largest:
        if requested is not None:
            log.warning("--ring-bytes %d is below the largest expert record (%d bytes, layer %d); "
                        "raised to that", requested, largest,
                        max(layouts, key=lambda lay: lay.stride).layer)
        size = largest
    return size


def bank_records(nbytes: int, stride: int) -> int:
    """Records per bank of a layer: about 4 banks in the ring (2 when fewer than 4 records fit,
    1 record when only one fits: copies and computes then alternate)."""
    n = nbytes // stride
    if n < 1:
        raise ValueError(f"a ring of {nbytes} bytes holds no record of {stride} bytes")
    return n // 4 if n >= 4 else max(1, n // 2)


@dataclass
class _Span:
    start: int
    end: int
    key: object
    consumed: bool = False


class Regions:
    """Circular placement of banks in the ring's bytes (pure bookkeeping, no device work).

    A bank goes at the write position, or at 0 when it does not fit before the end. It may only
    overwrite banks already consumed; those then leave the bookkeeping (the copy stream waited
    on their `free` once, and later copies on the same stream come after that wait)."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.head = 0  # the write position
        self.spans: list[_Span] = []  # placed and not yet overwritten, in placement order

    def place(self, size: int, key: object) -> tuple[int, list[object]] | None:
        """(start, keys of the consumed banks it overwrites), or None (nothing changes) when an
        overlapping bank is not consumed yet."""
        if not 0 < size <= self.nbytes:
            raise ValueError(f"a bank of {size} bytes in a ring of {self.nbytes}")
        start = self.head if self.head + size <= self.nbytes else 0
        end = start + size
        over = [s for s in self.spans if s.start < end and start < s.end]
        if not all(s.consumed for s in over):
            return None
        self.spans = [s for s in self.spans if not (s.start < end and start < s.end)]
        self.spans.append(_Span(start, end, key))
        self.head = -(-end // _ALIGN) * _ALIGN
        return start, [s.key for s in over]

    def consume(self, key: object) -> None:
        """The bank's compute is enqueued (or it was dropped): it may be overwritten."""
        for s in self.spans:
            if s.key is key:
                s.consumed = True


@dataclass(eq=False)
class Bank:
    """m records of one layer's experts at one place in the ring."""

    lay: ExpertLayout
    experts: list[int]
    start: int = -1  # byte offset in the ring once issued
    ready: torch.cuda.Event | None = field(default=None, repr=False)  # the copy landed
    free: torch.cuda.Event | None = field(default=None, repr=False)  # the compute read it

    @property
    def layer(self) -> int:
        return self.lay.layer

    @property
    def nbytes(self) -> int:
        return len(self.experts) * self.lay.stride

    @property
    def issued(self) -> bool:
        return self.start >= 0


_Call = tuple[list[Group], int, int]  # groups one compute call takes, their first row and slot
_Plan = tuple[Bank, list[_Call]]  # a bank and its calls (one per window of tokens)


class Ring:
    def __init__(self, nbytes: int, device: torch.device, grouped: bool = False):
        """grouped: compute banks of streamed experts in bf16 on tensor cores (CUDA with triton
        only; the engine should ask for it with --kernels fused, not exact/off)."""
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.device = device
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        if self.cuda:  # buf's memory may still be read by kernels queued before it was allocated
            self.copy_stream.wait_stream(torch.cuda.current_stream(device))
        self.streamed_bytes = 0
        self.grouped = grouped and self.cuda and _grouped_available()
        self.banks: list[Bank] = []  # FIFO, not yet consumed: issued ones first, then queued
        self.regions = Regions(nbytes)
        self._tables: dict[tuple[int, tuple[int, ...]], tuple[torch.Tensor, ...]] = {}
        # layer -> its experts' (gate, up, down) biases on the device (rows by expert id) and
        # activation, for layers with biases (gpt-oss): use_biases
        self.biases: dict[int, tuple[tuple[torch.Tensor, ...], str]] = {}

    def use_biases(self, layouts: list[ExpertLayout],
                   biases: dict[int, tuple[tuple[torch.Tensor, ...], str]]) -> None:
        """Compute the banks of layers with expert biases with them: `biases` maps a layer to
        its (gate, up, down) biases on the device, float32 [E, F], [E, F], [E, D], rows by
        expert id, and its activation (the hit path's copies, FusedHits.biases: not copied
        again). Where a layer with biases has none there, the bank path is off (the
        per-buffer path computes every layer, biases included, from float32 weights)."""
        missing = [lay.layer for lay in layouts if lay.bias is not None and lay.layer not in biases]
        if missing:
            log.info("the ring's grouped banks are off: layers %s have expert biases without a "
                     "device copy", missing[:8])
            self.grouped = False
            return
        self.biases = biases

    @property
    def nbytes(self) -> int:
        return self.buf.numel()

    def resize(self, nbytes: int) -> None:
        """Make the ring nbytes large (borrowing VRAM for a prompt, or giving it back), between
        passes: banks still queued or issued are stale then (an exception left them) and are
        dropped. The old buffer goes back to the allocator once every copy into it landed."""
        if nbytes == self.nbytes:
            return
        while self.banks:
            self._consume(self.banks[0])
        if self.cuda:  # kernels reading the old buffer are ordered before any later use
            torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        self.buf = None
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.cuda:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        self.regions = Regions(nbytes)

    def buffers(self, layout: ExpertLayout) -> torch.Tensor:
        """This layer's view of the ring for the per-buffer path: uint8 [n_l, stride_l]."""
        n = self.nbytes // layout.stride
        return self.buf[: n * layout.stride].view(n, layout.stride)

    # ---- the bank path: state across calls -----------------------------------------------------

    def prefetch(self, arena: Arena, layer: int, experts: list[int]) -> None:
        """Queue banks for these experts of `layer` (in this order; those already queued or
        issued for it are skipped). `stream` issues their copies, after its layer's small
        copies, as space frees. A no-op off the bank path."""
        if not self.grouped:
            return
        covered = self._covered(layer)
        self._queue(arena.layouts[layer], [e for e in experts if e not in covered])

    def _covered(self, layer: int) -> set[int]:
        return {e for b in self.banks if b.layer == layer for e in b.experts}

    def _queue(self, lay: ExpertLayout, experts: list[int]) -> None:
        m = bank_records(self.nbytes, lay.stride)
        for i in range(0, len(experts), m):
            self.banks.append(Bank(lay, experts[i:i + m]))

    def _issue(self, arena: Arena) -> None:
        """Issue queued banks in FIFO order until one finds no consumed place."""
        for bank in self.banks:
            if bank.issued:
                continue
            placed = self.regions.place(bank.nbytes, bank)
            if placed is None:
                return
            bank.start, overwritten = placed
            self._copy(arena, bank, [b.free for b in overwritten])

    def _copy(self, arena: Arena, bank: Bank, waits: list[torch.cuda.Event | None]) -> None:
        view = self._view(bank)
        ctx = torch.cuda.stream(self.copy_stream) if self.cuda else nullcontext()
        with ctx:
            for ev in waits:
                if ev is not None:
                    self.copy_stream.wait_event(ev)
            for j, src in _pieces(arena, bank.layer, bank.experts):
                view[j:j + src.shape[0]].copy_(src, non_blocking=self.cuda)
            if self.cuda:
                bank.ready = torch.cuda.Event()
                bank.ready.record(self.copy_stream)
        self.streamed_bytes += len(bank.experts) * bank.lay.nbytes

    def _consume(self, bank: Bank) -> None:
        """Take the head bank off the FIFO once its compute is enqueued (or to drop it)."""
        assert self.banks and self.banks[0] is bank
        self.banks.pop(0)
        if not bank.issued:
            return
        if self.cuda:
            bank.free = torch.cuda.Event()
            bank.free.record(torch.cuda.current_stream(self.device))
        self.regions.consume(bank)

    def _view(self, bank: Bank) -> torch.Tensor:
        return self.buf[bank.start: bank.start + bank.nbytes].view(len(bank.experts),
                                                                   bank.lay.stride)

    # ---- streaming -----------------------------------------------------------------------------

    def stream(self, arena: Arena, layer: int, groups: list[Group], h: torch.Tensor,
               out: torch.Tensor, workspace_bytes: int, rows: int | None = None) -> None:
        """out += Σ over the groups' experts, each copied into the ring and computed there.
        rows: the tokens computed at once (a layer-major prompt's whole layer: in windows of
        at most this many, each expert copied once for all of them)."""
        if self.grouped:
            self._stream_banks(arena, layer, groups, h, out, rows)
            return
        lay = arena.layouts[layer]
        bufs = self.buffers(lay)
        n = bufs.shape[0]
        if not self.cuda:
            for i in range(0, len(groups), n):
                chunk = groups[i:i + n]
                for j, g in enumerate(chunk):
                    bufs[j].copy_(arena.record(layer, g.expert))
                run_records(lay, bufs[: len(chunk)], chunk, h, out, workspace_bytes, rows)
                self.streamed_bytes += len(chunk) * lay.nbytes
            return
        compute = torch.cuda.current_stream(self.device)
        free: list[torch.cuda.Event | None] = [None] * n
        start = torch.cuda.Event()
        start.record(compute)  # h is ready
        for i, g in enumerate(groups):
            b = i % n
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(free[b] if free[b] is not None else start)
                bufs[b].copy_(arena.record(layer, g.expert), non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.copy_stream)
            compute.wait_event(ready)
            run_records(lay, bufs[b:b + 1], [g], h, out, workspace_bytes, rows)
            free[b] = torch.cuda.Event()
            free[b].record(compute)
            self.streamed_bytes += lay.nbytes

    def _stream_banks(self, arena: Arena, layer: int, groups: list[Group], h: torch.Tensor,
                      out: torch.Tensor, rows: int | None = None) -> None:
        """The bank path of `stream`: this layer's banks in FIFO order (prefetched ones first,
        then banks for the routed misses they do not cover), each computed as one group per
        window of `rows` tokens."""
        covered = self._covered(layer)
        self._queue(arena.layouts[layer], [g.expert for g in groups if g.expert not in covered])
        plans = self._plan(layer, {g.expert: g for g in groups}, h.shape[0], rows)
        # the layer's small copies go first: the copy engine takes host-to-device copies in
        # issue order across streams, so behind a bank's copy they would hold up the compute
        upload = self._upload(plans)
        while plans:
            bank = self.banks[0]
            if bank.layer != layer:  # stale, or ahead of this layer's banks: dropped
                self._consume(bank)
                continue
            self._issue(arena)  # every bank before it is consumed: it finds a place
            assert bank.issued and plans[0][0] is bank
            _, calls = plans.pop(0)
            for todo, r, s in calls:
                if todo:  # prefetched experts nobody routed to are not computed
                    self._compute(bank, todo, upload, r, s, h, out)
            self._consume(bank)
        self._issue(arena)

    def stream_routed(self, arena: Arena, layer: int, h: torch.Tensor, ids: torch.Tensor,
                      weights: torch.Tensor, out: torch.Tensor, scratch_bytes: int,
                      rows: int | None = None) -> None:
        """out += every pair whose expert is in one of this layer's queued banks, with the
        routing read on the device (no host sync): each bank runs moe_forward_grouped over its
        records, with ids mapped to positions in the bank (the bank's slot table; any other
        expert maps to a last entry that has no slot), once per window of `rows` tokens. The
        caller queued the layer's uncached experts (`prefetch`), each in one bank. Bank path
        only."""
        from strata.kernels.gpu.moe_grouped import moe_forward_grouped

        lay = arena.layouts[layer]
        while self.banks and self.banks[0].layer != layer:  # stale: dropped
            self._consume(self.banks[0])
        while self.banks and self.banks[0].layer == layer:
            bank = self.banks[0]
            self._issue(arena)  # every bank before it is consumed: it finds a place
            assert bank.issued
            if bank.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(bank.ready)
            position, table, experts = self._bank_tables(bank, arena.n_experts)
            gate, up, down = lay.views(self._view(bank))
            at = position[ids]  # [T, K]
            bias, act = self._bank_bias(lay, experts)
            for a, b in windows(h.shape[0], rows):
                moe_forward_grouped(h[a:b], at[a:b], weights[a:b], table, gate, up, down,
                                    lay.qtypes, lay.d_model, lay.d_expert, out=out[a:b],
                                    scratch_bytes=scratch_bytes, bias=bias, act=act)
            self._consume(bank)
        self._issue(arena)

    def _bank_tables(self, bank: Bank, n_experts: int) -> tuple[torch.Tensor, ...]:
        """(position [E] int64: expert -> its index in the bank, m for any other; table
        [m + 1] int32: 0..m-1, then -1; experts [m + 1] int64: the expert id at each index, the
        first one again at m) on the device, kept for the next chunk (the same layer gets the
        same banks while the cache stays as it is)."""
        key = (bank.layer, tuple(bank.experts))
        got = self._tables.get(key)
        if got is None:
            m = len(bank.experts)
            ids = torch.tensor(bank.experts, dtype=torch.int64)
            position = torch.full((n_experts,), m, dtype=torch.int64)
            position[ids] = torch.arange(m)
            table = torch.cat([torch.arange(m, dtype=torch.int32),
                               torch.tensor([-1], dtype=torch.int32)])
            got = self._tables[key] = tuple(to_device(t, self.device) for t in (
                position, table, torch.cat([ids, ids[:1]])))
        return got

    def _bank_bias(self, lay: ExpertLayout, experts: torch.Tensor,
                   ) -> tuple[tuple[torch.Tensor, ...] | None, str]:
        """_layer_bias with rows by index in a bank (experts: the bank's expert ids by index,
        _bank_tables)."""
        bias, act = self._layer_bias(lay)
        return (None if bias is None else tuple(b.index_select(0, experts) for b in bias)), act

    def _layer_bias(self, lay: ExpertLayout) -> tuple[tuple[torch.Tensor, ...] | None, str]:
        """The layer's expert biases on the device (rows by expert id) and its activation;
        (None, "swiglu") without biases."""
        if lay.bias is None:
            return None, "swiglu"
        got = self.biases.get(lay.layer)
        if got is None:
            raise RuntimeError(f"layer {lay.layer}: its experts' biases are not on the device "
                               "for the ring's banks (Ring.use_biases)")
        return got

    def _plan(self, layer: int, routed: dict[int, Group], tokens: int,
              rows: int | None = None) -> list[_Plan]:
        """Per bank of the layer, in FIFO order: the routed experts it computes (each expert
        once), split into one call per window of `rows` of the `tokens` tokens (the groups'
        pairs in that window; one call for all where rows is None), and where each call's rows
        and slots start in the layer's upload."""
        plans, done, r, s = [], set(), 0, 0
        for bank in self.banks:
            if bank.layer != layer:
                continue
            todo = [routed[e] for e in bank.experts if e in routed and e not in done]
            done.update(g.expert for g in todo)
            calls = []
            for a, b in windows(tokens, rows):
                part = [g for g in within(todo, a, b) if len(g.tokens)]
                calls.append((part, r, s))
                r += sum(len(g.tokens) for g in part)
                s += len(part)
            plans.append((bank, calls))
        return plans

    def _upload(self, plans: list[_Plan]) -> tuple[torch.Tensor, ...] | None:
        """tokens (int64), weights (float32) of every call's groups' rows, per group its
        record in the bank's view (int32) and the end of its rows within the call (int32), and
        each row's expert id (int64), on the device in one go."""
        calls = [(bank, todo) for bank, cs in plans for todo, _, _ in cs]
        groups = [g for _, todo in calls for g in todo]
        if not groups:
            return None
        slots, ends = [], []
        for bank, todo in calls:
            slots += [bank.experts.index(g.expert) for g in todo]
            end = 0
            for g in todo:
                end += len(g.tokens)
                ends.append(end)
        host = (torch.cat([g.tokens for g in groups]),
                torch.cat([g.weights for g in groups]).float(),
                torch.tensor(slots, dtype=torch.int32), torch.tensor(ends, dtype=torch.int32),
                torch.repeat_interleave(torch.tensor([g.expert for g in groups]),
                                        torch.tensor([len(g.tokens) for g in groups])))
        return tuple(to_device(t, self.device) for t in host)

    def _compute(self, bank: Bank, groups: list[Group], rows: tuple[torch.Tensor, ...], r: int,
                 s: int, h: torch.Tensor, out: torch.Tensor) -> None:
        """out += the groups' experts, read from the bank's records (once its copy landed);
        their rows start at r and their slots at s in the layer's upload (`rows`)."""
        from strata.kernels.gpu.moe_grouped import experts_forward_grouped

        if bank.ready is not None:
            torch.cuda.current_stream(self.device).wait_event(bank.ready)
        lay = bank.lay
        gate, up, down = lay.views(self._view(bank))
        counts = [len(g.tokens) for g in groups]
        tokens, weights, slots, ends, eid = rows
        n, r1 = len(groups), r + sum(counts)
        bias, act = self._layer_bias(lay)
        # no tokens_host: one accumulating index_put_, no copy to the device inside the call
        experts_forward_grouped(h, tokens[r:r1], weights[r:r1], counts, slots[s:s + n], gate,
                                up, down, lay.qtypes, lay.d_model, lay.d_expert, out,
                                offs=ends[s:s + n], bias=bias, eid=eid[r:r1], act=act)


def _pieces(arena: Arena, layer: int, experts: list[int]) -> list[tuple[int, torch.Tensor]]:
    """(position in the bank, records [n, stride]) to copy: a slice per run of consecutive
    experts where the arena has a [E, stride] table per layer (Arena.layers; a bank is mostly
    one run, and the host's time per bank is what the copy engine waits on), else a record
    each."""
    table = getattr(arena, "layers", None)
    if table is None:
        return [(j, arena.record(layer, e)[None]) for j, e in enumerate(experts)]
    return [(j, table[layer][a:b]) for j, a, b in _runs(experts)]


def _runs(experts: list[int]) -> list[tuple[int, int, int]]:
    """(position in the list, first expert, end expert) of each run of consecutive experts."""
    runs: list[tuple[int, int, int]] = []
    for j, e in enumerate(experts):
        if runs and e == runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], e + 1)
        else:
            runs.append((j, e, e + 1))
    return runs


def _grouped_available() -> bool:
    try:
        import strata.kernels.gpu.moe_grouped  # noqa: F401 (needs triton)
    except ImportError as e:
        log.info("grouped ring compute unavailable (%s): experts are dequantized to float32", e)
        return False
    return True
