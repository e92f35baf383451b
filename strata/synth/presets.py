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
    sliding_window: int = 0  # gpt-oss: the sliding layers' window
    yarn_factor: float = 0.0  # gpt-oss: YaRN RoPE scaling (0: none)
    yarn_orig_ctx: int = 0

    @property
    def vocab_kind(self) -> str:
        return {"llama": "mistral", "gpt-oss": "harmony"}.get(self.arch, "qwen")


# tiny: every row length a multiple of 256 so every block type applies; runs in seconds on a CPU.
_TINY = {
    "qwen3moe": Preset("qwen3moe", 3, 256, 4, 2, 64, 8, 2, 256, 1024, 512),
    "qwen2moe": Preset("qwen2moe", 3, 256, 4, 4, 64, 6, 2, 256, 1024, 512, d_shared=512),
    "llama": Preset("llama", 3, 256, 4, 2, 64, 4, 2, 512, 1024, 512, rms_eps=1e-5),
    # 4 layers: two sliding (window 16, shorter than the tests' prompts), two full
    "gpt-oss": Preset("gpt-oss", 4, 256, 4, 2, 64, 8, 2, 256, 1024, 256, context_length=131072,
                      rope_theta=150000.0, rms_eps=1e-5, sliding_window=16, yarn_factor=32.0,
                      yarn_orig_ctx=4096),
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
    # from openai/gpt-oss-20b and -120b's config.json (2880-wide rows: MXFP4 experts, 32-value
    # block types elsewhere)
    "gpt-oss-20b": Preset("gpt-oss", 24, 2880, 64, 8, 64, 32, 4, 2880, 201088, 2880,
                          context_length=131072, rope_theta=150000.0, rms_eps=1e-5,
                          sliding_window=128, yarn_factor=32.0, yarn_orig_ctx=4096),
    "gpt-oss-120b": Preset("gpt-oss", 36, 2880, 64, 8, 64, 128, 4, 2880, 201088, 2880,
                           context_length=131072, rope_theta=150000.0, rms_eps=1e-5,
                           sliding_window=128, yarn_factor=32.0, yarn_orig_ctx=4096),
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
