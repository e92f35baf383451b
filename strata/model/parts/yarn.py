"""YaRN as DeepSeek uses it (deepseek2, read in strata/arch_deepseek2.py): the rope dims'
frequencies blended with their interpolation (/ factor) by the correction ramp between the dims
of beta_fast and beta_slow; cos and sin unscaled; MLA's softmax scale multiplied by mscale^2,
mscale = 1 + 0.1 * mscale_all_dim * ln(factor). As llama.cpp's deepseek2 graph and transformers'
deepseek_v3 compute it.
"""

from __future__ import annotations

import math

import torch

from strata.config import ModelConfig


def yarn_mscale(cfg: ModelConfig) -> float:
    """The factor MLA's softmax scale is multiplied by: mscale^2 (1 without YaRN)."""
    if cfg.yarn_factor <= 1.0:
        return 1.0
    return (1.0 + 0.1 * cfg.yarn_log_mul * math.log(cfg.yarn_factor)) ** 2


def yarn_inv_freq(cfg: ModelConfig, device: torch.device | str) -> torch.Tensor:
    """float32 [rope_dim/2]: theta^(-2i/d) blended with its interpolation (/ factor) by YaRN's
    ramp between the correction dims of beta_fast and beta_slow (rope.scaling.yarn_beta_fast /
    _slow; 32 and 1 where absent)."""
    d, base = cfg.rope_dim, cfg.rope_theta
    extrap = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d)
    if cfg.yarn_factor <= 1.0:
        return extrap

    def corr(rot: float) -> float:
        return d * math.log(cfg.yarn_orig_ctx / (rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(corr(cfg.yarn_beta_slow)), d - 1)
    i = torch.arange(d // 2, dtype=torch.float32, device=device)
    ramp = 1.0 - ((i - low) / max(0.001, high - low)).clamp(0.0, 1.0)  # 1: extrapolate
    return extrap / cfg.yarn_factor * (1.0 - ramp) + extrap * ramp


def rope_tables_for(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, rope_dim/2] at `positions` with cfg's YaRN frequencies."""
    angles = positions.to(torch.float32)[:, None] * yarn_inv_freq(cfg, positions.device)[None]
    return angles.cos(), angles.sin()
