"""What a layer's parts are called with: the tokens' context, which also picks their kernels.

    Segments    new tokens of one or more sequences (a prompt chunk, a few sequences decoding
                together): positions from each segment's KV cache, the reference ops, torch's
                attention (flash attention on bf16 for long segments with --kernels fused)
    StaticStep  one token of one sequence over the decode step's static buffers: the position
                and KV length are device tensors, so the same launches can be captured once as
                CUDA graphs and replayed; the fused decode kernels (decode_ops). With `rows`
                (BatchRows): B rows of sequences of one KV pool, a token each (the batched
                step, strata.engine.batch_step: one row of each sequence, or several at
                consecutive positions for a prompt's chunk), pos and length [B]

A part reads `ctx.static` and picks its kernels; the layer is written once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from strata.runtime.kv_cache import KVCache


@dataclass
class Segment:
    """`length` new tokens of one sequence, at positions kv.length .. kv.length + length - 1."""

    kv: KVCache
    length: int


@dataclass
class Segments:
    """The context of a forward pass over segments (MoETransformer.forward).

    cos, sin [T, rope_dim/2]: RoPE at every token's position; experts: the model's
    ExpertExecutor; timer: --stats' GPU timer (each layer's experts timed), or None;
    fused_attention: CUDA with --kernels fused (see GQAAttention): the residual steps' norms
    run as one launch each (decode_ops.add_rms_norm), and a single segment's q/k norms, RoPE
    and cache store too (decode_ops.qk_rope_store, from pos and inv_freq)."""

    segments: Sequence[Segment]
    cos: torch.Tensor
    sin: torch.Tensor
    experts: object  # ExpertExecutor (strata.experts): run(layer, weights, h, ids, weights)
    timer: object | None = None  # GpuTimer (strata.experts.stats)
    fused_attention: bool = False
    # one segment under fused_attention: its first position (int64 [1] on the device) and the
    # RoPE frequencies (decode_ops.rope_inv_freq; None with YaRN), for the fused chunk kernels
    pos: torch.Tensor | None = None
    inv_freq: torch.Tensor | None = None
    # a padded prompt chunk's (strata.engine.chunk_graph), on the device: its last real row
    # (int64 [1]) and its real rows (float32 [T], 1 for each, 0 for padding), which a recurrent
    # layer keeps its state to
    last: torch.Tensor | None = None
    real: torch.Tensor | None = None
    # a layer-major prompt's chunk (strata.model.layer_major): its rows of the routed experts'
    # sum, computed once over every chunk's tokens of the layer; run_experts returns them
    ready: torch.Tensor | None = None
    static = False

    def run_experts(self, layer: int, weights: object, h: torch.Tensor, ids: torch.Tensor,
                    wts: torch.Tensor, sum_pairs: bool = True) -> torch.Tensor:
        """Σ_k wts[t, k] * expert_{ids[t, k]}(h[t]) -> [T, D] (summed: sum_pairs is the decode
        step's); `ready` where it was computed already."""
        if self.ready is not None:
            return self.ready
        t0 = self.timer.start() if self.timer else None
        out = self.experts.run(layer, weights, h, ids, wts)
        if self.timer:
            self.timer.stop(t0, layer=layer)
        return out


@dataclass
class StaticStep:
    """The context of one decode token over static buffers (strata.engine.decode_step).

    kv: the sequence's cache (its storage fixed for the capture); pos, length: int64 [1] on the
    device, the token's position and the KV rows after it; inv_freq: RoPE's table
    (decode_ops.rope_inv_freq); sync: norm_route's count; fuse_route: the residual step and
    the routing in one launch; counts(layer): where the layer's routing is counted on the
    device (or None); experts(layer, h, ids, wts, sum_pairs): the executor's decode path for
    the layer, which may return the K pairs' rows unsummed ([1, K, D]) when not sum_pairs:
    the next residual step (add_rms_norm) sums them. fused_attention: --kernels fused (decode
    attention may use TF32 dots; otherwise exact float32)."""

    kv: KVCache
    pos: torch.Tensor
    length: torch.Tensor
    inv_freq: torch.Tensor
    sync: torch.Tensor
    fuse_route: bool
    counts: Callable[[int], torch.Tensor | None]
    experts: Callable[..., torch.Tensor]
    fused_attention: bool = False
    rows: BatchRows | None = None  # a batched step's B rows (then kv is None)
    static = True

    def run_experts(self, layer: int, weights: object, h: torch.Tensor, ids: torch.Tensor,
                    wts: torch.Tensor, sum_pairs: bool = True) -> torch.Tensor:
        return self.experts(layer, h, ids, wts, sum_pairs)


@dataclass
class BatchRows:
    """Where the B rows of a batched decode step keep their sequences' state, all on the
    device (a captured graph reads them as they are at each replay). Rows of one sequence (a
    prompt's chunk) share its block table and state entry, at consecutive positions.

    pool: the KVSlots every row's sequence lives in; write int64 [B]: the pool row the row's
    token's keys and values go to (a padded row's: the scratch row); read int64 [B, span]:
    the pool rows of positions 0 .. span-1 of each row's sequence (through its block table;
    rows at and past its length are masked); state int64 [B]: each row's recurrent-state
    entry (hybrids; a padded row's: a free slot's)."""

    pool: object  # strata.runtime.kv_slots.KVSlots
    write: torch.Tensor
    read: torch.Tensor
    state: torch.Tensor


Context = Segments | StaticStep


def decode_ops():  # noqa: ANN201 (the module)
    """strata.kernels.gpu.decode_ops, imported on first use: the reference path needs no
    Triton."""
    global _OPS
    if _OPS is None:
        from strata.kernels.gpu import decode_ops as ops

        _OPS = ops
    return _OPS


_OPS = None
