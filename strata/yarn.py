"""YaRN RoPE's parameters, as a frozen record: ModelConfig.yarn (config.py) and the readers of
the architectures that use it (arch/gpt_oss.py, arch_deepseek2.py), which config imports, so the
record lives below all of them."""

from __future__ import annotations

from dataclasses import dataclass


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
