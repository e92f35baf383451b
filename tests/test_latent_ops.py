"""MLA's absorbed decode attention (strata.kernels.gpu.latent_ops.latent_attention): the torch
form against each token's attention over its own rows gathered (written out here), the split
kernel against the torch form under Triton's interpreter (small H / L / R, odd lengths, f32 /
f16 / bf16 rows, one sequence and a pool's rows), its sm_90 builds at DeepSeek-V3's shape, and
on CUDA at that shape.

Rows a token must not read are NaN (the storage past its length, the pool rows no block table
names) and the split partials start as NaN, so a read of either shows up as a NaN in the
output. Tolerance: TOL as max |out - ref| / max |ref| (the kernels sum in another order, exact
float32); TF32_TOL for the TF32 kernel against the reference over TF32-truncated inputs, as
tests/test_decode_ops.py holds the GQA kernels.
"""

from __future__ import annotations

import pytest
import torch
from interpreted import every_case, fresh_seed, run_interpreted_side_by_side

from strata.kernels.gpu import latent_ops

TOL = 1e-5
TF32_TOL = 4e-3
NAN = float("nan")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


def max_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; NaN anywhere in out gives NaN (fails every `<`)."""
    return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())


def written_out(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                lengths: list[int], scale: float, read: torch.Tensor | None) -> torch.Tensor:
    """Each token's attention over its own rows, one at a time, in float64: [B, H, L]."""
    lat, out = q_lat.shape[2], []
    for b, n in enumerate(lengths):
        rows = cache[:n] if read is None else cache[read[b, :n]]
        rows = rows.double()
        c, k_pe = rows[:, :lat], rows[:, lat:]  # [n, L], [n, R]
        scores = (q_lat[b].double() @ c.T + q_pe[b].double() @ k_pe.T) * scale  # [H, n]
        out.append(torch.softmax(scores, dim=-1) @ c)
    return torch.stack(out)


def inputs(gen: torch.Generator, h: int, lat: int, rope: int, rows: int, lengths: list[int],
           dtype: torch.dtype, paged: bool) -> tuple:
    """q_lat, q_pe, the cache [rows, L + R] (NaN where no token may read) and read or None."""
    b = len(lengths)
    q_lat = torch.randn(b, h, lat, generator=gen) * lat ** -0.25
    q_pe = torch.randn(b, h, rope, generator=gen) * rope ** -0.25
    cache = torch.full((rows, lat + rope), NAN)
    if not paged:
        cache[:lengths[0]] = torch.randn(lengths[0], lat + rope, generator=gen)
        return q_lat, q_pe, cache.to(dtype), None
    span = max(lengths) + 3  # (positions past each length: masked)
    read = torch.stack([torch.randperm(rows, generator=gen)[:span] for _ in range(b)])
    for i, n in enumerate(lengths):
        cache[read[i, :n]] = torch.randn(n, lat + rope, generator=gen)
    return q_lat, q_pe, cache.to(dtype), read


# (H, L, R, storage rows, lengths of the B tokens, paged): one sequence at length 1, across a
# split and to the storage's end; a pool's tokens of different lengths
TORCH_CASES = [(4, 48, 8, 70, [1], False), (3, 32, 16, 70, [33], False),
               (5, 64, 8, 70, [70], False), (4, 48, 8, 90, [1, 40, 17], True)]


@pytest.mark.parametrize("case", TORCH_CASES)
@pytest.mark.parametrize("kind", list(DTYPES))
def test_torch_form_is_each_tokens_attention(case, kind):
    h, lat, rope, rows, lengths, paged = case
    gen = torch.Generator().manual_seed(fresh_seed() % 2**31)
    q_lat, q_pe, cache, read = inputs(gen, h, lat, rope, rows, lengths, DTYPES[kind], paged)
    got = latent_ops.latent_attention(q_lat, q_pe, cache, torch.tensor(lengths), 0.3, read)
    assert got.shape == (len(lengths), h, lat)
    ref = written_out(q_lat, q_pe, cache, lengths, 0.3, read)
    assert max_rel(got, ref) < TOL, (case, kind)


