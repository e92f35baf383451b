"""The fused decode ops (strata.kernels.gpu.decode_ops) against the float32 reference ops of
strata.model.layers: rms_norm, rope_tables + apply_rope, attention, route.

Every run draws fresh random inputs (the seed is in each failure message). Outputs taken through
`out=` start as NaN, cache rows the op must not touch or read are NaN or 1e30 (a read of one shows
up as a NaN or a huge error in the output), and the attention partials start as NaN (`scratch`),
so a reduce over a split that was never written is caught too.

Tolerance, TOL = 1e-5 as max |out - ref| / max |ref| over the tensor: the kernels compute the same
float32 expressions as the reference, in another summation order (norms, scores, p·V, softmax
sums), with FMA contraction, and with different exp/rsqrt/cos/sin implementations (1-2 ulp);
1e-7..1e-6 is what the interpreter shows. The residual x + delta and the v cache rows are exact
(bit for bit); routing ids are exact away from ties (`check_route`).

The `device` fixture (tests/conftest.py) runs each op test on the CPU (the torch path of
decode_ops) and, with a GPU, on CUDA (the Triton kernels). One CPU test runs the Triton kernels
under Triton's interpreter in a subprocess; one CUDA test replays a captured graph of the ops
with `pos`/`length` advanced between replays.
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")  # the kernels, their SASS checks and the interpreter

from interpreted import (  # noqa: E402
    every_case,
    fresh_seed,
    run_interpreted,
    run_interpreted_side_by_side,
)

from strata.kernels.gpu import decode_kernels as dk  # noqa: E402
from strata.kernels.gpu import decode_ops as ops  # noqa: E402
from strata.model import layers  # noqa: E402

TOL = 1e-5
EPS = 1e-6
NAN = float("nan")


def fresh_rng() -> tuple[torch.Generator, int]:
    seed = fresh_seed()
    return torch.Generator().manual_seed(seed), seed


def randn(gen: torch.Generator, *shape: int, device: str = "cpu",
          std: float = 1.0) -> torch.Tensor:
    """Drawn on the CPU (the same numbers for a seed on every device), then moved."""
    return (torch.randn(*shape, generator=gen) * std).to(device)


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; NaN anywhere in out gives NaN (fails every `<`)."""
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN rows included)."""
    return torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def nan_scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, NAN, dtype=dtype, device=device)


def check_route(ids: torch.Tensor, w: torch.Tensor, ref_ids: torch.Tensor, ref_w: torch.Tensor,
                msg: str) -> None:
    """Weights to TOL; ids equal, except that a pair of slots whose reference weights agree to
    1e-6 (a tie, where torch.topk promises no order) may come swapped."""
    assert ids.dtype == torch.int64 and w.dtype == torch.float32, msg
    assert ids.shape == ref_ids.shape and w.shape == ref_w.shape, msg
    err = max_rel(w, ref_w)
    assert err < TOL, f"{msg}: weights rel err {err:.2e}"
    for t in range(ids.shape[0]):
        for i in torch.nonzero(ids[t] != ref_ids[t]).flatten().tolist():
            near = (ref_w[t] - ref_w[t, i]).abs() <= 1e-6 * ref_w[t, i]
            assert near.sum() > 1 and int(ids[t, i]) in ref_ids[t][near].tolist(), \
                f"{msg}: token {t} slot {i}: id {int(ids[t, i])}, reference {ref_ids[t].tolist()}"


# ---- rms_norm / add_rms_norm ---------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 3, 4])
@pytest.mark.parametrize("d", [2048, 4096, 96])  # Qwen3-30B-A3B, Mixtral, not a power of two
def test_rms_norm(device: str, t: int, d: int) -> None:
    gen, seed = fresh_rng()
    x = randn(gen, t, d, device=device, std=3.0)
    w = randn(gen, d, device=device)
    ref = layers.rms_norm(x, w, EPS)
    out = torch.full_like(x, NAN)
    assert ops.rms_norm(x, w, EPS, out=out) is out
    assert max_rel(out, ref) < TOL, f"seed={seed}: rel err {max_rel(out, ref):.2e}"
    assert max_rel(ops.rms_norm(x, w, EPS), ref) < TOL, f"seed={seed}"
    y = x.clone()
    ops.rms_norm(y, w, EPS, out=y)  # in place
    assert max_rel(y, ref) < TOL, f"seed={seed}: in place"


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("d", [2048, 96])
def test_add_rms_norm(device: str, t: int, d: int) -> None:
    gen, seed = fresh_rng()
    x = randn(gen, t, 2 * d, device=device)[:, :d]  # rows with a stride: a view
    delta = randn(gen, t, d, device=device)
    w = randn(gen, d, device=device)
    want_x = x + delta
    ref = layers.rms_norm(want_x, w, EPS)
    out = torch.full((t, d), NAN, device=device)
    h = ops.add_rms_norm(x, delta, w, EPS, out=out)
    assert h is out
    assert same_bits(x, want_x), f"seed={seed}: residual not x + delta"
    assert max_rel(h, ref) < TOL, f"seed={seed}: rel err {max_rel(h, ref):.2e}"


@pytest.mark.parametrize("t,r", [(1, 8), (4, 3), (2, 1)])
def test_add_rms_norm_sums_rows_of_delta(device: str, t: int, r: int) -> None:
    """delta [T, R, D] (a token's K expert outputs, unsummed): its rows are added to each other
    in order, then to x, bit for bit as that loop in float32."""
    gen, seed = fresh_rng()
    d = 96
    x = randn(gen, t, d, device=device, std=3.0)
    rows = randn(gen, t, r, d, device=device)
    w = randn(gen, d, device=device)
    total = rows[:, 0].clone()
    for i in range(1, r):
        total = total + rows[:, i]
    want_x = x + total
    out = torch.full((t, d), NAN, device=device)
    h = ops.add_rms_norm(x, rows, w, EPS, out=out)
    assert same_bits(x, want_x), f"seed={seed}: residual not x + the rows' sum"
    ref = layers.rms_norm(want_x, w, EPS)
    assert max_rel(h, ref) < TOL, f"seed={seed}: rel err {max_rel(h, ref):.2e}"
    with pytest.raises(ValueError, match="delta"):
        ops.add_rms_norm(x, rows[:, :, : d - 1], w, EPS)
    # a shared expert's row beside the rows (norm.SharedRows): added after them, bit for bit as
    # the rows joined with it as row R + 1
    extra = randn(gen, t, d, device=device)
    y, z = want_x - total, want_x - total
    h = ops.add_rms_norm(y, rows, w, EPS, extra=extra)
    h2 = ops.add_rms_norm(z, torch.cat([rows, extra[:, None]], 1), w, EPS)
    assert same_bits(y, z) and same_bits(h, h2), f"seed={seed}: extra not as row R + 1"
    with pytest.raises(ValueError, match="extra"):
        ops.add_rms_norm(y, rows, w, EPS, extra=extra[:, : d - 1])


# ---- q/k norm + RoPE + cache store -------------------------------------------------------------

# (H, Hkv, hd, rope_dim, style, qk norm, theta)
ROPE_CASES = {
    "qwen3-30b-a3b": (32, 4, 128, 128, "neox", True, 1e6),
    "mixtral": (32, 8, 128, 128, "normal", False, 1e6),
    "qwen2moe": (28, 4, 128, 128, "neox", False, 1e6),
    "odd-partial": (6, 2, 64, 32, "normal", True, 1e4),  # rope on the first 32 of 64 dims
    "odd-partial-neox": (5, 1, 64, 48, "neox", True, 5e5),
}


def rope_reference(q, k, qn, kn, positions, rope_dim, theta, style):  # noqa: ANN001, ANN201
    cos, sin = layers.rope_tables(positions, rope_dim, theta)
    if qn is not None:
        q, k = layers.rms_norm(q, qn, EPS), layers.rms_norm(k, kn, EPS)
    return layers.apply_rope(q, cos, sin, style), layers.apply_rope(k, cos, sin, style)


@pytest.mark.parametrize("t", [1, 3, 4])
@pytest.mark.parametrize("name", list(ROPE_CASES))
def test_qk_rope_store(device: str, name: str, t: int) -> None:
    gen, seed = fresh_rng()
    h, hkv, hd, rope_dim, style, qk_norm, theta = ROPE_CASES[name]
    cap = 1000
    # q, k, v as views of one fused projection [T, (H + 2 Hkv) hd]
    qkv = randn(gen, t, (h + 2 * hkv) * hd, device=device, std=2.0)
    q = qkv[:, : h * hd].view(t, h, hd)
    k = qkv[:, h * hd: (h + hkv) * hd].view(t, hkv, hd)
    v = qkv[:, (h + hkv) * hd:].view(t, hkv, hd)
    qn = randn(gen, hd, device=device) if qk_norm else None
    kn = randn(gen, hd, device=device) if qk_norm else None
    inv_freq = ops.rope_inv_freq(rope_dim, theta, device)
    for p, dtype in ((0, torch.int64), (int(torch.randint(1, cap - t, (), generator=gen)),
                                        torch.int32), (cap - t, torch.int64)):
        kc = torch.full((cap, hkv, hd), NAN, device=device)
        vc = torch.full((cap, hkv, hd), NAN, device=device)
        out = torch.full((t, h, hd), NAN, device=device)
        pos = torch.tensor([p], dtype=dtype, device=device)
        got = ops.qk_rope_store(q, k, v, qn, kn, EPS, pos, inv_freq, style, kc, vc, out=out)
        assert got is out
        q_ref, k_ref = rope_reference(q, k, qn, kn, torch.arange(p, p + t, device=device),
                                      rope_dim, theta, style)
        msg = f"{name} t={t} pos={p} seed={seed}"
        assert max_rel(out, q_ref) < TOL, f"{msg}: q rel err {max_rel(out, q_ref):.2e}"
        assert max_rel(kc[p:p + t], k_ref) < TOL, f"{msg}: k rel err"
        assert same_bits(vc[p:p + t], v), f"{msg}: v rows differ"
        rest = torch.ones(cap, dtype=torch.bool, device=device)
        rest[p:p + t] = False
        assert kc[rest].isnan().all() and vc[rest].isnan().all(), f"{msg}: other rows written"


def test_qk_rope_far_positions(device: str) -> None:
    """Positions near 2^17: angles of 1e5 radians, where cos/sin need a full range reduction."""
    gen, seed = fresh_rng()
    t, h, hkv, hd, cap = 2, 2, 1, 64, 131072
    q, k, v = (randn(gen, t, n, hd, device=device) for n in (h, hkv, hkv))
    kc = torch.zeros(cap, hkv, hd, device=device)
    vc = torch.zeros(cap, hkv, hd, device=device)
    p = cap - t - int(torch.randint(0, 1000, (), generator=gen))
    inv_freq = ops.rope_inv_freq(hd, 1e6, device)
    out = ops.qk_rope_store(q, k, v, None, None, EPS, torch.tensor([p], device=device), inv_freq,
                            "neox", kc, vc)
    q_ref, k_ref = rope_reference(q, k, None, None, torch.arange(p, p + t, device=device), hd,
                                  1e6, "neox")
    assert max_rel(out, q_ref) < TOL, f"seed={seed} pos={p}: {max_rel(out, q_ref):.2e}"
    assert max_rel(kc[p:p + t], k_ref) < TOL, f"seed={seed} pos={p}"


def test_rope_inv_freq_is_rope_tables() -> None:
    positions = torch.tensor([0, 1, 7, 4097])
    cos, sin = layers.rope_tables(positions, 128, 1e6)
    angles = positions.float()[:, None] * ops.rope_inv_freq(128, 1e6, "cpu")[None, :]
    assert same_bits(angles.cos(), cos) and same_bits(angles.sin(), sin)


# ---- decode attention ----------------------------------------------------------------------------

# (T, H, Hkv, hd, capacity, lengths, n_splits); None: attention_splits(capacity, Hkv)
ATTN_CASES = {
    "qwen3-30b-a3b": (1, 32, 4, 128, 4096, (1, 17, 128, 129, 1000, 4096), None),
    "qwen3-4tok": (4, 32, 4, 128, 4000, (4, 130, 2049, 4000), None),  # 2 row blocks of 16
    "mixtral-3tok": (3, 32, 8, 128, 1000, (3, 257, 999, 1000), None),
    "qwen2moe-g7": (4, 28, 4, 128, 700, (5, 300, 700), None),  # G = 7, T·G = 28
    "hd64-odd-cap": (3, 6, 2, 64, 333, (3, 128, 129, 333), 3),
    "hd256": (2, 8, 2, 256, 600, (2, 256, 600), None),
    "one-split": (2, 8, 2, 128, 500, (2, 300, 500), 1),
    "many-splits": (1, 4, 4, 64, 2000, (1, 1999, 2000), 64),  # S > live splits
}


def fill_cache(gen: torch.Generator, cap: int, hkv: int, hd: int, n: int, device: str,
               junk: float) -> torch.Tensor:
    """Rows 0..n-1 random, the rest `junk` (NaN or huge), which no correct kernel reads."""
    c = torch.full((cap, hkv, hd), junk)
    c[:n] = torch.randn(n, hkv, hd, generator=gen)
    return c.to(device)


@pytest.mark.parametrize("name", list(ATTN_CASES))
def test_decode_attention(device: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gen, seed = fresh_rng()
    monkeypatch.setattr(ops, "scratch", nan_scratch)
    t, h, hkv, hd, cap, lengths, n_splits = ATTN_CASES[name]
    for i, n in enumerate(lengths):
        junk = NAN if i % 2 == 0 else 1e30
        kc = fill_cache(gen, cap, hkv, hd, n, device, junk)
        vc = fill_cache(gen, cap, hkv, hd, n, device, junk)
        q = randn(gen, t, h, hd, device=device, std=0.5)
        length = torch.tensor([n], dtype=torch.int32 if i % 2 else torch.int64, device=device)
        out = torch.full((t, h * hd), NAN, device=device)
        got = ops.decode_attention(q, kc, vc, length, hd ** -0.5, out=out, n_splits=n_splits)
        assert got is out
        ref = layers.attention(q, kc[:n], vc[:n], n - t)
        err = max_rel(out, ref)
        assert err < TOL, f"{name} length={n} junk={junk} seed={seed}: rel err {err:.2e}"
        # an output gate per head, q and the gate strided views of one [T, H, 2, hd] tensor
        # (qwen35moe's q rows: each head's query, then its gate)
        qg = torch.stack([q, randn(gen, t, h, hd, device=device)], 2)
        got = ops.decode_attention(qg[:, :, 0], kc, vc, length, hd ** -0.5, n_splits=n_splits,
                                   gate=qg[:, :, 1])
        want = ref * torch.sigmoid(qg[:, :, 1].reshape(t, -1))
        assert max_rel(got, want) < TOL, f"{name} length={n} seed={seed}: gate"


# --kv-type f16 / bf16: one ulp of the type, relative to the largest value (RNE is half of it)
KV_ULP = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


@pytest.mark.parametrize("dtype", list(KV_ULP))
def test_reduced_kv_types(device: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float16 / bfloat16 KV cache: qk_rope_store rounds k and v once into their rows (v is
    exactly v.to(dtype), k the rotated keys rounded) and writes no other row; decode_attention
    reads the rounded rows as float32, so it equals float32 attention over those rows."""
    gen, seed = fresh_rng()
    monkeypatch.setattr(ops, "scratch", nan_scratch)
    t, h, hkv, hd, cap = 3, 8, 2, 128, 700
    q, k, v = (randn(gen, t, n, hd, device=device) for n in (h, hkv, hkv))
    qn, kn = randn(gen, hd, device=device), randn(gen, hd, device=device)
    inv_freq = ops.rope_inv_freq(hd, 1e6, device)
    for p in (0, 333, cap - t):
        kc = torch.full((cap, hkv, hd), NAN, dtype=dtype, device=device)
        vc = torch.full((cap, hkv, hd), NAN, dtype=dtype, device=device)
        kc[:p] = randn(gen, p, hkv, hd, device=device).to(dtype)  # an earlier prompt's rows
        vc[:p] = randn(gen, p, hkv, hd, device=device).to(dtype)
        before = kc[:p].clone(), vc[:p].clone()
        qr = ops.qk_rope_store(q, k, v, qn, kn, EPS, torch.tensor([p], device=device), inv_freq,
                               "neox", kc, vc)
        msg = f"{dtype} pos={p} seed={seed}"
        q_ref, k_ref = rope_reference(q, k, qn, kn, torch.arange(p, p + t, device=device), hd,
                                      1e6, "neox")
        assert max_rel(qr, q_ref) < TOL, msg
        assert kc.dtype == dtype and max_rel(kc[p:p + t].float(), k_ref) <= KV_ULP[dtype], msg
        assert torch.equal(vc[p:p + t], v.to(dtype)), msg
        assert torch.equal(kc[:p], before[0]) and torch.equal(vc[:p], before[1]), msg
        assert kc[p + t:].isnan().all() and vc[p + t:].isnan().all(), msg
        n = p + t
        out = ops.decode_attention(qr, kc, vc, torch.tensor([n], device=device), hd ** -0.5)
        ref = layers.attention(qr, kc[:n].float(), vc[:n].float(), n - t)
        assert max_rel(out, ref) < TOL, f"{msg}: attention {max_rel(out, ref):.2e}"
    with pytest.raises(ValueError, match="one type"):
        ops.decode_attention(qr, kc, vc.float(), torch.tensor([t], device=device), 1.0)
    with pytest.raises(ValueError, match="float32, float16, bfloat16"):
        ops.decode_attention(qr, kc.to(torch.float64), vc.to(torch.float64),
                             torch.tensor([t], device=device), 1.0)


@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16", "q8_0"])
def test_kv_kernels_compile_for_sm90(kv: str) -> None:
    """Without a GPU: Triton compiles the kernels that write and read the KV cache for sm_90 (its
    bundled ptxas) with each --kv-type, as the GPU will (the interpreter runs neither Triton's
    front end nor its types). The cache's stores convert to its type; its loads back to f32;
    q8_0 stores int8 and float16 scales and reads both."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    q8 = kv == "q8_0"
    elem = "i8" if q8 else kv
    target = GPUTarget("cuda", 90, 32)
    i32 = dict.fromkeys(("H", "C", "stride_qt", "stride_qh", "stride_kt", "stride_kh",
                         "stride_vt", "stride_vh", "stride_qot", "stride_qoh", "stride_kcr",
                         "stride_kch", "stride_vcr", "stride_vch", "stride_ksr", "stride_ksh",
                         "stride_vsr", "stride_vsh"), "i32")
    scales = "*fp16" if q8 else f"*{elem}"
    sig = {"q": "*fp32", "k": "*fp32", "v": "*fp32", "qn": "*fp32", "kn": "*fp32",
           "inv_freq": "*fp32", "pos": "*i64", "qo": "*fp32", "kc": f"*{elem}",
           "vc": f"*{elem}", "ks": scales, "vs": scales, "eps": "fp32", **i32,
           "HAS_QN": "constexpr", "HAS_KN": "constexpr", "HD": "constexpr",
           "ROPE_DIM": "constexpr", "NEOX": "constexpr", "BLOCK_D": "constexpr",
           "Q8": "constexpr"}
    rope = triton.compile(ASTSource(dk._qk_rope_kernel, sig, constexprs={
        "HAS_QN": True, "HAS_KN": True, "HD": 128, "ROPE_DIM": 128, "NEOX": True,
        "BLOCK_D": 128, "Q8": q8}), target=target)
    assert rope.asm["cubin"]
    ptx = rope.asm["ptx"]
    assert ("cvt.rn.bf16.f32" in ptx) == (kv == "bf16")
    assert ("cvt.rn.f16.f32" in ptx) == (kv in ("fp16", "q8_0"))  # (q8_0: its scales)
    assert ("st.global.b8" in ptx or "st.global.u8" in ptx) == q8
    i32 = dict.fromkeys(("T", "H", "S", "RB", "stride_qt", "stride_qh", "stride_kr", "stride_kh",
                         "stride_vr", "stride_vh", "stride_ksr", "stride_ksh", "stride_vsr",
                         "stride_vsh"), "i32")
    sig = {"q": "*fp32", "kc": f"*{elem}", "vc": f"*{elem}", "ks": scales, "vs": scales,
           "length": "*i64", "part_o": "*fp32", "part_ml": "*fp32", "scale": "fp32", **i32,
           "HD": "constexpr", "G": "constexpr", "MIN_CHUNK": "constexpr", "BLOCK_M": "constexpr",
           "BLOCK_N": "constexpr", "BLOCK_D": "constexpr", "STAGES": "constexpr",
           "Q8": "constexpr"}
    attn = triton.compile(ASTSource(dk._attn_split_kernel, sig, constexprs={
        "HD": 128, "G": 8, "MIN_CHUNK": ops.ATTN_MIN_CHUNK, "BLOCK_M": ops.ATTN_BLOCK_M,
        "BLOCK_N": 32, "BLOCK_D": 128, "STAGES": 2, "Q8": q8}), target=target,
        options={"num_warps": 8})
    assert attn.asm["cubin"]
    assert ("cvt.f32.f16" in attn.asm["ptx"]) == (kv in ("fp16", "q8_0"))


def test_attention_splits() -> None:
    assert ops.ATTN_MIN_CHUNK == 32
    assert ops.attention_splits(1024, 8) == 16  # 128 CTAs / Hkv, under capacity / 32
    assert ops.attention_splits(1024, 4) == 32  # capacity / 32 = 128 CTAs / Hkv
    assert ops.attention_splits(512, 2) == 16  # capacity / 32
    assert ops.attention_splits(32768, 4) == 32  # 128 CTAs / Hkv
    assert ops.attention_splits(32768, 8) == 16
    assert ops.attention_splits(20, 8) == 1



def test_attention_variant_picks() -> None:
    """Without --kernels fused every pick is an exact float32 variant; a pick exists for every
    case; an unknown variant is refused."""
    for t in (1, 2, 3, 4):
        for g in (1, 4, 7, 8, 16):
            for dt in (torch.float32, torch.float16, torch.bfloat16, torch.int8):
                assert ops.attention_variant(t, g, dt, False) in ("ieee", "fma"), (t, g, dt)
                assert ops.attention_variant(t, g, dt, True) in ops.ATTN_VARIANTS
    assert {ops.attention_launch(v, 1, 8, 128).variant for v in ops.ATTN_VARIANTS} == set(
        ops.ATTN_VARIANTS)
    q, c = torch.zeros(1, 8, 64), torch.zeros(4, 2, 64)
    with pytest.raises(ValueError, match="attention variant"):
        ops.attention_launch("bf16", 1, 4, 64)
    for bad in (ops.AttnLaunch("ieee", 8, 32, 2, 8), ops.AttnLaunch("fma", 8, 12, 2, 8, 16),
                ops.AttnLaunch("fma", 8, 16, 2, 8, 2)):
        with pytest.raises(ValueError, match="attention tile"):
            ops.decode_attention(q, c, c, torch.tensor([1]), 1.0, tile=bad)
    assert ops.decode_attention(q, c, c, torch.tensor([1]), 1.0, variant="fma").shape == (1, 512)


# tf32 against the reference over q, k, v truncated to TF32 (10-bit mantissas): what remains is
# p's own rounding inside the kernel (2^-10 of each weight at most, toward zero), well under this
TF32_TOL = 4e-3


def tf32(x: torch.Tensor) -> torch.Tensor:
    """x float32 with the low 13 mantissa bits cleared (TF32's inputs)."""
    return (x.float().contiguous().view(torch.int32) & ~0x1FFF).view(torch.float32)


# (T, H, Hkv, hd, capacity, window, sinks, n_splits): the three model shapes cut down, plus
# odd ones; lengths: 1 or T, a block and one past it, odd, the window's edges, the capacity
VARIANT_CASES = [(1, 8, 1, 128, 300, 0, False, None), (4, 8, 1, 128, 300, 0, False, None),
                 (2, 16, 2, 64, 333, 16, True, 5), (3, 8, 2, 256, 200, 0, False, None),
                 (1, 16, 2, 64, 200, 40, True, None), (4, 4, 4, 64, 131, 0, True, 8),
                 (3, 12, 4, 32, 97, 0, False, None)]


def check_attention_variants(device: str, seed: int, kinds: tuple[str, ...] = (
        "f32", "f16", "bf16", "q8_0"), few: bool = False) -> None:
    """Every split kernel variant with each cache type against the float32 reference over the
    rows as stored (layers.attention, or sink_attention with a window / sinks), over caches
    whose rows past the length are NaN and with NaN attention partials. few: fewer lengths
    (T, 17, one past the window, the capacity; the interpreter's time)."""
    from strata.model.parts.sink_attention import sink_attention
    from strata.runtime.kv_cache import dequantize_q8_0, quantize_q8_0

    gen = torch.Generator().manual_seed(seed)
    ops.scratch, plain = nan_scratch, ops.scratch
    try:
        for t, h, hkv, hd, cap, window, has_sinks, splits in VARIANT_CASES:
            sinks = torch.randn(h, generator=gen).to(device) if has_sinks else None
            lengths = {t, 1 + t, 16, 17, 64, 65, cap - 7, cap, window, window + 1}
            if few:
                lengths = {t, 17, window + 1, cap}
            for n in sorted(x for x in lengths if t <= x <= cap):
                k = torch.randn(cap, hkv, hd, generator=gen)
                v = torch.randn(cap, hkv, hd, generator=gen)
                q = (torch.randn(t, h, hd, generator=gen) * 0.5).to(device)
                for kind in kinds:
                    scales: tuple = (None, None)
                    if kind == "q8_0":
                        (kc, ks), (vc, vs) = quantize_q8_0(k), quantize_q8_0(v)
                        kr, vr = dequantize_q8_0(kc, ks), dequantize_q8_0(vc, vs)
                        kc[n:], vc[n:] = 127, -127  # no NaN in int8: huge values instead
                        ks[n:], vs[n:] = NAN, NAN
                        scales = (ks.to(device), vs.to(device))
                    else:
                        dt = {"f32": torch.float32, "f16": torch.float16,
                              "bf16": torch.bfloat16}[kind]
                        kc, vc = k.to(dt), v.to(dt)
                        kr, vr = kc.float(), vc.float()
                        kc[n:], vc[n:] = NAN, NAN
                    kc, vc, kr, vr = (x.to(device) for x in (kc, vc, kr, vr))
                    for variant in ops.ATTN_VARIANTS:
                        qx, kx, vx = (q, kr, vr) if variant != "tf32" else map(tf32, (q, kr, vr))
                        if window or sinks is not None:
                            ref = sink_attention(qx, kx[:n], vx[:n], n - t,
                                                 sinks if sinks is not None else
                                                 torch.full((h,), -1e30, device=device),
                                                 window, hd ** -0.5)
                        else:
                            ref = layers.attention(qx, kx[:n], vx[:n], n - t)
                        out = ops.decode_attention(q, kc, vc, torch.tensor([n], device=device),
                                                   hd ** -0.5, n_splits=splits, window=window,
                                                   sinks=sinks, k_scales=scales[0],
                                                   v_scales=scales[1], variant=variant)
                        err = max_rel(out, ref)
                        tol = TF32_TOL if variant == "tf32" else TOL
                        assert err < tol, (f"{variant} {kind} T={t} H={h} Hkv={hkv} hd={hd} "
                                           f"n={n} window={window} seed={seed}: {err:.2e}")
    finally:
        ops.scratch = plain


@pytest.mark.cuda
def test_attention_variants_cuda() -> None:
    """Every variant on the GPU (the tf32 one on tensor cores) with every cache type."""
    check_attention_variants("cuda", fresh_seed())


_VARIANTS_INTERPRETED = """
    sys.path.insert(0, "tests")
    import test_decode_ops as cases
    cases.VARIANT_CASES = [c for c in cases.VARIANT_CASES if c[3] <= 64]  # (time)
    cases.check_attention_variants("cpu", seed, kinds=KINDS, few=True)
    print("ok")
"""


@pytest.mark.slow
def test_attention_variants_under_the_interpreter() -> None:
    """Every variant under TRITON_INTERPRET=1 on the CPU over f32 and q8_0 caches side by side,
    windows, sinks, T 1..4, hd <= 64."""
    run_interpreted_side_by_side([_VARIANTS_INTERPRETED.replace("KINDS", repr(kinds))
                                  for kinds in (("f32",), ("q8_0",))], fresh_seed(), timeout=900)


@every_case
def test_attention_variants_over_half_caches_under_the_interpreter() -> None:
    """The same over f16 and bf16 caches (read as q8_0's rows are, without the scales)."""
    run_interpreted_side_by_side([_VARIANTS_INTERPRETED.replace("KINDS", repr(kinds))
                                  for kinds in (("f16",), ("bf16",))], fresh_seed(), timeout=900)


# (H, Hkv, hd, window): Qwen3-30B-A3B, gpt-oss-20b (its sliding layers), Qwen3.6-35B-A3B's full
# attention layers; sm_90's limits per block
MODEL_SHAPES = {"qwen3-30b-a3b": (32, 4, 128, 0), "gpt-oss-20b": (64, 8, 64, 128),
                "qwen3.6-35b-a3b": (16, 2, 256, 0)}
SM90_SHARED, SM90_REGS = 232448, 255
# the first (ieee) kernel's f16 and q8_0 builds spill at hd 128 and 256 (rows converted to
# float32 through the FMA-emulated dot's layouts); the launch picks fma there in exact mode
KNOWN_SPILLS = {("ieee", m, kv) for m in ("qwen3-30b-a3b", "qwen3.6-35b-a3b")
                for kv in ("f16", "q8_0")}


def split_kernel_resources(variant: str, t: int, h: int, hkv: int, hd: int, window: int,
                           kv: str, capacity: int = 32768,
                           tile: ops.AttnLaunch | None = None) -> dict:
    """The split kernel as the launch builds it for sm_90 (no GPU), over contiguous caches of
    `capacity` rows: sm90_resources. tile: another than the variant's (tuning)."""
    g = h // hkv
    tile = tile or ops.attention_launch(variant, t, g, hd)
    q8 = kv == "q8_0"
    elem = {"f32": "fp32", "f16": "fp16", "q8_0": "i8"}[kv]
    scales = "*fp16" if q8 else f"*{elem}"
    const = dict(HD=hd, G=g, MIN_CHUNK=ops.ATTN_MIN_CHUNK, BLOCK_M=tile.block_m,
                 BLOCK_N=tile.block_n, BLOCK_D=ops._pow2(hd), STAGES=tile.stages, Q8=q8,
                 WINDOW=window)
    if variant == "fma":
        fn, const["DC"] = dk._attn_split_fma_kernel, tile.dc
    else:
        fn, const["TF32"] = dk._attn_split_kernel, variant == "tf32"
    sd = hd // 32 if q8 else hd  # the scales' (or, unread, the caches') row of one head
    ints = dict(T=t, H=h, S=ops.attention_splits(capacity, hkv),
                RB=-(-t * g // tile.block_m), stride_qt=h * hd, stride_qh=hd,
                stride_kr=hkv * hd, stride_kh=hd, stride_vr=hkv * hd, stride_vh=hd,
                stride_ksr=hkv * sd, stride_ksh=sd, stride_vsr=hkv * sd, stride_vsh=sd)
    pointers = {"q": "*fp32", "kc": f"*{elem}", "vc": f"*{elem}", "ks": scales, "vs": scales,
                "length": "*i64", "part_o": "*fp32", "part_ml": "*fp32"}
    return sm90_resources(fn, pointers, {"scale": "fp32"}, ints, const, tile.warps)


def sm90_resources(fn, pointers: dict, floats: dict, ints: dict, const: dict,  # noqa: ANN001
                   warps: int) -> dict:
    """`fn` built by Triton for sm_90 (no GPU) with the specialization Triton's launcher gives
    its arguments (pointers 16-byte aligned, ints equal to 1 constant, multiples of 16 marked
    so): shared bytes, registers, spill stores and local bytes (cuobjdump of the cubin).
    pointers, floats: {name: type}; ints: {name: value}; const: the constexprs."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = const | {k: 1 for k, v in ints.items() if v == 1}
    sig = {**pointers, **floats,
           **{k: "constexpr" if v == 1 else "i32" for k, v in ints.items()},
           **dict.fromkeys(const, "constexpr")}
    names = list(fn.arg_names)
    aligned = [names.index(k) for k in pointers]
    aligned += [names.index(k) for k, v in ints.items() if v != 1 and v % 16 == 0]
    k = triton.compile(ASTSource(fn, sig, constexprs=const,
                                 attrs={(i,): [["tt.divisibility", 16]] for i in aligned}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout
    field = {f: int(re.search(rf"{f}:(\d+)", usage).group(1)) for f in ("REG", "STACK", "LOCAL")}
    return dict(shared=k.metadata.shared, regs=field["REG"], stack=field["STACK"],
                local=field["LOCAL"], spills=len(re.findall(r"\bSTL\b", sass)))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["fma", "tf32", "ieee"])
@pytest.mark.parametrize("model", list(MODEL_SHAPES))
def test_split_variants_fit_sm90(variant: str, model: str) -> None:
    """Without a GPU: each variant as launched at each model's shape (T 1 and 4: fma's row block
    is 8 or 16; the dot variants' tiles do not depend on T) and cache type builds for sm_90
    within its shared memory and registers, with no spills."""
    if (variant == "ieee" or model == "gpt-oss-20b") and not os.environ.get("STRATA_ALL_TESTS"):
        pytest.skip("the first kernel and the narrower head: STRATA_ALL_TESTS=1 builds them")
    h, hkv, hd, window = MODEL_SHAPES[model]
    for t in ((1, 4) if variant == "fma" else (1,)):
        for kv in ("f32", "f16", "q8_0"):
            got = split_kernel_resources(variant, t, h, hkv, hd, window, kv)
            msg = f"{variant} {model} T={t} {kv}: {got}"
            assert got["shared"] <= SM90_SHARED and got["regs"] <= SM90_REGS, msg
            if (variant, model, kv) not in KNOWN_SPILLS:
                assert got["spills"] == 0 and got["stack"] == 0 and got["local"] == 0, msg

# ---- routing -------------------------------------------------------------------------------------

# (E, K, renormalize)
ROUTE_CASES = [(128, 8, True), (128, 8, False), (8, 2, True), (60, 4, False), (256, 16, True),
               (7, 7, True)]


def distinct_router(gen: torch.Generator, t: int, d: int, e: int, k: int, device: str):  # noqa: ANN201
    """h [T, D], router [E, D] whose logits have no near ties among each row's top k + 1."""
    for _ in range(100):
        h, router = randn(gen, t, d), randn(gen, e, d, std=d ** -0.5)
        top = torch.sort(h @ router.T, dim=-1, descending=True).values[:, : k + 1]
        if (top[:, :-1] - top[:, 1:]).min() > 1e-4:
            return h.to(device), router.to(device)
    raise AssertionError("could not draw logits without near ties")


@pytest.mark.parametrize("t", [1, 4])
@pytest.mark.parametrize("e,k,norm", ROUTE_CASES)
def test_route_topk(device: str, t: int, e: int, k: int, norm: bool) -> None:
    gen, seed = fresh_rng()
    h, router = distinct_router(gen, t, 64, e, k, device)
    counts = torch.full((e,), 3, dtype=torch.int32, device=device)
    ids, w = ops.route_topk(h @ router.T, k, norm, counts=counts)
    ref_ids, ref_w = layers.route(h, router, k, norm)
    assert torch.equal(ids, ref_ids), f"seed={seed}: {ids.tolist()} vs {ref_ids.tolist()}"
    check_route(ids, w, ref_ids, ref_w, f"E={e} k={k} seed={seed}")
    want = 3 + torch.bincount(ref_ids.reshape(-1).cpu(), minlength=e).int()
    assert torch.equal(counts.cpu(), want), f"seed={seed}: routed pairs counted per expert"
    # skip (a slot table, as decode prefetch passes): experts with a slot come back as -1 in
    # their place, written into the given ids
    skip = torch.where(torch.rand(e, generator=gen) < 0.5, 0, -1).int().to(device)
    got = torch.full((t, k), 7, dtype=torch.int64, device=device)
    ops.route_topk(h @ router.T, k, norm, skip=skip, ids=got)
    assert torch.equal(got, torch.where(skip[ref_ids] >= 0, -1, ref_ids)), f"seed={seed}"


# (D, E, K, renormalize, delta rows: 0 none, 1 [1, D], R [1, R, D])
NORM_ROUTE_CASES = [(2048, 128, 8, True, 1), (2048, 128, 8, False, 8), (96, 7, 3, True, 0),
                    (1000, 60, 4, False, 1), (256, 256, 16, True, 3)]


def norm_route_reference(x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor,
                         router: torch.Tensor, k: int, norm: bool):  # noqa: ANN201
    """(new x, h, ids, weights) from the reference ops; delta's rows added in order."""
    v = x.clone()
    if delta is not None:
        total = delta.reshape(1, -1, x.shape[1])[:, 0].clone()
        for r in range(1, delta.reshape(1, -1, x.shape[1]).shape[1]):
            total += delta.reshape(1, -1, x.shape[1])[:, r]
        v = x + total
    h = layers.rms_norm(v, w, EPS)
    return (v, h, *layers.route(h, router, k, norm))


def tied_free_norm_route(gen: torch.Generator, d: int, e: int, k: int, rows: int, device: str):  # noqa: ANN201
    """x, delta, w, router whose routed logits have no near ties among the top k + 1."""
    for _ in range(100):
        x, w = randn(gen, 1, d), randn(gen, d)
        delta = None if rows == 0 else randn(gen, 1, rows, d) if rows > 1 else randn(gen, 1, d)
        router = randn(gen, e, d, std=d ** -0.5)
        _, h, _, _ = norm_route_reference(x, delta, w, router, k, False)
        top = torch.sort(h @ router.T, dim=-1, descending=True).values[:, : k + 1]
        if (top[:, :-1] - top[:, 1:]).min() > 1e-4:
            return tuple(None if v is None else v.to(device) for v in (x, delta, w, router))
    raise AssertionError("could not draw logits without near ties")


@pytest.mark.parametrize("d,e,k,norm,rows", NORM_ROUTE_CASES)
def test_norm_route(device: str, d: int, e: int, k: int, norm: bool, rows: int) -> None:
    """The fused residual step + routing of one token (the kernel on CUDA, the three ops in
    turn on the CPU) against the reference: x + delta bit for bit, h to TOL, the same ids,
    weights to TOL, the routing counted; the sync count is left at zero, so a second call (a
    graph replay) routes again. Without delta: h not stored, skip as the prefetch guess passes."""
    gen, seed = fresh_rng()
    x, delta, w, router = tied_free_norm_route(gen, d, e, k, rows, device)
    want_x, want_h, ref_ids, ref_w = norm_route_reference(x.cpu(), None if delta is None
                                                          else delta.cpu(), w.cpu(),
                                                          router.cpu(), k, norm)
    sync = torch.zeros(1, dtype=torch.int32, device=device)
    counts = torch.full((e,), 2, dtype=torch.int32, device=device)
    skip = torch.where(torch.rand(e, generator=gen) < 0.5, 0, -1).int().to(device)
    msg = f"D={d} E={e} k={k} rows={rows} seed={seed}"
    for call in range(2):
        y = x.clone()
        got = torch.full((1, k), 7, dtype=torch.int64, device=device)
        h, ids, wts = ops.norm_route(y, delta, w, EPS, router, k, norm, sync, counts=counts,
                                     skip=None if rows else skip, ids=got, store_h=rows > 0)
        assert ids is got, msg
        assert int(sync.item()) == 0, f"{msg}: the count of finished programs was left set"
        assert same_bits(y.cpu(), want_x), f"{msg}: residual"
        if rows:
            assert max_rel(h.cpu(), want_h) < TOL, f"{msg}: norm"
            assert torch.equal(ids.cpu(), ref_ids), f"{msg}: {ids.tolist()} vs {ref_ids.tolist()}"
        else:
            assert h is None, msg
            assert torch.equal(ids.cpu(), torch.where(skip.cpu()[ref_ids] >= 0, -1, ref_ids)), msg
        check_route(ids.cpu() if rows else ref_ids, wts.cpu(), ref_ids, ref_w, msg)
        want = 2 + (call + 1) * torch.bincount(ref_ids.reshape(-1), minlength=e).int()
        assert torch.equal(counts.cpu(), want), f"{msg}: routed pairs counted per expert"
    # a shared expert's gate row after the router's (one GEMV for both): the same routing, the
    # gate's sigmoid written beside it, the fused kernel's row E + 1 and the three ops' alike
    g = randn(gen, 1, d, device=device, std=0.05)
    y, gate = x.clone(), torch.full((1, 1), NAN, device=device)
    h, ids, wts = ops.norm_route(y, delta, w, EPS, torch.cat([router, g]), k, norm, sync,
                                 gate=gate)
    assert int(sync.item()) == 0 and same_bits(y.cpu(), want_x), f"{msg}: gate row"
    assert torch.equal(ids.cpu(), ref_ids), f"{msg}: gate row: {ids.tolist()}"
    check_route(ids.cpu(), wts.cpu(), ref_ids, ref_w, msg + " gate row")
    want_g = torch.sigmoid(want_h @ g.cpu().T)
    assert max_rel(gate.cpu(), want_g) < TOL, f"{msg}: gate {gate.item()} vs {want_g.item()}"


def sm90(fn, sig: dict, constexprs: dict):  # noqa: ANN001, ANN201
    """`fn` compiled by Triton for sm_90 (no GPU needed): its asm dict."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    return triton.compile(ASTSource(fn, sig, constexprs=constexprs),
                          target=GPUTarget("cuda", 90, 32)).asm


@pytest.mark.parametrize("count, skip, sort, gate", [
    (True, False, False, False), (False, True, False, False), (False, False, False, False),
    (True, False, True, False), (False, True, True, False), (True, False, True, True)])
def test_route_kernel_compiles_for_sm90(count: bool, skip: bool, sort: bool, gate: bool) -> None:
    """Without a GPU: Triton compiles the routing kernel for sm_90 as the decode step (counting)
    and the prefetch's guess (skipping experts with a slot) launch it, by rank comparison or
    bitonic top-k (sort, at 256 experts); it reads the logits row once (the rank comparison's
    two reads of it are one load), with skip the slot table too, with gate the shared expert's
    logit after the row."""
    sig = {"logits": "*fp32", "ids": "*i64", "wts": "*fp32", "counts": "*i32", "skip": "*i32",
           "gate": "*fp32", "E": "i32", "stride_l": "i32", "K": "constexpr",
           "NORM": "constexpr", "COUNT": "constexpr", "SKIP": "constexpr",
           "BLOCK_E": "constexpr", "BLOCK_J": "constexpr", "SORT": "constexpr",
           "GATE": "constexpr"}
    asm = sm90(dk._route_kernel, sig, {"K": 8 if count else 2, "NORM": count, "COUNT": count,
                                        "SKIP": skip, **ops._route_blocks(256 if sort else 128),
                                        "SORT": sort, "GATE": gate})
    assert asm["cubin"]
    assert asm["ttir"].count("tt.load") == 1 + skip + gate
    assert ("tt.atomic_rmw" in asm["ttir"]) == count


@pytest.mark.parametrize("delta, count, skip, gate", [(1, True, False, False),
                                                      (8, True, False, True),
                                                      (0, False, True, False)])
def test_norm_route_kernel_compiles_for_sm90(delta: int, count: bool, skip: bool,
                                             gate: bool) -> None:
    """The fused residual + norm + router + top-k kernel for sm_90, as the decode step (delta:
    the attention's row, or 8 expert rows; counting; with them a shared expert's gate row
    after the router's, at 256 experts) and the prefetch guess (no delta, no h, skip) launch it
    (with 8 rows, the bitonic top-k): the count of finished programs is one atomic add and one
    exchange (plus the routing counts), and the logits (the gate's too) are read back past L1
    (.cg)."""
    sig = {"x": "*fp32", "delta": "*fp32", "w": "*fp32", "router": "*fp32", "h": "*fp32",
           "logits": "*fp32", "ids": "*i64", "wts": "*fp32", "counts": "*i32", "skip": "*i32",
           "sync": "*i32", "gate": "*fp32", "D": "i32", "E": "i32", "stride_r": "i32",
           "stride_w": "i32", "eps": "fp32"}
    sig.update(dict.fromkeys(["HAS_DELTA", "R", "STORE_H", "K", "NORM", "COUNT", "SKIP", "BN",
                              "BLOCK_D", "BLOCK_E", "BLOCK_J", "SORT", "GATE"], "constexpr"))
    asm = sm90(dk._norm_route_kernel, sig, {
        "HAS_DELTA": delta > 0, "R": max(delta, 1), "STORE_H": delta > 0, "K": 8, "NORM": count,
        "COUNT": count, "SKIP": skip, "BN": 2, "BLOCK_D": 2048,
        **ops._route_blocks(256 if gate else 128), "SORT": delta == 8, "GATE": gate})
    ttir = asm["ttir"]
    assert asm["cubin"]
    assert ttir.count("tt.atomic_rmw") == 2 + count
    assert "atom.global.gpu.acq_rel.add" in asm["ptx"] or "atom.acq_rel.gpu" in asm["ptx"], \
        "the count is not an acquire-release atomic"
    assert ttir.count("cacheModifier = cg") == 1 + gate, "logits must be read past L1"


def test_attention_reduce_with_an_output_gate_compiles_for_sm90() -> None:
    """The decode attention's reduce with qwen35moe's output gate (a strided row per head,
    read once, its sigmoid times the combined row) for sm_90, without a GPU."""
    const = dict(HD=256, MIN_CHUNK=ops.ATTN_MIN_CHUNK, BLOCK_N=32, BLOCK_S=16, BLOCK_D=256,
                 WINDOW=0, HAS_SINKS=False, HAS_GATE=True)
    sig = {"part_o": "*fp32", "part_ml": "*fp32", "length": "*i64", "out": "*fp32",
           "T": "i32", "H": "i32", "S": "i32", "stride_ot": "i32", "sinks": "*fp32",
           "gate": "*fp32", "stride_gt": "i32", "stride_gh": "i32",
           **dict.fromkeys(const, "constexpr")}
    asm = sm90(dk._attn_reduce_kernel, sig, const)
    plain = sm90(dk._attn_reduce_kernel, sig, const | {"HAS_GATE": False})
    assert asm["cubin"]
    assert asm["ttir"].count("tt.load") == plain["ttir"].count("tt.load") + 1  # the gate's row


def test_route_ties_go_to_the_lower_id(device: str) -> None:
    if device == "cpu":
        pytest.skip("the tie rule is the kernel's; torch.topk promises no order")
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, -3.0]], device=device)
    ids, w = ops.route_topk(logits, 4, False)
    assert ids.tolist() == [[1, 3, 2, 4]]
    assert w[0, 0] == w[0, 1] and w[0, 2] == w[0, 3]


# ---- argument checks (no GPU needed) -------------------------------------------------------------


def test_bad_arguments() -> None:
    x, w = torch.zeros(2, 8), torch.ones(8)
    with pytest.raises(ValueError, match="float32"):
        ops.rms_norm(x.double(), w, EPS)
    with pytest.raises(ValueError, match="weight must be"):
        ops.rms_norm(x, torch.ones(7), EPS)
    with pytest.raises(ValueError, match="delta must be"):
        ops.add_rms_norm(x, torch.zeros(3, 8), w, EPS)
    q, kv, cache = torch.zeros(1, 4, 8), torch.zeros(1, 2, 8), torch.zeros(16, 2, 8)
    inv = ops.rope_inv_freq(8, 1e4, "cpu")
    pos = torch.tensor([0])
    with pytest.raises(ValueError, match="style"):
        ops.qk_rope_store(q, kv, kv, None, None, EPS, pos, inv, "llama", cache, cache)
    with pytest.raises(ValueError, match="pos must be"):
        ops.qk_rope_store(q, kv, kv, None, None, EPS, torch.tensor([0.0]), inv, "neox", cache,
                          cache)
    with pytest.raises(ValueError, match="rope_dim"):
        ops.qk_rope_store(q, kv, kv, None, None, EPS, pos, ops.rope_inv_freq(16, 1e4, "cpu"),
                          "neox", cache, cache)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        ops.decode_attention(torch.zeros(1, 3, 8), cache, cache, pos, 1.0)
    with pytest.raises(ValueError, match="length must be"):
        ops.decode_attention(q, cache, cache, torch.tensor([1, 2]), 1.0)
    with pytest.raises(ValueError, match="k must be"):
        ops.route_topk(torch.zeros(2, 4), 5, True)
    assert not ops.fused_decode_available("cpu")
    assert ops.fused_decode_available("cuda") == torch.cuda.is_available()


# ---- CUDA graph: one capture, replayed at advancing positions ------------------------------------


@pytest.mark.cuda
def test_cuda_graph_replays_follow_pos_and_length() -> None:
    """add_rms_norm -> qkv matmul -> qk_rope_store -> decode_attention -> rms_norm -> router
    matmul -> route_topk, captured once; each replay moves pos/length (fill_) and gets fresh
    inputs (copy_). Each stage is checked against the reference applied to the graph's own input
    of that stage, so an error points at one op, and a value baked in at capture (a position, a
    length, a split count) shows up at the first replay that differs from the capture."""
    gen, seed = fresh_rng()
    dev = "cuda"
    t, d, h, hkv, hd, e, k, cap = 2, 256, 8, 2, 64, 16, 4, 700
    w_norm, w_onorm = randn(gen, d, device=dev), randn(gen, h * hd, device=dev)
    wqkv = randn(gen, (h + 2 * hkv) * hd, d, device=dev, std=d ** -0.5)
    qn, kn = randn(gen, hd, device=dev), randn(gen, hd, device=dev)
    router = randn(gen, e, h * hd, device=dev, std=(h * hd) ** -0.5)
    inv_freq = ops.rope_inv_freq(hd, 1e6, dev)
    x, delta = torch.zeros(t, d, device=dev), torch.zeros(t, d, device=dev)
    pos = torch.zeros(1, dtype=torch.int64, device=dev)
    length = torch.full((1,), t, dtype=torch.int64, device=dev)
    kc = torch.full((cap, hkv, hd), NAN, device=dev)
    vc = torch.full((cap, hkv, hd), NAN, device=dev)

    def step() -> tuple[torch.Tensor, ...]:
        hh = ops.add_rms_norm(x, delta, w_norm, EPS)
        qkv = hh @ wqkv.T
        q = qkv[:, : h * hd].view(t, h, hd)
        kk = qkv[:, h * hd: (h + hkv) * hd].view(t, hkv, hd)
        v = qkv[:, (h + hkv) * hd:].view(t, hkv, hd)
        qr = ops.qk_rope_store(q, kk, v, qn, kn, EPS, pos, inv_freq, "neox", kc, vc)
        o = ops.decode_attention(qr, kc, vc, length, hd ** -0.5)
        on = ops.rms_norm(o, w_onorm, EPS)
        ids, wts = ops.route_topk(on @ router.T, k, True)
        return hh, qkv, qr, o, on, ids, wts

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile every kernel before the capture
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()

    written = 0  # rows 0..written-1 hold keys/values
    for p in (0, 2, 4, 6, 129, 131, 400, cap - 2 * t, cap - t):
        if p > written:  # a jump: fill the skipped rows as a prompt would
            kc[written:p] = randn(gen, p - written, hkv, hd, device=dev)
            vc[written:p] = randn(gen, p - written, hkv, hd, device=dev)
        kc[p:], vc[p:] = NAN, NAN  # anything read past the new rows poisons the output
        x_in, d_in = randn(gen, t, d, device=dev), randn(gen, t, d, device=dev)
        x.copy_(x_in)
        delta.copy_(d_in)
        pos.fill_(p)
        length.fill_(p + t)
        graph.replay()
        torch.cuda.synchronize()
        written = p + t
        hh, qkv, qr, o, on, ids, wts = outs
        msg = f"pos={p} seed={seed}"
        assert same_bits(x, x_in + d_in), f"{msg}: residual"
        assert max_rel(hh, layers.rms_norm(x_in + d_in, w_norm, EPS)) < TOL, f"{msg}: norm"
        q = qkv[:, : h * hd].view(t, h, hd)
        kk = qkv[:, h * hd: (h + hkv) * hd].view(t, hkv, hd)
        q_ref, k_ref = rope_reference(q, kk, qn, kn, torch.arange(p, p + t, device=dev), hd, 1e6,
                                      "neox")
        assert max_rel(qr, q_ref) < TOL, f"{msg}: q rope {max_rel(qr, q_ref):.2e}"
        assert max_rel(kc[p:p + t], k_ref) < TOL, f"{msg}: k rope / cache row"
        assert same_bits(vc[p:p + t], qkv[:, (h + hkv) * hd:].view(t, hkv, hd)), f"{msg}: v"
        assert kc[p + t:].isnan().all(), f"{msg}: rows past length written"
        o_ref = layers.attention(qr, kc[:p + t], vc[:p + t], p)
        assert max_rel(o, o_ref) < TOL, f"{msg}: attention {max_rel(o, o_ref):.2e}"
        assert max_rel(on, layers.rms_norm(o, w_onorm, EPS)) < TOL, f"{msg}: rms_norm"
        ref_ids, ref_w = layers.route(on, router, k, True)
        check_route(ids, wts, ref_ids, ref_w, msg)


@pytest.mark.cuda
def test_norm_route_in_a_cuda_graph() -> None:
    """Two fused residual + routing steps in a row sharing one sync count (two layers of a
    decode step), captured once and replayed on fresh inputs: each replay routes anew, so the
    count is back at zero after every launch, and the second step sees the first's residual."""
    gen, seed = fresh_rng()
    dev, d, e, k = "cuda", 2048, 128, 8
    w1, w2 = randn(gen, d, device=dev), randn(gen, d, device=dev)
    r1, r2 = (randn(gen, e, d, device=dev, std=d ** -0.5) for _ in range(2))
    x, d1, d2 = torch.zeros(1, d, device=dev), torch.zeros(1, d, device=dev), \
        torch.zeros(1, 8, d, device=dev)
    sync = torch.zeros(1, dtype=torch.int32, device=dev)

    def step() -> tuple[torch.Tensor, ...]:
        h1, i1, g1 = ops.norm_route(x, d1, w1, EPS, r1, k, True, sync)
        h2, i2, g2 = ops.norm_route(x, d2, w2, EPS, r2, k, False, sync)
        return h1, i1, g1, h2, i2, g2

    step()  # compiles both before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for rep in range(5):
        x_in, a, b = (randn(gen, *t.shape, device=dev) for t in (x, d1, d2))
        x.copy_(x_in)
        d1.copy_(a)
        d2.copy_(b)
        graph.replay()
        torch.cuda.synchronize()
        msg = f"replay {rep} seed={seed}"
        assert int(sync.item()) == 0, msg
        v1, h1, i1, g1 = norm_route_reference(x_in.cpu(), a.cpu(), w1.cpu(), r1.cpu(), k, True)
        v2, h2, i2, g2 = norm_route_reference(v1, b.cpu(), w2.cpu(), r2.cpu(), k, False)
        assert same_bits(x.cpu(), v2), f"{msg}: residual"
        for got, want in zip(outs, (h1, i1, g1, h2, i2, g2), strict=True):
            if got.dtype == torch.int64:
                continue  # ids: checked with their weights below
            assert max_rel(got.cpu(), want) < TOL, msg
        check_route(outs[1].cpu(), outs[2].cpu(), i1, g1, msg)
        check_route(outs[4].cpu(), outs[5].cpu(), i2, g2, msg)


# ---- the kernels on the CPU, under Triton's interpreter ------------------------------------------

_INTERPRETED = """
    import torch
    from strata.kernels.gpu import decode_ops as ops
    from strata.model import layers

    gen = torch.Generator().manual_seed(seed)
    nan = float("nan")
    ops.scratch = lambda shape, dtype, device: torch.full(shape, nan, dtype=dtype, device=device)
    def rnd(*shape):
        return torch.randn(*shape, generator=gen)
    def rel(a, b):
        return float((a.double() - b.double()).abs().max() / b.double().abs().max())
    TOL, EPS = 1e-5, 1e-6

    for t, d in ((1, 96), (3, 256)):
        x, dl, w = rnd(t, d), rnd(t, d), rnd(d)
        out = torch.full((t, d), nan)
        assert rel(ops.rms_norm(x, w, EPS, out=out), layers.rms_norm(x, w, EPS)) < TOL
        y = x.clone()
        h = ops.add_rms_norm(y, dl, w, EPS, out=out)
        assert torch.equal(y, x + dl) and rel(h, layers.rms_norm(x + dl, w, EPS)) < TOL
        rows = rnd(t, 5, d)  # K rows per token, unsummed: added in order, then to x
        total = rows[:, 0] + rows[:, 1] + rows[:, 2] + rows[:, 3] + rows[:, 4]
        y = x.clone()
        h = ops.add_rms_norm(y, rows, w, EPS, out=out)
        assert torch.equal(y, x + total) and rel(h, layers.rms_norm(x + total, w, EPS)) < TOL
        # a shared expert's row beside them: as if it were row 6 (the copy joining them saved)
        extra = rnd(t, d)
        y, z = x.clone(), x.clone()
        h = ops.add_rms_norm(y, rows, w, EPS, out=out, extra=extra)
        h2 = ops.add_rms_norm(z, torch.cat([rows, extra[:, None]], 1), w, EPS)
        assert torch.equal(y, z) and torch.equal(h, h2) and torch.equal(y, x + (total + extra))

    cap = 300
    for h, hkv, hd, rope_dim, style, norm, t in ((4, 2, 64, 64, "neox", True, 3),
                                                 (3, 1, 64, 32, "normal", True, 1),
                                                 (4, 4, 32, 24, "neox", False, 2),
                                                 (2, 2, 32, 32, "normal", False, 3)):
        qkv = rnd(t, (h + 2 * hkv) * hd)
        q = qkv[:, :h * hd].view(t, h, hd)
        k = qkv[:, h * hd:(h + hkv) * hd].view(t, hkv, hd)
        v = qkv[:, (h + hkv) * hd:].view(t, hkv, hd)
        qn, kn = (rnd(hd), rnd(hd)) if norm else (None, None)
        for p, dt in ((0, torch.int64), (117, torch.int32), (cap - t, torch.int64)):
            kc, vc, out = torch.full((cap, hkv, hd), nan), torch.full((cap, hkv, hd), nan), \\
                torch.full((t, h, hd), nan)
            ops.qk_rope_store(q, k, v, qn, kn, EPS, torch.tensor([p], dtype=dt),
                              ops.rope_inv_freq(rope_dim, 1e4, "cpu"), style, kc, vc, out=out)
            cos, sin = layers.rope_tables(torch.arange(p, p + t), rope_dim, 1e4)
            qr, kr = (q, k) if not norm else (layers.rms_norm(q, qn, EPS),
                                              layers.rms_norm(k, kn, EPS))
            assert rel(out, layers.apply_rope(qr, cos, sin, style)) < TOL, (style, p)
            assert rel(kc[p:p + t], layers.apply_rope(kr, cos, sin, style)) < TOL, (style, p)
            assert torch.equal(vc[p:p + t], v), (style, p)
            assert kc[:p].isnan().all() and kc[p + t:].isnan().all() and vc[p + t:].isnan().all()

    # (T, H, Hkv, hd, capacity, lengths, n_splits)
    for t, h, hkv, hd, cap, lengths, splits in ((1, 4, 2, 64, 300, (1, 128, 129, 300), None),
                                                (3, 6, 2, 64, 333, (3, 130, 333), None),
                                                (3, 8, 1, 32, 200, (3, 200), 1),  # T·G = 24
                                                (2, 4, 4, 32, 260, (2, 259), 8)):
        for i, n in enumerate(lengths):
            junk = nan if i % 2 == 0 else 1e30
            kc, vc = torch.full((cap, hkv, hd), junk), torch.full((cap, hkv, hd), junk)
            kc[:n], vc[:n] = rnd(n, hkv, hd), rnd(n, hkv, hd)
            q = rnd(t, h, hd) * 0.5
            out = torch.full((t, h * hd), nan)
            ops.decode_attention(q, kc, vc, torch.tensor([n]), hd ** -0.5, out=out,
                                 n_splits=splits)
            err = rel(out, layers.attention(q, kc[:n], vc[:n], n - t))
            assert err < TOL, (t, h, hkv, hd, n, err)
            # an output gate per head read strided (qwen35moe's q rows hold [q | gate] a head)
            qg = rnd(t, h, 2, hd)
            gated = ops.decode_attention(qg[:, :, 0], kc, vc, torch.tensor([n]), hd ** -0.5,
                                         n_splits=splits, gate=qg[:, :, 1])
            want = layers.attention(qg[:, :, 0].contiguous(), kc[:n], vc[:n], n - t) * \
                torch.sigmoid(qg[:, :, 1].reshape(t, -1))
            assert rel(gated, want) < TOL, (t, h, hkv, hd, n, "gate")

    # float16 / bfloat16 caches (--kv-type): k and v rounded once when stored, read as float32
    for dt, ulp in ((torch.float16, 2.0 ** -10), (torch.bfloat16, 2.0 ** -7)):
        t, h, hkv, hd, cap, p = 2, 4, 2, 64, 300, 131
        q, k, v = rnd(t, h, hd), rnd(t, hkv, hd), rnd(t, hkv, hd)
        kc = torch.full((cap, hkv, hd), nan, dtype=dt)
        vc = torch.full((cap, hkv, hd), nan, dtype=dt)
        kc[:p], vc[:p] = rnd(p, hkv, hd).to(dt), rnd(p, hkv, hd).to(dt)
        qr = ops.qk_rope_store(q, k, v, None, None, EPS, torch.tensor([p]),
                               ops.rope_inv_freq(hd, 1e4, "cpu"), "neox", kc, vc)
        cos, sin = layers.rope_tables(torch.arange(p, p + t), hd, 1e4)
        assert rel(kc[p:p + t].float(), layers.apply_rope(k, cos, sin, "neox")) <= ulp, dt
        # (the interpreter rounds to bfloat16 toward zero, the GPU to nearest as torch does:
        # within one ulp here, bit-equal in test_reduced_kv_types on CUDA)
        assert ((vc[p:p + t].float() - v).abs() <= ulp * v.abs()).all(), dt
        assert kc[p + t:].isnan().all() and vc[p + t:].isnan().all(), dt
        out = ops.decode_attention(qr, kc, vc, torch.tensor([p + t]), hd ** -0.5, n_splits=4)
        ref = layers.attention(qr, kc[:p + t].float(), vc[:p + t].float(), p)
        assert rel(out, ref) < TOL, (dt, rel(out, ref))

    for sort in (None, 1):  # the rank comparison, then the bitonic top-k (every E)
        ops.ROUTE_SORT_MIN_EXPERTS = sort
        for e, k, norm in ((60, 4, False), (8, 2, True), (128, 8, True), (256, 16, True),
                           (256, 6, True), (7, 7, False)):
            logits = torch.stack([(torch.randperm(e, generator=gen) + 0.5 * torch.rand(
                e, generator=gen)) * 0.1 for _ in range(3)])  # distinct, with gaps >= 0.05
            counts = torch.full((e,), 5, dtype=torch.int32)
            ids, w = ops.route_topk(logits, k, norm, counts=counts)
            ref_ids, ref_w = layers.route(logits, torch.eye(e), k, norm)
            assert torch.equal(ids, ref_ids) and rel(w, ref_w) < TOL, (e, k)
            want = 5 + torch.bincount(ref_ids.reshape(-1), minlength=e).int()
            assert torch.equal(counts, want), (e, k)
            # a shared expert's gate logit after the row: the same routing, its sigmoid
            lg, gate = torch.cat([logits, rnd(3, 1)], 1), torch.full((3, 1), nan)
            ids, w = ops.route_topk(lg, k, norm, gate=gate)
            assert torch.equal(ids, ref_ids) and rel(w, ref_w) < TOL, (e, k, "gate")
            assert rel(gate, torch.sigmoid(lg[:, e:])) < TOL, (e, k, "gate")
            # skip (a slot table): experts with a slot come back as -1 in their place, into ids
            skip = torch.where(torch.rand(e, generator=gen) < 0.5, 3, -1).int()
            got = torch.full((3, k), 7, dtype=torch.int64)
            ops.route_topk(logits, k, norm, skip=skip, ids=got)
            assert torch.equal(got, torch.where(skip[ref_ids] >= 0, -1, ref_ids)), (e, k)
        for e, d in ((128, 2048), (7, 96), (60, 1500)):
            hh, rw = rnd(1, d), rnd(e, d)
            plain = ops.router_logits(hh, rw)
            assert rel(plain, hh @ rw.T) < TOL, (e, d)
            # the sigmoid of the same sums: against the sigmoid of the plain launch's logits (a
            # logit near 0 carries the error of the largest one, ~TOL·max|logit|, and sigmoid's
            # slope there is 1/4: against torch's sums the bound would be that, not TOL)
            assert rel(ops.router_logits(hh, rw, sigmoid=True), torch.sigmoid(plain)) < 1e-6, \\
                (e, d, "sigmoid")
            bias = rnd(e)  # (gpt-oss's router bias, in the same launch)
            assert torch.equal(ops.router_logits(hh, rw, bias=bias), ops.router_logits(hh, rw)
                               + bias), (e, d, "bias")
        ids, w = ops.route_topk(torch.tensor([[0.5, 2.0, 1.0, 2.0, 1.0, -3.0]]), 4, False)
        assert ids.tolist() == [[1, 3, 2, 4]], ids  # ties: the lower id first
        # NaN logits route as -inf: still K distinct experts
        ids, w = ops.route_topk(torch.tensor([[nan, 1.0, nan, 0.5, 2.0]]), 4, False)
        assert ids.tolist() == [[4, 1, 3, 0]], ids
        # the fused residual step + routing (the kernel: the tensors are on the CPU, interpreted)
        import os
        sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"].split(os.pathsep)[0], "tests"))
        import test_decode_ops as cases
        cases.ops.ROUTE_SORT_MIN_EXPERTS = sort  # (the same module: ops)
        for case in cases.NORM_ROUTE_CASES[slice(None) if sort is None else slice(1, None, 3)]:
            cases.test_norm_route("cpu", *case)
    print("ok")
"""


def test_kernels_under_the_interpreter() -> None:
    """Every kernel (rms_norm, add_rms_norm, qk_rope_store, both attention kernels,
    router_logits, route_topk, norm_route) on small odd shapes, on the CPU under
    TRITON_INTERPRET=1 (~20 s)."""
    _, seed = fresh_rng()
    run_interpreted(_INTERPRETED, seed, timeout=300)
