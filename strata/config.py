"""Model configuration, normalized once from GGUF metadata and checked against the tensor table."""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata.errors import ModelFileError, UnsupportedError
from strata.gguf import ModelFile

# architecture -> (RoPE style, routing weights renormalized over the top-k by default)
# llama.cpp's converter permutes llama's Q/K rows so that RoPE rotates adjacent pairs ("normal");
# the qwen families rotate the two halves of each head ("neox").
ARCHITECTURES = {
    "qwen3moe": ("neox", True),
    "qwen2moe": ("neox", False),
    "llama": ("normal", True),
}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_vocab: int
    context_length: int
    rms_eps: float
    rope_theta: float
    rope_dim: int
    rope_style: str
    n_experts: int
    n_experts_used: int
    d_expert: int
    d_shared: int  # shared-expert hidden size (qwen2moe), 0 when there is none
    norm_topk: bool
    qkv_bias: bool
    qk_norm: bool
    tied_output: bool

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @classmethod
    def from_model(cls, mf: ModelFile) -> ModelConfig:
        arch = mf.meta("general.architecture")
        if arch not in ARCHITECTURES:
            raise UnsupportedError(f"{mf.path}: architecture {arch!r} is not supported "
                                   f"(supported: {', '.join(ARCHITECTURES)})")
        rope_style, norm_default = ARCHITECTURES[arch]

        def get(key: str, default: object = ModelFileError) -> object:
            return mf.meta(f"{arch}.{key}", default)

        n_experts = int(get("expert_count", 0))
        if n_experts == 0:
            raise UnsupportedError(f"{mf.path}: a dense {arch} model (no {arch}.expert_count); "
                                   "Strata runs Mixture-of-Experts models only")
        if "blk.0.ffn_gate.0.weight" in mf.tensors:
            raise UnsupportedError(f"{mf.path}: experts stored as one tensor each (old Mixtral "
                                   "layout); convert it again with a recent llama.cpp to get "
                                   "merged ffn_*_exps tensors")
        d_model, n_heads = int(get("embedding_length")), int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", d_model // n_heads))
        d_expert_key = "feed_forward_length" if arch == "llama" else "expert_feed_forward_length"
        embd = mf.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelFileError(mf.path, "tensor token_embd.weight is missing")
        cfg = cls(
            arch=arch,
            n_layers=int(get("block_count")),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(get("attention.head_count_kv", n_heads)),
            head_dim=head_dim,
            n_vocab=embd.shape[0],
            context_length=int(get("context_length", 4096)),
            rms_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_dim=int(get("rope.dimension_count", head_dim)),
            rope_style=rope_style,
            n_experts=n_experts,
            n_experts_used=int(get("expert_used_count")),
            d_expert=int(get(d_expert_key)),
            d_shared=int(get("expert_shared_feed_forward_length", 0)),
            norm_topk=bool(get("expert_weights_norm", norm_default)),
            qkv_bias="blk.0.attn_q.bias" in mf.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in mf.tensors,
            tied_output="output.weight" not in mf.tensors,
        )
        if arch == "qwen2moe" and cfg.d_shared == 0 and "blk.0.ffn_up_shexp.weight" in mf.tensors:
            shexp = mf.tensors["blk.0.ffn_up_shexp.weight"]
            cfg = replace(cfg, d_shared=shexp.shape[0])
        if not 0 < cfg.n_experts_used <= cfg.n_experts:
            raise ModelFileError(mf.path, f"{arch}.expert_used_count is {cfg.n_experts_used} but "
                                          f"there are {cfg.n_experts} experts")
        check_tensors(mf, cfg)
        return cfg


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture reads, with its shape in torch order."""
    D, V, E, F = cfg.d_model, cfg.n_vocab, cfg.n_experts, cfg.d_expert
    t: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not cfg.tied_output:
        t["output.weight"] = (V, D)
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        t |= {
            p + "attn_norm.weight": (D,),
            p + "attn_q.weight": (cfg.q_dim, D),
            p + "attn_k.weight": (cfg.kv_dim, D),
            p + "attn_v.weight": (cfg.kv_dim, D),
            p + "attn_output.weight": (D, cfg.q_dim),
            p + "ffn_norm.weight": (D,),
            p + "ffn_gate_inp.weight": (E, D),
            p + "ffn_gate_exps.weight": (E, F, D),
            p + "ffn_up_exps.weight": (E, F, D),
            p + "ffn_down_exps.weight": (E, D, F),
        }
        if cfg.qkv_bias:
            t |= {p + "attn_q.bias": (cfg.q_dim,), p + "attn_k.bias": (cfg.kv_dim,),
                  p + "attn_v.bias": (cfg.kv_dim,)}
        if cfg.qk_norm:
            t |= {p + "attn_q_norm.weight": (cfg.head_dim,),
                  p + "attn_k_norm.weight": (cfg.head_dim,)}
        if cfg.d_shared:
            S = cfg.d_shared
            t |= {p + "ffn_gate_inp_shexp.weight": (D,), p + "ffn_gate_shexp.weight": (S, D),
                  p + "ffn_up_shexp.weight": (S, D), p + "ffn_down_shexp.weight": (D, S)}
    return t


def check_tensors(mf: ModelFile, cfg: ModelConfig) -> None:
    """Every expected tensor is present with the shape the metadata implies, in a supported type."""
    from strata.quant import is_supported

    for name, shape in expected_tensors(cfg).items():
        ref = mf.tensors.get(name)
        if ref is None:
            raise ModelFileError(mf.path, f"tensor {name} is missing (needed by {cfg.arch})")
        if tuple(ref.shape) != shape:
            raise ModelFileError(mf.path, f"tensor {name} has shape {list(ref.shape)} but the "
                                          f"metadata implies {list(shape)}")
        if not is_supported(ref.qtype):
            raise UnsupportedError(f"{mf.path}: tensor {name} has type {ref.info.type_name}, "
                                   "which Strata does not support")


# --prefetch auto on CUDA decode steps (where the cache is small: prefetch_pays):
# at 2 GiB (30B-A3B, H200, LRU, before lent slots) 2 gave 42.8-45.1 tok/s against 40.6-40.9
# without, 1 gave 42.2 and 3-4 42.8-43.4 (bench/2026-11-30-h200-prefetch2.md); with LFU and lent
# slots 4 gave 66.2 against 61.9 for 2 on one machine (3: 63.7 on another), and 104.3 at 4 GiB
# against 99.3 (bench/2026-11-30-h200-lfu.md)
AUTO_PREFETCH = 4


def prefetch_pays(slots: list[int], k: int) -> bool:
    """--prefetch auto (the memory plan's call): on where the layers with experts outside VRAM
    (slots: theirs) average fewer cache slots than a token's k experts, so that most routed
    experts miss. On the H200 (30B-A3B, K = 8) it gained 5-10% at 2 GiB (1 slot a layer) and
    cost 9% at 10 GiB (43 slots a layer, 98% hits: the side streams' kernels and waits then
    outweigh the few copies they save)."""
    return bool(slots) and sum(slots) < k * len(slots)


@dataclass(frozen=True)
class EngineConfig:
    """How to run a model: the flags of generate/logits/bench (and strata-*.json), normalized."""

    device: str = "cpu"
    offload: str = "auto"  # auto (on for cuda) | on | off (everything on the device, reference)
    vram_budget_gib: float | None = None  # None: free VRAM minus a margin
    expert_cache: str = "auto"  # auto | N slots in all | 0
    cache_policy: str = "lfu"  # lfu | lru | profile
    expert_profile: str | None = None  # routing profile written by `strata profile`
    miss: str = "auto"  # auto | cpu | dma
    cpu_share: int = 0  # a decode token's last missed pairs of gathered layers the CPU takes
    # experts of the next gathered layer copied ahead of its routing (decode); None: auto
    prefetch: int | None = None
    threads: int | None = None  # CPU pool threads (default: usable cores - 1, usable_cpus)
    ctx: int | None = None  # KV cache tokens planned for (default: min(context, 4096))
    kv_type: str = "f32"  # KV cache elements: f32 | f16 | bf16
    sequences: int = 1  # sequences decoded together (strata serve --batch): each has a KV cache
    workspace_mib: int = 256  # float32 scratch of the dequantizing paths
    cpu_kernels: str = "auto"  # auto | ggml | torch
    prefill: str = "auto"  # prompt chunk: auto | auto:N | N | off (the whole prompt at once)
    ring_bytes: int | None = None  # streaming ring budget (None: auto from the memory plan)
    stream_min: int | None = None  # chunk tokens from which misses stream (None: auto)
    kernels: str = "fused"  # fused | exact (fused only for <= 4 tokens, float32-exact) | off
    decode_step: str = "graphs"  # graphs | eager | off: one-sequence decode (offload runtime)
    debug: bool = False  # check cache invariants after every layer

    def prefetch_count(self, n_experts_used: int) -> int:
        """--prefetch as a count: auto is AUTO_PREFETCH for CUDA decode steps, else off."""
        if self.prefetch is not None:
            return self.prefetch
        cuda = self.device.startswith("cuda") and self.decode_step != "off"
        return min(AUTO_PREFETCH, n_experts_used) if cuda else 0

    @property
    def use_offload(self) -> bool:
        return self.offload == "on" or (self.offload == "auto" and self.device == "cuda")
