"""Checks the architecture test files (test_arch_glm4moe, test_arch_deepseek2) run alike, each
on its own tiny model: transformers' model of the file, llama.cpp on the f16 and the quantized
file, the offload paths and the streamed prompt against the reference, the decode step's
graphs on CUDA, `strata check`, the file's chat template with `strata generate --chat`."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import numpy as np
from test_decode_step import PROMPT, assert_within_x8_rounding, decoded_logits
from test_offload import TOKENS, assert_same, offload

from strata.cli.logits import compute_logits
from strata.cli.main import main
from strata.config import EngineConfig
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
    engine and the reference's decoded positions. --kernels exact: the graphs hold the fused
    one-token kernels on float32 activations (--kernels fused rounds them to 8 bits, which
    moves these logits by a KL of ~5e-4: check_fused_decode_within_x8_rounding)."""
    ref = reference_logits(path)[PROMPT:]
    engine = offload(path, "cuda", expert_cache="16", kernels="exact")
    step = engine.model.step
    assert_same(decoded_logits(engine, TOKENS), ref)
    assert step.graphs and not step._failed and step.steps["replayed"] > 0
    return engine, ref


def check_fused_decode_within_x8_rounding(path: Path) -> None:
    """--kernels fused decode steps round the experts' activations to 8 bits (moe_forward x8,
    as test_decode_step's qwen3moe check): the logits move by that rounding (KL within 2e-3,
    top-1 mostly kept), not more, and they do move (the path runs); with x8 off the plain
    forward of the same engine gives the reference's."""
    assert_within_x8_rounding(offload(path, "cuda", expert_cache="16", kernels="fused"), path)


def exact_engine(path: Path, device: str) -> Engine:
    """The engine of `device` with --kernels exact: float32 on every path. (On CUDA the default
    --kernels fused runs prompt chunks of more than 4 tokens on bf16 tensor cores and one-token
    experts on 8-bit activations, so a chunk and the same tokens one at a time differ by those
    roundings; on the CPU the flag changes nothing.)"""
    return Engine.load(path, config=EngineConfig(device=device, kernels="exact"))


# The one-token paths of the offload runtime with every expert resident, on the fused MoE
# kernels (moe_forward: gate/up per pair scaled by the routing weight, down, the K rows summed)
# run by Triton's interpreter on the CPU device: prompt chunks of at most 4 tokens and single
# tokens, through sigmoid routing with a selection bias, groups (deepseek2) and the routed scale,
# a dense first layer and the shared expert, give the reference logits; with x8 (--kernels
# fused) they move by the 8-bit rounding only (interpreted.py's prelude defines seed).
FUSED_ONE_TOKEN_INTERPRETED = """
    import tempfile
    from pathlib import Path
    import torch
    import strata.experts.gpu_hits as gpu_hits
    import strata.kernels.gpu.moe as moe
    from strata.cli.logits import compute_logits
    from strata.config import EngineConfig
    from strata.engine.generator import Engine
    from strata.model.parts import Segment
    from strata.synth.presets import get_preset
    from strata.synth.recipes import Recipe
    from strata.synth.writer import write_model

    gpu_hits.fused_kernels_available = lambda device: True  # (the CPU device, interpreted)
    # wider tiles than CUDA's (BN 1 for gate/up): the same sums in 64x fewer programs, which
    # the interpreter runs one at a time
    moe.GATE_UP_TILE, moe.DOWN_TILE = (64, 256, 1, 4), (64, 256, 1, 4)
    moe.GATE_UP_Q8_TILE, moe.DOWN_Q8_TILE, moe.DOWN_Q6K_Q8_TILE = (64, 8, 1), (64, 4, 1), (
        64, 4, 1)
    launches = []
    decode = moe._decode
    moe._decode = lambda *a, **kw: launches.append(a[0].shape[0]) or decode(*a, **kw)
    tokens = [5, 311, 17, 902, 64]  # (a 4-token chunk, then a decode step)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.gguf"
        write_model(path, get_preset("tiny", ARCH), Recipe("Q4_K_M"), 0)
        ref = compute_logits(Engine.load(path), tokens)
        engine = Engine.load(path, config=EngineConfig(
            offload="on", kernels="exact", cpu_kernels="torch", expert_cache="16",
            decode_step="off"))
        assert engine.model.experts.fused.on and not engine.model.experts.fused.x8

        def run():
            kv = engine.model.new_cache(len(tokens))
            steps = [engine.model.forward(torch.tensor(tokens[:4]), [Segment(kv, 4)],
                                          all_logits=True)]
            for t in tokens[4:]:
                steps.append(engine.model.forward(torch.tensor([t]), [Segment(kv, 1)],
                                                  all_logits=True))
            return torch.cat(steps).numpy()

        ours = run()
        routed = engine.config.n_layers - engine.config.n_dense_lead
        assert launches == [4] * routed + [1] * routed * (len(tokens) - 4), launches
        diff = float(np.abs(ours - ref).max())
        assert diff < 2e-4, diff
        # --kernels fused's 8-bit activations (moe_forward x8): the logits move by that
        # rounding (up to ~0.15 here, KL ~5e-4: more than float32 checks allow), not more
        engine.model.experts.fused.x8 = True
        x8 = run()
    lp, lq = (torch.log_softmax(torch.from_numpy(a).double(), -1) for a in (ref, x8))
    kl = (lp.exp() * (lp - lq)).sum(-1)
    assert 1e-7 < float(kl.max()) < 2e-3, kl
    assert (x8.argmax(-1) == ref.argmax(-1)).all()
    print("ok")
"""


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
