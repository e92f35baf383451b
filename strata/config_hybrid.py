"""Hybrid linear-attention models (qwen35moe: Qwen3.5/3.6-MoE, qwen3next: Qwen3-Next), as
llama.cpp writes their GGUF files: most layers are Gated DeltaNet mixers, every
`full_attention_interval`-th one (layer i with (i + 1) % interval == 0) gated full attention.

Metadata (ARCH.*): ssm.conv_kernel (K), ssm.state_size (head dim of the delta rule's keys,
dk), ssm.group_count (key heads, Hk), ssm.time_step_rank (value heads, Hv), ssm.inner_size
(Hv * dv, with dv == dk), full_attention_interval, rope.dimension_count (the partial RoPE's
dims), rope.dimension_sections (qwen35moe's M-RoPE: text positions are equal in every section,
so it is plain neox RoPE on those dims; a fourth section would rotate at position 0: refused),
nextn_predict_layers (MTP blocks appended after the trunk; block_count counts them).

Tensors of a linear layer (torch order, [out, in]):
    qwen35moe   attn_qkv [2*Hk*dk + Hv*dv, D], attn_gate (z) [Hv*dv, D],
                ssm_beta, ssm_alpha [Hv, D]; value heads tiled: head j reads key head j % Hk
                (the converter reorders them so that ggml's repeat broadcasts)
    qwen3next   ssm_in [Hk * (2*dk + 2*r*dv), D] (per key head: q, k, r value heads, r gates;
                r = Hv / Hk), or attn_qkv + attn_gate (newer converters); ssm_ba [2*Hv, D] (per
                key head: r betas, r alphas); value heads grouped: head j reads key head j // r
    both        ssm_conv1d [2*Hk*dk + Hv*dv, K], ssm_dt.bias [Hv], ssm_a [Hv] (= -exp(A_log)),
                ssm_norm [dv] (the gated RMS norm), ssm_out [D, Hv*dv]
A full-attention layer: attn_q [2*H*hd, D] (per head: the query, then its sigmoid output gate),
attn_k, attn_v, attn_output, attn_q_norm, attn_k_norm. Every layer: attn_norm and
post_attention_norm (the feed-forward's norm), routed experts and the gated shared expert.
Norm weights hold 1 + w (the converter adds the 1 of Qwen's zero-centred norms) except ssm_norm.
"""

from __future__ import annotations

from typing import Protocol

from strata.errors import ModelFileError, UnsupportedError
from strata.gguf import ModelFile

HYBRID_ARCHS = ("qwen35moe", "qwen3next")


class HybridShape(Protocol):
    """What these functions read of a ModelConfig (strata.config, which imports this module)."""

    arch: str
    n_layers: int
    d_model: int
    head_dim: int
    q_dim: int
    kv_dim: int
    n_kv_layers: int
    full_attn_interval: int
    ssm_conv: int
    ssm_state: int
    ssm_groups: int
    ssm_heads: int
    conv_channels: int
    ssm_layout: str


class MetaReader(Protocol):
    """config._Meta's typed reads."""

    def int(self, key: str, default: object = ..., lo: int = 0, hi: int = ...) -> int: ...


def read_hybrid(mf: ModelFile, m: MetaReader, arch: str, n_layers: int,
                rope_dim: int) -> dict[str, object]:
    """The hybrid fields of ModelConfig read from the file (n_layers: block_count; the result's
    n_layers counts the trunk only)."""
    nextn = m.int("nextn_predict_layers", 0, 0, n_layers - 1)
    interval = m.int("full_attention_interval", 4, 1, 1 << 16)
    if mf.meta(f"{arch}.attention.recurrent_layers", None) is not None:
        raise UnsupportedError(f"{mf.path}: {arch}.attention.recurrent_layers (a per-layer list)"
                               " is not supported; Strata reads full_attention_interval")
    conv = m.int("ssm.conv_kernel", lo=1, hi=64)
    dk = m.int("ssm.state_size", lo=1, hi=4096)
    hk = m.int("ssm.group_count", lo=1, hi=4096)
    hv = m.int("ssm.time_step_rank", lo=1, hi=4096)
    inner = m.int("ssm.inner_size", lo=1)
    if hv % hk:
        raise ModelFileError(mf.path, f"{arch}.ssm.time_step_rank is {hv}, which is not a "
                                      f"multiple of {arch}.ssm.group_count ({hk})")
    if inner != hv * dk:
        raise UnsupportedError(f"{mf.path}: {arch}.ssm.inner_size is {inner} but "
                               f"time_step_rank x state_size is {hv * dk}: value heads of "
                               "another size than the keys are not supported")
    if arch == "qwen35moe":
        sections = mf.meta(f"{arch}.rope.dimension_sections", None)
        if sections is not None:
            s = list(sections) if isinstance(sections, (list, tuple)) else [sections]
            if not all(isinstance(v, int) and v >= 0 for v in s) or len(s) > 4 \
                    or sum(s[:3]) * 2 != rope_dim or sum(s[3:]) != 0:
                raise UnsupportedError(
                    f"{mf.path}: {arch}.rope.dimension_sections is {s}: Strata runs text, "
                    f"whose sections must cover rope.dimension_count ({rope_dim}) with a zero "
                    "fourth section")
    n_trunk = n_layers - nextn
    layout = "qwen35"
    if arch == "qwen3next":
        first = next((i for i in range(n_trunk) if (i + 1) % interval), None)
        fused = first is not None and f"blk.{first}.ssm_in.weight" in mf.tensors
        layout = "next" if fused else "next-split"
    return dict(n_layers=n_trunk, full_attn_interval=interval, ssm_conv=conv, ssm_state=dk,
                ssm_groups=hk, ssm_heads=hv, ssm_layout=layout, attn_gate=True, n_nextn=nextn,
                norm_topk=True, qk_norm=True)


