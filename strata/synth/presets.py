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
    # glm4moe / deepseek2: leading dense layers (of d_ff), shared experts of d_expert each, the
    # routed weights' scale, nextn layers written after the n_layers (qwen35moe: its MTP
    # blocks), RoPE dims (0: head_dim), q/k norms (None: the architecture's default)
    n_dense_lead: int = 0
    n_shared: int = 0
    expert_scale: float = 1.0
    n_nextn: int = 0
    rope_dim: int = 0
    qk_norm: bool | None = None
    # deepseek2: MLA ranks (q_lora 0: one q matrix) and value head size (head_dim is the
    # query/key head), expert groups (all / used), YaRN factor (1: none), its original context
    # and mscale_all_dim
    q_lora: int = 0
    kv_lora: int = 0
    d_v: int = 0
    n_groups: int = 1
    n_groups_used: int = 1
    yarn_factor: float = 1.0  # (also gpt-oss's and any other's; 1: no YaRN)
    rope_scaling: str = "yarn"  # with a yarn_factor > 1 (not deepseek2): yarn | linear
    yarn_orig_ctx: int = 0
    yarn_mscale: float = 1.0
    yarn_beta: tuple[float, float] = (32.0, 1.0)  # fast, slow
    # hybrid linear attention (qwen35moe, qwen3next; strata/config_hybrid.py)
    full_attn_interval: int = 0
    ssm_conv: int = 0
    ssm_state: int = 0  # dk == dv
    ssm_groups: int = 0  # key heads
    ssm_heads: int = 0  # value heads

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
    "glm4moe": Preset("glm4moe", 3, 256, 4, 2, 64, 8, 2, 256, 1024, 512, n_dense_lead=1,
                      n_shared=1, expert_scale=2.5, n_nextn=1, rope_dim=32, qk_norm=True,
                      rms_eps=1e-5),
    "deepseek2": Preset("deepseek2", 3, 256, 4, 4, 96, 8, 2, 256, 1024, 512, n_dense_lead=1,
                        n_shared=1, expert_scale=2.5, rope_dim=32, q_lora=256, kv_lora=256,
                        d_v=64, n_groups=4, n_groups_used=2, yarn_factor=4.0,
                        yarn_orig_ctx=1024, rope_theta=10000.0),
    # 4 layers, full attention every 2nd; 4 key heads for 8 value heads (so the tiled and the
    # grouped value-head orders differ), partial RoPE on 16 of 64 dims
    "qwen35moe": Preset("qwen35moe", 4, 256, 4, 2, 64, 8, 2, 256, 1024, 512, d_shared=256,
                        full_attn_interval=2, ssm_conv=4, ssm_state=32, ssm_groups=4,
                        ssm_heads=8, rope_dim=16, n_nextn=1),
    "qwen3next": Preset("qwen3next", 4, 256, 4, 2, 64, 8, 2, 256, 1024, 512, d_shared=256,
                        full_attn_interval=2, ssm_conv=4, ssm_state=32, ssm_groups=4,
                        ssm_heads=8, rope_dim=16),
    # dense (no experts: a --draft beside a MoE model of the same vocabulary)
    "qwen3": Preset("qwen3", 2, 256, 4, 2, 64, 0, 0, 0, 1024, 512),
    "qwen2": Preset("qwen2", 2, 256, 4, 2, 64, 0, 0, 0, 1024, 512),
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
    # GLM-4.5-Air and GLM-4.6 (their config.json: 46 / 92 layers + 1 nextn, partial RoPE 0.5)
    "glm-4.5-air": Preset("glm4moe", 46, 4096, 96, 8, 128, 128, 8, 1408, 151552, 10944,
                          n_dense_lead=1, n_shared=1, expert_scale=1.0, n_nextn=1, rope_dim=64,
                          qk_norm=False, context_length=131072, rms_eps=1e-5),
    "glm-4.6": Preset("glm4moe", 92, 5120, 96, 8, 128, 160, 8, 1536, 151552, 12288,
                      n_dense_lead=3, n_shared=1, expert_scale=2.5, n_nextn=1, rope_dim=64,
                      qk_norm=True, context_length=202752, rms_eps=1e-5),
    # DeepSeek-V3 / R1 (config.json: 61 layers, 3 dense, MLA 1536 / 512, 8 groups of 32)
    "deepseek-v3": Preset("deepseek2", 61, 7168, 128, 128, 192, 256, 8, 2048, 129280, 18432,
                          n_dense_lead=3, n_shared=1, expert_scale=2.5, rope_dim=64,
                          q_lora=1536, kv_lora=512, d_v=128, n_groups=8, n_groups_used=4,
                          yarn_factor=40.0, yarn_orig_ctx=4096, rope_theta=10000.0,
                          context_length=163840),
    # Kimi-K2-Instruct-0905 (deepseek2 in GGUF: 384 experts in one group, 64 heads, YaRN x64
    # with the correction range 1 / 1)
    "kimi-k2": Preset("deepseek2", 61, 7168, 64, 64, 192, 384, 8, 2048, 163840, 18432,
                      n_dense_lead=1, n_shared=1, expert_scale=2.827, rope_dim=64, q_lora=1536,
                      kv_lora=512, d_v=128, yarn_factor=64.0, yarn_orig_ctx=4096,
                      yarn_beta=(1.0, 1.0), rope_theta=50000.0, context_length=262144),
}

# dense drafts for the Qwen3 MoE models (their config.json; the output head written apart)
_REAL |= {
    "qwen3-0.6b": Preset("qwen3", 28, 1024, 16, 8, 128, 0, 0, 0, 151936, 3072,
                         context_length=40960),
    "qwen3-1.7b": Preset("qwen3", 28, 2048, 16, 8, 128, 0, 0, 0, 151936, 6144,
                         context_length=40960),
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
