"""Checks the architecture test files (test_arch_glm4moe, test_arch_deepseek2) run alike, each
on its own tiny model: transformers' model of the file, llama.cpp on the f16 and the quantized
file, the offload paths and the streamed prompt against the reference, the decode step's
graphs on CUDA, `strata check`, the file's chat template with `strata generate --chat`."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import numpy as np
from test_decode_step import PROMPT, decoded_logits
from test_offload import TOKENS, assert_same, offload

from strata.cli.logits import compute_logits
from strata.cli.main import main
from strata.engine.generator import Engine

from hf_reference import kl_per_position


@cache
def _reference(path: Path) -> np.ndarray:
    return compute_logits(Engine.load(path), TOKENS)


def reference_logits(path: Path) -> np.ndarray:
    """The float32 reference path's logits of TOKENS for the file (computed once a file; a
    copy each call)."""
    return _reference(path).copy()


def check_matches_transformers(path: Path, hf_logits) -> None:
    """The reference path against hf_logits(path, tokens), transformers' model of the file."""
    ours = reference_logits(path)
    theirs = hf_logits(path, TOKENS)
    assert kl_per_position(theirs, ours).max() < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def check_f16_matches_llama_cpp(path: Path) -> None:
    from test_llama_cpp import llama_logits

    ours = reference_logits(path)
    theirs = llama_logits(path, TOKENS)
    assert kl_per_position(theirs, ours).max() < 1e-3
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def check_quantized_agrees_with_llama_cpp(path: Path) -> None:
    from test_llama_cpp import llama_logits

    kl = kl_per_position(llama_logits(path, TOKENS), reference_logits(path))
    assert kl.mean() < 2e-2 and kl.max() < 1e-1, kl


def check_offload_paths(path: Path, device: str, cache: str, miss: str,
                        routed_layers: int) -> Engine:
    """The offload runtime (misses on the CPU or copied) gives the reference logits, and every
    routed pair (two a token in each of the routed_layers) was a hit, a CPU miss or a streamed
    one. Returns the engine."""
    engine = offload(path, device, expert_cache=cache, miss=miss, stream_min=1 << 20)
    assert_same(compute_logits(engine, TOKENS), reference_logits(path))
    st = engine.model.experts.stats
    assert engine.config.n_layers - engine.config.n_dense_lead == routed_layers
    assert st.hits.sum() + st.cpu.sum() + st.streamed.sum() == len(TOKENS) * routed_layers * 2
    return engine


def check_streamed_prompt(path: Path, device: str) -> None:
    engine = offload(path, device, expert_cache="3", stream_min=2)
    assert_same(compute_logits(engine, TOKENS), reference_logits(path))


def check_decode_graphs_on_cuda(path: Path) -> tuple[Engine, np.ndarray]:
    """The decode step captured as graphs and replayed gives the reference logits. Returns the
    engine and the reference's decoded positions."""
    ref = reference_logits(path)[PROMPT:]
    engine = offload(path, "cuda", expert_cache="16", kernels="fused")
    step = engine.model.step
    assert_same(decoded_logits(engine, TOKENS), ref)
    assert step.graphs and not step._failed and step.steps["replayed"] > 0
    return engine, ref


def check_command_passes(path: Path, capsys) -> None:
    """strata check (routing recorded on A, pinned on B: the pin's weights follow the
    architecture's gating) with the offload paths as B."""
    same = main(["check", str(path), "--b", "--offload on --prefill 5 --expert-cache 3 "
                 "--stream-min 2 --cpu-kernels torch", "--prompt-len", "20"])
    out = capsys.readouterr().out
    assert same == 0, out
    assert "top-1 agree 100.0%" in out
    pinned = re.search(r"routing pinned to A: KL max (\S+)", out)
    assert pinned and float(pinned[1]) < 1e-4, out


def check_chat_and_generate(path: Path, capsys) -> None:
    """The file's own chat template renders, and `strata generate --chat` runs end to end on
    the offload runtime (prompt chunks, then decode steps)."""
    engine = Engine.load(path)
    text = engine.chat.render([{"role": "user", "content": "Hello there"}])
    assert "Hello there" in text and engine.chat.encode([{"role": "user", "content": "Hi"}])
    assert main(["generate", str(path), "--chat", "Hi", "--max-tokens", "6", "--temperature",
                 "0", "--offload", "on", "--cpu-kernels", "torch"]) == 0
    assert capsys.readouterr().out.strip()
