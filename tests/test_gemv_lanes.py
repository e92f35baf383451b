"""The one-token lanes GEMV (matmul.gemv_lanes: BN rows across the lanes of a warp, which read
each x address together) against the reference, strata.quant.dequantize then a float32 matmul:
under Triton's interpreter, compiled for sm_90 (its register layout read from the TTGIR, its K
loop's loads counted in the SASS), and on CUDA.

Every run draws fresh random blocks and x (the seed is in each failure message); y starts as
NaN, so a row the kernel does not write shows up. Shapes: N not a multiple of BN, N < BN, N = 1,
K with a partial last step (BK not dividing K, or larger than K), steps shorter than a block;
BN 2 to 16; both dim orders of the tile ([BN, G, S] and GROUPS_FIRST's [G, BN, S]); rows
8-aligned and not (Q4_K and Q5_K then read their block headers byte by byte instead of as two
u64); x float32 and bfloat16; every fused type.

Tolerances, ||y - ref|| / ||ref||, as for the rows kernel (tests/test_gemv_rows.py):
  FMA_TOL  2e-5: exact weights, float32 products summed in another order than torch's.
  BF16_TOL 1e-2: bf16 x against the reference on the float32 x it was rounded from.
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
BF16_TOL = 1e-2

# (type, N, K, (BN, BK, stages, warps), x dtype, byte offset of the rows: 0 aligned, 2 not,
#  groups first)
CASES = [
    ("Q4_K", 13, 768, (4, 512, 1, 4), "float32", 0, False),  # 13 % 4 rows; last step half masked
    ("Q4_K", 5, 512, (8, 256, 1, 4), "bfloat16", 2, False),  # N < BN; headers byte by byte
    ("Q4_K", 7, 256, (4, 128, 1, 2), "float32", 0, True),  # steps of half a block
    ("Q4_K", 1, 256, (4, 256, 1, 2), "float32", 0, False),  # N = 1
    ("Q6_K", 11, 512, (4, 1024, 1, 2), "float32", 0, False),  # BK > K: one masked step
    ("Q6_K", 9, 768, (8, 512, 1, 4), "bfloat16", 0, True),
    ("Q6_K", 3, 256, (16, 256, 1, 4), "float32", 0, False),
    ("Q5_K", 6, 512, (4, 256, 1, 2), "float32", 0, False),
    ("Q5_K", 3, 256, (2, 256, 1, 1), "float32", 2, True),
    ("Q8_0", 10, 416, (4, 256, 1, 2), "float32", 0, False),  # 13 blocks of 32: a partial step
    ("Q4_0", 9, 224, (8, 128, 1, 1), "bfloat16", 0, True),
    ("IQ2_XS", 5, 512, (2, 256, 1, 1), "float32", 0, False),
    ("IQ3_XXS", 6, 768, (4, 512, 1, 2), "float32", 0, True),  # a partial step of half a block
]


def every_type_case(qtype: QType, groups_first: bool) -> tuple:
    """A case for any fused type: 7 rows, two 256-value blocks (or 13 blocks of 32, a partial
    last step of 256)."""
    k = 512 if get_quant(qtype).block_size == 256 else 416
    return (qtype.name, 7, k, (4, 256, 1, 2), "float32", 0, groups_first)


def rows_at(w: np.ndarray, offset: int, dev: str) -> torch.Tensor:
    """The rows of w copied to `dev`, starting `offset` bytes past an aligned allocation."""
    flat = torch.zeros(w.size + 16, dtype=torch.uint8, device=dev)
    out = flat[offset:offset + w.size].view(w.shape)
    out.copy_(torch.from_numpy(w))
    assert out.data_ptr() % 8 == offset % 8
    return out


def check(rng: np.random.Generator, qtype: str, n: int, k: int, tile: tuple, xdtype: str,
          offset: int, groups_first: bool, dev: str) -> None:
    """gemv_lanes on fresh random rows and x against the reference, on `dev`."""
    from strata.kernels.gpu.matmul import gemv_lanes
    from strata.kernels.gpu.reference import matmul_ref
    from strata.quant import random_rows

    qt = QType[qtype]
    w = rows_at(random_rows(qt, n, k, rng, 0.05), offset, dev)
    x32 = torch.from_numpy(rng.standard_normal((1, k)).astype(np.float32) * 3).to(dev)
    x = x32.to(getattr(torch, xdtype))
    y = torch.full((1, n), float("nan"), device=dev)  # poisoned: every row must be written
    gemv_lanes(x, w, qt, tile, out=y, groups_first=groups_first)
    what = (f"{qtype} N {n} K {k} tile {tile} x {xdtype} offset {offset} groups first "
            f"{groups_first}")
    assert torch.isfinite(y).all(), f"{what}: rows not written"
    err = rel_err(y.cpu(), matmul_ref(x.cpu(), w.cpu(), qt))
    assert err < FMA_TOL, f"{what}: rel err {err:.2e}"
    if xdtype == "bfloat16":
        err = rel_err(y.cpu(), matmul_ref(x32.cpu(), w.cpu(), qt))
        assert err < BF16_TOL, f"{what}: rel err {err:.2e} against the float32 x"


def _interpreted(cases: str) -> None:
    """check() on the CPU under the interpreter for each case of the expression `cases`."""
    run_interpreted(f"""
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_gemv_lanes import CASES, check, every_type_case
        from strata.kernels.gpu import FUSED_TYPES
        rng = np.random.default_rng(seed)
        for case in {cases}:
            check(rng, *case, dev="cpu")
        print("ok")
    """, fresh_seed(), timeout=300)


def test_gemv_lanes_under_the_interpreter() -> None:
    _interpreted("CASES")


def test_gemv_lanes_every_type_under_the_interpreter() -> None:
    """Every fused type through the dequant_tile dispatch, the two dim orders alternating."""
    _interpreted("[every_type_case(q, i % 2 == 1) for i, q in enumerate(FUSED_TYPES)]")


def test_gemv_lanes_refuses_bad_tiles() -> None:
    from strata.kernels.gpu.matmul import gemv_lanes

    w = torch.zeros(3, 144, dtype=torch.uint8)
    x = torch.zeros(1, 256)
    for tile in ((3, 256, 1, 1), (64, 256, 1, 1), (4, 16, 1, 1), (4, 96, 1, 1)):
        with pytest.raises(ValueError, match="tile"):  # BN; BN; BK < S; BK not 2^n
            gemv_lanes(x, w, QType.Q4_K, tile)
    with pytest.raises(ValueError, match="one token"):
        gemv_lanes(torch.zeros(2, 256), w, QType.Q4_K)
    with pytest.raises(ValueError, match="no dequantize tile"):
        gemv_lanes(x, torch.zeros(3, 512, dtype=torch.uint8), QType.F16)
    with pytest.raises(ValueError, match="out must be"):
        gemv_lanes(x, w, QType.Q4_K, out=torch.zeros(1, 3, dtype=torch.float64))


def test_quant_matmul_takes_lanes_for_listed_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """quant_matmul sends one token to the lanes kernel only for the shapes in GEMV_LANES_TUNE
    (empty by default: the engine's choice is the FMA kernel's)."""
    from strata.kernels.gpu import matmul as mm

    assert mm.GEMV_LANES_TUNE == {}
    launched = []
    monkeypatch.setattr(mm, "_launch_lanes", lambda *a: launched.append(a[-1]))
    monkeypatch.setattr(mm, "GEMV_LANES_TUNE", {(int(QType.Q4_K), 3, 256): (4, 256, 1, 2)})
    mm.quant_matmul(torch.zeros(1, 256), torch.zeros(3, 144, dtype=torch.uint8), QType.Q4_K)
    assert launched == [(4, 256, 1, 2)]


def _compiled(q: QType, tile: tuple, xt: str, groups_first: bool) -> tuple[list[str], str]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sass_count

    from strata.kernels.gpu import matmul as mm
    from strata.kernels.gpu.formats import kernel_format

    bn, bk, stages, warps = tile
    sass, _, ttgir = sass_count.compile_sm90_ir(
        mm._gemv_lanes_kernel, {**sass_count.LANES_SIG, "x": f"*{xt}"},
        {"QT": int(q), "S": kernel_format(q).group, "BN": bn, "BK": bk, "EVEN_K": True,
         "STAGES": stages, "WIDE": True, "GROUPS_FIRST": groups_first}, (0, 1, 2, 3, 4, 7),
        warps)
    return sass_count.opcodes(sass_count.longest_loop(sass)), ttgir


@pytest.mark.parametrize(("qtype", "tile", "xt"), [
    (QType.Q4_K, (4, 512, 1, 4), "fp32"), (QType.Q4_K, (8, 256, 1, 4), "bf16"),
    (QType.Q6_K, (4, 256, 1, 2), "fp32")], ids=["Q4_K-4x512-f32", "Q4_K-8x256-bf16",
                                                "Q6_K-4x256-f32"])
def test_gemv_lanes_puts_rows_across_lanes(qtype: QType, tile: tuple, xt: str) -> None:
    """Compiled for sm_90 (no GPU), in the dim order the launcher uses (LANES_GROUPS_FIRST):
    the x tile and the weight bytes load in one register layout whose lanes span S, then all
    BN rows, then the groups (so lanes of different rows ask for the same x); no per-value
    tensor changes layout in the K loop (Q6_K's per-group scale and d do, as in the FMA
    kernel: through shared memory; Q4_K nothing). If this fails after a Triton upgrade, its
    coalescing pass orders tied dims the other way: flip LANES_GROUPS_FIRST."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import sass_count

    from strata.kernels.gpu import matmul as mm

    gf = mm.LANES_GROUPS_FIRST
    ops, ttgir = _compiled(qtype, tile, xt, gf)
    loads, converts = sass_count.loop_loads(ttgir)
    rows_dim, groups_dim = (1, 0) if gf else (0, 1)
    tiles = [layout for shape, _, layout in loads if shape[2] > 1]  # x and the weight bytes
    assert len(tiles) >= 2 and len(set(tiles)) == 1, loads
    _, tpw, _, order = tiles[0]
    assert tpw[rows_dim] == tile[0], tiles[0]  # every row of the tile in the lanes
    assert order.index(2) < order.index(rows_dim) < order.index(groups_dim), tiles[0]
    assert all(shape[2] == 1 for shape in converts), converts
    if qtype == QType.Q4_K:
        assert not converts and not any(op.startswith(("LDS", "STS", "BAR")) for op in ops)
        # a thread's 16 values a step: x in 128-bit loads (4 float32 or 8 bf16 each), the 16
        # quant bytes in one, the block header as two u64; no byte or u16 loads
        ldg = {w: sum(op.startswith("LDG") and op.endswith(w) for op in ops)
               for w in (".128", ".64", ".U16", ".U8")}
        assert ldg == {".128": 5 if xt == "fp32" else 3, ".64": 2, ".U16": 0, ".U8": 0}, ldg


