"""strata info: architecture, shapes, tensor types per layer and sizes."""

from __future__ import annotations

import argparse
from collections import Counter

from strata.config import ModelConfig
from strata.config_hybrid import layer_kinds
from strata.gguf import ModelFile, open_model
from strata.units import fmt_bytes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file (any shard of a split set)")


def _layer_types(mf: ModelFile, i: int) -> str:
    def t(name: str) -> str:
        ref = mf.tensors.get(f"blk.{i}.{name}.weight")
        return ref.info.type_name if ref else "-"

    ffn = (f"dense gate/up/down {t('ffn_gate')}/{t('ffn_up')}/{t('ffn_down')}"
           if f"blk.{i}.ffn_gate.weight" in mf.tensors else
           f"experts gate/up/down {t('ffn_gate_exps')}/{t('ffn_up_exps')}/{t('ffn_down_exps')}")
    if f"blk.{i}.ssm_out.weight" in mf.tensors:  # a Gated DeltaNet layer (config_hybrid)
        qkv = t("ssm_in") if f"blk.{i}.ssm_in.weight" in mf.tensors else t("attn_qkv")
        return (f"linear qkv/out {qkv}/{t('ssm_out')}  "
                f"experts gate/up/down {t('ffn_gate_exps')}/{t('ffn_up_exps')}/"
                f"{t('ffn_down_exps')}")
    if f"blk.{i}.attn_kv_a_mqa.weight" in mf.tensors:  # deepseek2's latent attention
        q = t("attn_q_b") if f"blk.{i}.attn_q_b.weight" in mf.tensors else t("attn_q")
        return (f"mla q_a/q/kv_a/k_b/o {t('attn_q_a')}/{q}/{t('attn_kv_a_mqa')}/"
                f"{t('attn_k_b') if f'blk.{i}.attn_k_b.weight' in mf.tensors else t('attn_kv_b')}"
                f"/{t('attn_output')}  {ffn}")
    return f"attn q/k/v/o {t('attn_q')}/{t('attn_k')}/{t('attn_v')}/{t('attn_output')}  {ffn}"


def _routing_lines(cfg: ModelConfig) -> list[str]:
    """glm4moe / deepseek2's routing and layer kinds (nothing for the softmax families)."""
    if cfg.gating == "softmax" and not cfg.n_dense_lead and not cfg.n_nextn:
        return []
    groups = (f", {cfg.n_groups_used} of {cfg.n_groups} expert groups"
              if cfg.n_groups > 1 else "")
    return [f"routing      {cfg.gating}" + (" + selection bias" if cfg.expert_bias else "")
            + f", weights x {cfg.expert_scale:g}{groups}; {cfg.n_dense_lead} dense first "
            f"layers (hidden {cfg.d_ff}); {cfg.n_nextn} nextn layers (kept, not run)"]


def _mla_lines(cfg: ModelConfig) -> list[str]:
    """deepseek2's latent attention and YaRN (nothing for the others)."""
    if not cfg.kv_lora:
        return []
    return [f"latent attn  q LoRA {cfg.q_lora or 'none'}, kv latent {cfg.kv_lora} + rope "
            f"{cfg.rope_dim} cached a token, q/k heads {cfg.head_dim}, v heads {cfg.d_v}"
            + (f"; yarn x{cfg.yarn.factor:g} from {cfg.yarn.orig_ctx}" if cfg.yarn else "")]


def _window_lines(cfg: ModelConfig) -> list[str]:
    """Which layers attend over a sliding window and which over everything (gpt-oss)."""
    if not cfg.sliding_window:
        return []
    from strata.arch.gpt_oss import is_sliding

    sliding = [i for i in range(cfg.n_layers) if is_sliding(cfg, i)]
    full = [i for i in range(cfg.n_layers) if not is_sliding(cfg, i)]
    return [f"layers       sliding window {cfg.sliding_window}: {_runs(sliding)}; "
            f"full attention: {_runs(full)}"]


