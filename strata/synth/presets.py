"""Shapes for synthetic models: tiny ones for tests, and the real shapes of models users run."""

from __future__ import annotations

from dataclasses import dataclass

from strata.errors import StrataError


@dataclass(frozen=True)
class Preset:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    n_experts_used: int
    d_expert: int
    n_vocab: int
    d_ff: int  # the dense feed-forward size the metadata records (llama: the expert size)
    d_shared: int = 0  # qwen2moe shared expert
    context_length: int = 4096
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    # hybrid linear attention (qwen35moe, qwen3next; strata/config_hybrid.py)
    full_attn_interval: int = 0
    ssm_conv: int = 0
    ssm_state: int = 0  # dk == dv
    ssm_groups: int = 0  # key heads
    ssm_heads: int = 0  # value heads
    rope_dim: int = 0  # 0: the whole head
    n_nextn: int = 0  # MTP blocks (qwen35moe)

    @property
    def vocab_kind(self) -> str:
        return "mistral" if self.arch == "llama" else "qwen"


# tiny: every row length a multiple of 256 so every block type applies; runs in seconds on a CPU.
_TINY = {
    "qwen3moe": Preset("qwen3moe", 3, 256, 4, 2, 64, 8, 2, 256, 1024, 512),
    "qwen2moe": Preset("qwen2moe", 3, 256, 4, 4, 64, 6, 2, 256, 1024, 512, d_shared=512),
    "llama": Preset("llama", 3, 256, 4, 2, 64, 4, 2, 512, 1024, 512, rms_eps=1e-5),
    # 4 layers, full attention every 2nd; 4 key heads for 8 value heads (so the tiled and the
    # grouped value-head orders differ), partial RoPE on 16 of 64 dims
    "qwen35moe": Preset("qwen35moe", 4, 256, 4, 2, 64, 8, 2, 256, 1024, 512, d_shared=256,
                        full_attn_interval=2, ssm_conv=4, ssm_state=32, ssm_groups=4,
                        ssm_heads=8, rope_dim=16, n_nextn=1),
    "qwen3next": Preset("qwen3next", 4, 256, 4, 2, 64, 8, 2, 256, 1024, 512, d_shared=256,
                        full_attn_interval=2, ssm_conv=4, ssm_state=32, ssm_groups=4,
                        ssm_heads=8, rope_dim=16),
}

_REAL = {
    "30b-a3b": Preset("qwen3moe", 48, 2048, 32, 4, 128, 128, 8, 768, 151936, 6144,
                      context_length=40960),
    "235b-a22b": Preset("qwen3moe", 94, 4096, 64, 4, 128, 128, 8, 1536, 151936, 12288,
                        context_length=40960),
    "a2.7b": Preset("qwen2moe", 24, 2048, 16, 16, 128, 60, 4, 1408, 151936, 5632,
                    d_shared=5632, context_length=8192),
    "mixtral-8x7b": Preset("llama", 32, 4096, 32, 8, 128, 8, 2, 14336, 32000, 14336,
                           context_length=32768, rms_eps=1e-5),
}

# hybrid linear attention, from the models' config.json as llama.cpp converts them
_HYBRID = dict(full_attn_interval=4, ssm_conv=4, ssm_state=128, ssm_groups=16,
               context_length=262144, rope_theta=1e7, rope_dim=64)
_REAL |= {
    "qwen3.6-35b-a3b": Preset("qwen35moe", 40, 2048, 16, 2, 256, 256, 8, 512, 248320, 512,
                              d_shared=512, ssm_heads=32, n_nextn=1, **_HYBRID),
    "qwen3.5-122b-a10b": Preset("qwen35moe", 48, 3072, 32, 2, 256, 256, 8, 1024, 248320, 1024,
                                d_shared=1024, ssm_heads=64, n_nextn=1, **_HYBRID),
    "qwen3-next-80b-a3b": Preset("qwen3next", 48, 2048, 16, 2, 256, 512, 10, 512, 151936, 512,
                                 d_shared=512, ssm_heads=32, **_HYBRID),
}

PRESETS = ["tiny", *_REAL]


def get_preset(name: str, arch: str | None) -> Preset:
    """The preset `name` for `arch` (tiny exists for every architecture; the others fix it)."""
    if name == "tiny":
        arch = arch or "qwen3moe"
        if arch not in _TINY:
            raise StrataError(f"--arch {arch}: unknown architecture (choose from "
                              f"{', '.join(_TINY)})")
        return _TINY[arch]
    if name not in _REAL:
        raise StrataError(f"--preset {name}: unknown preset (choose from {', '.join(PRESETS)})")
    preset = _REAL[name]
    if arch is not None and arch != preset.arch:
        raise StrataError(f"--preset {name} is a {preset.arch} model; drop --arch {arch} or pick "
                          "another preset")
    return preset
