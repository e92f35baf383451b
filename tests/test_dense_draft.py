"""Dense models (qwen3, qwen2: every layer a dense FFN) as --draft beside a MoE target of the same
vocabulary (a Qwen3 0.6B drafting for Qwen3-30B-A3B): read as llama.cpp reads them (its logits),
refused as a model of their own, and exact as drafts (greedy output as without --spec)."""

from __future__ import annotations

import pytest

from strata.cli.logits import compute_logits
from strata.cli.main import main
from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.engine.sampling import SamplingParams
from strata.errors import UnsupportedError

from hf_reference import kl_per_position

TOKENS = [5, 311, 17, 902, 64, 64, 1000, 3, 250, 777, 41, 8]
DRAFT = EngineConfig(offload="off", beside_target=True)  # (as make_spec loads a draft)


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "llama"])
def test_dense_models_match_llama_cpp(synth, tmp_path, arch):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from dataclasses import replace

    from strata.synth.presets import get_preset
    from strata.synth.recipes import Recipe
    from strata.synth.writer import write_model

    from llama_worker import llama_scores

    if arch == "llama":  # (a dense Llama: the Mixtral-style preset without experts)
        path = tmp_path / "llama-dense.gguf"
        write_model(path, replace(get_preset("tiny", "llama"), n_experts=0, n_experts_used=0,
                                  d_expert=0), Recipe("F32"), 0)
    else:
        path = synth(arch, "F32")
    eng = Engine.load(path, config=DRAFT)
    assert eng.config.n_experts == 0 and eng.config.n_dense_lead == eng.config.n_layers
    ours = compute_logits(eng, TOKENS)
    theirs = llama_scores(path, [TOKENS])[0]
    assert kl_per_position(theirs, ours).max() < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_a_dense_model_alone_is_refused(synth, capsys):
    path = synth("qwen3", "Q4_K_M")
    with pytest.raises(UnsupportedError, match="run as a --draft only"):
        Engine.load(path)
    assert main(["generate", str(path), "--prompt", "hi", "-n", "2"]) == 2
    assert "run as a --draft only" in capsys.readouterr().err


@pytest.mark.parametrize("offload", ["off", "on"])
def test_a_dense_draft_is_exact(synth, offload):
    """A qwen3moe target with a dense qwen3 draft of its vocabulary (--spec 3): the greedy text
    is the target's own, through windows; the draft's plan counts its bytes."""
    from strata.engine.memory_plan import draft_bytes

    target, draft = synth("qwen3moe", "Q4_K_M"), synth("qwen3", "Q4_K_M")
    ec = EngineConfig(offload=offload)
    base = Engine.load(target, config=ec)
    prompt = base.tokenizer.encode("the dense draft", False)
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = list(base.generate(prompt, params))
    ec = EngineConfig(offload=offload, spec=3, draft=str(draft))
    eng = Engine.load(target, config=ec)
    eng.spec.timed = False
    assert eng.spec.drafter.name == "model"
    assert list(eng.generate(prompt, params)) == plain
    assert eng.stats.spec.windows > 0
    weights, kv = draft_bytes(ec)
    assert weights > 0 and kv > 0


@pytest.mark.cuda
def test_a_dense_draft_on_cuda_keeps_its_blocks_and_is_exact(synth):
    """On CUDA a draft's matrices stay in their GGUF blocks (the fused kernels read them); the
    greedy text is still the target's own."""
    from strata.model.weights import QuantTensor

    target, draft = synth("qwen3moe", "Q4_K_M"), synth("qwen3", "Q4_K_M")
    base = Engine.load(target, config=EngineConfig(device="cuda"))
    prompt = base.tokenizer.encode("the dense draft", False)
    params = SamplingParams(temperature=0, max_tokens=24)
    plain = list(base.generate(prompt, params))
    eng = Engine.load(target, config=EngineConfig(device="cuda", spec=3, draft=str(draft),
                                                  kernels="exact"))
    lw = eng.spec.drafter.engine.model.w.layers[0]
    assert isinstance(lw.ffn_gate, QuantTensor) and isinstance(lw.wo, QuantTensor)
    eng.spec.timed = False
    exact = Engine.load(target, config=EngineConfig(device="cuda", kernels="exact"))
    assert list(eng.generate(prompt, params)) == list(exact.generate(prompt, params))
    assert eng.stats.spec.windows > 0 and len(plain) == 24
