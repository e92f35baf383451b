"""Attention with sinks over a full or sliding window (gpt-oss): GQAAttention's projections
(+ biases) and neox RoPE (YaRN tables where the file has them), then each head's softmax over
its keys and one learned sink logit s_h that takes probability and gives no value:

    p = softmax([q k_j^T * scale for j in window(i)] ++ [s_h]);  out = Σ_j p_j v_j  (sink dropped)
    window(i) = {j <= i} (full layers), {i - W < j <= i} (sliding layers, W = sliding_window)

then wo and its bias (GQAAttention.forward's: in the GEMV's store on CUDA). The KV cache keeps
every row on both kinds of layer (a sliding layer reads only its last W). In a static step (the
decode step's buffers) the attention is
decode_ops.decode_attention with the window and the sinks: flash decoding over the window's rows
on CUDA, torch ops over the static cache elsewhere (no host sync either way).

Legend: T tokens, Tk keys, C cache rows, H heads, Hkv kv heads, hd head dim, W window.
"""

from __future__ import annotations

import torch

from strata.arch.gpt_oss import is_sliding
from strata.config import ModelConfig
from strata.model.layers import apply_rope
from strata.model.parts.attention import GQAAttention
from strata.model.parts.context import Segments, StaticStep, decode_ops
from strata.model.weights import LayerWeights

# the float32 score matrix [H, block, Tk] of a prompt chunk is held to this many bytes (a block
# of queries at a time): 64 heads over 8k keys take 2 MiB a query
_SCORE_BYTES = 256 << 20


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos0: int,
                   sinks: torch.Tensor, window: int, scale: float) -> torch.Tensor:
    """Causal GQA attention with a sink logit per head, queries at positions q_pos0.. over keys
    0..Tk-1, each query seeing at most its last `window` keys (0: all). float32.
    q: [T, H, hd]; k, v: [Tk, Hkv, hd]; sinks [H] -> [T, H*hd]"""
    T, H, hd = q.shape
    Tk, Hkv = k.shape[:2]
    kh = k.float().repeat_interleave(H // Hkv, 1).transpose(0, 1)  # [H, Tk, hd]
    vh = v.float().repeat_interleave(H // Hkv, 1).transpose(0, 1)
    key_pos = torch.arange(Tk, device=q.device)[None, :]
    out, block = [], max(1, _SCORE_BYTES // (4 * H * max(Tk, 1)))
    for a in range(0, T, block):
        qb = q[a:a + block].transpose(0, 1)  # [H, t, hd]
        q_pos = torch.arange(a, a + qb.shape[1], device=q.device)[:, None] + q_pos0
        mask = key_pos <= q_pos  # [t, Tk]
        if window:
            mask &= key_pos > q_pos - window
        scores = (qb @ kh.transpose(1, 2)) * scale  # [H, t, Tk]
        scores = scores.masked_fill(~mask, float("-inf"))
        sink = sinks.float()[:, None, None].expand(H, qb.shape[1], 1)
        p = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [H, t, Tk]
        out.append((p @ vh).transpose(0, 1).reshape(-1, H * hd))  # [t, H*hd]
    return torch.cat(out)


class SinkAttention(GQAAttention):
    """Attention with sinks: sliding-window on the layers arch.gpt_oss.is_sliding names, full
    on the others."""

    def __init__(self, cfg: ModelConfig, lw: LayerWeights, layer: int):
        super().__init__(cfg, lw, layer)  # (YaRN's scales: GQAAttention's)
        self.window = cfg.sliding_window if is_sliding(cfg, layer) else 0

    def _step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              ctx: StaticStep) -> torch.Tensor:
        """RoPE and the cache store in one launch (q and k scaled by YaRN's mscale first: the
        rotation is linear), then decode attention over the window with the sinks."""
        ops, kv, i = decode_ops(), ctx.kv, self.layer
        if ctx.rows is not None:  # B rows of sequences of one pool (the batched step)
            return self._rows(q, k, v, ctx, self.window, self.lw.sinks)
        q, k, _, _ = self._rope_inputs(q, k)  # (no q/k norms: YaRN's scale on q and k)
        q = ops.qk_rope_store(q, k, v, None, None, self.eps, ctx.pos, ctx.inv_freq,
                              self.rope_style, kv.k[i], kv.v[i])
        return ops.decode_attention(q, kv.k[i], kv.v[i], ctx.length, self.scale,
                                    window=self.window, sinks=self.lw.sinks,
                                    fused=ctx.fused_attention)  # [1, H*hd]

    def _segments(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  ctx: Segments) -> torch.Tensor:
        """Each segment appends its keys and values to its own cache and attends over it; one
        segment under --kernels fused on CUDA: GQAAttention._chunk with the window and sinks."""
        if ctx.inv_freq is not None:
            return self._chunk(q, k, v, ctx, self.window, self.lw.sinks)
        q, k = (apply_rope(q, ctx.cos, ctx.sin, self.rope_style),
                apply_rope(k, ctx.cos, ctx.sin, self.rope_style))
        out, start = [], 0
        for s in ctx.segments:
            sl = slice(start, start + s.length)
            keys, values = s.kv.append(self.layer, k[sl], v[sl])  # [pos0 + t, Hkv, hd]
            out.append(sink_attention(q[sl], keys, values, s.kv.length, self.lw.sinks,
                                      self.window, self.scale))
            start += s.length
        return torch.cat(out)  # [T, H*hd]
