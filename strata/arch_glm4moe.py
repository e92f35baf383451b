"""glm4moe (GLM-4.5 / 4.6 / 4.7 and the Air versions), read as llama.cpp writes it.

    block_count = transformer layers + nextn_predict_layers (the MTP layers come last: read and
                  kept, unused by the forward)
    leading_dense_block_count dense layers first (ffn_gate / up / down, feed_forward_length)
    routed layers: sigmoid gating (expert_gating_func, sigmoid when absent), the top K chosen
                  on sigmoid + exp_probs_b, weighted by the sigmoid, renormalized
                  (expert_weights_norm), scaled (expert_weights_scale); expert_shared_count
                  ungated shared experts of the expert size
    attention: q/k/v bias, optional q/k norms, RoPE (neox) on the first rope.dimension_count dims;
                  the feed-forward's norm is post_attention_norm
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from strata.errors import UnsupportedError

if TYPE_CHECKING:
    from strata.gguf import ModelFile


class Meta(Protocol):
    """config._Meta's typed reads of ARCH.key metadata (config.py calls these readers, so they
    do not import it)."""

    arch: str

    def int(self, key: str, default: object = ..., lo: int = 0, hi: int = ...) -> int: ...
    def float(self, key: str, default: float, lo: float, hi: float) -> float: ...

# llama.cpp's llama_expert_gating_func_type
GATING = {1: "softmax", 2: "sigmoid"}


def gating_func(mf: ModelFile, m: Meta, default: int) -> str:
    """ARCH.expert_gating_func as "softmax" | "sigmoid" (0, none, reads as `default`); another
    value is refused naming the key."""
    code = m.int("expert_gating_func", default, 0, 16) or default
    if code not in GATING:
        raise UnsupportedError(f"{mf.path}: {m.arch}.expert_gating_func is {code}; Strata "
                               "supports 1 (softmax) and 2 (sigmoid)")
    return GATING[code]


def glm4moe_fields(mf: ModelFile, m: Meta, block_count: int, d_expert: int) -> dict:
    """ModelConfig fields of glm4moe's own keys (over those the shared keys gave): nextn
    layers, dense first layers, sigmoid routing with its bias and scale, ungated shared
    experts."""
    n_nextn = m.int("nextn_predict_layers", 0, 0, block_count - 1)
    n_layers = block_count - n_nextn
    n_dense = m.int("leading_dense_block_count", 0, 0, n_layers - 1)  # (one MoE layer at least)
    sections = mf.meta(f"{m.arch}.rope.dimension_sections", None)
    if isinstance(sections, list) and any(sections):
        raise UnsupportedError(f"{mf.path}: {m.arch}.rope.dimension_sections is set "
                               "(multimodal RoPE, a vision model); Strata runs text models only")
    n_shared = m.int("expert_shared_count", 0, 0, 64)
    return dict(
        n_layers=n_layers, n_nextn=n_nextn, n_dense_lead=n_dense,
        d_ff=m.int("feed_forward_length", lo=1) if n_dense else 0,
        d_shared=n_shared * d_expert, gating=gating_func(mf, m, 2), expert_bias=True,
        expert_scale=m.float("expert_weights_scale", 1.0, 0.0, 1e3),
        ffn_norm_name="post_attention_norm")
