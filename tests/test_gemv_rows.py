"""The one-token rows GEMV (matmul.gemv_rows: R rows a program, sharing each step's x tile)
against the reference, strata.quant.dequantize then a float32 matmul: under Triton's
interpreter, compiled for sm_90 (its K loop's loads counted in the SASS), and on CUDA.

Every run draws fresh random blocks and x (the seed is in each failure message); y starts as
NaN, so a row the kernel does not write shows up. Shapes: N not a multiple of R, N < R, K with a
partial last step (BK not dividing K, or larger than K), steps shorter than a block, R = 1, 2, 4,
8; rows 8-aligned and not (Q4_K and Q5_K then read their block headers byte by byte instead of
as two u64); x float32 and bfloat16.

Tolerances, ||y - ref|| / ||ref||:
  FMA_TOL  2e-5, as for the FMA GEMV (tests/test_kernels_gpu.py): exact weights, float32
           products summed in another order than torch's; ref uses the x the kernel was given.
  BF16_TOL 2^-8, bf16 x against the reference on the float32 x it was rounded from, row by
           row: rounding x to bf16 moves each x_j by at most 2^-9 of itself (8 significant
           bits), so row i moves by at most 2^-9 sum_j |w_ij x_j| (the bound doubled for the sums'
           own rounding). A norm-relative bound failed on a draw whose 5 rows nearly cancelled
           (1.01e-2 against 1e-2).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from interpreted import fresh_seed, rel_err, run_interpreted  # noqa: E402

from strata.kernels.gpu import FUSED_TYPES  # noqa: E402
from strata.quant import QType, get_quant  # noqa: E402

FMA_TOL = 2e-5
BF16_TOL = 2.0 ** -8

# (type, N, K, (R, BK, stages, warps), x dtype, byte offset of the rows: 0 aligned, 2 not)
CASES = [
    ("Q4_K", 13, 768, (4, 512, 1, 2), "float32", 0),  # 13 % 4 rows; last step half masked
    ("Q4_K", 5, 512, (8, 256, 1, 1), "bfloat16", 2),  # N < R; headers byte by byte
    ("Q4_K", 7, 256, (2, 128, 1, 1), "float32", 0),  # steps of half a block
    ("Q6_K", 11, 512, (4, 1024, 1, 2), "float32", 0),  # BK > K: one masked step
    ("Q6_K", 9, 768, (2, 512, 1, 2), "bfloat16", 0),
    ("Q5_K", 6, 512, (4, 256, 1, 1), "float32", 0),
    ("Q5_K", 3, 256, (1, 256, 1, 1), "float32", 2),
    ("Q8_0", 10, 416, (4, 256, 1, 1), "float32", 0),  # 13 blocks of 32: a partial step
    ("Q4_0", 9, 224, (8, 128, 1, 1), "bfloat16", 0),
    ("IQ2_XS", 5, 512, (2, 256, 1, 1), "float32", 0),
    ("IQ4_XS", 4, 256, (4, 256, 1, 1), "float32", 0),
]


def rows_at(w: np.ndarray, offset: int, dev: str) -> torch.Tensor:
    """The rows of w copied to `dev`, starting `offset` bytes past an aligned allocation."""
    flat = torch.zeros(w.size + 16, dtype=torch.uint8, device=dev)
    out = flat[offset:offset + w.size].view(w.shape)
    out.copy_(torch.from_numpy(w))
    assert out.data_ptr() % 8 == offset % 8
    return out


def check(rng: np.random.Generator, qtype: str, n: int, k: int, tile: tuple, xdtype: str,
          offset: int, dev: str) -> None:
    """gemv_rows on fresh random rows and x against the reference, on `dev`."""
    from strata.kernels.gpu.matmul import gemv_rows
    from strata.kernels.gpu.reference import matmul_ref
    from strata.quant import random_rows

    qt = QType[qtype]
    w = rows_at(random_rows(qt, n, k, rng, 0.05), offset, dev)
    x32 = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32) * 3).to(dev)
    x = x32.to(getattr(torch, xdtype))
    y = torch.full((1, n), float("nan"), device=dev)  # poisoned: every row must be written
    gemv_rows(x, w, qt, tile, out=y)
    what = f"{qtype} N {n} K {k} tile {tile} x {xdtype} offset {offset}"
    assert torch.isfinite(y).all(), f"{what}: rows not written"
    err = rel_err(y.cpu(), matmul_ref(x.cpu(), w.cpu(), qt))
    assert err < FMA_TOL, f"{what}: rel err {err:.2e}"
    if xdtype == "bfloat16":  # each row within bf16's rounding of x of the float32 x's
        from strata.quant import dequantize

        scale = x32.cpu().abs() @ dequantize(w.cpu(), qt, k).abs().T  # [1, N]: Σ_j |w_ij x_j|
        off = (y.cpu() - matmul_ref(x32.cpu(), w.cpu(), qt)).abs()
        worst = float((off / (scale + 1e-30)).max())
        assert worst <= BF16_TOL, f"{what}: {worst:.2e} of Σ|w x| against the float32 x"


_INTERPRETED = f"""
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from test_gemv_rows import CASES, check
    rng = np.random.default_rng(seed)
    for case in CASES:
        check(rng, *case, dev="cpu")
    print("ok")
