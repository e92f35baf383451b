"""--draft mtp: the file's MTP (nextn) head as the drafter (strata.model.mtp,
strata.engine.drafters.MTPDrafter): its logits against an independent computation from the
dequantized weights, and greedy output identical with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.config import EngineConfig
from strata.engine.drafters import MTPDrafter, NgramDrafter, make_drafter
from strata.engine.generator import Engine
from strata.engine.sampling import SamplingParams
from strata.errors import StrataError
from strata.gguf import open_model
from strata.model.transformer import Segment

from hf_reference import deepseek_rope_parameters, gguf_weights, grouped_moe_ffn

PATHS = {
    "reference": dict(offload="off"),
    "offload": dict(offload="on", expert_cache="0", miss="cpu"),
}


def load(path, spec: int = 0, draft: str = "auto", **kw) -> Engine:  # noqa: ANN001
    eng = Engine.load(path, config=EngineConfig(device="cpu", spec=spec, draft=draft, **kw))
    if eng.spec is not None:
        eng.spec.timed = False  # (acceptance alone turns windows off: counts are stable)
    return eng


def greedy(engine: Engine, text: str, n: int) -> list[int]:
    return list(engine.generate(engine.tokenizer.encode(text),
                                SamplingParams(temperature=0, max_tokens=n)))


@pytest.fixture(scope="session")
def nextn_file(synth, tmp_path_factory):
    """nextn_file(arch) -> a tiny file with one nextn layer / MTP block (deepseek2's tiny
    preset has none: written here with one, as a converter keeping DeepSeek-V3's would)."""
    from dataclasses import replace

    from strata.synth.presets import get_preset
    from strata.synth.recipes import Recipe
    from strata.synth.writer import write_model

    made = {}

    def make(arch: str, recipe: str = "Q4_K_M"):  # noqa: ANN202
        p = get_preset("tiny", arch)
        if p.n_nextn:
            return synth(arch, recipe)
        if (arch, recipe) not in made:
            out = tmp_path_factory.mktemp("nextn") / f"{arch}-{recipe}.gguf"
            write_model(out, replace(p, n_nextn=1), Recipe(recipe), 0)
            made[arch, recipe] = out
        return made[arch, recipe]

    return make


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ["glm4moe", "deepseek2", "qwen35moe"])
def test_greedy_same_with_mtp_drafts(nextn_file, arch, path):
    """A random MTP head rarely guesses right: what matters is that its drafts, accepted or
    not, leave greedy output as it is without --spec."""
    f = nextn_file(arch)
    plain = greedy(load(f, **PATHS[path]), "hello world", 32)
    for draft in ("mtp", "auto"):
        eng = load(f, spec=3, draft=draft, **PATHS[path])
        assert isinstance(eng.spec.drafter, MTPDrafter)
        assert greedy(eng, "hello world", 32) == plain
        assert eng.stats.spec.windows > 0 and eng.stats.spec.drafted > 0


def test_mtp_refusals_and_auto(synth):
    """auto: mtp where the file has a nextn layer that runs, else n-gram; mtp without nextn
    layers is refused in one line."""
    f = synth("qwen3moe", "Q4_K_M")
    with pytest.raises(StrataError, match="has no nextn layers"):
        make_drafter("mtp", open_model(f), "qwen3moe", None, load(f).model)
    assert isinstance(make_drafter("auto", open_model(f), "qwen3moe", None, load(f).model),
                      NgramDrafter)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _load_layer(layer, sd: dict, score_bias: torch.Tensor) -> None:  # noqa: ANN001 (an HF layer)
    """sd into the layer (every key but the router's score bias must land), then that bias (a
    buffer: load_state_dict may skip it)."""
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert not unexpected and not [k for k in missing if "e_score" not in k], missing
    layer.mlp.gate.e_score_correction_bias.copy_(score_bias)