def test_bad_arguments():
    q_lat, q_pe, cache = torch.zeros(2, 4, 32), torch.zeros(2, 4, 16), torch.zeros(10, 48)
    with pytest.raises(ValueError, match="one sequence"):
        latent_ops.latent_attention(q_lat, q_pe, cache, torch.tensor([1, 1]), 1.0)
    with pytest.raises(ValueError, match=r"cache must be \[10, 40\]"):
        latent_ops.latent_attention(q_lat, q_pe[..., :8], cache, torch.tensor([1, 1]), 1.0,
                                    torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="float32, float16, bfloat16"):
        latent_ops.latent_attention(q_lat[:1], q_pe[:1], cache.double(), torch.tensor([1]), 1.0)
    with pytest.raises(ValueError, match="length"):
        latent_ops.latent_attention(q_lat[:1], q_pe[:1], cache, torch.tensor([1.0]), 1.0)


# ---- the kernel under the interpreter ------------------------------------------------------------

_INTERPRETED = """
    import torch
    sys.path.insert(0, "tests")
    import test_latent_ops as cases
    from strata.kernels.gpu import latent_ops as lo
    gen = torch.Generator().manual_seed(seed % 2**31)
    nan = float("nan")
    lo.scratch = lambda shape, dtype, device: torch.full(shape, nan, dtype=dtype, device=device)
    for i, (h, lat, rope, rows, lengths, paged, splits) in enumerate(CASES):
        for kind in KINDS:
            q_lat, q_pe, cache, read = cases.inputs(gen, h, lat, rope, rows, lengths,
                                                    cases.DTYPES[kind], paged)
            length = torch.tensor(lengths, dtype=torch.int32 if paged else torch.int64)
            ref = lo._latent_torch(q_lat, q_pe, cache, length, 0.3, read)
            # (the TF32 kernel runs as float32 under the interpreter: every other case)
            for fused in (False, True) if i % 2 == 0 else (False,):
                got = lo.latent_attention(q_lat, q_pe, cache, length, 0.3, read, fused=fused,
                                          n_splits=splits)
                err = cases.max_rel(got, ref)
                assert err < cases.TOL, (h, lat, rope, lengths, paged, splits, kind, fused, err)
    print("ok")
"""

# (H, L, R, storage rows, lengths, paged, n_splits): 4 heads of one 16-row block, L and R not
# powers of two or under tl.dot's 16; 20 heads (a full and a partial head block); lengths 1, 31,
# 33 (a split of 32 and one past it), 100 (not a multiple of a split) and the storage's end;
# a given S with splits past the length (3 of 32 rows over 40), one split over 100 rows; a pool's
# tokens of different lengths
INTERPRETED_CASES = [(4, 48, 8, 130, [1], False, None), (4, 48, 8, 130, [31], False, None),
                     (4, 48, 8, 130, [33], False, None), (4, 48, 8, 130, [100], False, None),
                     (20, 64, 16, 130, [130], False, None), (4, 32, 16, 130, [40], False, 3),
                     (3, 32, 8, 130, [100], False, 1),
                     (20, 48, 16, 140, [1, 100, 33], True, None),
                     (4, 64, 8, 140, [70, 5], True, 4)]


def _interpreted(kinds: tuple[str, ...]) -> str:
    return (_INTERPRETED.replace("CASES", repr(INTERPRETED_CASES), 1)
            .replace("KINDS", repr(kinds), 1))


def test_kernel_under_the_interpreter():
    """The split kernel and the reduce (interpreted on CPU tensors) equal the torch form over
    f32 and bf16 rows side by side (~15 s)."""
    pytest.importorskip("triton")
    run_interpreted_side_by_side([_interpreted(("f32",)), _interpreted(("bf16",))],
                                 fresh_seed(), timeout=300)


@every_case
def test_kernel_over_f16_rows_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted_side_by_side([_interpreted(("f16",))], fresh_seed(), timeout=300)


# ---- sm_90 builds --------------------------------------------------------------------------------

# DeepSeek-V3 / R1 (Kimi-K2: 64 heads, the same CTA); sm_90's limits per block
DEEPSEEK_V3 = dict(h=128, lat=512, rope=64)
SM90_SHARED, SM90_REGS = 232448, 255


