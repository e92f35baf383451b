"""Decode attention of B sequences over one pool's rows (decode_ops.paged_attention and
rows_rope_store): the torch path against each row's attention over its own rows gathered
(the reference ops), and the Triton kernel against the torch path under Triton's interpreter,
at odd lengths, head dims and groups, with windows and sinks, over every KV type."""

from __future__ import annotations

import pytest
import torch
from interpreted import fresh_seed, rel_err, run_interpreted

from strata.kernels.gpu import decode_ops as ops
from strata.model.parts.sink_attention import sink_attention
from strata.runtime.kv_cache import dequantize_q8_0, quantize_q8_0


def _case(seed: int, b: int, h: int, hkv: int, hd: int, lengths: list[int], rows: int = 97):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, hd, generator=g)
    k = torch.randn(rows, hkv, hd, generator=g)
    v = torch.randn(rows, hkv, hd, generator=g)
    span = max(lengths) + 3  # (rows past each length: masked)
    read = torch.stack([torch.randperm(rows, generator=g)[:span] for _ in range(b)])
    return q, k, v, read, torch.tensor(lengths)


# (B, H, Hkv, hd, lengths, window, sinks): one row at length 1; rows of different lengths; a
# group of 3 query heads (not a power of two); a window shorter than some lengths, with sinks
CASES = [(1, 2, 2, 32, [1], 0, False), (3, 4, 2, 48, [5, 17, 2], 0, False),
         (2, 6, 2, 32, [9, 31], 0, False), (4, 4, 1, 64, [3, 12, 40, 1], 7, True)]


def _inputs(case: tuple) -> tuple:
    """A CASES row's fresh inputs: q, k, v, read, length and the sinks (or None)."""
    b, h, hkv, hd, lengths, _, sinks = case
    q, k, v, read, length = _case(fresh_seed() % 2**31, b, h, hkv, hd, lengths)
    return q, k, v, read, length, torch.randn(h) if sinks else None


@pytest.mark.parametrize("case", CASES)
def test_torch_path_is_each_rows_attention(case):
    _, h, _, hd, lengths, window, _ = case
    q, k, v, read, length, s = _inputs(case)
    out = ops.paged_attention(q, k, v, read, length, hd ** -0.5, window, s)
    for i, n in enumerate(lengths):
        keys, values = k[read[i, :n]], v[read[i, :n]]
        if s is None and not window:
            ref = ops._attention_torch(q[i:i + 1], keys, values, torch.tensor([n]), hd ** -0.5)
        else:
            ref = sink_attention(q[i:i + 1], keys, values, n - 1,
                                 s if s is not None else torch.full((h,), -1e30), window,
                                 hd ** -0.5)
        assert rel_err(out[i:i + 1], ref) < 1e-5


