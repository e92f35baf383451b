"""RoPE scaling read from any architecture's rope.scaling keys (yarn, linear), as llama.cpp reads
them: the reference path against llama.cpp's logits, and the fused paths (the decode step, the
batched step), which take YaRN's q/k scale outside the frequency table, against the reference."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_batched_step import PROMPTS, STEPS, alone, assert_close, batched, pool_for
from test_decode_step import forward_then_decode
from test_offload import offload

from strata.cli.logits import compute_logits
from strata.config import ModelConfig
from strata.engine.batch_step import BatchStep
from strata.engine.generator import Engine
from strata.errors import UnsupportedError
from strata.gguf import open_model
from strata.synth.presets import get_preset
from strata.synth.recipes import Recipe
from strata.synth.writer import write_model

from gguf_edit import rewrite
from hf_reference import kl_per_position

TOKENS = [5, 311, 17, 902, 64, 64, 1000, 3, 250, 777, 41, 8, 19, 600, 2, 77]


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """scaled(arch, kind, recipe) -> a tiny file with RoPE scaling `kind` (yarn, linear; factor
    4 over an original context of 8 tokens) or none."""
    root, made = tmp_path_factory.mktemp("rope"), {}

    def make(arch: str, kind: str, recipe: str = "F32"):
        key = (arch, kind, recipe)
        if key not in made:
            p = get_preset("tiny", arch)
            if kind != "none":
                p = replace(p, yarn_factor=4.0, yarn_orig_ctx=8, rope_scaling=kind)
            made[key] = root / f"{arch}-{kind}-{recipe}.gguf"
            write_model(made[key], p, Recipe(recipe), 3)
        return made[key]

    return make


def test_config_reads_yarn_and_linear(scaled):
    y = ModelConfig.from_model(open_model(scaled("qwen3moe", "yarn"))).yarn
    assert (y.factor, y.orig_ctx, y.ext_factor, y.beta_fast, y.beta_slow) == (4.0, 8, 1.0, 32, 1)
    lin = ModelConfig.from_model(open_model(scaled("qwen2moe", "linear"))).yarn
    assert (lin.factor, lin.ext_factor) == (4.0, 0.0)
    assert ModelConfig.from_model(open_model(scaled("qwen3moe", "none"))).yarn is None


def test_unknown_scaling_is_refused_by_key(scaled, tmp_path):
    bad = rewrite(scaled("qwen3moe", "yarn"), tmp_path / "longrope.gguf",
                  {"qwen3moe.rope.scaling.type": "longrope"})
    with pytest.raises(UnsupportedError, match=r"qwen3moe\.rope\.scaling\.type is 'longrope'"):
        ModelConfig.from_model(open_model(bad))


llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")


# qwen3moe: q/k norms (YaRN's scale goes into their weights on the fused paths); qwen2moe: none
# (onto q and k); llama: adjacent pairs
@pytest.mark.parametrize(("arch", "kind"), [("qwen3moe", "yarn"), ("qwen2moe", "yarn"),
                                            ("qwen3moe", "linear"), ("llama", "yarn")])
def test_reference_matches_llama_cpp(scaled, arch, kind):
    from llama_worker import llama_scores

    path = scaled(arch, kind)
    ours = compute_logits(Engine.load(path), TOKENS)
    theirs = llama_scores(path, [TOKENS])[0]
    assert kl_per_position(theirs, ours).max() < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()
    # (the same weights without the scaling give other logits: the keys are read)
    plain = compute_logits(Engine.load(scaled(arch, "none")), TOKENS)
    assert kl_per_position(theirs, plain).max() > 1e-3


@pytest.mark.parametrize(("arch", "kind"), [("qwen3moe", "yarn"), ("qwen2moe", "yarn"),
                                            ("gpt-oss", "yarn")])
def test_decode_and_batched_steps_give_reference_logits(scaled, arch, kind):
    """The decode step (eager on the CPU: the fused kernels' torch forms, RoPE from the YaRN
    frequency table, the q/k scale outside it) continues a prompt as the reference forward
    does, and the batched step gives each sequence its logits alone."""
    path = scaled(arch, kind, "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)
    engine = offload(path, expert_cache="0", miss="cpu")
    model = engine.model
    assert model.step is not None and model.cfg.yarn is not None
    ours = forward_then_decode(model, TOKENS, 6)
    assert kl_per_position(ref, ours).max() < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    step = BatchStep(model, pool_for(engine, 4, block=3), "eager")
    fed, logits = batched(engine, step, PROMPTS[:3], STEPS)
    for p, f, got in zip(PROMPTS[:3], fed, logits, strict=True):
        assert_close(got, alone(engine, p, f))
    assert np.isfinite(ours).all()
