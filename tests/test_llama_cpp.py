"""llama.cpp (through llama-cpp-python, where installed) reads the synthetic files unchanged, and
its logits agree with Strata's reference path.

With F32 weights llama.cpp computes in float32 too, so the agreement is tight. With quantized
weights llama.cpp quantizes activations to 8 bits inside its dot products, which moves logits by
a few hundredths (KL ~1e-2 measured); the test checks that scale, which a wrong RoPE, norm or
routing rule would exceed by orders of magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata.cli.logits import compute_logits
from strata.engine.generator import Engine

from hf_reference import kl_per_position
from llama_worker import llama_scores

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")

TOKENS = [5, 311, 17, 902, 64, 64, 1000, 3, 250, 777, 41, 8]


def llama_logits(path, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits of `tokens`, in a process of its own (llama_worker says why)."""
    return llama_scores(path, [tokens])[0]


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama"])
def test_float_weights_match_llama_cpp(synth, arch):
    path = synth(arch, "F32")
    ours = compute_logits(Engine.load(path), TOKENS)
    theirs = llama_logits(path, TOKENS)
    assert kl_per_position(theirs, ours).max() < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("arch,recipe", [("qwen3moe", "Q4_K_M"), ("qwen3moe", "IQ2_XS-MIX"),
                                         ("qwen2moe", "Q8_0"), ("llama", "Q4_K_M")])
def test_quantized_files_load_and_agree_with_llama_cpp(synth, arch, recipe):
    path = synth(arch, recipe)
    ours = compute_logits(Engine.load(path), TOKENS)
    theirs = llama_logits(path, TOKENS)
    kl = kl_per_position(theirs, ours)
    assert kl.mean() < 2e-2 and kl.max() < 1e-1, kl
    assert (ours.argmax(-1) == theirs.argmax(-1)).mean() >= 0.75
