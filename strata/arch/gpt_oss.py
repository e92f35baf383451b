"""gpt-oss (llama.cpp's `gpt-oss`, LLM_ARCH_OPENAI_MOE): what its GGUF holds beyond a qwen3moe.

    attention   q/k/v/o with biases, a learned sink logit per head (blk.N.attn_sinks.weight),
                sliding-window layers (the even ones, llama.cpp's swa pattern 2) and full ones,
                YaRN RoPE (rope.scaling.type yarn, factor, original_context_length) in neox style
    ffn         post_attention_norm before it; a router with a bias: the top k of its logits,
                softmax over those k; experts with biases (ffn_{gate,up,down}_exps.bias) and the
                clamped SwiGLU: g = min(g, 7), u = clamp(u, -7, 7), (u + 1) * g * sigmoid(1.702 g)
                (alpha and limit are constants in llama.cpp; the file records neither)

Legend: D hidden, H heads, E experts, F expert hidden.
"""

from __future__ import annotations

from typing import Any

from strata.errors import ModelFileError, UnsupportedError

# cfg below is a strata.config.ModelConfig and m its typed metadata reader (config._Meta): not
# imported, as strata.config imports this module
ModelConfig = _Meta = Any

ARCH = "gpt-oss"
SWIGLU_ALPHA = 1.702  # llama.cpp's LLM_FFN_SWIGLU_OAI_MOE constants (HF: swiglu_alpha, _limit)
SWIGLU_LIMIT = 7.0


def read_fields(m: _Meta, n_layers: int) -> dict[str, object]:
    """The ModelConfig fields of a gpt-oss file that the shared reader does not set."""
    mf = m.mf
    window = m.int("attention.sliding_window", lo=1, hi=1 << 24)
    kind = m.mf.meta(f"{ARCH}.rope.scaling.type", "none")
    yarn = None
    if kind == "yarn":  # ggml's own mscale on cos and sin (config.Yarn's rope_mscale)
        from strata.yarn import rope_scaling

        m.int("rope.scaling.original_context_length", lo=1, hi=1 << 24)  # (required here)
        yarn = rope_scaling(m, 1)
    elif kind != "none":
        raise UnsupportedError(f"{mf.path}: metadata key {ARCH}.rope.scaling.type is {kind!r}; "
                               "Strata runs gpt-oss with yarn or no RoPE scaling")
    if "blk.0.attn_sinks.weight" not in mf.tensors:
        raise ModelFileError(mf.path, "tensor blk.0.attn_sinks.weight is missing (needed by "
                                      "gpt-oss)")
    return dict(sliding_window=window, attn_sinks=True, yarn=yarn, moe_bias=True,
                expert_act="swiglu_oai", norm_topk=True, ffn_norm_name="post_attention_norm")


def is_sliding(cfg: ModelConfig, index: int) -> bool:
    """Whether layer `index` attends over a sliding window: llama.cpp's set_swa_pattern(2)
    (and HF's layer_types): the even layers, starting with layer 0."""
    return cfg.sliding_window > 0 and index % 2 == 0


def layer_tensors(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """The tensors of one gpt-oss layer (prefix p = "blk.N."), in torch order."""
    D, E, F = cfg.d_model, cfg.n_experts, cfg.d_expert
    return {
        p + "attn_norm.weight": (D,),
        p + "attn_q.weight": (cfg.q_dim, D), p + "attn_q.bias": (cfg.q_dim,),
        p + "attn_k.weight": (cfg.kv_dim, D), p + "attn_k.bias": (cfg.kv_dim,),
        p + "attn_v.weight": (cfg.kv_dim, D), p + "attn_v.bias": (cfg.kv_dim,),
        p + "attn_output.weight": (D, cfg.q_dim), p + "attn_output.bias": (D,),
        p + "attn_sinks.weight": (cfg.n_heads,),
        p + "post_attention_norm.weight": (D,),
        p + "ffn_gate_inp.weight": (E, D), p + "ffn_gate_inp.bias": (E,),
        p + "ffn_gate_exps.weight": (E, F, D), p + "ffn_gate_exps.bias": (E, F),
        p + "ffn_up_exps.weight": (E, F, D), p + "ffn_up_exps.bias": (E, F),
        p + "ffn_down_exps.weight": (E, D, F), p + "ffn_down_exps.bias": (E, D),
    }
