"""Write synthetic GGUF models: real architecture, tensor names, metadata and block layouts, random
payloads with sane scales. Deterministic per seed; tensor data is generated and written in chunks,
so a 20 GB file needs little RAM.

Weights are zero-mean so that routing spreads over all experts; scales keep activations O(1):
projections ~ N(0, 1/fan_in), router logits with std ~2, norms ~ 1 + N(0, 0.1^2).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import ExpertGatingFuncType, GGUFWriter, LlamaFileType, RopeScalingType

from strata.cli.output import atomic_folder, check_free
from strata.config import ModelConfig, expected_tensors
from strata.gguf.writer import add_tensor, write_tensor_chunks
from strata.quant import random_rows, row_nbytes
from strata.synth.presets import Preset
from strata.synth.recipes import Recipe
from strata.tokenizer.synthetic import synthetic_vocab
from strata.yarn import Yarn

_CHUNK_BYTES = 16 << 20  # generate about this many bytes of one tensor at a time (per thread)


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    qtype: int
    std: float
    mean: float = 0.0

    @property
    def nbytes(self) -> int:
        rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        return rows * row_nbytes(self.qtype, self.shape[-1])


def config_of(p: Preset, tied_output: bool = False) -> ModelConfig:
    """The ModelConfig a file written from preset `p` will load as (tied_output: the file has no
    output.weight; the embedding serves as the output head)."""
    from strata.config import ARCHITECTURES, DENSE_ARCHITECTURES

    style, norm = (ARCHITECTURES if p.n_experts else DENSE_ARCHITECTURES)[p.arch]
    if p.arch == "glm4moe":
        return replace(config_of(replace(p, arch="qwen3moe"), tied_output), **_glm4moe_fields(p))
    if p.arch == "deepseek2":
        return replace(config_of(replace(p, arch="qwen3moe"), tied_output),
                       **_deepseek2_fields(p))
    cfg = ModelConfig(
        arch=p.arch, n_layers=p.n_layers, d_model=p.d_model, n_heads=p.n_heads,
        n_kv_heads=p.n_kv_heads, head_dim=p.head_dim, n_vocab=p.n_vocab,
        context_length=p.context_length, rms_eps=p.rms_eps, rope_theta=p.rope_theta,
        rope_dim=p.head_dim, rope_style=style, n_experts=p.n_experts,
        n_experts_used=p.n_experts_used, d_expert=p.d_expert, d_shared=p.d_shared, norm_topk=norm,
        qkv_bias=p.arch in ("qwen2moe", "gpt-oss", "qwen2"),
        qk_norm=p.arch in ("qwen3moe", "qwen3"), tied_output=tied_output)
    if not p.n_experts:  # a dense model: every layer's FFN
        cfg = replace(cfg, n_dense_lead=p.n_layers, d_ff=p.d_ff)
    if p.full_attn_interval:  # hybrid linear attention (config_hybrid)
        cfg = replace(cfg, rope_dim=p.rope_dim or p.head_dim,
                      full_attn_interval=p.full_attn_interval, ssm_conv=p.ssm_conv,
                      ssm_state=p.ssm_state, ssm_groups=p.ssm_groups,
                      ssm_heads=p.ssm_heads, attn_gate=True, n_nextn=p.n_nextn, qk_norm=True,
                      ssm_layout="qwen35" if p.arch == "qwen35moe" else "next")
    if p.yarn_factor > 1:  # (as strata.yarn.rope_scaling reads what _add_yarn writes)
        cfg = replace(cfg, yarn=Yarn(p.yarn_factor, p.yarn_orig_ctx or p.context_length,
                                     ext_factor=1.0 if p.rope_scaling == "yarn" else 0.0))
    if p.arch == "gpt-oss":
        cfg = replace(cfg, sliding_window=p.sliding_window, attn_sinks=True, moe_bias=True,
                      expert_act="swiglu_oai", ffn_norm_name="post_attention_norm")
    return cfg


def _glm4moe_fields(p: Preset) -> dict:
    return dict(arch="glm4moe", rope_dim=p.rope_dim or p.head_dim, norm_topk=True, qkv_bias=True,
                qk_norm=bool(p.qk_norm), d_shared=p.n_shared * p.d_expert,
                n_dense_lead=p.n_dense_lead, d_ff=p.d_ff if p.n_dense_lead else 0,
                gating="sigmoid", expert_bias=True, expert_scale=p.expert_scale,
                n_nextn=p.n_nextn, ffn_norm_name="post_attention_norm")


def _deepseek2_fields(p: Preset) -> dict:
    return dict(arch="deepseek2", n_nextn=p.n_nextn, rope_style="normal", rope_dim=p.rope_dim,
                norm_topk=True,
                qkv_bias=False, qk_norm=False, d_shared=p.n_shared * p.d_expert,
                n_dense_lead=p.n_dense_lead, d_ff=p.d_ff if p.n_dense_lead else 0,
                gating="sigmoid", expert_bias=True, expert_scale=p.expert_scale,
                n_groups=p.n_groups, n_groups_used=p.n_groups_used, q_lora=p.q_lora,
                kv_lora=p.kv_lora, d_v=p.d_v,
                yarn=Yarn(p.yarn_factor, p.yarn_orig_ctx, beta_fast=p.yarn_beta[0],
                          beta_slow=p.yarn_beta[1], rope_mscale=False,
                          mscale_all_dim=p.yarn_mscale) if p.yarn_factor > 1 else None)


def plan_tensors(p: Preset, recipe: Recipe) -> list[PlannedTensor]:
    out = []
    tensors = expected_tensors(config_of(p))
    for i in range(p.n_layers, p.n_layers + p.n_nextn):  # (optional: written as converters do)
        tensors[f"blk.{i}.nextn.shared_head_norm.weight"] = (p.d_model,)
    for name, shape in tensors.items():
        if len(shape) == 1:
            is_norm = "norm" in name
            std, mean = (0.1, 1.0) if is_norm else (0.1, 0.0)
            if name.endswith("ffn_gate_inp_shexp.weight"):
                std = shape[0] ** -0.5
            if name.endswith("attn_sinks.weight"):  # sink logits that take a real share
                std, mean = 1.0, 0.0
            elif name.endswith(".ssm_a"):  # -exp(A_log): negative, a decay of exp(a * dt)
                std, mean = 0.1, -1.0
        elif "ffn_gate_inp" in name:
            std, mean = 2.0 * shape[-1] ** -0.5, 0.0
        elif name == "token_embd.weight":
            std, mean = 1.0, 0.0
        elif name == "output.weight":
            std, mean = 3.0 * shape[-1] ** -0.5, 0.0
        else:
            std, mean = shape[-1] ** -0.5, 0.0
        out.append(PlannedTensor(name, shape, recipe.type_for(name, shape, p.n_layers), std, mean))
    return out


def _chunk(t: PlannedTensor, rows: int, rng: np.random.Generator) -> np.ndarray:
    if t.mean:  # norms: F32 around their mean
        return (t.mean + t.std * rng.standard_normal((rows, t.shape[-1]))).astype(np.float32)
    return random_rows(t.qtype, rows, t.shape[-1], rng, t.std)


def _chunks(t: PlannedTensor, seed: int, index: int, pool: ThreadPoolExecutor,
            ahead: int) -> Iterator[np.ndarray]:
    """The tensor's bytes in chunks of rows, generated on `pool` (numpy releases the GIL), in
    order, at most `ahead` chunks in flight. Chunk c is drawn from rng([seed, index, c]), so the
    file does not depend on the number of threads."""
    n_rows = int(np.prod(t.shape[:-1], dtype=np.int64))
    step = max(1, _CHUNK_BYTES // row_nbytes(t.qtype, t.shape[-1]))
    starts = list(range(0, n_rows, step))
    pending: deque = deque()
    for c, start in enumerate(starts):
        rng = np.random.default_rng([seed, index, c])
        pending.append(pool.submit(_chunk, t, min(step, n_rows - start), rng))
        if len(pending) >= ahead:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()


def add_metadata(w: GGUFWriter, p: Preset, name: str, description: str,
                 file_type: LlamaFileType | None) -> None:
    """The general.* and architecture keys of a model of shape `p`."""
    w.add_name(name)
    w.add_description(description)
    w.add_context_length(p.context_length)
    w.add_embedding_length(p.d_model)
    w.add_block_count(p.n_layers + p.n_nextn)
    w.add_feed_forward_length(p.d_ff)
    w.add_head_count(p.n_heads)
    w.add_head_count_kv(1 if p.arch == "deepseek2" else p.n_kv_heads)
    w.add_rope_freq_base(p.rope_theta)
    w.add_layer_norm_rms_eps(p.rms_eps)
    if p.n_experts:
        w.add_expert_count(p.n_experts)
        w.add_expert_used_count(p.n_experts_used)
    if p.arch == "llama":
        w.add_rope_dimension_count(p.head_dim)
        w.add_vocab_size(p.n_vocab)
    elif p.arch == "deepseek2":  # as current converters write MLA: the latent MQA view
        w.add_key_length(p.kv_lora + p.rope_dim)
        w.add_value_length(p.kv_lora)
        w.add_key_length_mla(p.head_dim)
        w.add_value_length_mla(p.d_v)
        w.add_expert_feed_forward_length(p.d_expert)
    else:
        w.add_key_length(p.head_dim)
        w.add_value_length(p.head_dim)
        if p.n_experts:
            w.add_expert_feed_forward_length(p.d_expert)
    if p.d_shared:
        w.add_expert_shared_feed_forward_length(p.d_shared)
    if p.sliding_window:
        w.add_sliding_window(p.sliding_window)
    if p.arch != "deepseek2" and p.yarn_factor > 1:  # as llama.cpp's converter writes its
        _add_yarn(w, p)  # rope_scaling
    if p.arch == "glm4moe":
        w.add_rope_dimension_count(p.rope_dim or p.head_dim)
        _add_sigmoid_routing(w, p)
        w.add_nextn_predict_layers(p.n_nextn)
    if p.arch == "deepseek2":
        w.add_rope_dimension_count(p.rope_dim)
        if p.q_lora:
            w.add_q_lora_rank(p.q_lora)
        w.add_kv_lora_rank(p.kv_lora)
        _add_sigmoid_routing(w, p)
        w.add_expert_group_count(p.n_groups)
        w.add_expert_group_used_count(p.n_groups_used)
        if p.n_nextn:
            w.add_nextn_predict_layers(p.n_nextn)
        if p.yarn_factor > 1:
            _add_yarn(w, p)
            w.add_rope_scaling_yarn_log_mul(0.1 * p.yarn_mscale)
            w.add_rope_scaling_yarn_beta_fast(p.yarn_beta[0])  # (as current converters do)
            w.add_rope_scaling_yarn_beta_slow(p.yarn_beta[1])
    if p.full_attn_interval:  # hybrid linear attention (config_hybrid)
        w.add_full_attention_interval(p.full_attn_interval)
        w.add_ssm_conv_kernel(p.ssm_conv)
        w.add_ssm_state_size(p.ssm_state)
        w.add_ssm_group_count(p.ssm_groups)
        w.add_ssm_time_step_rank(p.ssm_heads)
        w.add_ssm_inner_size(p.ssm_heads * p.ssm_state)
        w.add_rope_dimension_count(p.rope_dim or p.head_dim)
        if p.arch == "qwen35moe":
            half = (p.rope_dim or p.head_dim) // 2  # 32 -> [11, 11, 10, 0] as Qwen3.5 has
            third = -(-half // 3)
            w.add_rope_dimension_sections([third, third, half - 2 * third, 0])
        if p.n_nextn:
            w.add_nextn_predict_layers(p.n_nextn)
    w.add_quantization_version(2)
    if file_type is not None:
        w.add_file_type(file_type)


def _add_sigmoid_routing(w: GGUFWriter, p: Preset) -> None:
    """glm4moe's and deepseek2's routing keys: dense first layers, shared experts, the routed
    weights' scale, renormalized, sigmoid gating."""
    w.add_leading_dense_block_count(p.n_dense_lead)
    w.add_expert_shared_count(p.n_shared)
    w.add_expert_weights_scale(p.expert_scale)
    w.add_expert_weights_norm(True)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)


