"""Reference logits from HF transformers, loading the same GGUF file (qwen3moe, qwen2moe) or built
from gguf-py's dequantization of its tensors (Mixtral-style llama)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize


def hf_gguf_logits(path: Path, tokens: list[int], tied_output: bool = False) -> np.ndarray:
    """transformers' own GGUF loader; the config mapping misses the MoE sizes, set them by hand
    (and, for a file without output.weight, that its embedding is the output head)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def meta(key: str):
        f = reader.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else None

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    config.moe_intermediate_size = meta("expert_feed_forward_length")
    if arch == "qwen3moe":
        config.norm_topk_prob = True  # llama.cpp renormalizes qwen3moe's top-k weights
        config.head_dim = meta("attention.key_length")
    if arch == "qwen2moe":
        config.shared_expert_intermediate_size = meta("expert_shared_feed_forward_length")
        config.norm_topk_prob = False
    config.tie_word_embeddings = tied_output
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config,
                                                 dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def hf_mixtral_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """A MixtralForCausalLM holding the file's weights, dequantized by gguf-py."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    reader = GGUFReader(path)

    def meta(key: str):
        return reader.fields[f"llama.{key}"].contents()

    w = {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors}
    n_layers, n_heads, n_kv = meta("block_count"), meta("attention.head_count"), meta(
        "attention.head_count_kv")
    n_experts = meta("expert_count")
    cfg = MixtralConfig(
        vocab_size=w["token_embd.weight"].shape[0], hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"), num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv, num_local_experts=n_experts,
        num_experts_per_tok=meta("expert_used_count"), rms_norm_eps=meta(
            "attention.layer_norm_rms_epsilon"), rope_theta=meta("rope.freq_base"),
        max_position_embeddings=meta("context_length"), tie_word_embeddings=False)
    model = MixtralForCausalLM(cfg).float().eval()
    unpermute = LlamaTensorProcessor()._reverse_permute_weights
    sd = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight":
          w["output_norm.weight"], "lm_head.weight": w["output.weight"]}
    for i in range(n_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        sd |= {
            h + "self_attn.q_proj.weight": unpermute(w[p + "attn_q.weight"], n_heads, n_heads),
            h + "self_attn.k_proj.weight": unpermute(w[p + "attn_k.weight"], n_heads, n_kv),
            h + "self_attn.v_proj.weight": w[p + "attn_v.weight"],
            h + "self_attn.o_proj.weight": w[p + "attn_output.weight"],
            h + "input_layernorm.weight": w[p + "attn_norm.weight"],
            h + "post_attention_layernorm.weight": w[p + "ffn_norm.weight"],
            h + "mlp.gate.weight": w[p + "ffn_gate_inp.weight"],
            h + "mlp.experts.gate_up_proj": torch.cat(
                [w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"]], dim=1),
            h + "mlp.experts.down_proj": w[p + "ffn_down_exps.weight"],
        }
    missing, unexpected = model.load_state_dict({k: torch.as_tensor(v) for k, v in sd.items()},
                                                strict=True)
    assert not missing and not unexpected
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def kl_per_position(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(P || Q) per row, from logits, in float64."""
    lp = torch.log_softmax(torch.from_numpy(p_logits).double(), -1)
    lq = torch.log_softmax(torch.from_numpy(q_logits).double(), -1)
    return (lp.exp() * (lp - lq)).sum(-1).numpy()


def hf_gpt_oss_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """A GptOssForCausalLM (HF's own gpt-oss: sinks, sliding windows, YaRN, clamped SwiGLU)
    holding the file's weights, dequantized by gguf-py. Its YaRN is told truncate=True: llama.cpp
    floors / ceils the corrected dims (ggml_rope_yarn_corr_dims), as HF does with truncate; the
    GGUF has no key for gpt-oss's own truncate=false, so neither llama.cpp nor Strata reads one."""
    from transformers import GptOssConfig, GptOssForCausalLM

    reader = GGUFReader(path)

    def meta(key: str):
        return reader.fields[f"gpt-oss.{key}"].contents()

    w = {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors}
    n_layers, n_experts = meta("block_count"), meta("expert_count")
    cfg = GptOssConfig(
        vocab_size=w["token_embd.weight"].shape[0], hidden_size=meta("embedding_length"),
        intermediate_size=meta("expert_feed_forward_length"), num_hidden_layers=n_layers,
        num_attention_heads=meta("attention.head_count"),
        num_key_value_heads=meta("attention.head_count_kv"), head_dim=meta("attention.key_length"),
        num_local_experts=n_experts, num_experts_per_tok=meta("expert_used_count"),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        sliding_window=meta("attention.sliding_window"),
        max_position_embeddings=meta("context_length"), tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": meta("rope.freq_base"),
                         "factor": meta("rope.scaling.factor"), "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": True,
                         "original_max_position_embeddings":
                             meta("rope.scaling.original_context_length")})
    cfg._attn_implementation = "eager"  # (sinks: eager or flex attention)
    model = GptOssForCausalLM(cfg).float().eval()

    def interleave(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:  # [..., 2F]: g, u, g, u..
        return torch.stack([g, u], dim=-1).flatten(-2)

    sd = {"model.embed_tokens.weight": w["token_embd.weight"], "model.norm.weight":
          w["output_norm.weight"], "lm_head.weight": w["output.weight"]}
    for i in range(n_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        sd |= {h + "input_layernorm.weight": w[p + "attn_norm.weight"],
               h + "post_attention_layernorm.weight": w[p + "post_attention_norm.weight"],
               h + "self_attn.sinks": w[p + "attn_sinks.weight"],
               h + "mlp.router.weight": w[p + "ffn_gate_inp.weight"],
               h + "mlp.router.bias": w[p + "ffn_gate_inp.bias"],
               h + "mlp.experts.gate_up_proj": interleave(
                   w[p + "ffn_gate_exps.weight"].transpose(1, 2),
                   w[p + "ffn_up_exps.weight"].transpose(1, 2)),  # [E, D, 2F]
               h + "mlp.experts.gate_up_proj_bias": interleave(w[p + "ffn_gate_exps.bias"],
                                                               w[p + "ffn_up_exps.bias"]),
               h + "mlp.experts.down_proj": w[p + "ffn_down_exps.weight"].transpose(1, 2),
               h + "mlp.experts.down_proj_bias": w[p + "ffn_down_exps.bias"]}
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
            sd |= {h + f"self_attn.{theirs}.weight": w[p + f"{ours}.weight"],
                   h + f"self_attn.{theirs}.bias": w[p + f"{ours}.bias"]}
    missing, unexpected = model.load_state_dict({k: v.contiguous() for k, v in sd.items()},
                                                strict=True)
    assert not missing and not unexpected
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()
