"""The multi-token-prediction (nextn) head of glm4moe / deepseek2 files: one more transformer
layer that drafts the token after next (speculative decoding's --draft mtp, engine/drafters.py).

DeepSeek-V3's MTP module, as llama.cpp's MTP graph for GLM-4.5 (build_mtp_tail) and vLLM's
DeepSeekMultiTokenPredictorLayer compute it, at position i:

    x   = eh_proj([enorm(embed(t_i+1)); hnorm(h_i)])   h_i: the target's last hidden state of
                                                        token i (before the output norm)
    h'  = the nextn layer over x (its own attention cache over the positions so far)
    p   = head(head_norm(h'))                          logits of token i+2

The embedding and the head are the nextn layer's own where the file has them
(nextn.embed_tokens, nextn.shared_head_head), else the model's. qwen35moe's MTP block
(llama.cpp's build_qwen35moe_mtp) is the same around a full gated-attention layer with the
trunk's routed and shared experts; its tensors stay raw in ModelWeights.mtp and hybrid_nextn
below makes the layer of them. Chained for a second draft,
h' takes the place of h_i (llama.cpp's and vLLM's MTP drafters feed their own hidden state).

Legend: t tokens, D hidden, V vocab.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from strata.config import ModelConfig
from strata.experts import ReferenceExperts
from strata.kernels.torch_ops import rms_norm
from strata.model.layers import rope_tables
from strata.model.parts import Head, Layer, Segment, Segments
from strata.model.weights import ExpertWeights, NextNWeights, QuantTensor, linear
from strata.runtime.kv_cache import KVCache
from strata.runtime.latent_cache import LatentCache


class HostExperts(ReferenceExperts):
    """The head's routed experts, kept in host memory (a real model's MTP layer holds as many
    experts as a trunk layer): each routed expert dequantized there and its rows moved to the
    activations' device, one expert at a time."""

    def run(self, layer: int, experts: ExpertWeights, h: torch.Tensor, ids: torch.Tensor,
            weights: torch.Tensor) -> torch.Tensor:
        if experts.gate.raw.device == h.device:
            return super().run(layer, experts, h, ids, weights)
        from strata.model.parts.ffn import swiglu

        out = torch.zeros_like(h)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.nonzero(ids == e, as_tuple=True)  # tokens routed to e
            g, u, d = (m.rows(e).to(h.device) for m in (experts.gate, experts.up, experts.down))
            out.index_add_(0, tok, swiglu(h[tok], g, u, d) * weights[tok, slot, None])
        return out


