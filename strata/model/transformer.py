"""The MoE transformer forward pass shared by qwen3moe, qwen2moe and Mixtral-style llama.

The architectures differ only in what ModelConfig records: RoPE style, QKV bias, per-head q/k norms,
a gated shared expert, and whether the top-k routing weights are renormalized.

One forward runs a batch of segments: each segment is some new tokens of one sequence, appended to
that sequence's KV cache. Attention runs per segment; every other matmul (and so every expert read)
runs over all tokens of the batch at once.

Legend: T tokens in the batch, D hidden, H heads, Hkv kv heads, hd head dim, V vocab.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from strata.config import ModelConfig
from strata.engine.kv_cache import KVCache
from strata.experts import ExpertExecutor, ReferenceExperts
from strata.kernels import tuning
from strata.model.layers import apply_rope, attention, attention_bf16, rms_norm, rope_tables, route
from strata.model.weights import LayerWeights, ModelWeights, linear, qkv_linear

BF16_ATTENTION_MIN_T = tuning.BF16_ATTENTION_MIN_T


@dataclass
class Segment:
    """`length` new tokens of one sequence, at positions kv.length .. kv.length + length - 1."""

    kv: KVCache
    length: int


class MoETransformer:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, device: torch.device,
                 experts: ExpertExecutor | None = None):
        self.cfg, self.w, self.device = cfg, weights, device
        self.experts = experts or ReferenceExperts()
        self.step = None  # a DecodeStep (strata.engine.decode_step) when the engine made one
        self.max_chunk: int | None = None  # prompt tokens per forward the memory plan allows
        # CUDA with --kernels fused: prompt chunks attend on bf16 tensor cores, a few tokens
        # over a float16 / bfloat16 KV cache through the decode kernel
        self.fused_attention = False
        self.kv_dtype = torch.float32  # the KV cache's elements (--kv-type)

    def decode(self, token: int, kv: KVCache) -> torch.Tensor:
        """One new token of one sequence -> logits [1, V] float32: the decode step (captured as
        CUDA graphs where it can be) when the engine built one, else a plain forward."""
        if self.step is not None:
            self.experts.before_pass(1)
            return self.step(token, kv)
        return self.forward(torch.tensor([token]), [Segment(kv, 1)])

    def new_cache(self, capacity: int = 256) -> KVCache:
        """A KV cache for `capacity` tokens (it grows past them). With a decode step, caches of
        at least the planned context come from one pool, so its graphs serve every request."""
        c = self.cfg
        if self.step is None:
            return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, self.device, capacity,
                           dtype=self.kv_dtype)
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, self.device,
                       max(capacity, self.step.kv_capacity), self.step.kv_pool, self.kv_dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, segments: Sequence[Segment],
                all_logits: bool = False) -> torch.Tensor:
        """tokens: [T] (the segments' tokens, concatenated) -> logits float32.

        Returns [T, V] when all_logits, else [n_segments, V] (each segment's last position).
        Each segment's KV cache grows by its length.
        """
        cfg = self.cfg
        if sum(s.length for s in segments) != tokens.shape[0]:
            raise ValueError("segments do not cover the tokens")
        self.experts.before_pass(tokens.shape[0])
        timer = self.gpu_timer()
        t0 = timer.start() if timer else None
        positions = torch.cat([torch.arange(s.kv.length, s.kv.length + s.length)
                               for s in segments]).to(self.device)
        cos, sin = rope_tables(positions, cfg.rope_dim, cfg.rope_theta)
        x = self.w.embed.rows(tokens.to(self.device))  # [T, D]
        for i, lw in enumerate(self.w.layers):
            x = x + self._attention(i, lw, rms_norm(x, lw.attn_norm, cfg.rms_eps), cos, sin,
                                    segments)
            x = x + self._moe(i, lw, rms_norm(x, lw.ffn_norm, cfg.rms_eps))
        for s in segments:
            s.kv.advance(s.length)
        if not all_logits:
            ends = torch.tensor([s.length for s in segments], device=self.device).cumsum(0) - 1
            x = x[ends]
        logits = linear(rms_norm(x, self.w.output_norm, cfg.rms_eps), self.w.output)
        if timer:
            timer.stop(t0)
        return logits

    def gpu_timer(self):  # noqa: ANN201 (GpuTimer | None)
        """The experts' GPU timer when --stats asked for one (CUDA only)."""
        return getattr(getattr(self.experts, "stats", None), "timer", None)

    def _attention(self, i: int, lw: LayerWeights, h: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        cfg = self.cfg
        T = h.shape[0]
        q, k, v = qkv_linear(h, lw)
        if cfg.qkv_bias:
            q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
        q = q.view(T, cfg.n_heads, cfg.head_dim)
        k = k.view(T, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(T, cfg.n_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = rms_norm(q, lw.q_norm, cfg.rms_eps), rms_norm(k, lw.k_norm, cfg.rms_eps)
        q, k = apply_rope(q, cos, sin, cfg.rope_style), apply_rope(k, cos, sin, cfg.rope_style)
        out, start = [], 0
        for s in segments:
            sl = slice(start, start + s.length)
            keys, values = s.kv.append(i, k[sl], v[sl])  # [pos0 + t, Hkv, hd]
            if self.fused_attention and s.length > BF16_ATTENTION_MIN_T:
                out.append(attention_bf16(q[sl], keys, values))
            elif self.fused_attention and keys.dtype != torch.float32:
                # a few tokens (batched decode) over a half-size cache: the decode kernel
                # reads its rows as they are, where attention() would need a float32 copy
                from strata.kernels.gpu import decode_ops

                end = torch.full((1,), s.kv.length + s.length, device=q.device)
                out.append(decode_ops.decode_attention(q[sl], s.kv.k[i], s.kv.v[i], end,
                                                       cfg.head_dim ** -0.5))
            else:  # (keys and values as stored: rounded to --kv-type)
                out.append(attention(q[sl], keys.float(), values.float(), s.kv.length))
            start += s.length
        return linear(torch.cat(out), lw.wo)

    def _moe(self, i: int, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        ids, weights = route(h, lw.router, cfg.n_experts_used, cfg.norm_topk)  # [T, K]
        timer = self.gpu_timer()
        t0 = timer.start() if timer else None
        out = self.experts.run(i, lw.experts, h, ids, weights)
        if timer:
            timer.stop(t0, layer=i)
        if lw.shared_w1 is not None:
            out = out + shared_expert(lw, h)
        return out


def shared_expert(lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
    """The gated shared expert (qwen2moe): sigmoid(h . g) * swiglu(h). h: [T, D] -> [T, D]"""
    gate = torch.sigmoid(h @ lw.shared_gate)[:, None]  # [T, 1]
    act = torch.nn.functional.silu(linear(h, lw.shared_w1)) * linear(h, lw.shared_w3)
    return gate * linear(act, lw.shared_w2)
