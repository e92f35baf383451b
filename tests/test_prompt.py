"""Prompt chunks and the streaming ring give the reference logits: any chunk size, any ring
budget from one expert up, streaming on or off, mixed packs, empty / one-slot / full caches."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from strata.cli.logits import compute_logits
from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.errors import StrataError

from hf_reference import kl_per_position

PROMPT = [int(x) for x in np.random.default_rng(0).integers(0, 1024, 70)]


def assert_same(ours: np.ndarray, ref: np.ndarray) -> None:
    assert ours.shape == ref.shape
    assert kl_per_position(ref, ours).max() < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


@pytest.fixture(scope="module")
def pack(synth):
    """IQ2_XS layers with an IQ1_M layer and a Q4_K layer: records of three sizes."""
    path = synth("qwen3moe", "IQ2_XS-MIX")  # 3 layers: IQ2_XS, Q4_K, IQ1_M
    ref = compute_logits(Engine.load(path, config=EngineConfig(prefill="off")), PROMPT)
    return path, ref


def engine(path, device="cpu", **kw) -> Engine:
    kw.setdefault("cpu_kernels", "torch")  # float32 CPU kernels: the reference's tolerance
    kw.setdefault("kernels", "exact")  # and float32-exact GPU kernels
    return Engine.load(path, config=EngineConfig(device=device, offload="on", debug=True, **kw))


# chunk sizes: one token at a time, an odd size, one that splits the prompt unevenly, whole
@pytest.mark.parametrize("chunk", ["1", "7", "64", "off"])
def test_chunk_sizes_equal_the_unchunked_reference(pack, chunk, device):
    path, ref = pack
    e = engine(path, device, prefill=chunk, expert_cache="5", stream_min=4)
    assert_same(compute_logits(e, PROMPT), ref)
    if chunk in ("7", "64", "off"):
        assert e.model.experts.ring.streamed_bytes > 0


def test_reference_path_chunks_too(pack):
    path, ref = pack
    assert_same(compute_logits(Engine.load(path, config=EngineConfig(prefill="7")), PROMPT), ref)


# ring budgets: below one expert (raised to the largest record), exactly one record of the largest
# layer (no double buffering in that layer), an odd size, large
@pytest.mark.parametrize("ring", ["min", "largest", "odd", "large"])
@pytest.mark.parametrize("cache", ["0", "1", "24"])
def test_ring_budgets_and_cache_sizes(pack, ring, cache, device, caplog):
    path, ref = pack
    probe = engine(path, expert_cache="0", miss="cpu")
    largest = max(lay.stride for lay in probe.model.experts.arena.layouts)
    size = {"min": 1000, "largest": largest, "odd": 2 * largest + 12345,
            "large": 64 * largest}[ring]
    with caplog.at_level(logging.WARNING, logger="strata.ring"):
        e = engine(path, device, ring_bytes=size, expert_cache=cache, prefill="16",
                   stream_min=2)
    assert e.model.experts.ring.nbytes == max(size, largest)
    if ring == "min":
        assert "raised to that" in caplog.text
    assert_same(compute_logits(e, PROMPT), ref)
    st = e.model.experts.stats
    assert (st.streamed.sum() > 0) == (cache != "24")
    assert st.cpu.sum() == 0  # every miss of a streamed chunk goes through the ring


@pytest.mark.parametrize("kernels", ["exact", "fused"])
def test_every_pass_streams_each_routed_expert_once(pack, device, kernels):
    """A prompt whose 70 tokens route to every expert of every layer, with no cache slots,
    streams every layer's experts once, whether the host reads the routing (the CPU, CUDA with
    exact kernels) or the ring streams every uncached expert with the routing on the device (CUDA,
    fused: the bank path); and the same again on a second pass after decode steps, as `strata
    bench` runs them."""
    import torch

    path, _ = pack
    e = engine(path, device, expert_cache="0", prefill="off", stream_min=2, kernels=kernels)
    ex, cfg = e.model.experts, e.config
    want = sum(cfg.n_experts * lay.nbytes for lay in ex.arena.layouts)
    for _ in range(2):
        kv = e.model.new_cache(len(PROMPT) + 4)
        before = ex.ring.streamed_bytes
        token = int(e.run_prompt(PROMPT, kv)[0].argmax())
        assert ex.ring.streamed_bytes - before == want, (device, kernels)
        for _ in range(4):
            token = int(e.model.decode(token, kv)[0].argmax())
        del kv
        if device == "cuda":
            torch.cuda.synchronize()


def test_ring_buffers_are_sized_per_layer(pack):
    path, _ = pack
    e = engine(path, expert_cache="0", stream_min=2)  # (on the CPU a ring only when asked for)
    ring, layouts = e.model.experts.ring, e.model.experts.arena.layouts
    assert len({lay.stride for lay in layouts}) == 3
    for lay in layouts:
        bufs = ring.buffers(lay)
        assert bufs.shape == (ring.nbytes // lay.stride, lay.stride) and bufs.shape[0] >= 1


def test_no_ring_on_the_cpu_unless_asked(pack):
    """On the CPU device, --stream-min and --ring-bytes left to auto: no ring in the plan or the
    executor, and --miss auto sends every miss of a prompt chunk to the CPU pool (a copy there
    would only move host memory for torch to dequantize); the logits are the reference's."""
    path, ref = pack
    e = engine(path, expert_cache="2", prefill="16")
    assert e.model.experts.ring is None and e.model.experts.planner.mode == "cpu"
    assert_same(compute_logits(e, PROMPT), ref)
    stats = e.model.experts.stats
    assert stats.cpu.sum() > 0 and stats.streamed.sum() == 0


