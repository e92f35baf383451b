"""--kv-type q8_0: keys and values in 8-bit blocks of 32 with a float16 scale, exactly llama.cpp's
q8_0 (checked against gguf's own quantizer), the cache's bookkeeping, the decode kernels' q8_0
reads and writes (torch path, and the Triton kernels under the interpreter), the plan's bytes,
and the error it brings to a model's logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from strata.config import EngineConfig, ModelConfig, kv_bytes, kv_elem_bytes
from strata.engine.generator import Engine
from strata.errors import StrataError
from strata.model.parts import Segment
from strata.runtime.kv_cache import (
    KVCache,
    KVPool,
    dequantize_q8_0,
    quantize_q8_0,
)


def test_quantizer_is_ggufs_q8_0_bit_for_bit() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 3, 128, generator=gen) * torch.logspace(-3, 3, 128)
    x[0, 0, :32] = 0  # an all-zero block: scale 0, values 0
    x[1, 1, 5] = 1e4  # one large element dominates its block
    x[2, 2, 32:64] = 0.5 * torch.arange(-16, 16) / 127  # halves: rounded away from zero
    q, d = quantize_q8_0(x)
    raw = quantize(x.numpy().reshape(-1, 128), GGMLQuantizationType.Q8_0).reshape(-1, 34)
    assert np.array_equal(d.numpy().reshape(-1), raw[:, :2].copy().view(np.float16).ravel())
    assert np.array_equal(q.numpy().reshape(-1), raw[:, 2:].copy().view(np.int8).ravel())
    back = dequantize_q8_0(q, d)
    # each element within half a step of its block's scale, plus the float16 scale's rounding
    # (2^-11 of it) times the largest value, 127
    step = d.float().repeat_interleave(32, -1)
    assert ((back - x).abs() <= step * (0.5 + 127 * 2**-11) * (1 + 1e-3)).all()
    assert ((back - x).abs() > 0.45 * step).any()  # (the bound is not loose)


def test_cache_appends_grows_and_pools() -> None:
    gen = torch.Generator().manual_seed(1)
    pool = KVPool()
    kv = KVCache(2, 2, 64, torch.device("cpu"), capacity=4, pool=pool, dtype=torch.int8)
    assert kv.quantized and kv.scales.shape == (2, 2, 4, 2, 2)
    assert kv.nbytes == 2 * 2 * 4 * 2 * 64 * 34 // 32
    rows = [torch.randn(3, 2, 64, generator=gen) for _ in range(4)]
    keys, values = kv.append(0, rows[0], rows[1])
    kv.append(1, rows[2], rows[3])
    kv.advance(3)
    assert keys.dtype == torch.float32 and keys.shape == (3, 2, 64)
    assert torch.equal(keys, dequantize_q8_0(*quantize_q8_0(rows[0])))
    assert kv.append(0, rows[0][:1], rows[1][:1], read=False) == (None, None)
    more = torch.randn(4, 2, 64, generator=gen)
    keys, _ = kv.append(1, more, more)  # past the capacity: the storage and scales double
    assert kv.capacity >= 7 and kv.scales.shape[2] == kv.capacity
    assert torch.equal(keys[:3], dequantize_q8_0(*quantize_q8_0(rows[2])))
    assert torch.equal(keys[3:], dequantize_q8_0(*quantize_q8_0(more)))
    store = kv.store
    del kv  # both tensors back to the pool
    assert sum(t is store for t in pool.free) == 1 and len(pool.free) == 2 + 2  # (and the old)
    with pytest.raises(StrataError, match="head dimension 48 is not a multiple of 32"):
        KVCache(1, 1, 48, torch.device("cpu"), dtype=torch.int8)


def test_plan_counts_34_bytes_a_block(synth) -> None:
    from strata.gguf import open_model

    cfg = ModelConfig.from_model(open_model(synth("qwen3moe", "Q4_K_M")))
    assert kv_elem_bytes("q8_0") == 34 / 32 and kv_elem_bytes("f16") == 2
    assert kv_bytes(cfg, 1024, "q8_0") * 32 == kv_bytes(cfg, 1024, "f16") * 17
    engine = Engine.load(synth("qwen3moe", "Q4_K_M"),
                         config=EngineConfig(kv_type="q8_0", offload="on", ctx=512))
    kv = engine.model.new_cache(512)
    assert kv.quantized and kv.nbytes == kv_bytes(cfg, 512, "q8_0")


def test_latent_caches_refuse_q8_0(synth) -> None:
    with pytest.raises(StrataError, match="--kv-type q8_0: deepseek2's latent cache"):
        Engine.load(synth("deepseek2", "Q4_K_M"), config=EngineConfig(kv_type="q8_0"))


def _logits(engine: Engine, ids: list[int], decode: int) -> torch.Tensor:
    """The prompt's logits, then `decode` more tokens fed one at a time (the prompt's ids again)."""
    m = engine.model
    kv = m.new_cache(64)
    out = [m.forward(torch.tensor(ids), [Segment(kv, len(ids))], all_logits=True)]
    for t in ids[:decode]:
        out.append(m.decode(t, kv).clone())  # (a static buffer with a decode step)
    return torch.cat(out).double()


def test_q8_0_cache_moves_the_logits_within_its_bound() -> None:
    """The trained demo model on real text, the reference path with each KV type against
    float32, prompt and decode: q8_0 max KL < 1e-3 (measured 4.1e-4), f16 < 1e-4 (1.6e-5), the
    same top token at every position. (A random model's routing flips on such changes: its
    KL says nothing.)"""
    from strata.demo import demo_model

    runs = {}
    for t in ("f32", "f16", "q8_0"):
        e = Engine.load(demo_model(), config=EngineConfig(kv_type=t, offload="off"))
        ids = e.tokenizer.encode("The Linux kernel schedules processes by their priority, and "
                                 "the scheduler picks the next task to run when")
        runs[t] = _logits(e, ids, 16)
    lp = torch.log_softmax(runs["f32"], -1)
    kl = {}
    for t in ("f16", "q8_0"):
        lq = torch.log_softmax(runs[t], -1)
        kl[t] = float((lp.exp() * (lp - lq)).sum(-1).max())
        assert torch.equal(runs[t].argmax(-1), runs["f32"].argmax(-1)), t
    assert kl["q8_0"] < 1e-3 and kl["f16"] < 1e-4 and kl["q8_0"] > kl["f16"], kl


def test_decode_ops_torch_path_reads_and_writes_q8_0() -> None:
    """qk_rope_store into an int8 cache writes quantize_q8_0 of the rotated keys and the values;
    decode_attention over it is attention over the dequantized rows."""
    from strata.kernels import torch_ops as layers
    from strata.kernels.gpu import decode_ops as ops

    gen = torch.Generator().manual_seed(4)
    t, h, hkv, hd, cap, p = 2, 4, 2, 64, 40, 17
    q, k, v = (torch.randn(t, n, hd, generator=gen) for n in (h, hkv, hkv))
    kc, vc = (torch.zeros(cap, hkv, hd, dtype=torch.int8) for _ in range(2))
    ks, vs = (torch.zeros(cap, hkv, hd // 32, dtype=torch.float16) for _ in range(2))
    pos, inv = torch.tensor([p]), ops.rope_inv_freq(hd, 1e4, "cpu")
    ops.qk_rope_store(q, k, v, None, None, 1e-6, pos, inv, "neox", kc, vc, k_scales=ks,
                      v_scales=vs)
    cos, sin = layers.rope_tables(torch.arange(p, p + t), hd, 1e4)
    want_k = quantize_q8_0(layers.apply_rope(k, cos, sin, "neox"))
    assert torch.equal(kc[p:p + t], want_k[0]) and torch.equal(ks[p:p + t], want_k[1])
    assert torch.equal(vc[p:p + t], quantize_q8_0(v)[0])
    qr = layers.apply_rope(q, cos, sin, "neox")
    got = ops.decode_attention(qr, kc, vc, torch.tensor([p + t]), hd ** -0.5, k_scales=ks,
                               v_scales=vs)
    keys, values = dequantize_q8_0(kc, ks)[:p + t], dequantize_q8_0(vc, vs)[:p + t]
    ref = layers.attention(qr, keys, values, p)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="needs its q8_0 scales"):
        ops.decode_attention(qr, kc, vc, torch.tensor([p + t]), 1.0)


_INTERPRETED = """
    import torch
    from strata.kernels.gpu import decode_ops as ops
    from strata.kernels import torch_ops as layers
    from strata.runtime.kv_cache import quantize_q8_0, dequantize_q8_0

    gen = torch.Generator().manual_seed(seed)
    nan = float("nan")
    ops.scratch = lambda shape, dtype, device: torch.full(shape, nan, dtype=dtype, device=device)
    cap = 200
    for h, hkv, hd, t, p, splits in ((4, 2, 64, 1, 0, None), (8, 2, 128, 3, 150, 3),
                                     (2, 2, 96, 2, 61, 2)):
        q, k, v = (torch.randn(t, n, hd, generator=gen) * 3 for n in (h, hkv, hkv))
        kc, vc = (torch.full((cap, hkv, hd), 77, dtype=torch.int8) for _ in range(2))
        ks, vs = (torch.full((cap, hkv, hd // 32), nan, dtype=torch.float16) for _ in range(2))
        # rows before p: written by the torch path (another step's tokens)
        old_k, old_v = (torch.randn(p, hkv, hd, generator=gen) for _ in range(2))
        for c, s, x in ((kc, ks, old_k), (vc, vs, old_v)):
            c[:p], s[:p] = quantize_q8_0(x)
        pos, inv = torch.tensor([p]), ops.rope_inv_freq(hd, 1e6, "cpu")
        out = torch.full((t, h, hd), nan)
        ops.qk_rope_store(q, k, v, None, None, 1e-6, pos, inv, "neox", kc, vc, out=out,
                          k_scales=ks, v_scales=vs)
        cos, sin = layers.rope_tables(torch.arange(p, p + t), hd, 1e6)
        kr = layers.apply_rope(k, cos, sin, "neox")
        for c, s, x in ((kc, ks, kr), (vc, vs, v)):
            wq, wd = quantize_q8_0(x)
            # the kernel's rotation differs from the reference by ~1e-7: a value on a rounding
            # edge may land one step over; the scales within float16's rounding
            assert (c[p:p + t].int() - wq.int()).abs().max() <= 1, (hd, t)
            assert (c[p:p + t] != wq).float().mean() < 0.01, (hd, t)
            torch.testing.assert_close(s[p:p + t].float(), wd.float(), rtol=2e-3, atol=0)
        got = ops.decode_attention(out, kc, vc, torch.tensor([p + t]), hd ** -0.5,
                                   n_splits=splits, k_scales=ks, v_scales=vs)
        keys, values = dequantize_q8_0(kc, ks)[:p + t], dequantize_q8_0(vc, vs)[:p + t]
        ref = layers.attention(out, keys, values, p)
        err = float((got - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, (hd, t, err)
    print("ok")
"""


def test_q8_0_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    from interpreted import fresh_seed, run_interpreted

    run_interpreted(_INTERPRETED, fresh_seed(), timeout=600)


@pytest.mark.cuda
def test_q8_0_decode_step_on_cuda_matches_the_reference() -> None:
    """The demo model on CUDA, every expert resident, float32-exact kernels, a q8_0 cache: the
    prompt, then decode steps replayed from CUDA graphs (the kernels quantize and read the
    blocks), against the reference path on the CPU with a q8_0 cache (torch's quantizer): the
    two quantize nearly equal rows, so a value on a rounding edge may take the next step; max
    KL < 1e-3 and the same top token."""
    from strata.demo import demo_model

    text = ("The Linux kernel schedules processes by their priority, and the scheduler picks "
            "the next task to run when")
    ref_e = Engine.load(demo_model(), config=EngineConfig(kv_type="q8_0", offload="off"))
    ids = ref_e.tokenizer.encode(text)
    ref = _logits(ref_e, ids, 16)
    e = Engine.load(demo_model(), config=EngineConfig(
        device="cuda", kv_type="q8_0", offload="on", vram_budget_gib=4, kernels="exact"))
    assert e.model.new_cache(8).quantized
    got = _logits(e, ids, 16).cpu()
    assert e.model.step.steps["replayed"] > 0
    lp, lq = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    kl = float((lp.exp() * (lp - lq)).sum(-1).max())
    assert kl < 1e-3 and torch.equal(ref.argmax(-1), got.argmax(-1)), kl
