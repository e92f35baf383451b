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


def gguf_weights(path: Path) -> tuple[dict[str, torch.Tensor], callable]:
    """Every tensor of the file dequantized by gguf-py (float32), and meta(key) of its
    architecture's keys (None where absent)."""
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def meta(key: str):
        f = reader.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else None

    w = {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
         for t in reader.tensors}
    return w, meta


def grouped_moe_ffn(w: dict, p: str, h: str, dense: bool) -> dict:
    """glm4moe's and deepseek_v3's FFN of layer p (HF prefix h): the dense MLP of a leading
    dense layer, else the router with its score bias, the fused experts and the shared expert."""
    if dense:
        return {h + f"mlp.{n}_proj.weight": w[p + f"ffn_{n}.weight"]
                for n in ("gate", "up", "down")}
    return {
        h + "mlp.gate.weight": w[p + "ffn_gate_inp.weight"],
        h + "mlp.gate.e_score_correction_bias": w[p + "exp_probs_b.bias"],
        h + "mlp.experts.gate_up_proj": torch.cat(
            [w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"]], dim=1),
        h + "mlp.experts.down_proj": w[p + "ffn_down_exps.weight"],
    } | {h + f"mlp.shared_experts.{n}_proj.weight": w[p + f"ffn_{n}_shexp.weight"]
         for n in ("gate", "up", "down")}


def _run_with_score_bias(model, sd: dict, w: dict, routed, tokens: list[int]) -> np.ndarray:
    """Loads sd (every key but the score biases must land), copies each routed layer's score
    bias (a buffer: load_state_dict may skip it), and returns the logits of tokens."""
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert not [k for k in missing if "e_score_correction_bias" not in k], missing
    for i in routed:
        model.model.layers[i].mlp.gate.e_score_correction_bias.copy_(
            w[f"blk.{i}.exp_probs_b.bias"])
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def deepseek_rope_parameters(meta) -> dict:  # noqa: ANN001 (gguf_weights' meta)
    """transformers' rope_parameters of a deepseek2 file: YaRN with DeepSeek's mscale (the
    converter writes 0.1 * mscale_all_dim as yarn_log_multiplier) where the file has it."""
    params = {"rope_type": "default", "rope_theta": meta("rope.freq_base")}
    if meta("rope.scaling.type") == "yarn":
        mscale = meta("rope.scaling.yarn_log_multiplier") / 0.1
        params |= {"rope_type": "yarn", "factor": meta("rope.scaling.factor"),
                   "original_max_position_embeddings":
                       meta("rope.scaling.original_context_length"),
                   "mscale": mscale, "mscale_all_dim": mscale,
                   "beta_fast": meta("rope.scaling.yarn_beta_fast") or 32.0,
                   "beta_slow": meta("rope.scaling.yarn_beta_slow") or 1.0}
    return params


def hf_glm4moe_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """A Glm4MoeForCausalLM (transformers' glm4_moe) holding the file's weights, dequantized by
    gguf-py; the nextn layers are not part of its forward."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    w, meta = gguf_weights(path)
    n_nextn = meta("nextn_predict_layers") or 0
    n_layers = meta("block_count") - n_nextn
    head_dim, dense = meta("attention.key_length"), meta("leading_dense_block_count") or 0
    cfg = Glm4MoeConfig(
        vocab_size=w["token_embd.weight"].shape[0], hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"), num_hidden_layers=n_layers,
        num_attention_heads=meta("attention.head_count"),
        num_key_value_heads=meta("attention.head_count_kv"), head_dim=head_dim,
        max_position_embeddings=meta("context_length"),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        rope_parameters={"rope_type": "default", "rope_theta": meta("rope.freq_base"),
                         "partial_rotary_factor": meta("rope.dimension_count") / head_dim},
        attention_bias="blk.0.attn_q.bias" in w,
        moe_intermediate_size=meta("expert_feed_forward_length"),
        num_experts_per_tok=meta("expert_used_count"),
        n_shared_experts=meta("expert_shared_count"), n_routed_experts=meta("expert_count"),
        routed_scaling_factor=meta("expert_weights_scale"), first_k_dense_replace=dense,
        norm_topk_prob=bool(meta("expert_weights_norm")),
        use_qk_norm="blk.0.attn_q_norm.weight" in w, num_mtp_layers=n_nextn,
        tie_word_embeddings=False)
    model = Glm4MoeForCausalLM(cfg).float().eval()
    sd = {"model.embed_tokens.weight": w["token_embd.weight"],
          "model.norm.weight": w["output_norm.weight"], "lm_head.weight": w["output.weight"]}
    for i in range(n_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v"}
        for hf, gg in names.items():
            sd[h + hf + ".weight"] = w[p + gg + ".weight"]
            if p + gg + ".bias" in w:
                sd[h + hf + ".bias"] = w[p + gg + ".bias"]
        sd |= {h + "self_attn.o_proj.weight": w[p + "attn_output.weight"],
               h + "input_layernorm.weight": w[p + "attn_norm.weight"],
               h + "post_attention_layernorm.weight": w[p + "post_attention_norm.weight"]}
        if cfg.use_qk_norm:
            sd |= {h + "self_attn.q_norm.weight": w[p + "attn_q_norm.weight"],
                   h + "self_attn.k_norm.weight": w[p + "attn_k_norm.weight"]}
        sd |= grouped_moe_ffn(w, p, h, i < dense)
    return _run_with_score_bias(model, sd, w, range(dense, n_layers), tokens)


def hf_deepseek2_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """A DeepseekV3ForCausalLM (transformers' deepseek_v3) holding the file's weights,
    dequantized by gguf-py: kv_b_proj rebuilt from the split attn_k_b / attn_v_b, RoPE on
    adjacent pairs (rope_interleave), YaRN from the rope.scaling keys."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    w, meta = gguf_weights(path)
    n_layers, H = meta("block_count"), meta("attention.head_count")
    rope, kv_lora = meta("rope.dimension_count"), meta("attention.kv_lora_rank")
    d_k, d_v = meta("attention.key_length_mla"), meta("attention.value_length_mla")
    nope, dense = d_k - rope, meta("leading_dense_block_count") or 0
    rope_params = deepseek_rope_parameters(meta)
    cfg = DeepseekV3Config(
        vocab_size=w["token_embd.weight"].shape[0], hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        moe_intermediate_size=meta("expert_feed_forward_length"), num_hidden_layers=n_layers,
        num_attention_heads=H, num_key_value_heads=H,
        n_shared_experts=meta("expert_shared_count"), n_routed_experts=meta("expert_count"),
        routed_scaling_factor=meta("expert_weights_scale"), kv_lora_rank=kv_lora,
        q_lora_rank=meta("attention.q_lora_rank"), qk_rope_head_dim=rope, v_head_dim=d_v,
        qk_nope_head_dim=nope, n_group=meta("expert_group_count"),
        topk_group=meta("expert_group_used_count"),
        num_experts_per_tok=meta("expert_used_count"), first_k_dense_replace=dense,
        norm_topk_prob=bool(meta("expert_weights_norm")),
        max_position_embeddings=meta("context_length"),
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"), rope_parameters=rope_params,
        rope_interleave=True, tie_word_embeddings=False, num_mtp_layers=0)
    model = DeepseekV3ForCausalLM(cfg).float().eval()
    sd = {"model.embed_tokens.weight": w["token_embd.weight"],
          "model.norm.weight": w["output_norm.weight"], "lm_head.weight": w["output.weight"]}
    for i in range(n_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        k_b, v_b = w[p + "attn_k_b.weight"], w[p + "attn_v_b.weight"]  # [H, L, N], [H, V, L]
        sd |= {
            h + "self_attn.q_a_proj.weight": w[p + "attn_q_a.weight"],
            h + "self_attn.q_a_layernorm.weight": w[p + "attn_q_a_norm.weight"],
            h + "self_attn.q_b_proj.weight": w[p + "attn_q_b.weight"],
            h + "self_attn.kv_a_proj_with_mqa.weight": w[p + "attn_kv_a_mqa.weight"],
            h + "self_attn.kv_a_layernorm.weight": w[p + "attn_kv_a_norm.weight"],
            h + "self_attn.kv_b_proj.weight": torch.cat(
                [k_b.transpose(1, 2), v_b], dim=1).reshape(H * (nope + d_v), kv_lora),
            h + "self_attn.o_proj.weight": w[p + "attn_output.weight"],
            h + "input_layernorm.weight": w[p + "attn_norm.weight"],
            h + "post_attention_layernorm.weight": w[p + "ffn_norm.weight"],
        }
        sd |= grouped_moe_ffn(w, p, h, i < dense)
    return _run_with_score_bias(model, sd, w, range(dense, n_layers), tokens)


def hf_hybrid_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """transformers' Qwen3_5MoeForCausalLM (qwen35moe) or Qwen3NextForCausalLM (qwen3next) holding
    the file's weights, dequantized by gguf-py, with the converter's rewrites undone: norms less
    the 1 it adds (all but ssm_norm), A_log = log(-ssm_a), the conv's singleton dim, and for
    qwen35moe the value heads back from the tiled order to transformers' grouped one."""
    reader = GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()

    def meta(key: str, default=None):
        f = reader.fields.get(f"{arch}.{key}")
        return f.contents() if f is not None else default

    w = {t.name: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()) for t in reader.tensors}
    n_nextn = meta("nextn_predict_layers", 0)
    n_layers = meta("block_count") - n_nextn
    hd, dk = meta("attention.key_length"), meta("ssm.state_size")
    hk, hv = meta("ssm.group_count"), meta("ssm.time_step_rank")
    common = dict(
        vocab_size=w["token_embd.weight"].shape[0], hidden_size=meta("embedding_length"),
        num_hidden_layers=n_layers, num_attention_heads=meta("attention.head_count"),
        num_key_value_heads=meta("attention.head_count_kv"), head_dim=hd,
        rms_norm_eps=meta("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=meta("context_length"), tie_word_embeddings=False,
        linear_conv_kernel_dim=meta("ssm.conv_kernel"), linear_key_head_dim=dk,
        linear_value_head_dim=dk, linear_num_key_heads=hk, linear_num_value_heads=hv,
        moe_intermediate_size=meta("expert_feed_forward_length"),
        shared_expert_intermediate_size=meta("expert_shared_feed_forward_length"),
        num_experts=meta("expert_count"), num_experts_per_tok=meta("expert_used_count"),
        full_attention_interval=meta("full_attention_interval"))
    rope = dict(rope_type="default", rope_theta=meta("rope.freq_base"),
                partial_rotary_factor=meta("rope.dimension_count") / hd)
    if arch == "qwen35moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        sections = list(meta("rope.dimension_sections"))[:3]
        cfg = Qwen3_5MoeTextConfig(**common, rope_parameters=rope | {"mrope_section": sections,
                                                                     "mrope_interleaved": True})
        model = Qwen3_5MoeForCausalLM(cfg)
    else:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(**common, rope_parameters=rope, norm_topk_prob=True,
                              decoder_sparse_step=1)
        model = Qwen3NextForCausalLM(cfg)
    model = model.float().eval()
    r = hv // hk
    # transformers' value head g*r + i is the file's head i*Hk + g (qwen35moe's tiled order)
    heads = (torch.arange(r)[None, :] * hk + torch.arange(hk)[:, None]).flatten()
    rows = (heads[:, None] * dk + torch.arange(dk)).flatten()

    def grouped(x: torch.Tensor, dim: int = 0, per_head: int = dk) -> torch.Tensor:
        if arch != "qwen35moe":
            return x
        idx = heads if per_head == 1 else rows
        return x.index_select(dim, idx)

    sd = {"model.embed_tokens.weight": w["token_embd.weight"],
          "model.norm.weight": w["output_norm.weight"] - 1, "lm_head.weight": w["output.weight"]}
    for i in range(n_layers):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        sd |= {h + "input_layernorm.weight": w[p + "attn_norm.weight"] - 1,
               h + "post_attention_layernorm.weight": w[p + "post_attention_norm.weight"] - 1,
               h + "mlp.gate.weight": w[p + "ffn_gate_inp.weight"],
               h + "mlp.experts.gate_up_proj": torch.cat(
                   [w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"]], dim=1),
               h + "mlp.experts.down_proj": w[p + "ffn_down_exps.weight"],
               h + "mlp.shared_expert.gate_proj.weight": w[p + "ffn_gate_shexp.weight"],
               h + "mlp.shared_expert.up_proj.weight": w[p + "ffn_up_shexp.weight"],
               h + "mlp.shared_expert.down_proj.weight": w[p + "ffn_down_shexp.weight"],
               h + "mlp.shared_expert_gate.weight": w[p + "ffn_gate_inp_shexp.weight"][None]}
        if (i + 1) % meta("full_attention_interval") == 0:
            a = h + "self_attn."
            sd |= {a + "q_proj.weight": w[p + "attn_q.weight"],
                   a + "k_proj.weight": w[p + "attn_k.weight"],
                   a + "v_proj.weight": w[p + "attn_v.weight"],
                   a + "o_proj.weight": w[p + "attn_output.weight"],
                   a + "q_norm.weight": w[p + "attn_q_norm.weight"] - 1,
                   a + "k_norm.weight": w[p + "attn_k_norm.weight"] - 1}
            continue
        a, key = h + "linear_attn.", 2 * hk * dk
        conv = w[p + "ssm_conv1d.weight"]
        sd |= {a + "conv1d.weight": torch.cat([conv[:key], grouped(conv[key:])])[:, None],
               a + "dt_bias": grouped(w[p + "ssm_dt.bias"], per_head=1),
               a + "A_log": grouped(torch.log(-w[p + "ssm_a"]), per_head=1),
               a + "norm.weight": w[p + "ssm_norm.weight"],
               a + "out_proj.weight": grouped(w[p + "ssm_out.weight"], dim=1)}
        if arch == "qwen35moe":
            qkv = w[p + "attn_qkv.weight"]
            sd |= {a + "in_proj_qkv.weight": torch.cat([qkv[:key], grouped(qkv[key:])]),
                   a + "in_proj_z.weight": grouped(w[p + "attn_gate.weight"]),
                   a + "in_proj_b.weight": grouped(w[p + "ssm_beta.weight"], per_head=1),
                   a + "in_proj_a.weight": grouped(w[p + "ssm_alpha.weight"], per_head=1)}
        else:
            sd |= {a + "in_proj_qkvz.weight": w[p + "ssm_in.weight"],
                   a + "in_proj_ba.weight": w[p + "ssm_ba.weight"]}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()
