"""Model configuration, normalized once from GGUF metadata and checked against the tensor table."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace

from strata.config_hybrid import (
    HYBRID_ARCHS,
    attention_tensors,
    ffn_norm_name,
    linear_tensors,
    nextn_tensors,
    read_hybrid,
    state_bytes,
)
from strata.errors import ModelFileError, UnsupportedError
from strata.gguf import ModelFile
from strata.kernels.tuning import AUTO_PREFETCH
from strata.yarn import Yarn, rope_scaling

# architecture -> (RoPE style, routing weights renormalized over the top-k by default)
# llama.cpp's converter permutes llama's Q/K rows so that RoPE rotates adjacent pairs ("normal");
# the qwen families rotate the two halves of each head ("neox").
ARCHITECTURES = {
    "qwen3moe": ("neox", True),
    "qwen2moe": ("neox", False),
    "llama": ("normal", True),
    "glm4moe": ("neox", False),  # (llama.cpp: expert_weights_norm false when absent)
    "deepseek2": ("normal", False),
    "qwen35moe": ("neox", True),  # hybrid linear attention: config_hybrid
    "qwen3next": ("neox", True),
    "gpt-oss": ("neox", True),  # strata.arch.gpt_oss: sinks, sliding windows, YaRN, biases
}
# dense models (every layer a dense FFN): loaded only as a --draft beside a MoE target (a Qwen3
# 0.6B drafting for Qwen3-30B-A3B / 235B-A22B); "llama" without experts is the dense Llama
DENSE_ARCHITECTURES = {"qwen3": ("neox", False), "qwen2": ("neox", False),
                       "llama": ("normal", False)}


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
    # glm4moe / deepseek2 (strata/arch_glm4moe.py): leading dense layers and their hidden size,
    # the router's gating ("softmax" | "sigmoid"), its selection bias (exp_probs_b), the routed
    # weights' scale, expert groups (all / used), nextn (MTP) layers after the n_layers
    n_dense_lead: int = 0
    d_ff: int = 0
    gating: str = "softmax"
    expert_bias: bool = False
    expert_scale: float = 1.0
    n_groups: int = 1
    n_groups_used: int = 1
    ffn_norm_name: str = "ffn_norm"  # glm4moe: post_attention_norm
    # deepseek2's multi-head latent attention (strata/arch_deepseek2.py; kv_lora 0: none):
    # q LoRA rank (0: one q matrix), the latent's rank, the value head size (head_dim is the
    # query/key head, rope_dim of it rotated), k_b / v_b split in the file (else attn_kv_b)
    q_lora: int = 0
    kv_lora: int = 0
    d_v: int = 0
    mla_split: bool = True
    # hybrid linear attention (qwen35moe, qwen3next: config_hybrid); 0 / "" elsewhere
    full_attn_interval: int = 0  # layer i is full attention where (i + 1) % interval == 0
    ssm_conv: int = 0  # the short causal conv's kernel K
    ssm_state: int = 0  # head dim of the delta rule's keys and values (dk == dv)
    ssm_groups: int = 0  # key heads Hk
    ssm_heads: int = 0  # value heads Hv
    ssm_layout: str = ""  # qwen35 | next (ssm_in, ssm_ba) | next-split (attn_qkv, ssm_ba)
    attn_gate: bool = False  # attn_q carries a sigmoid output gate per head
    n_nextn: int = 0  # nextn (MTP) layers after the trunk (blk.n_layers ..), read and kept
    # gpt-oss (strata.arch.gpt_oss); the defaults are every other architecture's
    sliding_window: int = 0  # tokens a sliding layer attends over (0: none)
    attn_sinks: bool = False  # a learned sink logit per head (blk.N.attn_sinks.weight)
    moe_bias: bool = False  # biases on the attention output, the router and the experts
    expert_act: str = "swiglu"  # swiglu | swiglu_oai (gpt-oss's clamped SwiGLU)
    # YaRN RoPE (gpt-oss, deepseek2, and any file whose rope.scaling says yarn or linear:
    # strata.yarn.rope_scaling), or None (plain RoPE)
    yarn: Yarn | None = None

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """A Gated DeltaNet layer's conv channels C = 2*Hk*dk + Hv*dv: its q, k and v (hybrids;
        0 elsewhere)."""
        return (2 * self.ssm_groups + self.ssm_heads) * self.ssm_state

    def is_linear(self, layer: int) -> bool:
        """Layer `layer` is a Gated DeltaNet mixer (hybrid models), not full attention."""
        return bool(self.full_attn_interval) and (layer + 1) % self.full_attn_interval != 0

    @property
    def n_kv_layers(self) -> int:
        """Layers with a KV cache: the full-attention ones."""
        return sum(not self.is_linear(i) for i in range(self.n_layers))

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def kv_row(self) -> int:
        """Cached elements per token and layer: keys and values, or MLA's latent + rope part."""
        return self.kv_lora + self.rope_dim if self.kv_lora else 2 * self.kv_dim

    @classmethod
    def from_model(cls, mf: ModelFile, dense: bool = False) -> ModelConfig:
        """The configuration, every value checked (type, range, finiteness) before anything is
        sized from it; an error names the file and the key. dense: a dense model is taken too
        (DENSE_ARCHITECTURES: a --draft), every layer a dense FFN."""
        arch = mf.meta("general.architecture")
        known = ARCHITECTURES | (DENSE_ARCHITECTURES if dense else {})
        if not isinstance(arch, str) or arch not in known:
            also = (f"; dense {', '.join(DENSE_ARCHITECTURES)} models run as a --draft only"
                    if isinstance(arch, str) and arch in DENSE_ARCHITECTURES else "")
            raise UnsupportedError(f"{mf.path}: architecture {arch!r} is not supported "
                                   f"(supported: {', '.join(ARCHITECTURES)}){also}")
        m = _Meta(mf, arch)
        n_experts = m.int("expert_count", 0, 0, MAX_EXPERTS)
        if n_experts == 0 and not (dense and arch in DENSE_ARCHITECTURES):
            raise UnsupportedError(f"{mf.path}: a dense {arch} model (no {arch}.expert_count); "
                                   "Strata runs Mixture-of-Experts models (a dense model of "
                                   "the same vocabulary runs as a --draft beside one)")
        if n_experts and arch not in ARCHITECTURES:
            raise UnsupportedError(f"{mf.path}: {arch}.expert_count is {n_experts}, but {arch} "
                                   "is a dense architecture")
        rope_style, norm_default = (ARCHITECTURES if n_experts else DENSE_ARCHITECTURES)[arch]
        if "blk.0.ffn_gate.0.weight" in mf.tensors:
            raise UnsupportedError(f"{mf.path}: experts stored as one tensor each (old Mixtral "
                                   "layout); convert it again with a recent llama.cpp to get "
                                   "merged ffn_*_exps tensors")
        n_layers = m.int("block_count", lo=1, hi=MAX_DIM)
        if n_layers > len(mf.tensors):  # bounds the tensor table built from it
            raise ModelFileError(mf.path, f"{arch}.block_count is {n_layers} but the file holds "
                                          f"only {len(mf.tensors)} tensors")
        d_model = m.int("embedding_length", lo=1, hi=MAX_DIM)
        n_heads = m.int("attention.head_count", lo=1, hi=d_model)
        head_dim = m.int("attention.key_length", max(d_model // n_heads, 1), 1, MAX_DIM)
        n_kv_heads = m.int("attention.head_count_kv", n_heads, 1, n_heads)
        if n_heads % n_kv_heads:
            raise ModelFileError(mf.path, f"{arch}.attention.head_count_kv is {n_kv_heads}, which "
                                          f"does not divide the {n_heads} heads")
        d_expert_key = "feed_forward_length" if arch == "llama" else "expert_feed_forward_length"
        embd = mf.tensors.get("token_embd.weight")
        if embd is None:
            raise ModelFileError(mf.path, "tensor token_embd.weight is missing")
        tokens = mf.meta("tokenizer.ggml.tokens", None)  # (llama.cpp sizes the embedding by it)
        if isinstance(tokens, list) and len(tokens) != embd.shape[0]:
            raise ModelFileError(mf.path, f"tokenizer.ggml.tokens has {len(tokens):,} tokens but "
                                          f"tensor token_embd.weight has {embd.shape[0]:,} rows: "
                                          "its vocabulary does not fit its model (convert it "
                                          "again)")
        cfg = cls(
            arch=arch,
            n_layers=n_layers,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            n_vocab=embd.shape[0],
            context_length=m.int("context_length", 4096, 1, MAX_CONTEXT),
            rms_eps=m.float("attention.layer_norm_rms_epsilon", 1e-6, 0.0, 1.0),
            rope_theta=m.float("rope.freq_base", 10000.0, 1.0, 1e12),  # (YaRN divides by ln)
            rope_dim=m.int("rope.dimension_count", head_dim, 2, head_dim),
            rope_style=rope_style,
            n_experts=n_experts,
            n_experts_used=m.int("expert_used_count", lo=1, hi=n_experts) if n_experts else 0,
            d_expert=m.int(d_expert_key, lo=1, hi=MAX_DIM) if n_experts else 0,
            d_shared=m.int("expert_shared_feed_forward_length", 0, 0, MAX_DIM),
            norm_topk=m.bool("expert_weights_norm", norm_default),
            qkv_bias="blk.0.attn_q.bias" in mf.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in mf.tensors,
            tied_output="output.weight" not in mf.tensors,
        )
        if not n_experts:  # a dense model: every layer's FFN
            cfg = replace(cfg, n_dense_lead=n_layers,
                          d_ff=m.int("feed_forward_length", lo=1, hi=MAX_DIM))
        if arch not in ("gpt-oss", "deepseek2"):  # (theirs: their readers, below)
            cfg = replace(cfg, yarn=rope_scaling(m, cfg.context_length))
        if arch == "gpt-oss":
            from strata.arch import gpt_oss

            cfg = replace(cfg, **gpt_oss.read_fields(m, n_layers))
        if arch == "glm4moe":
            from strata.arch_glm4moe import glm4moe_fields

            cfg = replace(cfg, **glm4moe_fields(mf, m, cfg.n_layers, cfg.d_expert))
        if arch == "deepseek2":
            from strata.arch_deepseek2 import deepseek2_fields

            cfg = replace(cfg, **deepseek2_fields(mf, m, cfg.n_layers, cfg.n_experts,
                                                  cfg.n_heads, cfg.d_expert,
                                                  cfg.context_length))
        if cfg.rope_dim % 2:
            raise ModelFileError(mf.path, f"{arch}.rope.dimension_count is {cfg.rope_dim}; RoPE "
                                          "rotates pairs, so it must be even")
        if arch in HYBRID_ARCHS:
            cfg = replace(cfg, **read_hybrid(mf, m, arch, cfg.n_layers, cfg.rope_dim))
        if arch == "qwen2moe" and cfg.d_shared == 0 and "blk.0.ffn_up_shexp.weight" in mf.tensors:
            shexp = mf.tensors["blk.0.ffn_up_shexp.weight"]
            cfg = replace(cfg, d_shared=shexp.shape[0])
        check_tensors(mf, cfg)
        return cfg


# Bounds of the sizes a file may declare: far above every real model, low enough that nothing
# sized from them (tensor tables, KV caches, plans) runs away before the tensors are checked.
MAX_DIM = 1 << 20
MAX_EXPERTS = 1 << 16
MAX_CONTEXT = 1 << 24


class _Meta:
    """Typed reads of `ARCH.key` metadata: a wrong type or a value out of range is one line
    naming the file and the key."""

    def __init__(self, mf: ModelFile, arch: str):
        self.mf, self.arch = mf, arch

    def _get(self, key: str, default: object) -> tuple[str, object]:
        name = f"{self.arch}.{key}"
        return name, self.mf.meta(name, default)

    def _bad(self, name: str, value: object, want: str) -> ModelFileError:
        shown = repr(value) if not isinstance(value, list) else f"an array of {len(value)}"
        return ModelFileError(self.mf.path, f"metadata key {name} is {shown[:60]}: {want}")

    def int(self, key: str, default: object = ModelFileError, lo: int = 0,
            hi: int = MAX_DIM) -> int:
        name, v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise self._bad(name, v, f"expected an integer from {lo} to {hi}")
        return int(v)

    def float(self, key: str, default: float, lo: float, hi: float) -> float:
        """A finite number with lo < value <= hi."""
        name, v = self._get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or not lo < v <= hi:
            raise self._bad(name, v, f"expected a finite number above {lo:g}, at most {hi:g}")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        name, v = self._get(key, default)
        if not isinstance(v, (bool, int)) or isinstance(v, int) and v not in (0, 1):
            raise self._bad(name, v, "expected true or false")
        return bool(v)


def kv_elem_bytes(kv_type: str) -> float:
    """Bytes a key or value element of --kv-type takes in the cache (q8_0: 34 bytes a block of
    32; strata.runtime.kv_cache holds the types)."""
    return {"f32": 4.0, "q8_0": 34 / 32}.get(kv_type, 2.0)


def kv_bytes(cfg: ModelConfig, tokens: int, kv_type: str = "f32") -> int:
    """Bytes of one sequence's KV cache for `tokens` positions: [2, L, tokens, Hkv, hd] (or MLA's
    latent rows) over the L full-attention layers (q8_0: 34 bytes a block of 32), plus a hybrid
    model's recurrent state (config_hybrid.state_bytes)."""
    return int(cfg.n_kv_layers * tokens * cfg.kv_row * kv_elem_bytes(kv_type)) + state_bytes(cfg)


def expected_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the architecture reads, with its shape in torch order."""
    D, V, E, F = cfg.d_model, cfg.n_vocab, cfg.n_experts, cfg.d_expert
    t: dict[str, tuple[int, ...]] = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    if not cfg.tied_output:
        t["output.weight"] = (V, D)
    if cfg.arch in HYBRID_ARCHS:
        return t | _hybrid_tensors(cfg)
    for i in range(cfg.n_layers + cfg.n_nextn):
        p = f"blk.{i}."
        if cfg.arch == "gpt-oss":
            from strata.arch.gpt_oss import layer_tensors

            t |= layer_tensors(cfg, p)
            continue
        t[p + "attn_norm.weight"] = (D,)
        if cfg.kv_lora:
            from strata.arch_deepseek2 import mla_tensors

            t |= mla_tensors(p, D, cfg.n_heads, cfg.head_dim, cfg.rope_dim, cfg.q_lora,
                             cfg.kv_lora, cfg.d_v, cfg.mla_split)
        else:
            t |= {p + "attn_q.weight": (cfg.q_dim, D), p + "attn_k.weight": (cfg.kv_dim, D),
                  p + "attn_v.weight": (cfg.kv_dim, D), p + "attn_output.weight": (D, cfg.q_dim)}
        t[p + f"{cfg.ffn_norm_name}.weight"] = (D,)
        if i < cfg.n_dense_lead:
            t |= {p + "ffn_gate.weight": (cfg.d_ff, D), p + "ffn_up.weight": (cfg.d_ff, D),
                  p + "ffn_down.weight": (D, cfg.d_ff)}
        else:
            t |= {p + "ffn_gate_inp.weight": (E, D), p + "ffn_gate_exps.weight": (E, F, D),
                  p + "ffn_up_exps.weight": (E, F, D), p + "ffn_down_exps.weight": (E, D, F)}
            if cfg.expert_bias:
                t[p + "exp_probs_b.bias"] = (E,)
        if i >= cfg.n_layers:  # (llama.cpp: shared_head_norm / _head, embed_tokens optional)
            t |= {p + "nextn.eh_proj.weight": (D, 2 * D), p + "nextn.enorm.weight": (D,),
                  p + "nextn.hnorm.weight": (D,)}
        if cfg.qkv_bias:
            t |= {p + "attn_q.bias": (cfg.q_dim,), p + "attn_k.bias": (cfg.kv_dim,),
                  p + "attn_v.bias": (cfg.kv_dim,)}
        if cfg.qk_norm:
            t |= {p + "attn_q_norm.weight": (cfg.head_dim,),
                  p + "attn_k_norm.weight": (cfg.head_dim,)}
        if cfg.d_shared and i >= cfg.n_dense_lead:
            S = cfg.d_shared
            if cfg.arch == "qwen2moe":  # the shared expert's sigmoid gate
                t[p + "ffn_gate_inp_shexp.weight"] = (D,)
            t |= {p + "ffn_gate_shexp.weight": (S, D), p + "ffn_up_shexp.weight": (S, D),
                  p + "ffn_down_shexp.weight": (D, S)}
    return t


def _hybrid_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The layers of qwen35moe / qwen3next (config_hybrid), MTP blocks included."""
    D, E, F, S = cfg.d_model, cfg.n_experts, cfg.d_expert, cfg.d_shared
    t: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.n_layers + cfg.n_nextn):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": (D,), p + ffn_norm_name(cfg) + ".weight": (D,)}
        t |= (linear_tensors(cfg, p) if i < cfg.n_layers and cfg.is_linear(i)
              else attention_tensors(cfg, p))
        if i >= cfg.n_layers:
            t |= nextn_tensors(cfg, p)
        t |= {p + "ffn_gate_inp.weight": (E, D), p + "ffn_gate_exps.weight": (E, F, D),
              p + "ffn_up_exps.weight": (E, F, D), p + "ffn_down_exps.weight": (E, D, F)}
        if S:
            t |= {p + "ffn_gate_inp_shexp.weight": (D,), p + "ffn_gate_shexp.weight": (S, D),
                  p + "ffn_up_shexp.weight": (S, D), p + "ffn_down_shexp.weight": (D, S)}
    return t


def optional_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensors beyond expected_tensors that the loader reads where a file has them: a nextn
    (MTP) layer's own head norm, output and embedding (llama.cpp: optional), torch order."""
    D, V = cfg.d_model, cfg.n_vocab
    t: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.n_layers, cfg.n_layers + cfg.n_nextn):
        p = f"blk.{i}.nextn."
        t |= {p + "shared_head_norm.weight": (D,), p + "shared_head_head.weight": (V, D),
              p + "embed_tokens.weight": (V, D)}
    return t