def test_streaming_off_and_forced_on_agree(pack):
    path, ref = pack
    off = engine(path, expert_cache="3", prefill="16", stream_min=1 << 20, miss="cpu")
    on = engine(path, expert_cache="3", prefill="16", stream_min=1)
    assert_same(compute_logits(off, PROMPT), ref)
    assert_same(compute_logits(on, PROMPT), ref)
    assert off.model.experts.ring.streamed_bytes == 0 < on.model.experts.ring.streamed_bytes


def test_many_chunks_then_decode_equals_unchunked(pack):
    from strata.engine.sampling import SamplingParams

    path, _ = pack
    p = SamplingParams(temperature=0, max_tokens=8)
    whole = list(Engine.load(path, config=EngineConfig(prefill="off")).generate(PROMPT, p))
    chunked = list(engine(path, prefill="5", expert_cache="4", stream_min=3).generate(PROMPT, p))
    assert chunked == whole


@pytest.mark.parametrize("flag", ["0", "x", "auto:0"])
def test_bad_prefill_is_refused(pack, flag):
    e = Engine.load(pack[0], config=EngineConfig(prefill=flag))
    with pytest.raises(StrataError, match="--prefill"):
        e.prefill_chunk(10)


def test_check_command_passes_equal_and_fails_different(pack, capsys):
    from strata.cli.main import main

    path = str(pack[0])
    same = main(["check", path, "--b", "--offload on --prefill 7 --expert-cache 2 --stream-min 2"
                 " --cpu-kernels torch", "--prompt-len", "40"])
    out = capsys.readouterr().out
    assert same == 0, out
    assert "first token:" in out and "top-1 agree 100.0%" in out
    assert main(["check", path, "--b", "--bogus 3"]) == 2
    assert "not an engine flag" in capsys.readouterr().err
    pytest.importorskip("ggml", reason="ggml-python is not installed")
    # ggml's 8-bit activations are a real difference at a tight tolerance
    diff = main(["check", path, "--b", "--offload on --expert-cache 0 --miss cpu --cpu-kernels "
                 "ggml --stream-min 100000", "--prompt-len", "40", "--max-kl", "1e-9"])
    assert diff == 1


def test_check_compares_decode_steps(pack, capsys, device):
    """--decode N runs the last N tokens through the decode step (CUDA graphs on the GPU) and
    reports them apart; an impossible N is refused with exit code 2."""
    from strata.cli.main import main

    path = str(pack[0])
    flags = f"--device {device} --offload on --expert-cache 5 --cpu-kernels torch --kernels exact"
    assert main(["check", path, "--a", f"--device {device} --offload off", "--b", flags,
                 "--prompt-len", "24", "--decode", "10"]) == 0
    out = capsys.readouterr().out
    assert "10 decode steps: KL max" in out and "top-1 agree 100.0%" in out
    assert main(["check", path, "--b", flags, "--prompt-len", "24", "--decode", "24"]) == 2
    assert "--decode 24: give 0 .. 23" in capsys.readouterr().err


@pytest.mark.parametrize("tq,tk", [(5, 5), (7, 19), (64, 200)])
def test_bf16_chunk_attention_is_the_causal_attention_within_bf16_rounding(tq, tk, device):
    """The --kernels fused prompt attention (bf16 flash attention, queries aligned to the last
    keys) against the float32 reference, for a first chunk and later chunks, with GQA."""
    import torch

    from strata.model.layers import attention, attention_bf16

    g = torch.Generator().manual_seed(tq * 1000 + tk)
    q = torch.randn(tq, 8, 64, generator=g).to(device)
    k, v = (torch.randn(tk, 2, 64, generator=g).to(device) for _ in range(2))
    ref = attention(q, k, v, tk - tq)
    ours = attention_bf16(q, k, v)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert float((ours - ref).norm() / ref.norm()) < 1e-2
    if tq < tk:  # the first query sees keys 0 .. tk - tq only: a top-left mask would differ
        ahead = attention(q, k, v, 0)
        assert float((ours - ahead).norm() / ref.norm()) > 5e-2


def test_one_token_batched_attention_equals_each_sequence_alone(synth):
    """attention_last (batched decode on the float path: each cache in two batched matmuls) gives
    each sequence's attention() over its own keys, for caches of different lengths (1 included),
    with GQA; and the batched forward of three sequences gives each one's logits alone."""
    import numpy as np
    import torch

    from strata.model.layers import attention, attention_last

    g = torch.Generator().manual_seed(7)
    lengths = [1, 5, 17, 9]
    q = torch.randn(len(lengths), 8, 64, generator=g)
    keys = [torch.randn(n, 2, 64, generator=g) for n in lengths]
    values = [torch.randn(n, 2, 64, generator=g) for n in lengths]
    ours = attention_last(q, keys, values)
    for b, n in enumerate(lengths):
        ref = attention(q[b:b + 1], keys[b], values[b], n - 1)
        torch.testing.assert_close(ours[b:b + 1], ref, rtol=0, atol=2e-6)

    from strata.cli.logits import compute_logits
    from strata.engine.generator import Engine
    from strata.model.transformer import Segment

    engine = Engine.load(synth("qwen3moe", "Q4_K_M"))
    seqs = [[5, 9, 2, 7, 11, 3], [8, 1, 4], [3, 3, 6, 2, 9]]
    model = engine.model
    kvs = [model.new_cache(8) for _ in seqs]
    for s, kv in zip(seqs, kvs, strict=True):
        model.forward(torch.tensor(s[:-1]), [Segment(kv, len(s) - 1)])
    both = model.forward(torch.tensor([s[-1] for s in seqs]), [Segment(kv, 1) for kv in kvs])
    for j, s in enumerate(seqs):
        np.testing.assert_allclose(both[j].numpy(), compute_logits(engine, s)[-1], rtol=0,
                                   atol=1e-4)