def ffn_norm_name(cfg: HybridShape) -> str:
    """The feed-forward's norm tensor (without blk.N. and .weight)."""
    if cfg.arch in HYBRID_ARCHS:
        return "post_attention_norm"
    return getattr(cfg, "ffn_norm_name", "ffn_norm")  # (glm4moe: post_attention_norm too)


def attention_tensors(cfg: HybridShape, p: str) -> dict[str, tuple[int, ...]]:
    """A gated full-attention layer's tensors (also an MTP block's)."""
    D, hd = cfg.d_model, cfg.head_dim
    return {p + "attn_q.weight": (2 * cfg.q_dim, D), p + "attn_k.weight": (cfg.kv_dim, D),
            p + "attn_v.weight": (cfg.kv_dim, D), p + "attn_output.weight": (D, cfg.q_dim),
            p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)}


def linear_tensors(cfg: HybridShape, p: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's tensors."""
    D, hv = cfg.d_model, cfg.ssm_heads
    value, conv = hv * cfg.ssm_state, cfg.conv_channels
    t = {p + "ssm_conv1d.weight": (conv, cfg.ssm_conv), p + "ssm_dt.bias": (hv,),
         p + "ssm_a": (hv,), p + "ssm_norm.weight": (cfg.ssm_state,),
         p + "ssm_out.weight": (D, value)}
    if cfg.ssm_layout == "next":
        t[p + "ssm_in.weight"] = (conv + value, D)
    else:
        t |= {p + "attn_qkv.weight": (conv, D), p + "attn_gate.weight": (value, D)}
    if cfg.ssm_layout == "qwen35":
        t |= {p + "ssm_beta.weight": (hv, D), p + "ssm_alpha.weight": (hv, D)}
    else:
        t[p + "ssm_ba.weight"] = (2 * hv, D)
    return t


def nextn_tensors(cfg: HybridShape, p: str) -> dict[str, tuple[int, ...]]:
    """An MTP block's own tensors, beside its attention and feed-forward (read, kept, not yet
    run): eh_proj [D, 2D] mixes the normed embedding and hidden state."""
    D = cfg.d_model
    return {p + "nextn.eh_proj.weight": (D, 2 * D), p + "nextn.enorm.weight": (D,),
            p + "nextn.hnorm.weight": (D,)}


def state_bytes(cfg: HybridShape) -> int:
    """One sequence's recurrent state, float32: each linear layer's conv window
    [2*Hk*dk + Hv*dv, K-1] and delta-rule state [Hv, dk, dv]."""
    if not cfg.full_attn_interval:
        return 0
    n = cfg.n_layers - cfg.n_kv_layers
    conv = cfg.conv_channels * (cfg.ssm_conv - 1)
    delta = cfg.ssm_heads * cfg.ssm_state * cfg.ssm_state
    return 4 * n * (conv + delta)


def layer_kinds(cfg: HybridShape) -> str:
    """e.g. "linear attention x30, full attention x10"."""
    n_full = cfg.n_kv_layers
    if n_full == cfg.n_layers:
        return f"full attention x{n_full}"
    return f"linear attention x{cfg.n_layers - n_full}, full attention x{n_full}"