def check_tensors(mf: ModelFile, cfg: ModelConfig) -> None:
    """Every expected tensor is present with the shape the metadata implies, in a supported type;
    so is every optional one the file has."""
    from strata.quant import is_supported

    optional = optional_tensors(cfg)
    for name, shape in (expected_tensors(cfg) | optional).items():
        ref = mf.tensors.get(name)
        if ref is None and name in optional:
            continue
        if ref is None:
            raise ModelFileError(mf.path, f"tensor {name} is missing (needed by {cfg.arch})")
        if tuple(ref.shape) != shape:
            raise ModelFileError(mf.path, f"tensor {name} has shape {list(ref.shape)} but the "
                                          f"metadata implies {list(shape)}")
        if not is_supported(ref.qtype):
            raise UnsupportedError(f"{mf.path}: tensor {name} has type {ref.info.type_name}, "
                                   "which Strata does not support")


BUSY_SAMPLE_S = 0.1  # busy_now's window: 10 ticks a core of /proc/stat's 100 a second
BUSY_REUSE_S = 5.0  # other_load's reading serves the calls this soon after it (start-up asks twice)
_busy_read: list[float] = []  # [monotonic time, cores busy] of other_load's last sample


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask: a container's cpuset, taskset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def cpu_threads(usable: int | None = None, load: float | None = None) -> int:
    """Threads for CPU work: the usable cores less those other processes keep busy (other_load),
    at least 1. On 2 cores with one busy process, 1 thread decoded at ~100 tok/s where 2 fell
    to 20-28 (each step waits for its preempted thread)."""
    usable = usable or usable_cores()
    if load is None:
        load = other_load()
    busy = min(usable - 1, int(load + 0.5)) if math.isfinite(load) and load > 0 else 0
    return max(1, usable - busy)