def hf_glm4moe_nextn_logits(path, tokens: torch.Tensor, hidden: torch.Tensor):  # noqa: ANN001, ANN201
    """The MTP head from the dequantized weights: llama.cpp's recipe (build_mtp_tail) in plain
    float32 around transformers' own Glm4MoeDecoderLayer holding the nextn layer."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import (
        Glm4MoeDecoderLayer,
        Glm4MoeRotaryEmbedding,
    )

    w, meta = gguf_weights(path)
    n = meta("block_count") - meta("nextn_predict_layers")  # the nextn layer's index
    head_dim, eps = meta("attention.key_length"), meta("attention.layer_norm_rms_epsilon")
    cfg = Glm4MoeConfig(
        vocab_size=w["token_embd.weight"].shape[0], hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"), num_hidden_layers=n + 1,
        num_attention_heads=meta("attention.head_count"),
        num_key_value_heads=meta("attention.head_count_kv"), head_dim=head_dim,
        max_position_embeddings=meta("context_length"), rms_norm_eps=eps,
        rope_parameters={"rope_type": "default", "rope_theta": meta("rope.freq_base"),
                         "partial_rotary_factor": meta("rope.dimension_count") / head_dim},
        attention_bias=f"blk.{n}.attn_q.bias" in w,
        moe_intermediate_size=meta("expert_feed_forward_length"),
        num_experts_per_tok=meta("expert_used_count"),
        n_shared_experts=meta("expert_shared_count"), n_routed_experts=meta("expert_count"),
        routed_scaling_factor=meta("expert_weights_scale"),
        first_k_dense_replace=meta("leading_dense_block_count"),
        norm_topk_prob=bool(meta("expert_weights_norm")), use_qk_norm=True,
        tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    layer = Glm4MoeDecoderLayer(cfg, n).float().eval()
    p = f"blk.{n}."
    sd = {"self_attn.q_proj.weight": w[p + "attn_q.weight"],
          "self_attn.k_proj.weight": w[p + "attn_k.weight"],
          "self_attn.v_proj.weight": w[p + "attn_v.weight"],
          "self_attn.o_proj.weight": w[p + "attn_output.weight"],
          "self_attn.q_norm.weight": w[p + "attn_q_norm.weight"],
          "self_attn.k_norm.weight": w[p + "attn_k_norm.weight"],
          "input_layernorm.weight": w[p + "attn_norm.weight"],
          "post_attention_layernorm.weight": w[p + "post_attention_norm.weight"],
          } | grouped_moe_ffn(w, p, "", dense=False)
    if cfg.attention_bias:
        sd |= {f"self_attn.{k}_proj.bias": w[p + f"attn_{k}.bias"] for k in "qkv"}
    _load_layer(layer, sd, w[p + "exp_probs_b.bias"])
    t = tokens.shape[0]
    e = _rms(w["token_embd.weight"][tokens], w[p + "nextn.enorm.weight"], eps)
    h = _rms(hidden, w[p + "nextn.hnorm.weight"], eps)
    x = F.linear(torch.cat([e, h], -1), w[p + "nextn.eh_proj.weight"])[None]  # [1, t, D]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        rope = Glm4MoeRotaryEmbedding(cfg)(x, pos)
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        head = w.get(p + "nextn.shared_head_head.weight", w["output.weight"])
        return F.linear(_rms(out[0], w[p + "nextn.shared_head_norm.weight"], eps), head)


def test_glm4moe_mtp_logits_match_an_independent_computation(synth):
    f = synth("glm4moe", "Q8_0")
    eng = load(f)
    m = eng.model
    seen = []
    m.hidden_hook = lambda segments, hidden: seen.append(hidden.clone())
    tokens = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])
    m.forward(tokens, [Segment(m.new_cache(16), len(tokens))])
    m.hidden_hook = None
    hidden = seen[0][:-1]  # h_0 .. h_6 with tokens 1 .. 7
    from strata.model.mtp import MTPHead

    head = MTPHead(eng.config, m.w.nextn[0], m)
    kv = head.new_cache()
    logits, _ = head.forward(tokens[1:], hidden, kv)
    ref = hf_glm4moe_nextn_logits(f, tokens[1:], hidden)
    assert torch.allclose(logits, ref, atol=1e-3, rtol=1e-3), (logits - ref).abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).all()
    # one row at a time through the head's cache: the same logits (incremental = full)
    kv = head.new_cache()
    rows = torch.cat([head.forward(tokens[1 + i:2 + i], hidden[i:i + 1], kv)[0]
                      for i in range(len(tokens) - 1)])
    assert torch.allclose(rows, logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["glm4moe", "qwen35moe"])
def test_drafts_after_windows_equal_a_fresh_head(nextn_file, arch):
    """The drafter's bookkeeping across windows (rows kept, rejected and chained rows dropped):
    after a generation its next proposal equals a fresh head's over the whole context, fed the
    hidden states of one forward of the target over it."""
    f = nextn_file(arch)
    eng = load(f, spec=3, draft="mtp")
    ids = eng.tokenizer.encode("hello world")
    kv = eng.model.new_cache(64)
    out = list(eng.generate(ids, SamplingParams(temperature=0, max_tokens=20), kv))
    context = ids + out
    drafter = eng.spec.drafter
    assert kv.length == len(context) - 1 and eng.stats.spec.windows > 0
    got = drafter.propose(context, 3)
    m = eng.model
    seen = []
    m.hidden_hook = lambda segments, hidden: seen.append(hidden.clone())
    m.forward(torch.tensor(context[:-1]), [Segment(m.new_cache(64), len(context) - 1)])
    m.hidden_hook = drafter.see
    head = drafter.head
    hkv = head.new_cache()
    logits, h = head.forward(torch.tensor(context[1:]), seen[0], hkv)
    want = [int(logits[-1].argmax())]
    while len(want) < 3:
        logits, h = head.forward(torch.tensor(want[-1:]), h[-1:], hkv)
        want.append(int(logits[-1].argmax()))
    assert got == want


def _head_logits(w: dict, p: str, eps: float, layer, rope, tokens: torch.Tensor,  # noqa: ANN001
                 hidden: torch.Tensor, minus_one: bool = False, **kw) -> torch.Tensor:
    """llama.cpp's MTP recipe in float32 around a transformers decoder layer: x = eh_proj(
    [enorm(embed(t)); hnorm(h)]), the layer, the head norm, the head. minus_one: the layer's
    own norms are (1 + w) ones (qwen35moe: the file's norms hold w + 1, as its converter adds)."""
    t = tokens.shape[0]
    e = _rms(w["token_embd.weight"][tokens], w[p + "nextn.enorm.weight"], eps)
    h = _rms(hidden, w[p + "nextn.hnorm.weight"], eps)
    x = F.linear(torch.cat([e, h], -1), w[p + "nextn.eh_proj.weight"])[None]  # [1, t, D]
    pos = torch.arange(t)[None]
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=rope(x, pos),
                    **kw)
        out = out[0] if isinstance(out, tuple) else out
        head = w.get(p + "nextn.shared_head_head.weight", w["output.weight"])
        return F.linear(_rms(out[0], w[p + "nextn.shared_head_norm.weight"], eps), head)