def latent_kernel_resources(fused: bool, kind: str, paged: bool, rows: int = 32768) -> dict:
    """The split kernel as the launch builds it at DeepSeek-V3's shape for sm_90 (no GPU)."""
    from test_decode_ops import sm90_resources

    from strata.kernels.gpu import decode_kernels as dk

    h, lat, rope = DEEPSEEK_V3["h"], DEEPSEEK_V3["lat"], DEEPSEEK_V3["rope"]
    tile = latent_ops.latent_launch(fused)
    elem = {"f32": "fp32", "f16": "fp16", "bf16": "bf16"}[kind]
    pointers = {"ql": "*fp32", "qp": "*fp32", "cache": f"*{elem}", "read": "*i64",
                "length": "*i64", "part_o": "*fp32", "part_ml": "*fp32"}
    b = 4 if paged else 1
    ints = dict(B=b, H=h, S=latent_ops.latent_splits(rows, b * -(-h // tile.block_h)),
                stride_qb=h * lat, stride_qh=lat, stride_pb=h * rope, stride_ph=rope,
                stride_cr=lat + rope, stride_rb=rows if paged else 0)
    const = dict(L=lat, R=rope, MIN_CHUNK=latent_ops.ATTN_MIN_CHUNK, BLOCK_H=tile.block_h,
                 BLOCK_N=tile.block_n, BLOCK_L=lat, BLOCK_R=rope, STAGES=tile.stages,
                 PAGED=paged, TF32=tile.tf32)
    return sm90_resources(dk._latent_split_kernel, pointers, {"scale": "fp32"}, ints, const,
                          tile.warps)


@pytest.mark.slow
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind,paged", [("f32", False), ("bf16", False),
                                        pytest.param("f16", False, marks=every_case),
                                        pytest.param("bf16", True, marks=every_case),
                                        pytest.param("f32", True, marks=every_case)])
def test_kernel_fits_sm90_at_deepseek_v3(fused, kind, paged):
    """Without a GPU: the exact and the TF32 kernel, as launched at DeepSeek-V3's shape, build
    for sm_90 within its shared memory and registers, with no spills."""
    pytest.importorskip("triton")
    got = latent_kernel_resources(fused, kind, paged)
    msg = f"fused={fused} {kind} paged={paged}: {got}"
    assert got["shared"] <= SM90_SHARED and got["regs"] <= SM90_REGS, msg
    assert got["spills"] == 0 and got["stack"] == 0 and got["local"] == 0, msg


# ---- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("kind", list(DTYPES))
@pytest.mark.parametrize("fused", [False, True])
def test_kernel_on_cuda_at_deepseek_v3(kind, fused):
    """The compiled kernels at DeepSeek-V3's shape (H 128, L 512, R 64) against the torch form
    on the CPU: one sequence at lengths 1, 1000 and 4097 (not a multiple of a split) in a
    storage of 8192 rows, and four tokens of a pool at other lengths; the exact kernel to TOL,
    the TF32 one against TF32-truncated inputs to TF32_TOL. Rows past each length are NaN and
    the partials start as NaN."""
    from test_decode_ops import tf32

    gen = torch.Generator().manual_seed(fresh_seed() % 2**31)
    h, lat, rope = DEEPSEEK_V3["h"], DEEPSEEK_V3["lat"], DEEPSEEK_V3["rope"]
    scale = 1 / 192 ** 0.5  # (qk_nope 128 + rope 64; YaRN's mscale^2 left out)
    plain = latent_ops.scratch
    latent_ops.scratch = lambda shape, dtype, device: torch.full(shape, NAN, dtype=dtype,
                                                                 device=device)
    try:
        for lengths, rows, paged in (([1], 8192, False), ([1000], 8192, False),
                                     ([4097], 8192, False), ([1, 333, 4097, 2048], 9000, True)):
            q_lat, q_pe, cache, read = inputs(gen, h, lat, rope, rows, lengths, DTYPES[kind],
                                              paged)
            length = torch.tensor(lengths)
            # (TF32 keeps f16's and bf16's mantissas whole: only f32 rows lose bits)
            qx, px, cx = (q_lat, q_pe, cache) if not fused else (tf32(q_lat), tf32(q_pe),
                                                                 tf32(cache))
            ref = latent_ops.latent_attention(qx, px, cx, length, scale, read)
            dev = [t.cuda() if t is not None else None for t in (q_lat, q_pe, cache, length,
                                                                  read)]
            got = latent_ops.latent_attention(dev[0], dev[1], dev[2], dev[3], scale, dev[4],
                                              fused=fused)
            err = max_rel(got.cpu(), ref)
            tol = TF32_TOL if fused else TOL
            assert err < tol, f"{kind} fused={fused} lengths={lengths}: {err:.2e}"
    finally:
        latent_ops.scratch = plain