def _add_yarn(w: GGUFWriter, p: Preset) -> None:
    """The rope.scaling keys every architecture shares: the type (yarn; linear where the preset
    says, not for deepseek2), its factor, the original context."""
    linear = p.rope_scaling == "linear" and p.arch != "deepseek2"
    w.add_rope_scaling_type(RopeScalingType.LINEAR if linear else RopeScalingType.YARN)
    w.add_rope_scaling_factor(p.yarn_factor)
    w.add_rope_scaling_orig_ctx_len(p.yarn_orig_ctx or p.context_length)


def file_type(recipe: Recipe) -> LlamaFileType | None:
    """general.file_type for a recipe (llama.cpp names the model's type by it; without it,
    it guesses from the commonest tensor type, F32 where the norms outnumber the rest), or None
    for ALL-TYPES, which has no such name."""
    name = {"F32": "ALL_F32", "IQ2_XS-MIX": "MOSTLY_IQ2_XS",
            "MXFP4": "MOSTLY_MXFP4_MOE"}.get(recipe.name, f"MOSTLY_{recipe.name}")
    return LlamaFileType.__members__.get(name)


def write_model(out: Path, p: Preset, recipe: Recipe, seed: int, split_max_tensors: int = 0,
                split_max_size: int = 0, progress: bool = False) -> list[PlannedTensor]:
    """Write the model; return the tensors written. Split sets: OUT-0000i-of-0000n.gguf.
    Atomic: the files are written in a temporary folder beside `out` and moved into place when
    complete; a stopped or failed write leaves nothing (after checking the free space)."""
    out = Path(out)
    tensors = plan_tensors(p, recipe)
    check_free(out, sum(t.nbytes for t in tensors), "synth")
    with atomic_folder(out, "synth") as tmp:
        _write(tmp / out.name, p, recipe, seed, tensors, split_max_tensors, split_max_size,
               progress)
    return tensors