def _runs(layers: list[int]) -> str:
    """0, 2, 4, 6 -> '0-6 step 2'; a short list as it is; none -> 'none'."""
    if not layers:
        return "none"
    if len(layers) > 3 and len({b - a for a, b in zip(layers[:-1], layers[1:], strict=True)}) == 1:
        return f"{layers[0]}-{layers[-1]} step {layers[1] - layers[0]} ({len(layers)})"
    return ", ".join(map(str, layers))


def describe(mf: ModelFile, cfg: ModelConfig) -> list[str]:
    expert_bytes = sum(r.info.nbytes for n, r in mf.tensors.items() if "_exps." in n)
    run = sum(mf.tensors[f"blk.{i}.ffn_{w}_exps.weight"].info.nbytes  # (not the nextn layers)
              for i in range(cfg.n_dense_lead, cfg.n_layers) for w in ("gate", "up", "down"))
    per_token = run * cfg.n_experts_used / cfg.n_experts
    lines = [
        f"file         {mf.path}"
        + (f" (+{len(mf.files) - 1} shards)" if len(mf.files) > 1 else ""),
        f"architecture {cfg.arch}: {cfg.n_layers} layers, hidden {cfg.d_model}, "
        f"{cfg.n_heads} heads ({cfg.n_kv_heads} kv) of {cfg.head_dim}, vocab {cfg.n_vocab}, "
        f"context {cfg.context_length}",
        f"experts      {cfg.n_experts} per layer, {cfg.n_experts_used} used per token, "
        f"hidden {cfg.d_expert}" + (f", shared expert {cfg.d_shared}" if cfg.d_shared else "")
        + f", top-k weights {'renormalized' if cfg.norm_topk else 'as routed'}",
        *_routing_lines(cfg), *_mla_lines(cfg),
        f"attention    rope {cfg.rope_style} theta {cfg.rope_theta:g}"
        + (f" on {cfg.rope_dim} of {cfg.head_dim} dims" if cfg.rope_dim < cfg.head_dim else "")
        + (", qkv bias" if cfg.qkv_bias else "") + (", q/k norms" if cfg.qk_norm else "")
        + (f", yarn x{cfg.yarn.factor:g} of {cfg.yarn.orig_ctx}"
           if cfg.yarn and not cfg.kv_lora else "") + (", sinks" if cfg.attn_sinks else "")
        + (", output gate" if cfg.attn_gate else ""),
        *_window_lines(cfg),
        f"layers       {layer_kinds(cfg)}"
        + (f" (Gated DeltaNet: {cfg.ssm_groups} key / {cfg.ssm_heads} value heads of "
           f"{cfg.ssm_state}, conv {cfg.ssm_conv})" if cfg.full_attn_interval else "")
        + (f"; {cfg.n_nextn} MTP block(s) kept" if cfg.n_nextn else ""),
        f"size         {fmt_bytes(mf.nbytes)}: experts {fmt_bytes(expert_bytes)}, "
        f"dense {fmt_bytes(mf.nbytes - expert_bytes)}; routed expert bytes per token "
        f"{fmt_bytes(per_token)}",
    ]
    counts = Counter(r.info.type_name for r in mf.tensors.values())
    lines.append("types        " + ", ".join(f"{k} x{v}" for k, v in counts.most_common()))
    rows: list[tuple[int, int, str]] = []  # runs of layers with the same types
    for i in range(cfg.n_layers):
        desc = _layer_types(mf, i)
        if rows and rows[-1][2] == desc:
            rows[-1] = (rows[-1][0], i, desc)
        else:
            rows.append((i, i, desc))
    for a, b, desc in rows:
        lines.append(f"layer {a:>3}{'-' + str(b) if b > a else '':<5} {desc}")
    return lines


def run(args: argparse.Namespace) -> int:
    mf = open_model(args.model)
    print("\n".join(describe(mf, ModelConfig.from_model(mf))))
    return 0