"""


def test_gemv_rows_under_the_interpreter() -> None:
    run_interpreted(_INTERPRETED, fresh_seed(), timeout=300)


def test_gemv_rows_refuses_bad_tiles() -> None:
    from strata.kernels.gpu.matmul import gemv_rows

    w = torch.zeros(3, 144, dtype=torch.uint8)
    x = torch.zeros(1, 256)
    for tile in ((3, 256, 1, 1), (4, 16, 1, 1), (4, 96, 1, 1)):  # R; BK < S; BK not 2^n
        with pytest.raises(ValueError, match="tile"):
            gemv_rows(x, w, QType.Q4_K, tile)
    with pytest.raises(ValueError, match="one token"):
        gemv_rows(torch.zeros(2, 256), w, QType.Q4_K)


def test_quant_matmul_takes_rows_for_listed_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """quant_matmul sends one token to the rows kernel only for the shapes in GEMV_ROWS_TUNE
    (gpt-oss's 2880-wide Q8_0 ones by default; others take the FMA kernel)."""
    from strata.kernels.gpu import matmul as mm

    assert set(mm.GEMV_ROWS_TUNE) == {(int(QType.Q8_0), 201088, 2880),
                                      (int(QType.Q8_0), 5120, 2880)}
    launched = []
    monkeypatch.setattr(mm, "_launch_rows", lambda x, w, out, fmt, nbytes, tile, bias=None:
                        launched.append(tile))
    monkeypatch.setattr(mm, "GEMV_ROWS_TUNE", {(int(QType.Q4_K), 3, 256): (2, 256, 1, 1)})
    mm.quant_matmul(torch.zeros(1, 256), torch.zeros(3, 144, dtype=torch.uint8), QType.Q4_K)
    assert launched == [(2, 256, 1, 1)]
    # a benchmark's tile, given to the call (the table frozen: strata.kernels.tuning)
    mm.quant_matmul(torch.zeros(1, 256), torch.zeros(5, 144, dtype=torch.uint8), QType.Q4_K,
                    rows_tile=(4, 256, 1, 2))
    assert launched == [(2, 256, 1, 1), (4, 256, 1, 2)]
    from strata.kernels import tuning

    with pytest.raises(TypeError):
        tuning.GEMV_ROWS_TUNE[(int(QType.Q4_K), 3, 256)] = (2, 256, 1, 1)  # type: ignore[index]


def test_gemv_rows_loads_x_once_a_step() -> None:
    """Compiled for sm_90 (no GPU): each row added to a program adds only its own weight loads
    to the K loop (x is not read again), and Q4_K's 8-aligned rows read each block header as
    two 64-bit loads, with no byte loads left; no layout conversion through shared memory."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sass_count

    from strata.kernels.gpu import matmul as mm

    def loads(r: int) -> dict:
        sass, _ = sass_count.compile_sm90(
            mm._gemv_rows_kernel, {**sass_count.ROWS_SIG, "x": "*bf16"},
            {"QT": int(QType.Q4_K), "S": 32, "R": r, "BK": 1024, "EVEN_K": True, "STAGES": 1,
             "WIDE": True}, (0, 1, 2, 3, 4, 7), 2)
        ops = sass_count.opcodes(sass_count.longest_loop(sass))
        assert not any(op.startswith(("LDS", "STS", "BAR")) for op in ops), ops
        return {w: sum(op.startswith("LDG") and op.endswith(w) for op in ops)
                for w in (".128", ".64", ".U16", ".U8")}

    one, four = loads(1), loads(4)
    # one row: x (16 bf16 values a thread) in two 128-bit loads, the row's 16 quant bytes in
    # one, its header in two 64-bit loads; each further row: one 128-bit and two 64-bit loads
    assert one == {".128": 3, ".64": 2, ".U16": 0, ".U8": 0}, one
    assert four == {".128": 6, ".64": 8, ".U16": 0, ".U8": 0}, four


@pytest.mark.cuda
def test_gemv_rows_on_cuda() -> None:
    rng = np.random.default_rng(seed := fresh_seed())
    cases = CASES + [
        ("Q4_K", 14336, 4096, (4, 1024, 1, 2), "float32", 0),
        ("Q4_K", 4097, 2048, (8, 512, 1, 2), "bfloat16", 2),
        ("Q6_K", 14336, 4096, (4, 512, 1, 1), "bfloat16", 0),
        ("Q6_K", 2047, 2048, (2, 1024, 1, 4), "float32", 0),
        ("IQ3_XXS", 1001, 4096, (2, 512, 1, 4), "float32", 0),
        ("Q8_0", 999, 4096, (4, 1024, 1, 4), "bfloat16", 0),
    ]
    for case in cases:
        try:
            check(rng, *case, dev="cuda")
        except AssertionError as e:
            raise AssertionError(f"seed={seed}: {e}") from e


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", list(FUSED_TYPES), ids=lambda q: q.name)
@pytest.mark.parametrize("r", [1, 2, 4, 8])
def test_gemv_rows_every_type_on_cuda(qtype: QType, r: int) -> None:
    """Every fused type through the dequant_tile dispatch: 41 rows, three 256-value blocks
    (or 13 blocks of 32, a partial last step of 256)."""
    rng = np.random.default_rng(seed := fresh_seed())
    k = 768 if get_quant(qtype).block_size == 256 else 416
    try:
        check(rng, qtype.name, 41, k, (r, 256, 1, 2), "float32", 0, "cuda")
    except AssertionError as e:
        raise AssertionError(f"seed={seed}: {e}") from e