class MTPHead:
    def __init__(self, cfg: ModelConfig, nw: NextNWeights, model, mf=None,  # noqa: ANN001
                 layer: Layer | None = None):
        self.cfg, self.w, self.device = cfg, nw, model.device
        lw, index = nw.layer, cfg.n_layers
        if layer is None:
            if lw.router is not None and (lw.experts is None or lw.experts.gate.raw.is_cuda):
                # (the routed experts from the file's host pages, whatever the model holds)
                p, t = f"blk.{index}.", mf.tensors
                lw = replace(lw, experts=ExpertWeights(*(
                    QuantTensor.load(t[p + f"ffn_{w}_exps.weight"], torch.device("cpu"))
                    for w in ("gate", "up", "down"))))
            layer = Layer.build(cfg, lw, index)
            layer.mixer.layer = 0  # its rows in the head's own one-layer cache
        self.layer = layer
        self.embed = nw.embed if nw.embed is not None else model.w.embed
        norm = nw.head_norm if nw.head_norm is not None else torch.ones_like(nw.enorm)
        self.head = Head(norm, nw.head if nw.head is not None else model.w.output, cfg.rms_eps)
        self.experts = HostExperts()  # (a draft token or a few: one expert at a time)

    def new_cache(self, capacity: int = 256) -> KVCache | LatentCache:
        c = self.cfg
        if c.kv_lora:
            return LatentCache(1, c.kv_row, self.device, capacity)
        return KVCache(1, c.n_kv_heads, c.head_dim, self.device, capacity)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor,
                kv: KVCache | LatentCache) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [t] (t_i+1 ..), hidden [t, D] (h_i ..), at positions kv.length .. -> (logits
        [t, V] float32, the layer's hidden states h' [t, D]); kv grows by t."""
        cfg, w, eps, t = self.cfg, self.w, self.cfg.rms_eps, tokens.shape[0]
        positions = torch.arange(kv.length, kv.length + t, device=self.device)
        cos, sin = rope_tables(positions, cfg.rope_dim, cfg.rope_theta, cfg.yarn)
        ctx = Segments([Segment(kv, t)], cos, sin, self.experts)
        e = rms_norm(self.embed.rows(tokens.to(self.device)), w.enorm, eps)  # [t, D]
        h = rms_norm(hidden.to(self.device), w.hnorm, eps)
        x = linear(torch.cat([e, h], dim=-1), w.eh_proj)  # [t, D]
        delta = self.layer.forward(x, None, ctx)
        kv.advance(t)
        out = x + delta  # [t, D]
        return self.head.forward(out.clone(), None, ctx), out


def hybrid_nextn(cfg: ModelConfig, block: dict[str, QuantTensor],
                 device: torch.device) -> tuple[NextNWeights, Layer]:
    """A hybrid model's MTP block (its tensors by name without "blk.N.", ModelWeights.mtp):
    its NextNWeights and its layer, gated full attention (rows 0 of the head's own cache) and
    the routed experts with the gated shared expert, as the trunk's full-attention layers."""
    from strata.config_hybrid import ffn_norm_name
    from strata.model.parts.attention import GatedAttention
    from strata.model.parts.ffn import RoutedExperts
    from strata.model.weights import LayerWeights

    def d(name: str) -> torch.Tensor:  # float32 on the device; norms and gates [D]
        x = dequantize_tensor(block[name]).to(device)
        return x.reshape(-1) if name.endswith(("norm.weight", "_shexp.weight")) and (
            x.dim() == 1 or x.shape[0] == 1) else x

    def opt(name: str) -> torch.Tensor | None:
        return d(name) if name in block else None

    def moved(name: str) -> QuantTensor:  # (the routed experts stay on the host: HostExperts)
        return block[name]

    lw = LayerWeights(
        attn_norm=d("attn_norm.weight"), wq=d("attn_q.weight"), wk=d("attn_k.weight"),
        wv=d("attn_v.weight"), wo=d("attn_output.weight"), bq=None, bk=None, bv=None,
        q_norm=opt("attn_q_norm.weight"), k_norm=opt("attn_k_norm.weight"),
        ffn_norm=d(ffn_norm_name(cfg) + ".weight"), router=d("ffn_gate_inp.weight"),
        experts=ExpertWeights(*(moved(f"ffn_{w}_exps.weight") for w in ("gate", "up", "down"))),
        shared_gate=opt("ffn_gate_inp_shexp.weight"), shared_w1=opt("ffn_gate_shexp.weight"),
        shared_w3=opt("ffn_up_shexp.weight"), shared_w2=opt("ffn_down_shexp.weight"))
    layer = Layer(cfg.n_layers, GatedAttention(cfg, lw, 0), RoutedExperts(cfg, lw, cfg.n_layers),
                  lw.attn_norm, cfg.rms_eps)
    nw = NextNWeights(lw, d("nextn.eh_proj.weight"), d("nextn.enorm.weight"),
                      d("nextn.hnorm.weight"), opt("nextn.shared_head_norm.weight"))
    return nw, layer


def dequantize_tensor(q: QuantTensor) -> torch.Tensor:
    """A whole QuantTensor as float32 (its shape: rows of n_cols)."""
    from strata.quant import dequantize

    raw = q.raw.reshape(-1, q.raw.shape[-1]) if q.raw.dim() > 1 else q.raw[None]
    out = dequantize(raw, q.qtype, q.n_cols)  # [rows, n_cols]
    return out[0] if q.raw.dim() == 1 else out.reshape(*q.raw.shape[:-1], q.n_cols)


def mtp_head(model, mf=None) -> MTPHead | None:  # noqa: ANN001
    """The file's first runnable MTP head: a glm4moe / deepseek2 nextn layer or a qwen35moe
    MTP block; None where the file has neither."""
    if model.w.nextn:
        return MTPHead(model.cfg, model.w.nextn[0], model, mf)
    if model.w.mtp:
        nw, layer = hybrid_nextn(model.cfg, model.w.mtp[0], model.device)
        return MTPHead(model.cfg, nw, model, mf, layer)
    return None