def hf_deepseek2_nextn_logits(path, tokens: torch.Tensor, hidden: torch.Tensor):  # noqa: ANN001, ANN201
    """deepseek2's nextn layer in transformers' DeepseekV3DecoderLayer (MLA: kv_b_proj rebuilt
    from attn_k_b / attn_v_b, RoPE on adjacent pairs, YaRN from the file's keys)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RotaryEmbedding,
    )

    w, meta = gguf_weights(path)
    n = meta("block_count") - meta("nextn_predict_layers")
    H, rope, kv_lora = (meta("attention.head_count"), meta("rope.dimension_count"),
                        meta("attention.kv_lora_rank"))
    d_k, d_v = meta("attention.key_length_mla"), meta("attention.value_length_mla")
    eps = meta("attention.layer_norm_rms_epsilon")
    rope_params = deepseek_rope_parameters(meta)
    cfg = DeepseekV3Config(
        vocab_size=w["token_embd.weight"].shape[0], hidden_size=meta("embedding_length"),
        intermediate_size=meta("feed_forward_length"),
        moe_intermediate_size=meta("expert_feed_forward_length"), num_hidden_layers=n + 1,
        num_attention_heads=H, num_key_value_heads=H,
        n_shared_experts=meta("expert_shared_count"), n_routed_experts=meta("expert_count"),
        routed_scaling_factor=meta("expert_weights_scale"), kv_lora_rank=kv_lora,
        q_lora_rank=meta("attention.q_lora_rank"), qk_rope_head_dim=rope, v_head_dim=d_v,
        qk_nope_head_dim=d_k - rope, n_group=meta("expert_group_count"),
        topk_group=meta("expert_group_used_count"),
        num_experts_per_tok=meta("expert_used_count"),
        first_k_dense_replace=meta("leading_dense_block_count"),
        norm_topk_prob=bool(meta("expert_weights_norm")),
        max_position_embeddings=meta("context_length"), rms_norm_eps=eps,
        rope_parameters=rope_params, rope_interleave=True, tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    layer = DeepseekV3DecoderLayer(cfg, n).float().eval()
    p = f"blk.{n}."
    k_b, v_b = w[p + "attn_k_b.weight"], w[p + "attn_v_b.weight"]  # [H, L, N], [H, V, L]
    sd = {"self_attn.q_a_proj.weight": w[p + "attn_q_a.weight"],
          "self_attn.q_a_layernorm.weight": w[p + "attn_q_a_norm.weight"],
          "self_attn.q_b_proj.weight": w[p + "attn_q_b.weight"],
          "self_attn.kv_a_proj_with_mqa.weight": w[p + "attn_kv_a_mqa.weight"],
          "self_attn.kv_a_layernorm.weight": w[p + "attn_kv_a_norm.weight"],
          "self_attn.kv_b_proj.weight": torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(
              H * (d_k - rope + d_v), kv_lora),
          "self_attn.o_proj.weight": w[p + "attn_output.weight"],
          "input_layernorm.weight": w[p + "attn_norm.weight"],
          "post_attention_layernorm.weight": w[p + "ffn_norm.weight"],
          } | grouped_moe_ffn(w, p, "", dense=False)
    _load_layer(layer, sd, w[p + "exp_probs_b.bias"])
    return _head_logits(w, p, eps, layer, DeepseekV3RotaryEmbedding(cfg), tokens, hidden)


def hf_qwen35moe_mtp_logits(path, tokens: torch.Tensor, hidden: torch.Tensor):  # noqa: ANN001, ANN201
    """qwen35moe's MTP block in transformers' Qwen3_5MoeDecoderLayer (a full-attention layer:
    gated attention, routed experts and the gated shared expert; norms less the converter's 1)."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
        Qwen3_5MoeDecoderLayer,
        Qwen3_5MoeTextRotaryEmbedding,
    )

    w, meta = gguf_weights(path)
    n = meta("block_count") - meta("nextn_predict_layers")
    hd, eps = meta("attention.key_length"), meta("attention.layer_norm_rms_epsilon")
    interval = meta("full_attention_interval")
    types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=w["token_embd.weight"].shape[0], hidden_size=meta("embedding_length"),
        num_hidden_layers=n + 1, layer_types=[*types, "full_attention"],
        num_attention_heads=meta("attention.head_count"),
        num_key_value_heads=meta("attention.head_count_kv"), head_dim=hd, rms_norm_eps=eps,
        max_position_embeddings=meta("context_length"), tie_word_embeddings=False,
        linear_conv_kernel_dim=meta("ssm.conv_kernel"),
        linear_key_head_dim=meta("ssm.state_size"), linear_value_head_dim=meta("ssm.state_size"),
        linear_num_key_heads=meta("ssm.group_count"),
        linear_num_value_heads=meta("ssm.time_step_rank"),
        moe_intermediate_size=meta("expert_feed_forward_length"),
        shared_expert_intermediate_size=meta("expert_shared_feed_forward_length"),
        num_experts=meta("expert_count"), num_experts_per_tok=meta("expert_used_count"),
        full_attention_interval=interval,
        rope_parameters={"rope_type": "default", "rope_theta": meta("rope.freq_base"),
                         "partial_rotary_factor": meta("rope.dimension_count") / hd,
                         "mrope_section": list(meta("rope.dimension_sections"))[:3],
                         "mrope_interleaved": True})
    cfg._attn_implementation = "eager"
    layer = Qwen3_5MoeDecoderLayer(cfg, n).float().eval()
    p = f"blk.{n}."
    sd = {"input_layernorm.weight": w[p + "attn_norm.weight"] - 1,
          "post_attention_layernorm.weight": w[p + "post_attention_norm.weight"] - 1,
          "self_attn.q_proj.weight": w[p + "attn_q.weight"],
          "self_attn.k_proj.weight": w[p + "attn_k.weight"],
          "self_attn.v_proj.weight": w[p + "attn_v.weight"],
          "self_attn.o_proj.weight": w[p + "attn_output.weight"],
          "self_attn.q_norm.weight": w[p + "attn_q_norm.weight"] - 1,
          "self_attn.k_norm.weight": w[p + "attn_k_norm.weight"] - 1,
          "mlp.gate.weight": w[p + "ffn_gate_inp.weight"],
          "mlp.experts.gate_up_proj": torch.cat([w[p + "ffn_gate_exps.weight"],
                                                 w[p + "ffn_up_exps.weight"]], dim=1),
          "mlp.experts.down_proj": w[p + "ffn_down_exps.weight"],
          "mlp.shared_expert.gate_proj.weight": w[p + "ffn_gate_shexp.weight"],
          "mlp.shared_expert.up_proj.weight": w[p + "ffn_up_shexp.weight"],
          "mlp.shared_expert.down_proj.weight": w[p + "ffn_down_shexp.weight"],
          "mlp.shared_expert_gate.weight": w[p + "ffn_gate_inp_shexp.weight"][None]}
    missing, unexpected = layer.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return _head_logits(w, p, eps, layer, Qwen3_5MoeTextRotaryEmbedding(cfg), tokens, hidden)


