"""Multi-head latent attention (deepseek2): the token mixer over a LatentCache.

    q = q_b(rms_norm(q_a h)) (or q h)        [T, H, nope + rope]; rope on the last rope dims
    [c ; k_pe] = kv_a_mqa h; c = rms_norm(c) [T, kv_lora], [T, rope]; k_pe rotated, shared
    cached: [c ; k_pe] per token

Two equal forms of the same attention (scale = mscale^2 / sqrt(nope + rope)):
    expanded (prompt chunks)  k_h = [c k_b[h] ; k_pe], v_h = c v_b[h]^T, attention per head
    absorbed (decode)         q_h' = k_b[h] q_nope_h [kv_lora]: scores = q_h' . c + q_pe . k_pe,
                              o_h = v_b[h] (softmax . c), attending in the latent space (the
                              cached rows as they are, no expansion)
A segment of at most ABSORB_MAX_T tokens takes the absorbed form (decode, batched decode,
short chunks), a longer one the expanded form. In the decode steps (StaticStep: one sequence,
or a batch's rows over a pool) the absorbed form through latent_ops.latent_attention: on CUDA
split-KV kernels that read only the rows below the device-side length (exact float32, or TF32
with --kernels fused), elsewhere the same form in torch ops over the storage's rows, masked
(both capturable).

Legend: T tokens, Tk cached tokens, H heads, L kv_lora, R rope dims, N nope dims, V value dims.
"""

from __future__ import annotations

import torch

from strata.config import ModelConfig
from strata.kernels.torch_ops import yarn_attn_scale
from strata.model.layers import apply_rope, rms_norm
from strata.model.parts.context import Context, StaticStep
from strata.model.weights import LayerWeights, linear

ABSORB_MAX_T = 4  # segments up to this many tokens attend in the latent space
# the expanded form's keys and values of a block of heads (a prompt chunk over a long context:
# DeepSeek-V3's 128 heads x 4096 rows x 320 floats would take 671 MB at once)
EXPAND_BYTES = 64 << 20