@pytest.mark.cuda
def test_gemv_lanes_on_cuda() -> None:
    rng = np.random.default_rng(seed := fresh_seed())
    cases = CASES + [
        ("Q4_K", 14336, 4096, (4, 512, 1, 4), "float32", 0, False),
        ("Q4_K", 4097, 2048, (8, 256, 1, 4), "bfloat16", 2, False),
        ("Q4_K", 2048, 4096, (16, 256, 1, 4), "float32", 0, True),
        ("Q6_K", 14336, 4096, (4, 512, 1, 4), "bfloat16", 0, True),
        ("Q6_K", 2047, 2048, (8, 1024, 1, 4), "float32", 0, False),
        ("IQ2_XS", 1001, 4096, (8, 512, 1, 4), "float32", 0, False),
        ("IQ3_XXS", 1001, 4096, (4, 512, 1, 4), "float32", 0, True),
        ("Q8_0", 999, 4096, (4, 1024, 1, 4), "bfloat16", 0, False),
    ]
    for case in cases:
        try:
            check(rng, *case, dev="cuda")
        except AssertionError as e:
            raise AssertionError(f"seed={seed}: {e}") from e


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", list(FUSED_TYPES), ids=lambda q: q.name)
@pytest.mark.parametrize("tile", [(4, 256, 1, 2), (8, 512, 1, 4), (16, 256, 1, 4)],
                         ids=lambda t: "x".join(map(str, t)))
@pytest.mark.parametrize("groups_first", [False, True], ids=["rows-first", "groups-first"])
def test_gemv_lanes_every_type_on_cuda(qtype: QType, tile: tuple, groups_first: bool) -> None:
    """Every fused type through the dequant_tile dispatch: 41 rows, three 256-value blocks
    (or 13 blocks of 32, a partial last step of 256)."""
    rng = np.random.default_rng(seed := fresh_seed())
    k = 768 if get_quant(qtype).block_size == 256 else 416
    try:
        check(rng, qtype.name, 41, k, tile, "float32", 0, groups_first, "cuda")
    except AssertionError as e:
        raise AssertionError(f"seed={seed}: {e}") from e
