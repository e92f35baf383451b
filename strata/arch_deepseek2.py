"""deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2), read as llama.cpp writes it.

Multi-head latent attention (MLA): each token's keys and values come from one latent row,
    c = rms_norm(x @ attn_kv_a_mqa[:kv_lora])          [kv_lora]   (attn_kv_a_norm)
    k_pe = rope(x @ attn_kv_a_mqa[kv_lora:])           [rope]      one for every head
    head h: k = [c @ k_b[h] ; k_pe], v = c @ v_b[h].T  k_b [H, kv_lora, nope], v_b [H, v, kv_lora]
queries through a LoRA (attn_q_a, attn_q_a_norm, attn_q_b) or one matrix (attn_q, the lite
models). Current converters write k_b / v_b split (attention.key_length_mla and
value_length_mla present); older files hold attn_kv_b [H * (nope + v), kv_lora], split here at
load. The cache keeps [c ; k_pe] per token (LatentCache), not K and V.

RoPE: adjacent pairs on the rope dims; YaRN (rope.scaling.type yarn) as DeepSeek uses it
(config.Yarn, rope_mscale False and mscale_all_dim set): interpolated frequencies blended by
the correction ramp, cos and sin unscaled, and the softmax scale multiplied by mscale^2,
mscale = 1 + 0.1 * yarn_log_multiplier / 0.1 * ln(factor) (the converter writes the multiplier
times 0.1; llama.cpp divides it out).

config.py calls these readers, so they import config (config.Yarn) only when called; they
return ModelConfig fields.

Routing: softmax or sigmoid (expert_gating_func; softmax when absent), the selection bias
(exp_probs_b) where the file has it, expert groups (expert_group_count, _used_count), normalized
(expert_weights_norm) and scaled (expert_weights_scale); expert_shared_count ungated shared
experts; leading_dense_block_count dense first layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from strata.arch_glm4moe import Meta, gating_func
from strata.errors import ModelFileError, UnsupportedError

if TYPE_CHECKING:
    from strata.gguf import ModelFile


def deepseek2_fields(mf: ModelFile, m: Meta, n_layers: int, n_experts: int, n_heads: int,
                     d_expert: int, context_length: int) -> dict:
    """ModelConfig fields of deepseek2's own keys (over those the shared keys gave): MLA sizes,
    YaRN, routing, dense first layers."""
    from strata.yarn import Yarn

    t, a = mf.tensors, m.arch
    if mf.meta(f"{a}.attention.temperature_scale", None) is not None:
        raise UnsupportedError(f"{mf.path}: {a}.attention.temperature_scale is set (attention "
                               "temperature tuning); Strata does not run it")
    kv_lora = m.int("attention.kv_lora_rank", lo=1)
    rope = m.int("rope.dimension_count", lo=2)
    if "blk.0.attn_k_b.weight" in t:  # current converters: MLA sizes in their own keys
        d_k, d_v = m.int("attention.key_length_mla", lo=rope + 1), m.int(
            "attention.value_length_mla", lo=1)
    elif "blk.0.attn_kv_b.weight" in t:  # older files: the MHA sizes
        d_k, d_v = m.int("attention.key_length", lo=rope + 1), m.int(
            "attention.value_length", lo=1)
    else:
        raise ModelFileError(mf.path, "neither blk.0.attn_k_b.weight nor blk.0.attn_kv_b.weight "
                                      "is in the file (deepseek2 MLA needs one)")
    q_lora = m.int("attention.q_lora_rank", lo=1) if "blk.0.attn_q_a.weight" in t else 0
    # nextn (MTP) layers after the trunk, where a file keeps them (block_count counts them)
    n_nextn = m.int("nextn_predict_layers", 0, 0, n_layers - 1)
    n_layers -= n_nextn
    n_dense = m.int("leading_dense_block_count", 0, 0, n_layers - 1)  # (one MoE layer at least)
    E = n_experts
    groups = m.int("expert_group_count", 1, 0, E) or 1
    used = m.int("expert_group_used_count", groups, 0, groups) or groups
    if E % groups or (groups > 1 and E // groups < 2):
        raise ModelFileError(mf.path, f"{a}.expert_group_count is {groups}, which does not cut "
                                      f"the {E} experts into groups of two or more")
    scale = m.float("expert_weights_scale", 1.0, -1.0, 1e3)
    kind = mf.meta(f"{a}.rope.scaling.type", "none")
    factor, orig, log_mul, beta = 1.0, 0, 0.0, (32.0, 1.0)
    if kind == "yarn":
        factor = m.float("rope.scaling.factor", 1.0, 0.0, 1e6)
        orig = m.int("rope.scaling.original_context_length", context_length, 1)
        log_mul = m.float("rope.scaling.yarn_log_multiplier", 1e-30, 0.0, 100.0) / 0.1
        beta = (m.float("rope.scaling.yarn_beta_fast", 32.0, 0.0, 1e4),
                m.float("rope.scaling.yarn_beta_slow", 1.0, 0.0, 1e4))
        for key in ("yarn_ext_factor", "yarn_attn_factor"):  # (mscale: DeepSeek's own)
            if m.float(f"rope.scaling.{key}", 1.0, -1e6, 1e6) != 1.0:
                raise UnsupportedError(f"{mf.path}: {a}.rope.scaling.{key} is not 1; Strata "
                                       "runs deepseek2's YaRN with its mscale only")
    elif kind not in ("none", None):
        raise UnsupportedError(f"{mf.path}: {a}.rope.scaling.type is {kind!r}; Strata runs "
                               "deepseek2 with yarn or no RoPE scaling")
    return dict(
        n_layers=n_layers, n_nextn=n_nextn,
        n_kv_heads=n_heads, head_dim=d_k, rope_dim=rope, rope_style="normal",
        n_dense_lead=n_dense, d_ff=m.int("feed_forward_length", lo=1) if n_dense else 0,
        d_shared=m.int("expert_shared_count", 0, 0, 64) * d_expert,
        gating=gating_func(mf, m, 1), expert_bias=f"blk.{n_dense}.exp_probs_b.bias" in t,
        expert_scale=scale if scale > 0 else 1.0, n_groups=groups, n_groups_used=used,
        qkv_bias=False, qk_norm=False, q_lora=q_lora, kv_lora=kv_lora, d_v=d_v,
        yarn=Yarn(factor, orig, beta_fast=beta[0], beta_slow=beta[1], rope_mscale=False,
                  mscale_all_dim=log_mul) if factor > 1 else None,
        mla_split="blk.0.attn_k_b.weight" in t)


def mla_tensors(p: str, D: int, H: int, head_dim: int, R: int, q_lora: int, L: int, d_v: int,
                split: bool) -> dict[str, tuple[int, ...]]:
    """Layer p's attention tensors (torch order): D hidden, H heads of head_dim (R of them
    rotated), q LoRA rank (0: none), latent rank L, value head d_v, k_b / v_b split."""
    nope = head_dim - R
    t: dict[str, tuple[int, ...]] = {}
    if q_lora:
        t |= {p + "attn_q_a.weight": (q_lora, D), p + "attn_q_a_norm.weight": (q_lora,),
              p + "attn_q_b.weight": (H * head_dim, q_lora)}
    else:
        t[p + "attn_q.weight"] = (H * head_dim, D)
    t |= {p + "attn_kv_a_mqa.weight": (L + R, D), p + "attn_kv_a_norm.weight": (L,)}
    if split:
        t |= {p + "attn_k_b.weight": (H, L, nope), p + "attn_v_b.weight": (H, d_v, L)}
    else:
        t[p + "attn_kv_b.weight"] = (H * (nope + d_v), L)
    t[p + "attn_output.weight"] = (D, H * d_v)
    return t