@pytest.mark.parametrize("arch,reference", [("deepseek2", hf_deepseek2_nextn_logits),
                                            ("qwen35moe", hf_qwen35moe_mtp_logits)])
def test_mtp_logits_match_transformers_layers(nextn_file, arch, reference):
    f = nextn_file(arch, "Q8_0")
    eng = load(f)
    m = eng.model
    seen = []
    m.hidden_hook = lambda segments, hidden: seen.append(hidden.clone())
    tokens = torch.tensor([3, 14, 15, 92, 65, 35, 89, 79])
    m.forward(tokens, [Segment(m.new_cache(16), len(tokens))])
    m.hidden_hook = None
    from strata.model.mtp import mtp_head

    head = mtp_head(m)
    logits, _ = head.forward(tokens[1:], seen[0][:-1], head.new_cache())
    ref = reference(f, tokens[1:], seen[0][:-1])
    assert torch.allclose(logits, ref, atol=1e-3, rtol=1e-3), (logits - ref).abs().max()
    assert (logits.argmax(-1) == ref.argmax(-1)).all()


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["glm4moe", "qwen35moe"])
def test_greedy_same_with_mtp_drafts_cuda(nextn_file, arch):
    """CUDA, the offload runtime with the decode step's graphs: the plain steps between MTP
    windows run the forward (the hidden states), the windows roll back."""
    f = nextn_file(arch)
    kw = dict(device="cuda", offload="on", expert_cache="2", kernels="exact")
    plain = list(Engine.load(f, config=EngineConfig(**kw)).generate(
        [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=32)))
    eng = Engine.load(f, config=EngineConfig(spec=3, draft="mtp", **kw))
    assert isinstance(eng.spec.drafter, MTPDrafter)
    assert list(eng.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=32))) == plain
    assert eng.stats.spec.drafted > 0


def test_plan_counts_the_head(nextn_file):
    """--spec with --draft mtp / auto: the plan counts the head's dense tensors on the device
    (float32); its routed experts stay on the host."""
    from strata.config import ModelConfig
    from strata.engine.memory_plan import make_plan, mtp_head_bytes
    from strata.experts.layout import expert_layouts

    mf = open_model(nextn_file("qwen35moe"))
    cfg = ModelConfig.from_model(mf)
    layouts = expert_layouts(mf, cfg)
    head = mtp_head_bytes(mf, cfg, EngineConfig(spec=3, draft="mtp"))
    D = cfg.d_model
    assert head > 4 * 2 * D * D  # eh_proj at least
    assert mtp_head_bytes(mf, cfg, EngineConfig(spec=3, draft="ngram")) == 0
    plans = [make_plan(mf, cfg, EngineConfig(ctx=256, offload="on", **kw), layouts)
             for kw in ({}, dict(spec=3, draft="mtp"))]
    assert plans[1].dense - plans[0].dense == head