def other_load(sample_s: float = BUSY_SAMPLE_S) -> float:
    """Cores other processes keep busy: the 1-minute load average, or where that says a core is
    busy, the smaller of it and the cores busy now (busy_now over sample_s; this process
    sleeps meanwhile, so its own work is not counted). The load average remembers a minute:
    a `strata serve` started just after a benchmark's previous server (or its clients) ended
    saw 0.8-1.1 on 2 cores and ran on 1 thread, where its batched step gains nothing
    (bench/2026-12-06-cpu-serve.md)."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0
    if not (math.isfinite(load) and load >= 0.5):
        return load
    if _busy_read and time.monotonic() - _busy_read[0] < BUSY_REUSE_S:
        now: float | None = _busy_read[1]  # (the thread pools and the CPU pool, at start-up)
    else:
        now = busy_now(sample_s)
        if now is not None:
            _busy_read[:] = [time.monotonic(), now]
    return load if now is None else min(load, now)


def busy_now(sample_s: float = BUSY_SAMPLE_S) -> float | None:
    """Cores busy over the next sample_s seconds among those this process may use, from two
    reads of /proc/stat (user, nice, system, irq, softirq time; a VM's steal and idle, iowait
    not), or None where there is no /proc/stat."""
    def read() -> dict[str, tuple[int, int]]:
        times = {}
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name.startswith("cpu") and name != "cpu":
                    t = [int(x) for x in fields[:8]]
                    times[name] = (t[0] + t[1] + t[2] + t[5] + t[6], sum(t))
        return times
    try:
        cpus = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    except AttributeError:
        cpus = None
    try:
        before = read()
        time.sleep(sample_s)
        after = read()
    except (OSError, ValueError, IndexError):
        return None
    busy = 0.0
    for name, (work, total) in after.items():
        if (cpus is None or name in cpus) and name in before and total > before[name][1]:
            busy += (work - before[name][0]) / (total - before[name][1])
    return busy


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
    threads: int | None = None  # CPU pool threads (default: cpu_pool.default_threads)
    ctx: int | None = None  # KV cache tokens planned (default: the model's, capped: memory_plan)
    kv_type: str = "f32"  # KV cache elements: f32 | f16 | bf16
    sequences: int = 1  # sequences decoded together (strata serve --batch): each has a KV cache
    workspace_mib: int = 256  # float32 scratch of the dequantizing paths
    cpu_kernels: str = "auto"  # auto | ggml | torch
    prefill: str = "auto"  # prompt chunk: auto | auto:N | N | off (the whole prompt at once)
    # a prompt of several chunks: auto (layer by layer where experts stream) | layers | chunks
    prefill_order: str = "auto"
    ring_bytes: int | None = None  # streaming ring budget (None: auto from the memory plan)
    stream_min: int | None = None  # chunk tokens from which misses stream (None: auto)
    kernels: str = "fused"  # fused | exact (fused only for <= 4 tokens, float32-exact) | off
    decode_step: str = "graphs"  # graphs | eager | off: one-sequence decode (offload runtime)
    prompt_graphs: str = "on"  # on | off: prompt chunks replayed from CUDA graphs where they can
    debug: bool = False  # check cache invariants after every layer
    spec: int = 0  # --spec T: drafted tokens per verify window at most (0: off)
    draft: str = "auto"  # --draft auto | ngram | mtp | PATH.gguf (strata.engine.drafters)
    # a --draft model loaded beside its target, whose memory plan counts it: the target's VRAM
    # cap stays (memory_plan.draft_bytes)
    beside_target: bool = False

    def prefetch_count(self, n_experts_used: int) -> int:
        """--prefetch as a count: auto is AUTO_PREFETCH for CUDA decode steps, else off."""
        if self.prefetch is not None:
            return self.prefetch
        cuda = self.device.startswith("cuda") and self.decode_step != "off"
        return min(AUTO_PREFETCH, n_experts_used) if cuda else 0

    @property
    def use_offload(self) -> bool:
        return self.offload == "on" or (self.offload == "auto" and self.device.startswith("cuda"))