def _gathered(q, k_pool, v_pool, read, length, scale, window, sinks, k_scales, v_scales):
    """paged_attention's former torch form: every row's Tk keys and values gathered by
    pool[read] as [B, Tk, Hkv, hd], masked scores over the permuted keys."""
    b, h, hd = q.shape
    tk, hkv = read.shape[1], k_pool.shape[1]
    k, v = k_pool[read], v_pool[read]  # [B, Tk, Hkv, hd]
    if k_pool.dtype == torch.int8:
        k, v = dequantize_q8_0(k, k_scales[read]), dequantize_q8_0(v, v_scales[read])
    keys = torch.arange(tk)[None, :]
    n = length.long()[:, None]
    mask = keys < n
    if window:
        mask &= keys > n - 1 - window
    g = h // hkv
    sc = (q.view(b, hkv, g, hd) @ k.float().permute(0, 2, 3, 1)) * scale  # [B, Hkv, G, Tk]
    sc = sc.masked_fill(~mask[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, g, 1).expand(b, hkv, g, 1)
        p = torch.softmax(torch.cat([sc, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(sc, dim=-1)
    return (p @ v.float().transpose(1, 2)).reshape(b, h * hd)


# (B, H, Hkv, hd, lengths, window, sinks): odd lengths over blocks of 16 (one row of 1, rows
# ending inside and on a block's edge), a group of 3, hd 96 (q8_0: 3 blocks), a window with
# sinks, 8 rows of the tiny model's shape
GATHER_CASES = [(3, 6, 2, 96, [1, 17, 33], 0, False), (5, 4, 4, 32, [16, 31, 2, 47, 9], 0, False),
                (2, 9, 3, 64, [45, 13], 11, True),
                (8, 4, 2, 64, [130, 137, 144, 151, 158, 165, 172, 179], 0, False)]


@pytest.mark.parametrize("case", GATHER_CASES)
@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0"])
def test_torch_path_equals_the_former_gather(case, kind):
    """The CPU form (one head-major index_select a pool, two bmm) against the former one
    (pool[read] gathered, permuted products) over a paged pool's block tables, every KV type."""
    b, h, hkv, hd, lengths, window, sinks = case
    g = torch.Generator().manual_seed(fresh_seed() % 2**31)
    block, nb = 16, (max(lengths) + 1 + 15) // 16
    blocks = torch.randperm(b * nb + 5, generator=g)  # (5 blocks no row reads)
    rows = (b * nb + 5) * block
    read = ops.block_rows(blocks[: b * nb].view(b, nb), block, max(lengths) + 1)
    q = torch.randn(b, h, hd, generator=g)
    k, v = torch.randn(rows, hkv, hd, generator=g), torch.randn(rows, hkv, hd, generator=g)
    s = torch.randn(h, generator=g) if sinks else None
    kp, vp, ks, vs = k, v, None, None
    if kind == "q8_0":
        (kp, ks), (vp, vs) = quantize_q8_0(k), quantize_q8_0(v)
    elif kind != "f32":
        dt = torch.float16 if kind == "f16" else torch.bfloat16
        kp, vp = k.to(dt), v.to(dt)
    length = torch.tensor(lengths)
    got = ops.paged_attention(q, kp, vp, read, length, hd ** -0.5, window, s, ks, vs)
    want = _gathered(q, kp, vp, read, length, hd ** -0.5, window, s, ks, vs)
    assert rel_err(got, want) < 1e-6


def test_rows_rope_store_writes_each_row_where_told():
    q, k, v = torch.randn(3, 4, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    pos, write = torch.tensor([0, 7, 3]), torch.tensor([10, 2, 5])
    inv = ops.rope_inv_freq(32, 10000.0, "cpu")
    for dtype in (torch.float32, torch.float16, torch.int8):
        kp, vp = torch.zeros(12, 2, 32, dtype=dtype), torch.zeros(12, 2, 32, dtype=dtype)
        ks = vs = None
        if dtype == torch.int8:
            ks, vs = torch.zeros(12, 2, 1, dtype=torch.float16), torch.zeros(12, 2, 1,
                                                                          dtype=torch.float16)
        qo = ops.rows_rope_store(q, k, v, None, None, 1e-6, pos, inv, "neox", kp, vp, write,
                                 ks, vs)
        for i in range(3):  # each row as the one-sequence op stores it at its position
            kc, vc = torch.zeros(8, 2, 32), torch.zeros(8, 2, 32)
            qr = ops.qk_rope_store(q[i:i + 1], k[i:i + 1], v[i:i + 1], None, None, 1e-6,
                                   pos[i:i + 1], inv, "neox", kc, vc)
            assert torch.equal(qo[i:i + 1], qr)
            got_k, got_v = kp[write[i]], vp[write[i]]
            if dtype == torch.int8:
                got_k, got_v = (dequantize_q8_0(got_k, ks[write[i]]),
                                dequantize_q8_0(got_v, vs[write[i]]))
                kq = dequantize_q8_0(*quantize_q8_0(kc[pos[i]]))
                assert torch.equal(got_k, kq)
            else:
                assert torch.equal(got_k, kc[pos[i]].to(dtype))
                assert torch.equal(got_v, vc[pos[i]].to(dtype))
        untouched = torch.ones(12, dtype=torch.bool)
        untouched[write] = False
        assert not kp[untouched].float().abs().sum()


_ROWS_STORE_INTERPRETED = """
    import torch
    from strata.kernels.gpu import decode_ops as ops
    from strata.runtime.kv_cache import dequantize_q8_0
    torch.manual_seed(seed)
    b, h, hkv, hd = 3, 6, 2, 64
    q, k, v = torch.randn(b, h, hd), torch.randn(b, hkv, hd), torch.randn(b, hkv, hd)
    qn, kn = torch.rand(hd) + 0.5, torch.rand(hd) + 0.5
    pos, write = torch.tensor([0, 7, 3]), torch.tensor([10, 2, 5])
    inv = ops.rope_inv_freq(48, 10000.0, "cpu")  # (partial RoPE: 48 of 64 dims)
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        for style in ("neox", "normal"):
            pools = []
            for kernel in (True, False):  # the kernel's rows, then the torch form's
                kp = torch.zeros(12, hkv, hd, dtype=dtype)
                vp = torch.zeros(12, hkv, hd, dtype=dtype)
                ks = vs = None
                if dtype == torch.int8:
                    ks, vs = (torch.zeros(12, hkv, 2, dtype=torch.float16),
                              torch.zeros(12, hkv, 2, dtype=torch.float16))
                use = ops._use_kernels
                if not kernel:
                    ops._use_kernels = lambda t: False
                qo = ops.rows_rope_store(q, k, v, qn, kn, 1e-6, pos, inv, style, kp, vp, write,
                                         ks, vs)
                ops._use_kernels = use
                pools.append((qo, kp, vp, ks, vs))
            (qa, ka, va, ksa, vsa), (qb, kb, vb, ksb, vsb) = pools
            assert float((qa - qb).abs().max()) < 1e-5, (dtype, style)
            # Both forms compute in float32 and round once to the pool's type; their float32
            # values may differ in the last bits, so a stored value may round one step apart:
            # one bf16 unit in the last place, or one q8_0 step (its block's scale; the scale
            # itself may differ in its last f16 bit, hence the half step more).
            if dtype == torch.int8:
                steps = tuple(s.float().repeat_interleave(32, -1) for s in (ksb, vsb))
                ka, kb = dequantize_q8_0(ka, ksa), dequantize_q8_0(kb, ksb)
                va, vb = dequantize_q8_0(va, vsa), dequantize_q8_0(vb, vsb)
            elif dtype == torch.bfloat16:
                steps = (kb.float().abs() * 2.0 ** -7, vb.float().abs() * 2.0 ** -7)
            else:
                steps = (torch.full(kb.shape, 1e-5), torch.full(vb.shape, 1e-5))
            for got, want, step in ((ka, kb, steps[0]), (va, vb, steps[1])):
                over = (got.float() - want.float()).abs() - step * 1.5
                assert float(over.max()) <= 1e-6, (dtype, style, float(over.max()))
            untouched = torch.ones(12, dtype=torch.bool)
            untouched[write] = False
            assert not ka[untouched].float().abs().sum(), (dtype, style)
            for i in range(b):  # each row as the one-sequence kernel stores it at its position
                kc, vc = torch.zeros(8, hkv, hd), torch.zeros(8, hkv, hd)
                qr = ops.qk_rope_store(q[i:i + 1], k[i:i + 1], v[i:i + 1], qn, kn, 1e-6,
                                       pos[i:i + 1], inv, style, kc, vc)
                assert torch.equal(qa[i:i + 1], qr), (dtype, style, i)
                if dtype == torch.float32:
                    assert torch.equal(ka[write[i]], kc[pos[i]]), (style, i)
    print("ok")
"""


def test_rows_rope_store_kernel_under_the_interpreter():
    """The batched step's one launch for q/k norms, RoPE and the pool store (interpreted on CPU
    tensors) writes what the torch form writes, where it is told, and each row's q as the
    one-sequence kernel gives it, over f32, bf16 and q8_0 pools, both RoPE styles."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    run_interpreted(_ROWS_STORE_INTERPRETED, fresh_seed() % 2**31, timeout=300)


_INTERPRETED = """
    import torch
    from strata.kernels.gpu import decode_ops as ops
    from strata.runtime.kv_cache import quantize_q8_0
    torch.manual_seed(seed)
    CASES = {cases}
    for b, h, hkv, hd, lengths, window, sinks in CASES:
        rows = 101
        q = torch.randn(b, h, hd)
        k, v = torch.randn(rows, hkv, hd), torch.randn(rows, hkv, hd)
        span = max(lengths) + 2
        read = torch.stack([torch.randperm(rows)[:span] for _ in range(b)])
        length = torch.tensor(lengths)
        s = torch.randn(h) if sinks else None
        for kind in ("f32", "f16", "bf16", "q8_0"):
            kp, vp, ks, vs = k, v, None, None
            if kind == "q8_0":
                if hd % 32:
                    continue
                (kp, ks), (vp, vs) = quantize_q8_0(k), quantize_q8_0(v)
            elif kind != "f32":
                dt = torch.float16 if kind == "f16" else torch.bfloat16
                kp, vp = k.to(dt), v.to(dt)
            use, ops._use_kernels = ops._use_kernels, lambda t: False
            ref = ops.paged_attention(q, kp, vp, read, length, hd ** -0.5, window, s, ks, vs)
            ops._use_kernels = use
            for splits in (None, 3):  # (3: rows past 64 keys in three live splits)
                for fused in (False, True):  # (TF32's tl.dot: float32 under the interpreter)
                    got = ops._paged_launch(q, kp, vp, read, length, hd ** -0.5, window, s, ks,
                                            vs, splits, fused=fused)
                    err = float((got - ref).norm() / ref.norm())
                    assert err < 1e-5, (b, h, hkv, hd, lengths, window, kind, splits, fused,
                                        err)
    print("ok")
"""


def test_paged_kernel_under_the_interpreter():
    """The kernel (interpreted on CPU tensors) equals the torch path at odd shapes."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    # rows of 1..80 keys (one to three splits of 32), a group of 3, hd 48, windows with sinks
    cases = [(2, 4, 2, 48, [5, 70], 0, False), (3, 6, 2, 32, [1, 9, 75], 5, True),
             (1, 2, 1, 64, [80], 40, False)]
    run_interpreted(_INTERPRETED.replace("{cases}", repr(cases)), fresh_seed() % 2**31,
                    timeout=300)


@pytest.mark.cuda
@pytest.mark.parametrize("case", CASES)
def test_paged_kernel_on_cuda(case):
    """The compiled kernel against the torch path (CPU) over every KV type."""
    hd, window = case[3], case[5]
    q, k, v, read, length, s = _inputs(case)
    ref = ops.paged_attention(q, k, v, read, length, hd ** -0.5, window, s)
    dev = [t.cuda() if t is not None else None for t in (q, k, v, read, length, s)]
    got = ops.paged_attention(dev[0], dev[1], dev[2], dev[3], dev[4], hd ** -0.5, window,
                              dev[5])
    assert rel_err(got.cpu(), ref) < 1e-5
    for dt in (torch.float16, torch.bfloat16):
        ref = ops.paged_attention(q, k.to(dt), v.to(dt), read, length, hd ** -0.5, window, s)
        got = ops.paged_attention(dev[0], dev[1].to(dt), dev[2].to(dt), dev[3], dev[4],
                                  hd ** -0.5, window, dev[5])
        assert rel_err(got.cpu(), ref) < 1e-5
        # --kernels fused: both products on TF32 tensor cores (10-bit mantissas), the bound of
        # decode_attention's tf32 variant (tests/test_decode_ops.py)
        got = ops.paged_attention(dev[0], dev[1].to(dt), dev[2].to(dt), dev[3], dev[4],
                                  hd ** -0.5, window, dev[5], fused=True)
        assert rel_err(got.cpu(), ref) < 4e-3


@pytest.mark.slow
@pytest.mark.parametrize("model,fused", [("qwen3-30b-a3b", False), ("qwen3-30b-a3b", True),
                                         ("gpt-oss-20b", True), ("qwen3.6-35b-a3b", True)])
@pytest.mark.parametrize("kv", ["f32", "f16", "q8_0"])
def test_paged_kernel_fits_sm90(kv: str, model: str, fused: bool) -> None:
    """Without a GPU: the split kernel as _paged_launch builds it (a pool of 16 x 5746 rows),
    exact at Qwen3-30B-A3B's shape and TF32 (--kernels fused) at each model's (its heads, kv
    heads and head dim), builds for sm_90 within its shared memory and registers, with no
    spills."""
    pytest.importorskip("triton")
    from test_decode_ops import MODEL_SHAPES, SM90_REGS, SM90_SHARED, sm90_resources

    from strata.kernels.gpu import decode_kernels as dk

    h, hkv, hd, window = MODEL_SHAPES[model]
    b, rows = 16, 16 * 5746
    g = h // hkv
    block_m, block_n, stages, warps = ops.paged_tile(g, hd, fused)
    q8 = kv == "q8_0"
    elem = {"f32": "fp32", "f16": "fp16", "q8_0": "i8"}[kv]
    scales = "*fp16" if q8 else f"*{elem}"
    sd = hd // 32 if q8 else hd
    splits = max(1, min(-(-rows // ops.ATTN_MIN_CHUNK), ops.PAGED_TARGET_CTAS // (b * hkv)))
    ints = dict(B=b, H=h, S=splits, stride_qb=h * hd, stride_qh=hd, stride_kr=hkv * hd,
                stride_kh=hd, stride_vr=hkv * hd, stride_vh=hd, stride_ksr=hkv * sd,
                stride_ksh=sd, stride_vsr=hkv * sd, stride_vsh=sd, stride_rb=rows)
    pointers = {"q": "*fp32", "kc": f"*{elem}", "vc": f"*{elem}", "ks": scales, "vs": scales,
                "read": "*i64", "length": "*i64", "part_o": "*fp32", "part_ml": "*fp32"}
    const = dict(HD=hd, G=g, MIN_CHUNK=ops.ATTN_MIN_CHUNK, BLOCK_M=block_m, BLOCK_N=block_n,
                 BLOCK_D=hd, Q8=q8, WINDOW=window, TF32=fused, STAGES=stages)
    got = sm90_resources(dk._paged_split_kernel, pointers, {"scale": "fp32"}, ints, const,
                         warps)
    assert got["shared"] <= SM90_SHARED and got["regs"] <= SM90_REGS, got
    assert got["spills"] == 0 and got["stack"] == 0 and got["local"] == 0, got
