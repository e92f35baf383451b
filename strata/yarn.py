"""YaRN RoPE's parameters, as a frozen record: ModelConfig.yarn (config.py) and the readers of
the architectures that use it (arch/gpt_oss.py, arch_deepseek2.py), which config imports, so the
record lives below all of them. rope_scaling reads a file's rope.scaling keys as llama.cpp does for
the architectures without a reader of their own (linear scaling is YaRN with ext_factor 0: every
dim interpolated, no mscale)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE as llama.cpp's ggml_rope_yarn computes it (strata.kernels.torch_ops:
    yarn_inv_freq, yarn_attn_scale). The frequencies of the dims between the correction dims of
    beta_fast and beta_slow (the dims whose rotations over orig_ctx are those counts, floored /
    ceiled as llama.cpp does) ramp from extrapolated to interpolated (/ factor), the ramp times
    ext_factor. Where the attention scale goes differs by architecture:
      rope_mscale     cos and sin times attn_factor * (1 + 0.1 ln factor) (ggml's mscale,
                      where ext_factor != 0; gpt-oss)
      mscale_all_dim  the softmax scale times (1 + 0.1 mscale_all_dim ln factor)^2 (deepseek2,
                      which cancels ggml's mscale: rope_mscale False); 0: 1
    """

    factor: float
    orig_ctx: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ext_factor: float = 1.0
    attn_factor: float = 1.0
    rope_mscale: bool = True
    mscale_all_dim: float = 0.0


def rope_scaling(m: Any, context_length: int) -> Yarn | None:
    """The RoPE scaling of a file's `{arch}.rope.scaling.*` keys (m: config's typed metadata
    reader), as llama.cpp reads them for any architecture: type `yarn` (factor, original
    context, default the model's context; beta_fast 32, beta_slow 1, ext_factor 1, attn_factor
    1 unless the file says), `linear` (or no type, llama.cpp's default) with a factor
    (rope.scaling.factor, else the old rope.scale_linear) other than 1, or None. Another type
    raises UnsupportedError naming the key."""
    from strata.errors import UnsupportedError

    kind = m.mf.meta(f"{m.arch}.rope.scaling.type", "linear")
    factor = m.float("rope.scaling.factor", m.float("rope.scale_linear", 1.0, 0.0, 1e6), 0.0, 1e6)
    orig = m.int("rope.scaling.original_context_length", context_length, 1, 1 << 24)
    if kind == "yarn":
        return Yarn(factor=factor, orig_ctx=orig,
                    beta_fast=m.float("rope.scaling.yarn_beta_fast", 32.0, 0.0, 1e6),
                    beta_slow=m.float("rope.scaling.yarn_beta_slow", 1.0, 0.0, 1e6),
                    ext_factor=m.float("rope.scaling.yarn_ext_factor", 1.0, -1e-9, 1e6),
                    attn_factor=m.float("rope.scaling.yarn_attn_factor", 1.0, 0.0, 1e6))
    if kind in ("linear", "none"):
        if kind == "none" or factor in (0.0, 1.0):
            return None
        return Yarn(factor=factor, orig_ctx=orig, ext_factor=0.0)
    raise UnsupportedError(f"{m.mf.path}: metadata key {m.arch}.rope.scaling.type is {kind!r}; "
                           "Strata runs RoPE with yarn, linear or no scaling")