class MLAttention:
    absorb_max_t = ABSORB_MAX_T

    def __init__(self, cfg: ModelConfig, lw: LayerWeights, layer: int):
        self.lw, self.layer = lw, layer
        self.H, self.R, self.L, self.V = cfg.n_heads, cfg.rope_dim, cfg.kv_lora, cfg.d_v
        self.N = cfg.head_dim - cfg.rope_dim
        self.eps = cfg.rms_eps
        self.scale = yarn_attn_scale(cfg.yarn)[1] / cfg.head_dim ** 0.5  # (q/k: 1, deepseek2)

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        """h [T, D] -> attention output after wo [T, D]; the latent cache gets the new rows."""
        if ctx.static:  # one token over the step's static buffers
            angles = ctx.pos.float()[:, None] * ctx.inv_freq[None]  # [1, R/2]
            q_nope, q_pe, rows = self._project(h, angles.cos(), angles.sin())
            return linear(self._step(q_nope, q_pe, rows, ctx), self.lw.wo)
        q_nope, q_pe, rows = self._project(h, ctx.cos, ctx.sin)
        out, start = [], 0
        for s in ctx.segments:
            sl = slice(start, start + s.length)
            cached = s.kv.append(self.layer, rows[sl]).float()  # [Tk, L + R]
            attend = self.absorbed if s.length <= self.absorb_max_t else self.expanded
            out.append(attend(q_nope[sl], q_pe[sl], cached, s.kv.length))
            start += s.length
        return linear(torch.cat(out), self.lw.wo)  # [T, H*V] -> [T, D]

    def _project(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 ) -> tuple[torch.Tensor, ...]:
        """h [T, D] -> q_nope [T, H, N], rotated q_pe [T, H, R], cache rows [T, L + R]"""
        lw, T = self.lw, h.shape[0]
        if lw.wq_a is not None:
            q = linear(rms_norm(linear(h, lw.wq_a), lw.q_a_norm, self.eps), lw.wq)
        else:
            q = linear(h, lw.wq)
        q = q.view(T, self.H, self.N + self.R)
        q_pe = apply_rope(q[..., self.N:], cos, sin, "normal")
        kv = linear(h, lw.wkv_a)  # [T, L + R]
        c = rms_norm(kv[:, : self.L], lw.kv_a_norm, self.eps)
        k_pe = apply_rope(kv[:, None, self.L:], cos, sin, "normal")[:, 0]  # [T, R]
        return q[..., : self.N], q_pe, torch.cat([c, k_pe], dim=-1)

    def _step(self, q_nope: torch.Tensor, q_pe: torch.Tensor, row: torch.Tensor,
              ctx: StaticStep) -> torch.Tensor:
        """The decode step's token: its row stored at ctx.pos, then the absorbed attention over
        the storage's rows below ctx.length (latent_ops.latent_attention: the split kernels on
        CUDA, torch ops over the whole storage, masked, elsewhere; graph-safe either way).
        -> [1, H*V]. With ctx.rows: B rows of sequences of one pool (a prompt's chunk: rows of
        one sequence at consecutive positions), every row stored at pool row write[b] before
        any attends, each attending over its rows read[b] below length[b] (so a chunk's rows
        causally) -> [B, H*V]."""
        from strata.kernels.gpu.latent_ops import latent_attention

        lw, B, r = self.lw, q_nope.shape[0], ctx.rows
        if r is None:
            store, read, at = ctx.kv.store[self.layer], None, ctx.pos  # [capacity, L + R]
        else:
            store, read, at = r.pool.latent[self.layer], r.read, r.write  # [rows, L + R]
        store.index_copy_(0, at, row.to(store.dtype))
        q_lat = torch.einsum("bhn,hln->bhl", q_nope, lw.k_b).contiguous()  # [B, H, L]
        o_lat = latent_attention(q_lat, q_pe.contiguous(), store, ctx.length, self.scale, read,
                                 fused=ctx.fused_attention)  # [B, H, L]
        return torch.einsum("bhl,hvl->bhv", o_lat, lw.v_b).reshape(B, self.H * self.V)

    def expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cached: torch.Tensor,
                 pos0: int) -> torch.Tensor:
        """Every head's keys and values from the cached rows; causal attention -> [T, H*V].
        Heads go in blocks whose expanded keys and values stay within EXPAND_BYTES."""
        lw = self.lw
        c, k_pe = cached[:, : self.L], cached[:, self.L:]
        T, Tk = q_nope.shape[0], c.shape[0]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, T, N+R]
        mask = _causal(T, Tk, pos0, q.device)
        step = max(1, EXPAND_BYTES // (4 * Tk * (self.N + self.R + self.V)))
        out = []
        for h0 in range(0, self.H, step):
            hs = slice(h0, min(h0 + step, self.H))
            k_nope = torch.einsum("kl,hln->hkn", c, lw.k_b[hs])  # [h, Tk, N]
            v = torch.einsum("kl,hvl->hkv", c, lw.v_b[hs])  # [h, Tk, V]
            k = torch.cat([k_nope, k_pe[None].expand(k_nope.shape[0], -1, -1)], dim=-1)
            out.append(torch.nn.functional.scaled_dot_product_attention(
                q[hs], k, v, attn_mask=mask, scale=self.scale))  # [h, T, V]
        return torch.cat(out).transpose(0, 1).reshape(T, self.H * self.V)

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cached: torch.Tensor,
                 pos0: int) -> torch.Tensor:
        """Attention in the latent space: k_b folded into the query, v_b applied after the
        weighted sum of the cached latents -> [T, H*V]"""
        mask = _causal(q_nope.shape[0], cached.shape[0], pos0, cached.device)
        return self._latent(q_nope, q_pe, cached, mask)

    def _latent(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cached: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """softmax over the rows `mask` [T, Tk] lets each query see, in the latent space."""
        lw, T = self.lw, q_nope.shape[0]
        c, k_pe = cached[:, : self.L], cached[:, self.L:]
        q_lat = torch.einsum("thn,hln->thl", q_nope, lw.k_b)  # [T, H, L]
        scores = (torch.einsum("thl,kl->htk", q_lat, c)
                  + torch.einsum("thr,kr->htk", q_pe, k_pe)) * self.scale  # [H, T, Tk]
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        o_lat = torch.einsum("htk,kl->thl", p, c)  # [T, H, L]
        return torch.einsum("thl,hvl->thv", o_lat, lw.v_b).reshape(T, self.H * self.V)


def _causal(tq: int, tk: int, pos0: int, device: torch.device) -> torch.Tensor:
    """[Tq, Tk], True = attend: query i (at pos0 + i) sees keys j <= pos0 + i."""
    q_idx = torch.arange(tq, device=device)[:, None] + pos0
    return torch.arange(tk, device=device)[None, :] <= q_idx
