"""Token mixers: what a layer runs before its feed-forward. Each is a class with
`forward(h, ctx) -> [T, D]` (h the normed residual) that picks its kernels from the context.

GQAAttention: full causal grouped-query attention with RoPE (qwen3moe, qwen2moe, llama): the
q/k/v projections (+ bias), per-head q/k RMS norms (qwen3moe), RoPE on the first rope_dim dims,
the new keys and values appended to the KV cache, attention over every cached row, then wo.
Sliding-window attention, attention sinks, MLA and gated linear attention go beside it, as
classes of their own with the same forward (and a name in layer.MIXERS).

Legend: T tokens, D hidden, H heads, Hkv kv heads, hd head dim.
"""

from __future__ import annotations

import torch

from strata.config import ModelConfig
from strata.kernels.gpu.chunk_attention import chunk_attention, flash_reads
from strata.kernels.torch_ops import yarn_attn_scale
from strata.kernels.tuning import BF16_ATTENTION_MIN_T
from strata.model.layers import apply_rope, attention, attention_bf16, attention_last, rms_norm
from strata.model.parts.context import Context, Segments, StaticStep, decode_ops
from strata.model.weights import LayerWeights, linear, qkv_linear
from strata.runtime.kv_cache import dequantize_q8_0


class GQAAttention:
    def __init__(self, cfg: ModelConfig, lw: LayerWeights, layer: int):
        self.lw, self.layer = lw, layer
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.qkv_bias, self.qk_norm = cfg.qkv_bias, cfg.qk_norm
        self.eps, self.rope_style = cfg.rms_eps, cfg.rope_style
        # YaRN's q/k scale (the reference's cos and sin carry it; the fused kernels' frequency
        # table does not: _rope_inputs) and its softmax scale
        self.mscale, softmax = yarn_attn_scale(cfg.yarn)
        self.scale = cfg.head_dim ** -0.5 * softmax
        # the fused kernels' q/k norm weights, YaRN's scale in them where there is one (made
        # once, not every step)
        self.norms = (lw.q_norm, lw.k_norm) if self.qk_norm else (None, None)
        if self.qk_norm and self.mscale != 1.0:
            self.norms = (lw.q_norm * self.mscale, lw.k_norm * self.mscale)

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        """h [T, D] -> attention output after wo [T, D]; the KV cache gets the new rows."""
        lw = self.lw
        # [T, H*hd], [T, Hkv*hd], [T, Hkv*hd]; a static step's kernels read them strided
        q, k, v = qkv_linear(h, lw, self.qkv_bias, contiguous=not ctx.static)
        T = h.shape[0]
        q = q.view(T, self.n_heads, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        out = self._step(q, k, v, ctx) if ctx.static else self._segments(q, k, v, ctx)
        return linear(out, lw.wo, lw.bo)  # (the output's bias: gpt-oss's)

    def _step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              ctx: StaticStep, gate: torch.Tensor | None = None) -> torch.Tensor:
        """One token over static buffers: q/k norms, RoPE and the cache store in one launch,
        then flash decoding over the rows up to ctx.length (two launches); gate [1, H, hd]: the
        output times its sigmoid, in the second (decode_attention's gate)."""
        if ctx.rows is not None:  # B rows of sequences of one pool (the batched step)
            return self._rows(q, k, v, ctx)
        ops, kv, i = decode_ops(), ctx.kv, self.layer
        ks, vs = (kv.ks[i], kv.vs[i]) if kv.quantized else (None, None)  # q8_0's scales
        q, k, qn, kn = self._rope_inputs(q, k)
        q = ops.qk_rope_store(q, k, v, qn, kn, self.eps, ctx.pos, ctx.inv_freq, self.rope_style,
                              kv.k[i], kv.v[i], k_scales=ks, v_scales=vs)
        return ops.decode_attention(q, kv.k[i], kv.v[i], ctx.length, self.scale, k_scales=ks,
                                    v_scales=vs, fused=ctx.fused_attention,
                                    gate=gate)  # [1, H*hd]

    def _rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StaticStep,
              window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """B rows of sequences of one KV pool (a token each; a prompt's chunk: rows of one
        sequence at consecutive positions): q/k norms, RoPE at each row's position and every
        row's keys and values into the pool, then each row's attention over its sequence's rows
        up to its own (so a chunk's rows attend causally among themselves). -> [B, H*hd]"""
        ops, r = decode_ops(), ctx.rows
        kp, vp, ks, vs = r.pool.layer(self.layer)  # [R, Hkv, hd] (+ q8_0's scales)
        q, k, qn, kn = self._rope_inputs(q, k)
        q = ops.rows_rope_store(q, k, v, qn, kn, self.eps, ctx.pos, ctx.inv_freq,
                                self.rope_style, kp, vp, r.write, ks, vs)
        return ops.paged_attention(q, kp, vp, r.read, ctx.length, self.scale, window, sinks,
                                   ks, vs, fused=ctx.fused_attention)

    def _rope_inputs(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, q norm, k norm) for the fused kernels that norm, rotate (by the frequency
        table, YaRN's included) and store in one launch: YaRN's q/k scale goes into the norms'
        weights where there are norms (a norm would undo a scaled input), else onto q and k (the
        rotation is linear), so the stored keys are the reference's."""
        if self.mscale == 1.0 or self.qk_norm:
            return q, k, *self.norms
        return q * self.mscale, k * self.mscale, None, None

    def _segments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  ctx: Segments) -> torch.Tensor:
        """Each segment appends its keys and values to its own cache and attends over it."""
        if ctx.inv_freq is not None:  # one segment, --kernels fused on CUDA
            return self._chunk(q, k, v, ctx)
        lw, i = self.lw, self.layer
        if self.qk_norm:
            q, k = rms_norm(q, lw.q_norm, self.eps), rms_norm(k, lw.k_norm, self.eps)
        q, k = (apply_rope(q, ctx.cos, ctx.sin, self.rope_style),
                apply_rope(k, ctx.cos, ctx.sin, self.rope_style))
        if (len(ctx.segments) > 1 and not ctx.fused_attention
                and all(s.length == 1 for s in ctx.segments)):
            # batched decode on the float path: one call over the B caches
            rows = [s.kv.append(i, k[b:b + 1], v[b:b + 1]) for b, s in enumerate(ctx.segments)]
            return attention_last(q, [r[0].float() for r in rows], [r[1].float() for r in rows])
        out, start = [], 0
        for s in ctx.segments:
            sl = slice(start, start + s.length)
            # (a q8_0 cache read by the decode kernel below needs no float32 copy)
            # (a paged cache's rows come gathered from its blocks: attention() reads them)
            paged = getattr(s.kv, "paged", False)
            kernel_reads = (ctx.fused_attention and s.kv.quantized and not paged
                            and s.length <= BF16_ATTENTION_MIN_T)
            keys, values = s.kv.append(i, k[sl], v[sl], read=not kernel_reads)  # [pos0 + t, ..]
            if ctx.fused_attention and s.length > BF16_ATTENTION_MIN_T:
                out.append(attention_bf16(q[sl], keys, values))
            elif kernel_reads or (ctx.fused_attention and keys.dtype != torch.float32
                                  and not paged):
                # a few tokens (batched decode) over a half-size or q8_0 cache: the decode
                # kernel reads its rows as they are, where attention() needs float32
                end = torch.full((1,), s.kv.length + s.length, device=q.device)
                ks, vs = (s.kv.ks[i], s.kv.vs[i]) if s.kv.quantized else (None, None)
                out.append(decode_ops().decode_attention(q[sl], s.kv.k[i], s.kv.v[i], end,
                                                         self.scale, k_scales=ks, v_scales=vs,
                                                         fused=ctx.fused_attention))
            else:  # (keys and values as stored: rounded to --kv-type)
                out.append(attention(q[sl], keys.float(), values.float(), s.kv.length))
            start += s.length
        return torch.cat(out)  # [T, H*hd]

    def _chunk(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: Segments,
               window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One segment's T tokens on the fused kernels: q/k norms, RoPE and the cache store in
        one launch (as the decode step's), then flash attention over the cache's rows (T >
        BF16_ATTENTION_MIN_T: on a float16 / bfloat16 CUDA cache as stored, its length read on
        the device, chunk_attention; else over the rows up to the chunk's end in bf16) or the
        decode kernel reading them as stored (a few tokens). Every position and length but
        that bf16 copy's comes from ctx.pos on the device: a captured chunk serves any start
        (strata.engine.chunk_graph). With a window or sinks (gpt-oss): flash attention with its
        left window and the sinks folded in from its log-sum-exp, else the decode kernel at
        any T (both read the length on the device)."""
        ops, i = decode_ops(), self.layer
        kv, t = ctx.segments[0].kv, q.shape[0]
        end = kv.length + t
        kv.reserve(end)
        ks, vs = (kv.ks[i], kv.vs[i]) if kv.quantized else (None, None)  # q8_0's scales
        q, k, qn, kn = self._rope_inputs(q, k)
        q = ops.qk_rope_store(q, k, v, qn, kn, self.eps, ctx.pos, ctx.inv_freq, self.rope_style,
                              kv.k[i], kv.v[i], k_scales=ks, v_scales=vs)
        if t > BF16_ATTENTION_MIN_T and flash_reads(kv.k[i]):
            return chunk_attention(q, kv.k[i], kv.v[i], ctx.pos + t, self.scale, window, sinks)
        if t > BF16_ATTENTION_MIN_T and not window and sinks is None:
            keys, values = kv.k[i][:end], kv.v[i][:end]  # [end, Hkv, hd]
            if kv.quantized:
                keys, values = dequantize_q8_0(keys, ks[:end]), dequantize_q8_0(values, vs[:end])
            return attention_bf16(q, keys, values)
        return ops.decode_attention(q, kv.k[i], kv.v[i], ctx.pos + t, self.scale, k_scales=ks,
                                    v_scales=vs, fused=True, window=window,
                                    sinks=sinks)  # [T, H*hd]


class GatedAttention(GQAAttention):
    """Full attention with a sigmoid output gate per head (qwen35moe, qwen3next): attn_q's rows
    hold, per head, the query [hd] then its gate [hd]; out = wo(attention * sigmoid(gate)).
    Partial RoPE (the first rope_dim dims), q/k norms. Its KV rows are layer `kv_layer` of the
    cache, which holds the full-attention layers only."""

    def __init__(self, cfg: ModelConfig, lw: LayerWeights, layer: int):
        kv_layer = sum(not cfg.is_linear(i) for i in range(layer))
        super().__init__(cfg, lw, kv_layer)
        self.index = layer

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        lw, T = self.lw, h.shape[0]
        qg, k, v = qkv_linear(h, lw)  # [T, 2*H*hd], [T, Hkv*hd], [T, Hkv*hd]
        qg = qg.view(T, self.n_heads, 2, self.head_dim)
        k = k.view(T, self.n_kv_heads, self.head_dim)
        v = v.view(T, self.n_kv_heads, self.head_dim)
        if ctx.static and ctx.rows is None:  # one token: q read strided, the gate applied in
            # the attention's reduce launch (no copies, no sigmoid and product launches)
            return linear(self._step(qg[:, :, 0], k, v, ctx, gate=qg[:, :, 1]), lw.wo)
        q, gate = qg[:, :, 0].contiguous(), qg[:, :, 1].reshape(T, -1)  # [T, H, hd], [T, H*hd]
        out = self._step(q, k, v, ctx) if ctx.static else self._segments(q, k, v, ctx)
        return linear(out * torch.sigmoid(gate), lw.wo)
