"""The building blocks of the reference forward pass, in float32: the model's layers
(strata.model.layers) and the torch paths of the kernels (decode_ops, the CPU experts) are built
on these, so they sit below both.

Legend: T tokens, D hidden, H query heads, Hkv key/value heads, hd head dim, E experts, K used.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from strata.yarn import Yarn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight, over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def sum_rows(delta: torch.Tensor) -> torch.Tensor:
    """A residual step's delta as [T, D]: [T, R, D] (a token's K expert outputs unsummed,
    moe_forward's sum_pairs=False) has its R rows added to each other in order, the fused
    residual kernel's order (decode_ops.add_rms_norm); [T, D] comes back as it is."""
    if delta.dim() != 3:
        return delta
    total = delta[:, 0].clone()
    for r in range(1, delta.shape[1]):
        total += delta[:, r]
    return total


def rope_tables(positions: torch.Tensor, dim: int, theta: float,
                yarn: Yarn | None = None) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, dim/2] for angle(p, i) = p * theta^(-2i/dim); with yarn (a config.Yarn) its
    frequencies (yarn_inv_freq) and both tables times its q/k scale (yarn_attn_scale)."""
    if yarn is None:
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                                device=positions.device) / dim)
    else:
        inv_freq = yarn_inv_freq(dim, theta, yarn, positions.device)
    mscale = yarn_attn_scale(yarn)[0]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [T, dim/2]
    if mscale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * mscale, angles.sin() * mscale


def yarn_inv_freq(dim: int, theta: float, yarn: Yarn, device: torch.device | str) -> torch.Tensor:
    """float32 [dim/2]: YaRN's frequencies as ggml's rope_yarn computes them: pair i's angle
    mixes the interpolated one (freq_scale = 1 / factor) and the original theta^(-2i/dim) by
    ramp r_i = ext_factor * (1 - clamp((i - lo) / max(0.001, hi - lo), 0, 1)), lo / hi the
    floor / ceil of the dims where beta_fast / beta_slow rotations fit the original context."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    freq_scale = 1.0 / yarn.factor

    def corr_dim(n_rot: float) -> float:
        return dim * math.log(yarn.orig_ctx / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(0.0, math.floor(corr_dim(yarn.beta_fast)))
    hi = min(dim - 1.0, math.ceil(corr_dim(yarn.beta_slow)))
    i = torch.arange(dim // 2, dtype=torch.float32, device=device)
    ramp = (1 - ((i - lo) / max(0.001, hi - lo)).clamp(0, 1)) * yarn.ext_factor  # [dim/2]
    return inv_freq * (freq_scale * (1 - ramp) + ramp)


def yarn_attn_scale(yarn: Yarn | None) -> tuple[float, float]:
    """(q/k, softmax): what YaRN multiplies q and k by (cos and sin: ggml's mscale =
    attn_factor * (1 + 0.1 ln factor) where rope_mscale and ext_factor != 0) and what it
    multiplies the softmax scale by ((1 + 0.1 mscale_all_dim ln factor)^2); (1, 1) without."""
    if yarn is None:
        return 1.0, 1.0
    qk = 1.0
    if yarn.rope_mscale:
        qk = yarn.attn_factor
        if yarn.ext_factor != 0:
            qk *= 1.0 + 0.1 * math.log(yarn.factor)
    softmax = 1.0
    if yarn.mscale_all_dim:
        softmax = (1.0 + 0.1 * yarn.mscale_all_dim * math.log(yarn.factor)) ** 2
    return qk, softmax


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate the first `2 * cos.shape[-1]` dims of each head. x: [T, heads, hd].

    neox: pairs (i, i + dim/2) (the qwen families);
    normal: adjacent pairs (2i, 2i+1) (llama in GGUF).
    """
    dim = 2 * cos.shape[-1]
    rot, rest = x[..., :dim], x[..., dim:]
    c, s = cos[:, None, :], sin[:, None, :]  # [T, 1, dim/2]
    if style == "neox":
        a, b = rot[..., : dim // 2], rot[..., dim // 2:]
        out = torch.cat([a * c - b * s, b * c + a * s], dim=-1)
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos0: int) -> torch.Tensor:
    """Causal GQA attention of queries at positions q_pos0.. over keys 0..n_k-1.

    softmax(q k^T / sqrt(hd) + mask) v, where query i sees keys j <= q_pos0 + i. Runs through
    torch's fused attention (no [H, Tq, Tk] score matrix in memory on CUDA).
    q: [Tq, H, hd]; k, v: [Tk, Hkv, hd] -> [Tq, H*hd]
    """
    Tq, H, hd = q.shape
    Tk = k.shape[0]
    q_idx = torch.arange(Tq, device=q.device)[:, None] + q_pos0
    mask = torch.arange(Tk, device=q.device)[None, :] <= q_idx  # [Tq, Tk], True = attend
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
        enable_gqa=True)  # [H, Tq, hd]
    return out.transpose(0, 1).reshape(Tq, H * hd)


def attention_last(q: torch.Tensor, keys: list[torch.Tensor],
                   values: list[torch.Tensor]) -> torch.Tensor:
    """One new token of each of B sequences over its own keys (all of them, its own last
    included): attention() for each (batched decode on the float path). Per sequence, its GQA
    groups' scores and weighted values are two batched matmuls written into one output: on a
    2-core CPU at 8 sequences of ~160 rows, 190 us a layer against 322 for one padded pass
    over all B (the padding's copy and masked einsums; bench/2026-12-05-cpu-serve.md).
    q: [B, H, hd]; keys[b], values[b]: [n_b, Hkv, hd] -> [B, H*hd]"""
    B, H, hd = q.shape
    hkv = keys[0].shape[1]
    out = torch.empty(B, H * hd, dtype=q.dtype, device=q.device)
    for b in range(B):
        qg = q[b].view(hkv, H // hkv, hd)  # [Hkv, G, hd]
        p = torch.softmax(torch.bmm(qg, keys[b].permute(1, 2, 0)) * hd ** -0.5, -1)  # [Hkv, G, n]
        torch.bmm(p, values[b].transpose(0, 1), out=out[b].view(hkv, H // hkv, hd))
    return out


def attention_bf16(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The same causal attention for a prompt chunk whose queries are the last Tq of the Tk
    keys, on bf16 tensor cores (flash attention; float32 out): the --kernels fused prompt path.
    At a long context float32 attention costs more than all the chunk's experts.
    q: [Tq, H, hd]; k, v: [Tk, Hkv, hd] -> [Tq, H*hd]"""
    from torch.nn.attention.bias import causal_lower_right

    Tq, H, hd = q.shape
    Tk, Hkv = k.shape[:2]
    qb, kb, vb = (t.transpose(0, 1).to(torch.bfloat16)[None] for t in (q, k, v))
    if Hkv != H:  # the flash kernel takes equal head counts
        kb, vb = kb.repeat_interleave(H // Hkv, 1), vb.repeat_interleave(H // Hkv, 1)
    out = torch.nn.functional.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=causal_lower_right(Tq, Tk))  # [1, H, Tq, hd]
    return out[0].transpose(0, 1).reshape(Tq, H * hd).float()


def route(h: torch.Tensor, router: torch.Tensor, k: int,
          norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, keep the top k, optionally renormalize them to sum to 1.

    h: [T, D], router: [E, D] -> ids [T, K] (int64), weights [T, K] (float32)
    """
    weights, ids = torch.topk(router_probs(h, router), k, dim=-1)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def router_probs(h: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """softmax(h @ router.T) in float32 (whatever h and router hold): [T, D], [E, D] -> [T, E]"""
    return torch.softmax(h.float() @ router.float().T, dim=-1)


def route_weights(h: torch.Tensor, router: torch.Tensor, ids: torch.Tensor,
                  norm_topk: bool) -> torch.Tensor:
    """route()'s weights for given experts (routing pinned): the router's probabilities of
    ids [T, K], renormalized to sum 1 where norm_topk -> float32 [T, K]"""
    weights = router_probs(h, router).gather(1, ids)
    if norm_topk:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights


def swiglu(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor,
           w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate h) * up h). h: [T, D]; w_gate, w_up: [F, D]; w_down: [D, F] -> [T, D]"""
    return (torch.nn.functional.silu(h @ w_gate.T) * (h @ w_up.T)) @ w_down.T


def glu(g: torch.Tensor, u: torch.Tensor, act: str = "swiglu") -> torch.Tensor:
    """The gated activation of an expert: swiglu silu(g) * u, or swiglu_oai (gpt-oss, ggml's
    swiglu_oai): g' = min(g, limit), u' = clamp(u, -limit, limit),
    (u' + 1) * g' * sigmoid(alpha g')."""
    if act == "swiglu":
        return torch.nn.functional.silu(g) * u
    from strata.arch.gpt_oss import SWIGLU_ALPHA, SWIGLU_LIMIT

    g = g.clamp(max=SWIGLU_LIMIT)
    return (u.clamp(-SWIGLU_LIMIT, SWIGLU_LIMIT) + 1) * (g * torch.sigmoid(SWIGLU_ALPHA * g))


def expert_mlp(h: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
               b_gate: torch.Tensor, b_up: torch.Tensor, b_down: torch.Tensor,
               act: str) -> torch.Tensor:
    """One expert with biases: down(glu(gate h + b_gate, up h + b_up)) + b_down.
    h: [T, D]; w_gate, w_up: [F, D]; w_down: [D, F]; b_gate, b_up: [F]; b_down: [D] -> [T, D]"""
    return glu(h @ w_gate.T + b_gate, h @ w_up.T + b_up, act) @ w_down.T + b_down


def delta_rule_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule (Gated DeltaNet) over any leading dims: S [..., H, dk,
    dv] the state before it, q (scaled), k [..., H, dk], v [..., H, dv], g, beta [..., H]
    -> (o [..., H, dv], the new state): S' = e^g S + k (beta (v - S^T k))^T, o = S'^T q."""
    S = S * g.exp()[..., None, None]
    delta = beta[..., None] * (v - torch.einsum("...hkv,...hk->...hv", S, k))
    S = S + k[..., :, None] * delta[..., None, :]
    return torch.einsum("...hkv,...hk->...hv", S, q), S
