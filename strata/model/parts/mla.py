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
short chunks), a longer one the expanded form.

Legend: T tokens, Tk cached tokens, H heads, L kv_lora, R rope dims, N nope dims, V value dims.
"""

from __future__ import annotations

import torch

from strata.arch_deepseek2 import yarn_mscale
from strata.config import ModelConfig
from strata.model.layers import apply_rope, rms_norm
from strata.model.parts.context import Context
from strata.model.weights import LayerWeights, linear

ABSORB_MAX_T = 4  # segments up to this many tokens attend in the latent space


class MLAttention:
    absorb_max_t = ABSORB_MAX_T

    def __init__(self, cfg: ModelConfig, lw: LayerWeights, layer: int):
        self.lw, self.layer = lw, layer
        self.H, self.R, self.L, self.V = cfg.n_heads, cfg.rope_dim, cfg.kv_lora, cfg.d_v
        self.N = cfg.head_dim - cfg.rope_dim
        self.eps = cfg.rms_eps
        self.scale = yarn_mscale(cfg) / cfg.head_dim ** 0.5

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        """h [T, D] -> attention output after wo [T, D]; the latent cache gets the new rows."""
        if ctx.static:
            raise NotImplementedError("deepseek2 runs its decode tokens through the forward "
                                      "(no static decode step for MLA yet)")
        lw, T = self.lw, h.shape[0]
        if lw.wq_a is not None:
            q = linear(rms_norm(linear(h, lw.wq_a), lw.q_a_norm, self.eps), lw.wq)
        else:
            q = linear(h, lw.wq)
        q = q.view(T, self.H, self.N + self.R)
        q_nope, q_pe = q[..., : self.N], apply_rope(q[..., self.N:], ctx.cos, ctx.sin, "normal")
        kv = linear(h, lw.wkv_a)  # [T, L + R]
        c = rms_norm(kv[:, : self.L], lw.kv_a_norm, self.eps)
        k_pe = apply_rope(kv[:, None, self.L:], ctx.cos, ctx.sin, "normal")[:, 0]  # [T, R]
        rows = torch.cat([c, k_pe], dim=-1)  # [T, L + R]
        out, start = [], 0
        for s in ctx.segments:
            sl = slice(start, start + s.length)
            cached = s.kv.append(self.layer, rows[sl]).float()  # [Tk, L + R]
            attend = self.absorbed if s.length <= self.absorb_max_t else self.expanded
            out.append(attend(q_nope[sl], q_pe[sl], cached, s.kv.length))
            start += s.length
        return linear(torch.cat(out), lw.wo)  # [T, H*V] -> [T, D]

    def expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cached: torch.Tensor,
                 pos0: int) -> torch.Tensor:
        """Every head's keys and values from the cached rows; causal attention -> [T, H*V]"""
        lw = self.lw
        c, k_pe = cached[:, : self.L], cached[:, self.L:]
        k_nope = torch.einsum("kl,hln->hkn", c, lw.k_b)  # [H, Tk, N]
        v = torch.einsum("kl,hvl->hkv", c, lw.v_b)  # [H, Tk, V]
        k = torch.cat([k_nope, k_pe[None].expand(self.H, -1, -1)], dim=-1)  # [H, Tk, N+R]
        q = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, T, N+R]
        mask = _causal(q.shape[1], k.shape[1], pos0, q.device)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                             scale=self.scale)  # [H, T, V]
        return o.transpose(0, 1).reshape(q.shape[1], self.H * self.V)

    def absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cached: torch.Tensor,
                 pos0: int) -> torch.Tensor:
        """Attention in the latent space: k_b folded into the query, v_b applied after the
        weighted sum of the cached latents -> [T, H*V]"""
        lw, T = self.lw, q_nope.shape[0]
        c, k_pe = cached[:, : self.L], cached[:, self.L:]
        q_lat = torch.einsum("thn,hln->thl", q_nope, lw.k_b)  # [T, H, L]
        scores = (torch.einsum("thl,kl->htk", q_lat, c)
                  + torch.einsum("thr,kr->htk", q_pe, k_pe)) * self.scale  # [H, T, Tk]
        mask = _causal(T, c.shape[0], pos0, c.device)
        p = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        o_lat = torch.einsum("htk,kl->thl", p, c)  # [T, H, L]
        return torch.einsum("thl,hvl->thv", o_lat, lw.v_b).reshape(T, self.H * self.V)


def _causal(tq: int, tk: int, pos0: int, device: torch.device) -> torch.Tensor:
    """[Tq, Tk], True = attend: query i (at pos0 + i) sees keys j <= pos0 + i."""
    q_idx = torch.arange(tq, device=device)[:, None] + pos0
    return torch.arange(tk, device=device)[None, :] <= q_idx