def _write(out: Path, p: Preset, recipe: Recipe, seed: int, tensors: list[PlannedTensor],
           split_max_tensors: int, split_max_size: int, progress: bool) -> None:
    w = GGUFWriter(out, p.arch, split_max_tensors=split_max_tensors, split_max_size=split_max_size)
    add_metadata(w, p, f"strata-synthetic-{p.arch}-{recipe.name}",
                 "Synthetic model written by `strata synth`: random weights, real layout. "
                 "Its text is meaningless.", file_type(recipe))
    synthetic_vocab(p.vocab_kind, p.n_vocab).add_to(w)
    for t in tensors:
        add_tensor(w, t.name, t.shape, t.qtype, t.nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    bar = _progress(sum(t.nbytes for t in tensors), progress)
    threads = min(16, os.cpu_count() or 1)
    with ThreadPoolExecutor(threads) as pool:
        for i, t in enumerate(tensors):
            chunks = _chunks(t, seed, i, pool, 2 * threads)
            write_tensor_chunks(w, t.nbytes, _counted(chunks, bar))
    w.close()
    if bar is not None:
        bar.close()


def _progress(total: int, enabled: bool):  # noqa: ANN202 - tqdm or None
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="writing")


def _counted(chunks: Iterator[np.ndarray], bar) -> Iterator[np.ndarray]:  # noqa: ANN001
    for c in chunks:
        if bar is not None:
            bar.update(c.nbytes)
        yield c
