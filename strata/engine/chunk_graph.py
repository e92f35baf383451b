"""Prompt chunks of one sequence replayed from CUDA graphs: the host launches a chunk's kernels
once per bucket instead of once per chunk.

A chunk of n tokens runs in the smallest bucket T >= n (tuning.PROMPT_GRAPH_BUCKETS, those the
memory plan took), padded after its real tokens to T, through the model's own trunk and head
(MoETransformer.trunk: every layer's parts, in a Segments context on --kernels fused's chunk
kernels, as MoETransformer.forward runs them) over static buffers:

    inputs  int64 [T + 2] on the device: the T tokens (padding: token 0), the chunk's first
            position `pos`, and `last` = n - 1, the row whose logits are kept
    logits  float32 [1, V]: the last real token's

    x = embed(tokens)                  [T, D]
    per layer: norms, attention        qk_rope_store writes KV rows pos .. pos+T-1;
                                       chunk_attention reads pos + T rows (flash, the length
                                       read on the device)
               routing, experts        route_topk; the executor's resident path (device_hits)
    logits = head(x[last])             [1, V]

Padding leaves the real rows exact: causal attention lets row t < n see keys <= pos + t only,
and every other op works row by row (norms, matmuls, routing, each pair's expert). The padded
rows' KV rows pos+n .. pos+T-1 are written but never counted (the cache advances by n) and are
overwritten by the next chunk or decode token; their routing is left out of the counters (the
`live` mask), their logits are never computed.

Each bucket is captured once per KV storage (its address and capacity: the rows the kernels
write and read) and expert slot tensors (ExpertCache.slots_key). The first chunk of a bucket on
a storage runs the pass eagerly (compiling and warming every kernel; its results are the
chunk's), which is then captured; later chunks replay it. One memory pool holds every bucket's
graph (they never run at once, so a later capture reuses an earlier one's freed blocks; every
buffer that outlives a pass is allocated outside it); the memory plan counts it
(`graph_pool_bytes`) and keeps the buckets that fit (`plan_buckets`).

A verify window (strata.engine.spec: a pass of n <= WINDOW_GRAPH_MAX tokens wanting every
position's logits) runs the same pass unpadded, in a graph of its own size n, its head over
every row:

    logits  float32 [n, V]: rows 0 .. n-1 of one buffer [W, V] that every window size shares
            (W the largest window the plan took; one window runs at a time, and its rows are
            copied out after each pass)

One graph per size rather than the 16 bucket padded with every row's logits: the static
logits are W rows (W <= 16) against 16, the pool holds one pass of at most 16 tokens either
way (the sizes' graphs share it with the chunks'), and an unpadded window reads no expert that
only padding rows route to and runs the eager window's shapes (so its kernels and their
rounding). The KV rows, the counters and the cache length behave as a chunk's (the window has
no padding rows: every row is live).

Where a chunk cannot be captured it runs eagerly through MoETransformer.forward, as before:
decided once at load (`blocked` and ChunkGraphs.__init__: the reason in one log line) or per
chunk (`ChunkGraphs.eager_reason`: counted by reason for --stats).

Legend: n real tokens, T the bucket, W the largest window, D hidden, V vocab, E experts,
K experts per token.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from strata.config import EngineConfig, ModelConfig
from strata.kernels.gpu.chunk_attention import flash_reads
from strata.kernels.tuning import DEQUANT_MIN_M, PROMPT_GRAPH_BUCKETS, WINDOW_GRAPH_MAX
from strata.model.parts.spec import layer_spec
from strata.runtime.waits import wait_event

log = logging.getLogger("strata")

PROMPT_GRAPH_MODES = ("on", "off")
HALF_KV = ("f16", "bf16")  # the cache types chunk_attention reads on flash attention
# layer parts other than full GQA attention, gpt-oss's (sinks, sliding windows: its chunks run
# GQAAttention._chunk with them) and a hybrid's (gated attention; Gated DeltaNet, whose padded
# rows neither decay nor write the recurrent state: Segments.real, .last), and why their chunks need
# the host
CAPTURED_MIXERS = {"gqa", "sinks", "gated", "delta"}
MIXER_WHY = {"mla": "a latent cache"}


# ---- the choice, at load ------------------------------------------------------------------------


def blocked(cfg: ModelConfig, ec: EngineConfig) -> str | None:
    """Why no prompt chunk or verify window of this model under this configuration can be
    captured, or None (then ChunkGraphs checks what the built engine adds: the executor,
    resident experts, flash attention on this GPU). A hybrid's recurrent layers take both: a
    padded chunk through the chunked rule with its padding masked out of the state, a window
    (never padded) token by token into static state buffers (DeltaState, WindowStates)."""
    if ec.prompt_graphs == "off":
        return "--prompt-graphs off"
    if not ec.device.startswith("cuda"):
        return "the CPU device"
    if not ec.use_offload:
        return "--offload off: the reference layout groups each layer's experts on the host"
    if ec.kernels != "fused":
        return f"--kernels {ec.kernels}: prompt chunks attend over rows the host slices"
    mixers = sorted({layer_spec(cfg, i).mixer for i in range(cfg.n_layers)} - CAPTURED_MIXERS)
    if mixers:
        return f"{cfg.arch}'s layers hold " + ", ".join(MIXER_WHY.get(m, m) for m in mixers)
    if ec.kv_type not in HALF_KV:
        return (f"--kv-type {ec.kv_type}: flash attention reads f16 or bf16 rows; this cache's "
                "rows are copied up to a length the host knows")
    return None


def buckets_for(chunk: int) -> tuple[int, ...]:
    """The buckets a plan of prompt chunks of up to `chunk` tokens may take: those up to the
    first that holds a whole chunk."""
    out = []
    for b in PROMPT_GRAPH_BUCKETS:
        out.append(b)
        if b >= chunk:
            break
    return tuple(out)


def bucket_of(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding n tokens (None: n is past the largest)."""
    return next((b for b in buckets if b >= n), None)


