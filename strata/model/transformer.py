"""The MoE transformer shared by qwen3moe, qwen2moe, Mixtral-style llama, glm4moe and deepseek2.

The architectures differ only in what ModelConfig records: RoPE style, QKV bias, per-head q/k norms,
a gated shared expert, and whether the top-k routing weights are renormalized. Each layer is built
from parts (strata.model.parts: a token mixer and a feed-forward, chosen per layer index), which
every path calls: this forward, and the decode step (strata.engine.decode_step) over its static
buffers.

One forward runs a batch of segments: each segment is some new tokens of one sequence, appended to
that sequence's KV cache. Attention runs per segment; every other matmul (and so every expert read)
runs over all tokens of the batch at once. A long prompt may instead run layer by layer, every
chunk through a layer before the next layer (forward_layers: strata.model.layer_major).

Legend: T tokens in the batch, D hidden, H heads, Hkv kv heads, hd head dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from strata.config import ModelConfig
from strata.experts import ExpertExecutor, ReferenceExperts
from strata.kernels.torch_ops import yarn_inv_freq
from strata.model.layers import rope_tables
from strata.model.parts import Head, Layer, Segment, Segments
from strata.model.parts.attention import BF16_ATTENTION_MIN_T
from strata.model.parts.context import decode_ops
from strata.model.parts.ffn import SharedExpert
from strata.model.weights import LayerWeights, ModelWeights
from strata.runtime.delta_state import DeltaState
from strata.runtime.kv_cache import KVCache, grown
from strata.runtime.latent_cache import LatentCache
from strata.runtime.waits import to_device

__all__ = ["BF16_ATTENTION_MIN_T", "MoETransformer", "Segment", "shared_expert"]


class MoETransformer:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: torch.device,
                 experts: ExpertExecutor | None = None):
        self.cfg, self.w, self.device = cfg, weights, device
        self.experts = experts or ReferenceExperts()
        self.layers = [Layer.build(cfg, lw, i) for i, lw in enumerate(weights.layers)]
        self.head = Head(weights.output_norm, weights.output, cfg.rms_eps)
        self.step = None  # a DecodeStep (strata.engine.decode_step) when the engine made one
        # ChunkGraphs (strata.engine.chunk_graph): prompt chunks replayed from CUDA graphs
        self.chunks = None
        self.max_chunk: int | None = None  # prompt tokens per forward the memory plan allows
        # prompt tokens a layer-major pass holds (memory_plan.layer_span; None: unbounded, 0:
        # none)
        self.layer_tokens: int | None = None
        # CUDA with --kernels fused: prompt chunks attend on bf16 tensor cores, a few tokens
        # over a float16 / bfloat16 KV cache through the decode kernel
        self.fused_attention = False
        self._inv_freq: torch.Tensor | None = None  # RoPE frequencies of the fused chunk path
        self.kv_dtype = torch.float32  # the KV cache's elements (--kv-type)
        self.kv_limit: int | None = None  # rows a cache may hold (the memory plan's, on CUDA)
        self.plan_ctx: int | None = None  # the context the memory plan holds (offload runtime)
        # rows of a plain cache the plan holds for a --batch pool's prompts (server.kv_batch)
        self.prefill_rows = 0
        # called after the layers of each forward with (segments, hidden [T, D]): the last
        # hidden states before the output norm (an MTP drafter's input, engine/drafters.py)
        self.hidden_hook = None

    def decode(self, token: int, kv: KVCache) -> torch.Tensor:
        """One new token of one sequence -> logits [1, V] float32: the decode step (captured as
        CUDA graphs where it can be) when the engine built one, else a plain forward."""
        if self.step is not None:
            self.experts.before_pass(1)
            return self.step(token, kv)
        return self._forward(torch.tensor([token]), [Segment(kv, 1)])  # (one token: no bucket)

    def new_cache(self, capacity: int = 256) -> KVCache:
        """A KV cache for `capacity` tokens (it grows past them, up to kv_limit rows where the
        memory plan bounds it). With a decode step, caches of at least the planned context come
        from one pool, so its graphs serve every request."""
        if self.kv_limit is not None:
            grown(capacity, 0, self.kv_limit)  # (refuses a capacity past the limit)
        kv = self._new_cache(capacity)
        kv.limit = self.kv_limit
        return kv

    def _new_cache(self, capacity: int) -> KVCache:
        c = self.cfg
        if c.kv_lora:  # deepseek2: the latent rows (runtime/latent_cache.py)
            if self.step is None:
                return LatentCache(c.n_layers, c.kv_row, self.device, capacity,
                                   dtype=self.kv_dtype)
            return LatentCache(c.n_layers, c.kv_row, self.device,
                               max(capacity, self.step.kv_capacity), self.step.kv_pool,
                               self.kv_dtype)
        if self.step is None:
            kv = KVCache(c.n_kv_layers, c.n_kv_heads, c.head_dim, self.device, capacity,
                         dtype=self.kv_dtype)
        else:
            kv = KVCache(c.n_kv_layers, c.n_kv_heads, c.head_dim, self.device,
                         max(capacity, self.step.kv_capacity), self.step.kv_pool, self.kv_dtype)
        if c.full_attn_interval:  # hybrid: the linear layers' recurrent state beside it
            kv.state = DeltaState(c, self.device, self.step.kv_pool if self.step else None,
                                  window_tokens=getattr(self.chunks, "windows", 0))
        return kv

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment],
                all_logits: bool = False, marks: object | None = None) -> torch.Tensor:
        """tokens: [T] (the segments' tokens, concatenated) -> logits float32.

        Returns [T, V] when all_logits, else [n_segments, V] (each segment's last position).
        Each segment's KV cache grows by its length. marks: told after each layer and after
        the head (`marks.after(i)`: a verify window's bounded wait, strata.engine.spec).
        One prompt chunk is replayed from a CUDA graph where the engine built them and one
        applies (strata.engine.chunk_graph), the same layers over static buffers.
        """
        if sum(s.length for s in segments) != tokens.shape[0]:
            raise ValueError("segments do not cover the tokens")
        if self.chunks is not None:
            logits = self.chunks(tokens, segments, all_logits, marks)
            if logits is not None:
                return logits
        return self._forward(tokens, segments, all_logits, marks)

    @torch.inference_mode()
    def _forward(self, tokens: torch.Tensor, segments: Sequence[Segment],
                 all_logits: bool = False, marks: object | None = None) -> torch.Tensor:
        """forward's passes run eagerly."""
        cfg = self.cfg
        self.experts.before_pass(tokens.shape[0])
        timer = self.gpu_timer()
        t0 = timer.start() if timer else None
        # (small host tensors through pinned memory: a plain .to() from pageable memory waits
        # for the stream's queued work)
        positions = to_device(torch.cat([torch.arange(s.kv.length, s.kv.length + s.length)
                                         for s in segments]), self.device)
        cos, sin = rope_tables(positions, cfg.rope_dim, cfg.rope_theta, cfg.yarn)
        ctx = self.context(segments, cos, sin, timer)
        x, delta = self.trunk(tokens.to(self.device), ctx, marks)
        if self.hidden_hook is not None:  # (before advance: each segment's kv.length is its start)
            self.hidden_hook(segments, x if delta is None else x + delta)
        for s in segments:
            s.kv.advance(s.length)
        ends = None
        if not all_logits:
            ends = to_device(torch.tensor([s.length for s in segments]).cumsum(0) - 1,
                             self.device)
        logits = self.head.forward(x, delta, ctx, rows=ends)
        if marks is not None:
            marks.after(len(self.layers))
        if timer:
            timer.stop(t0)
        return logits

    def context(self, segments: Sequence[Segment], cos: torch.Tensor, sin: torch.Tensor,
                timer: object | None, start: int | None = None) -> Segments:
        """The layers' context for these segments (cos, sin: RoPE at their tokens' positions);
        start: where one segment's tokens begin (default: its cache's length)."""
        ctx = Segments(segments, cos, sin, self.experts, timer, self.fused_attention)
        if (self.fused_attention and len(segments) == 1
                and not getattr(segments[0].kv, "paged", False)):
            # (one launch a layer for the q/k norms, RoPE and the cache store: GQAAttention;
            # a paged cache's rows go through its block table instead)
            ctx.inv_freq = self.rope_inv_freq()
            first = segments[0].kv.length if start is None else start
            ctx.pos = to_device(torch.tensor([first]), self.device)
        return ctx

    @torch.inference_mode()
    def forward_layers(self, tokens: torch.Tensor, kv: KVCache, chunk: int,
                       all_logits: bool = False, marks: object | None = None) -> torch.Tensor:
        """One sequence's tokens [T] in chunks of `chunk`, layer by layer (layer-major: each
        layer's experts run once over the whole prompt, strata.model.layer_major) -> logits
        float32 as forward's for one segment: [T, V] when all_logits, else [1, V]. kv grows by
        T; marks.after(i) after layer i and after the head."""
        from strata.model.layer_major import forward_layers

        return forward_layers(self, tokens, kv, chunk, all_logits, marks)

    def trunk(self, tokens: torch.Tensor, ctx: Segments,
              marks: object | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """tokens [T] on the device, embedded and run through every layer -> (x [T, D], the last
        layer's output delta, which the head's norm adds). marks.after(i) after layer i."""
        x = self.w.embed.rows(tokens)  # [T, D]
        delta = None  # each layer's output, added by the next residual step
        ex, L = self.experts, len(self.layers)
        for i, layer in enumerate(self.layers):
            if (i + 1 < L and layer.ffn.routed and self.layers[i + 1].ffn.routed
                    and getattr(ex, "wants_ahead", None) and ex.wants_ahead(i + 1, len(x))):
                # a verify window: the next layer's router on this layer's residual (after its
                # attention) guesses that layer's experts, copied while this layer's run
                r = layer.begin(x, delta, ctx)
                ex.guessed = (i + 1, self.layers[i + 1].ffn.guess(x))
                delta = layer.finish(r, ctx)
            else:
                delta = layer.forward(x, delta, ctx)
            if marks is not None:
                marks.after(i)
        return x, delta

    def rope_inv_freq(self) -> torch.Tensor:
        """RoPE's frequencies for the fused chunk kernels (decode_ops.rope_inv_freq; YaRN's where
        the model has it, its q/k scale applied by the attention), made once."""
        if self._inv_freq is None:
            c = self.cfg
            if c.yarn is not None:
                self._inv_freq = yarn_inv_freq(c.rope_dim, c.rope_theta, c.yarn, self.device)
            else:
                self._inv_freq = decode_ops().rope_inv_freq(c.rope_dim, c.rope_theta,
                                                            self.device)
        return self._inv_freq

    def gpu_timer(self):  # noqa: ANN201 (GpuTimer | None)
        """The experts' GPU timer when --stats asked for one (CUDA only)."""
        return getattr(getattr(self.experts, "stats", None), "timer", None)


def shared_expert(lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
    """The gated shared expert (qwen2moe): sigmoid(h . g) * swiglu(h). h: [T, D] -> [T, D]"""
    return SharedExpert(lw).forward(h)