def window_tokens(spec: int) -> int:
    """The most tokens of a verify window the graphs serve under --spec `spec` (0: none)."""
    return min(WINDOW_GRAPH_MAX, spec + 1) if spec else 0


def graph_pool_bytes(cfg: ModelConfig, layouts: list, t: int,
                     prompt_weights: int | None, logit_rows: int = 1) -> int:
    """A bound on the device bytes one captured pass of t tokens allocates inside its graph
    (its pool holds them for good): the MoE layer's scratch at t tokens (the grouped path's,
    moe_grouped.grouped_scratch_bytes, or the tl.dot path's h and y), the dense parts' float32
    activations live across a layer (an attention layer's or a Gated DeltaNet's), a dense
    matrix's bf16 copy (cuBLAS, from DEQUANT_MIN_M tokens) and the head's `logit_rows` rows (a
    chunk's last one, a window's every row). Derived from the buffers the parts allocate, not
    measured."""
    from strata.kernels.gpu.moe import layouts_min_tokens, use_grouped
    from strata.kernels.gpu.moe_grouped import GROUPED_SCRATCH_BYTES, grouped_scratch_bytes

    lay = max(layouts, key=lambda la: la.d_model * la.d_expert)
    d, e, k = cfg.d_model, cfg.n_experts, cfg.n_experts_used
    p = t * k
    # _prompt: h bf16 [P, F], y float32 [P, D], the sum [T, D], sort keys and order; the
    # grouped path's where some layer takes it at t (layers of other types may not: the larger)
    moe = p * (2 * lay.d_expert + 4 * d + 24) + 4 * t * d + 12 * e
    if use_grouped(t, k, e, layouts_min_tokens(layouts)):
        moe = max(moe, grouped_scratch_bytes(lay, e, t, k,
                                             prompt_weights or GROUPED_SCRATCH_BYTES))
    qkv = cfg.q_dim + 2 * cfg.kv_dim
    hidden = max(cfg.d_ff, cfg.d_shared, lay.d_expert)
    # x, h, attention out, wo out, norms (6 D); qkv, its split copies, q rotated and its half
    # copy, flash's out (4 qkv); router logits and probabilities (2 E); a dense or shared FFN
    rows = 4 * t * (6 * d + 4 * qkv + 2 * e + 3 * hidden)
    if cfg.ssm_heads:  # a hybrid's Gated DeltaNet layer, where it is the larger: its conv input
        # and output, q, k, v at the value heads, the chunked rule's per-token work and output,
        # the output gate (4 C + 8 Hv dk + 64 Hv a token), and the rule's state per chunk of 64
        hv, dk, c = cfg.ssm_heads, cfg.ssm_state, cfg.conv_channels
        rows = max(rows, 4 * t * (6 * d + 4 * c + 8 * hv * dk + 64 * hv + 2 * e + 3 * hidden)
                   + 4 * (-(-t // 64) + 1) * hv * dk * dk)
    widest = max(qkv, cfg.q_dim, 3 * hidden, cfg.conv_channels)
    dequant = 2 * widest * d if t >= DEQUANT_MIN_M else 0
    return moe + rows + dequant + 4 * logit_rows * cfg.n_vocab


def window_static_bytes(cfg: ModelConfig, w: int) -> int:
    """The static buffers of the windows of 1 .. w tokens: each size's inputs and row indices,
    and the one float32 [w, V] logits buffer they share."""
    return sum(8 * (n + 2) + 8 * n for n in range(1, w + 1)) + 4 * w * cfg.n_vocab if w else 0


def plan_buckets(cfg: ModelConfig, ec: EngineConfig, layouts: list, slots: list[int],
                 chunk: int, prompt_weights: int | None,
                 room: int) -> tuple[int, tuple, int, str]:
    """The memory plan's line item: (bytes, buckets, window tokens, why none) for the prompt
    graphs where they apply (`blocked`, and every routed layer's experts each in a slot: no
    chunk of a plan that misses some runs without the host). Buckets up to the first holding a
    whole chunk, and with --spec the verify windows of up to `window_tokens` tokens, as many
    buckets as `room` holds the shared pool of (the largest pass's: a bucket's, or a window's
    with every row's logits) and the static buffers of; where no bucket fits beside the
    windows, the buckets are planned without them."""
    why = blocked(cfg, ec)
    outside = any(n < cfg.n_experts and not lay.empty for n, lay in zip(slots, layouts,
                                                                          strict=True))
    if why is None and outside:
        why = "experts outside VRAM: their misses are planned on the host"
    if why is not None:
        return 0, (), 0, why
    for w in dict.fromkeys((window_tokens(ec.spec), 0)):
        win_pool = graph_pool_bytes(cfg, layouts, w, prompt_weights, logit_rows=w) if w else 0
        taken, total = (), 0
        for b in buckets_for(chunk):
            static = sum(8 * (x + 2) + 8 * x + 4 * cfg.n_vocab for x in (*taken, b))
            pool = max(graph_pool_bytes(cfg, layouts, b, prompt_weights), win_pool)
            need = pool + static + window_static_bytes(cfg, w)
            if need > room:
                break
            taken, total = (*taken, b), need
        if taken:
            return total, taken, w, ""
    return 0, (), 0, "the plan leaves too little room for their pool"


# ---- the graphs ----------------------------------------------------------------------------------


@dataclass
class _Bucket:
    """One bucket's (or one window size's) static buffers and its graph (captured for `key`:
    KV storage, capacity, slot tensors)."""

    size: int
    inputs: torch.Tensor  # int64 [T + 2]: tokens, pos, last
    rows: torch.Tensor  # int64 [T]: 0 .. T-1
    logits: torch.Tensor  # float32 [1, V]; a window's [T, V] (every row's)
    graph: object | None = None  # torch.cuda.CUDAGraph
    key: tuple | None = None
    window: bool = False  # a verify window's: every row's logits, no padding


def _state_key(kv) -> tuple:  # noqa: ANN001 (a KVCache)
    """The addresses a window's graph writes a hybrid's recurrent state through: the state's
    and its window's per-token buffers (DeltaState, WindowStates); () without one."""
    st = kv.state
    if st is None:
        return ()
    w = st.window
    return (st.conv.data_ptr(), st.ssm.data_ptr(), w.conv.data_ptr() if w else 0,
            w.ssm.data_ptr() if w else 0)


class _Experts:
    """The executor's path for the routed experts of a pass over static buffers (Segments'
    `experts`): on CUDA the resident path with device work only (device_hits; the routing of
    the real rows counted on the device, the host counts the hits per pass), elsewhere (eager
    tests on the CPU) its planned path, every pair a hit."""

    def __init__(self, ex, live: torch.Tensor, window: bool = False):  # noqa: ANN001
        """ex: the OffloadExperts; live: 1 for the real rows; window: a verify window's pass
        (its hits on the decode step's per-pair kernels, as an eager window's: Resident)."""
        self.ex, self.live, self.window = ex, live, window

    def run(self, layer: int, weights: object, h: torch.Tensor, ids: torch.Tensor,
            wts: torch.Tensor) -> torch.Tensor:
        if self.ex.device.type != "cuda":
            return self.ex.run(layer, weights, h, ids, wts)
        out = self.ex.device_hits(layer, h, ids, wts, count=False, step=self.window)
        self.ex.stats.count_on_device(layer, ids, self.live)
        return out


class ChunkGraphs:
    def __init__(self, model, buckets: Sequence[int], why: str | None = None,  # noqa: ANN001
                 mode: str = "graphs", windows: int = 0):
        """model: the MoETransformer (on the offload runtime); buckets: those the memory plan
        took; why: the reason none applies (`blocked`, or the plan's), if known; mode "graphs"
        (CUDA) or "eager" (the same passes over the static buffers, uncaptured: the CPU's
        tests); windows: the most tokens of a verify window the plan took (0: windows run
        eagerly)."""
        from strata.experts.offload import OffloadExperts

        self.model, self.cfg, self.device = model, model.cfg, model.device
        self.ex = model.experts
        self.graphs = mode == "graphs" and self.device.type == "cuda"
        self.routed = np.array([i for i, layer in enumerate(model.layers) if layer.ffn.routed],
                               dtype=np.int64)
        self.buckets = tuple(buckets)
        self.windows = windows
        # why no prompt chunk is captured (no bucket: windows alone), where windows still are
        self.prompt_why = why or (None if self.buckets else "no bucket")
        why = None if windows and not self.buckets else self.prompt_why
        if why is None and not isinstance(self.ex, OffloadExperts):
            why = "the reference layout groups each layer's experts on the host"
        if why is None:
            why = self._device_reason()
        self.why = why  # why nothing is captured
        if why is not None:
            self.prompt_why = why
        self.steps = {"replayed": 0, "captured": 0, "warm": 0, "eager": 0}
        self.eager: Counter[str] = Counter()  # chunks (and windows) run eagerly, by reason
        self.window_steps = {"replayed": 0, "captured": 0, "warm": 0}
        self._failed = False
        self._buckets: dict[int, _Bucket] = {}
        self._windows: dict[int, _Bucket] = {}  # by window size
        self._window_logits: torch.Tensor | None = None  # float32 [W, V]: every size's rows
        self._pool = None
        pin = self.device.type == "cuda"
        top = max(self.buckets, default=0)
        self._host = torch.zeros(max(top, windows) + 2, dtype=torch.int64, pin_memory=pin)
        self._host_read: torch.cuda.Event | None = None
        log.info("prompt graphs: " + (
            f"off, {why}; prompt chunks run eagerly" if why else
            (f"chunks off, {self.prompt_why}; verify windows of up to {self.windows} tokens "
             "one graph per size" if self.prompt_why else
             f"chunks of up to {top} tokens padded to the next of {len(self.buckets)} buckets "
             f"({', '.join(map(str, self.buckets))}), each captured once per KV storage"
             + (f", verify windows of up to {self.windows} tokens one graph per size"
                if self.windows else ""))
            + "; " + ("CUDA graphs" if self.graphs else "eager")))

    def _device_reason(self) -> str | None:
        """What the built engine on this GPU keeps from the graphs (None: nothing); may drop
        the buckets whose MoE layers take a path with a host sync here."""
        from strata.kernels.gpu.moe import layouts_min_tokens, use_grouped

        cfg = self.cfg
        top = max(self.buckets, default=self.windows)
        outside = [int(i) for i in self.routed if not self._resident(int(i), top)]
        if outside:
            return (f"{len(outside)} of {len(self.routed)} routed layers keep experts outside "
                    "VRAM or off the fused kernels: their misses are planned on the host")
        probe = torch.empty(1, cfg.n_kv_heads, cfg.head_dim, dtype=self.model.kv_dtype,
                            device=self.device)
        if self.device.type == "cuda" and not flash_reads(probe):
            return "no flash attention for this GPU, torch build or head dim"
        if self.device.type == "cuda" and torch.cuda.get_device_capability(self.device)[0] \
                not in (9, 10):  # torch._grouped_mm elsewhere loops on the host (moe_grouped)
            least = layouts_min_tokens(self.ex.arena.layouts)
            keep = tuple(b for b in self.buckets
                         if not use_grouped(b, cfg.n_experts_used, cfg.n_experts, least))
            if not keep and self.buckets:
                return "the grouped MoE path reads its group sizes on the host on this GPU"
            self.buckets = keep
            self.windows = max((w for w in range(self.windows + 1)
                                if not use_grouped(w, cfg.n_experts_used, cfg.n_experts,
                                                   least)), default=0)
        return None

    # ---- one chunk ------------------------------------------------------------------------------

    def eager_reason(self, tokens: torch.Tensor, segments: Sequence, all_logits: bool) -> str:
        """Why this forward runs eagerly ("" where a graph takes it)."""
        if self.why is not None:
            return self.why
        if not all_logits and self.prompt_why is not None:
            return self.prompt_why
        if len(segments) != 1:
            return "several sequences"
        kv, n = segments[0].kv, tokens.shape[0]
        t = n if all_logits else bucket_of(n, self.buckets)  # (a window is never padded)
        model = self.model
        if self._failed:
            return "capture failed"
        if n == 0:
            return "no tokens"
        if all_logits and n > self.windows:
            return (f"every position's logits of more than {self.windows} tokens"
                    if self.windows else "every position's logits")
        if t is None:
            return f"longer than {self.buckets[-1]} tokens"
        # (a hybrid's recurrent state: a window's records each token's state, a chunk's not)
        state_ok = kv.state is None or all_logits == getattr(kv.state, "recording", False)
        if getattr(kv, "paged", False) or not state_ok or kv.dtype != model.kv_dtype:
            return "a paged, hybrid or other-typed cache"
        if self.graphs and not flash_reads(kv.k[0]):  # (a pass without it slices on the host)
            return "no flash attention over the cache"
        if kv.limit is not None and kv.length + t > kv.limit:
            return "padding past the cache's planned rows"
        if model.hidden_hook is not None or any(model.layers[int(i)].ffn.hook is not None
                                                for i in self.routed):
            return "a hook on the hidden states or the routing"
        if not all(self._resident(int(i), t) for i in self.routed):
            return "experts outside VRAM"
        return ""

    def _resident(self, layer: int, t: int) -> bool:
        """Every expert of the layer has a slot (and, on CUDA, the fused kernels cover it at
        t tokens: OffloadExperts.resident)."""
        if self.device.type == "cuda":
            return self.ex.resident(layer, t)
        return self.ex.cache.layers[layer].capacity == self.ex.arena.n_experts

    def __call__(self, tokens: torch.Tensor, segments: Sequence, all_logits: bool = False,
                 marks: object | None = None) -> torch.Tensor | None:
        """The chunk's last logits [1, V] (a window's, all_logits: every row's [n, V]; a new
        tensor), its KV rows appended; None where it runs eagerly (the caller runs
        MoETransformer.forward)."""
        why = self.eager_reason(tokens, segments, all_logits)
        if why:
            if self.why is None and len(segments) == 1:
                self.eager[why] += 1
                self.steps["eager"] += 1
            return None
        kv, n = segments[0].kv, tokens.shape[0]
        b = self._window(n) if all_logits else self._bucket(bucket_of(n, self.buckets))
        steps = self.window_steps if all_logits else self.steps
        ex, start = self.ex, kv.length
        ex.before_pass(n)
        kv.reserve(start + b.size)  # (before any key: a growing cache moves its storage)
        _, slots = ex.begin_step([])  # the cache's pending changes land: its tables hold
        self._fill(b, tokens, start, n)
        key = (kv.store.data_ptr(), kv.capacity, slots, _state_key(kv))
        timer = self.model.gpu_timer()
        t0 = timer.start() if timer else None
        if b.key == key and b.graph is not None:
            b.graph.replay()
            steps["replayed"] += 1
        else:
            self._pass(b, kv)  # the chunk itself; every kernel compiled and warmed
            steps["warm"] += 1
            if self.graphs and not self._failed:
                self._capture(b, key, kv, steps)
        if self.device.type == "cuda":  # (device_hits leaves the hits to the host)
            ex.account(self.routed, hits=n * self.cfg.n_experts_used)
            ex.slots_read(range(len(ex.cache.layers)), self._record())
        if timer:
            timer.stop(t0)
        kv.advance(n)
        if marks is not None:
            # (the graph ran every layer and the head: each mark is recorded after all of them,
            # so a replayed window that stalls is still reported as its verify window of n
            # tokens, but the layer named is not the one the GPU was in: every mark is then
            # unfinished (the first, layer 0, is named) and the progress line's layer is the
            # last one, the head. `whole_pass` lets the report say so.)
            marks.whole_pass = True
            for i in range(len(self.model.layers) + 1):
                marks.after(i)
        return b.logits.clone()

    def _bucket(self, t: int) -> _Bucket:
        """The bucket's static buffers, made (outside any capture) on its first chunk."""
        if t not in self._buckets:
            dev = self.device
            self._buckets[t] = _Bucket(t, torch.zeros(t + 2, dtype=torch.int64, device=dev),
                                       torch.arange(t, device=dev),
                                       torch.zeros(1, self.cfg.n_vocab, device=dev))
        return self._buckets[t]

    def _window(self, n: int) -> _Bucket:
        """The window size's static buffers (its logits rows 0 .. n-1 of the buffer every
        size shares), made outside any capture on its first window."""
        if n not in self._windows:
            dev = self.device
            if self._window_logits is None:
                self._window_logits = torch.zeros(self.windows, self.cfg.n_vocab, device=dev)
            self._windows[n] = _Bucket(n, torch.zeros(n + 2, dtype=torch.int64, device=dev),
                                       torch.arange(n, device=dev), self._window_logits[:n],
                                       window=True)
        return self._windows[n]

    def _fill(self, b: _Bucket, tokens: torch.Tensor, start: int, n: int) -> None:
        """The chunk's tokens (padded with token 0), its first position and last row into the
        bucket's inputs: one copy from pinned memory."""
        if self._host_read is not None:  # the last chunk's copy has read the pinned buffer
            wait_event(self._host_read, "the prompt graphs' input copy")
        t = b.size
        host = self._host[: t + 2]
        host[:n] = tokens.reshape(-1)
        host[n:t] = 0
        host[t], host[t + 1] = start, n - 1
        b.inputs.copy_(host, non_blocking=True)
        if self.device.type == "cuda":
            self._host_read = self._record()

    def _pass(self, b: _Bucket, kv) -> None:  # noqa: ANN001 (a KVCache)
        """The bucket's forward over its static buffers: embed, every layer, the head's row."""
        from strata.model.layers import rope_tables
        from strata.model.parts import Segment, Segments

        model, cfg, t = self.model, self.cfg, b.size
        tokens, pos, last = b.inputs[:t], b.inputs[t:t + 1], b.inputs[t + 1:t + 2]
        live = (b.rows <= last).to(torch.int32)  # [T]: 1 for the real rows
        # (the chunk kernels take positions from pos; the tables serve any part that reads
        # them, from the same device positions)
        cos, sin = rope_tables(pos + b.rows, cfg.rope_dim, cfg.rope_theta)
        pad = {} if b.window else dict(last=last, real=live.to(torch.float32))  # (a chunk's)
        ctx = Segments([Segment(kv, t)], cos, sin, _Experts(self.ex, live, b.window), None, True,
                       pos=pos, inv_freq=model.rope_inv_freq(), **pad)
        x, delta = model.trunk(tokens, ctx)
        b.logits.copy_(model.head.forward(x, delta, ctx, rows=None if b.window else last))

    def _capture(self, b: _Bucket, key: tuple, kv, steps: dict) -> None:  # noqa: ANN001
        try:
            torch.cuda.synchronize(self.device)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._pass(b, kv)
        except Exception as e:  # noqa: BLE001 (any capture failure: run eagerly, say why)
            log.warning(f"prompt graphs: CUDA graph capture failed ({type(e).__name__}: {e}); "
                        "prompt chunks run eagerly")
            self._failed = True
            torch.cuda.synchronize(self.device)
            return
        b.graph, b.key = graph, key
        steps["captured"] += 1

    def _record(self) -> torch.cuda.Event:
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def line(self) -> str:
        """One line for --stats."""
        if self.why is not None:
            return f"prompt graphs: off, {self.why}"
        w = self.window_steps
        windows = (f"verify windows: {w['replayed']} replayed, {w['warm']} run to capture "
                   f"({w['captured']} capture(s))")
        if self.prompt_why is not None:
            return (f"prompt graphs: chunks off, {self.prompt_why}; {windows}, "
                    f"{self.steps['eager']} eager")
        eager = "; ".join(f"{n} {why}" for why, n in self.eager.most_common())
        return (f"prompt graphs: {self.steps['replayed']} chunk(s) replayed, "
                f"{self.steps['warm']} run to capture ({self.steps['captured']} capture(s)), "
                f"{self.steps['eager']} eager" + (f" ({eager})" if eager else "")
                + (f"; {windows}" if self.windows else ""))
