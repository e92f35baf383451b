"""Check iqc.py on the CPU under Triton's interpreter: the compact tables against gemv_q8's
(decoded back in numpy), and each gemv_iqc form bit for bit against gemv_q8.gemv_iq_spread on
the same rows, x̂ and tile (37 rows of K 512 and 768: 768 puts every other row at 2 mod 4).

    .venv/bin/python bench/2026-12-01-h200/prototypes-iqc/check_iqc.py [seed]
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[2])]

import gguf.quants as gq  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

# Triton 3.6's interpreter reads loop bounds with int() of a 1-element array, which NumPy 2.4
# refuses (tests/interpreted.py patches it the same way)
_patch = interpreter._patch_lang_tensor


def _patched(tensor, scope):
    _patch(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).item()))


interpreter._patch_lang_tensor = _patched

import iqc  # noqa: E402

from strata.kernels.gpu.gemv_q8 import (  # noqa: E402
    _grid_bytes,
    _iq2xs_sel,
    gemv_iq_spread,
    quantize_x,
)
from strata.quant import QType, grids, random_rows  # noqa: E402


def prmt(a: int, b: int, sel: np.ndarray) -> np.ndarray:
    """PTX prmt.b32 (default mode, selector nibbles < 8) of constant words a, b, in numpy."""
    src = np.array([a, b], dtype=np.uint32).view(np.uint8)  # bytes 0-7
    out = np.zeros(sel.shape, dtype=np.uint32)
    for k in range(4):
        out |= src[(sel.astype(np.int64) >> (4 * k)) & 7].astype(np.uint32) << (8 * k)
    return out.view(np.int32)


def spread_signs(s7: np.ndarray) -> np.ndarray:
    """The kernel's arithmetic signs (_iq2_sel without SSEL), in numpy."""
    s = s7 | (np.bitwise_count(s7) & 1) << 7
    s = (s | s << 12) & 0x000F000F
    s = (s | s << 6) & 0x03030303
    return ((s | s << 3) & 0x11111111) << 2


def check_tables() -> None:
    gsel, ssel = (t.view(np.uint32).astype(np.int64) for t in _iq2xs_sel())
    c16 = iqc.iq2xs_codes16().astype(np.int64) & 0xFFFF
    x = (c16 | c16 << 8) & 0x00FF00FF
    x = (x | x << 4) & 0x0F0F0F0F
    x = (x | x << 2) & 0x33333333
    assert (x == gsel).all(), "IQ2_XS codes16 spread != gsel"
    s7 = np.arange(128, dtype=np.int64)
    assert (spread_signs(s7) == ssel).all(), "IQ2_XS arithmetic signs != ssel"
    ks = np.frombuffer(gq.IQ2_XXS.ksigns, dtype=np.uint8).astype(np.int64)
    assert (ks == s7 | (np.bitwise_count(s7) & 1) << 7).all(), "parity != ggml's ksigns"
    lv = iqc.iq3xxs_levels16()
    assert lv.dtype == np.int16 and lv.min() >= 0 and lv.max() <= 0x7777
    g = grids._grid_np(gq.IQ3_XXS)
    assert len(np.unique(g)) == 8 and g.max() <= 127, "IQ3_XXS: not 8 levels of a signed byte"
    grid4 = _grid_bytes(gq.IQ3_XXS, 256, 4)[:, 0]
    assert (prmt(iqc.IQ3_LO.value, iqc.IQ3_HI.value, lv) == grid4).all(), "levels16 != grid4"
    print(f"tables: IQ2_XS codes16 {iqc.iq2xs_codes16().nbytes} B spreads to gsel, arithmetic "
          f"signs = ssel = ggml ksigns; IQ3_XXS levels16 {lv.nbytes} B through PRMT = grid4 "
          f"(levels {iqc.IQ3_LEVELS})")


def check_gemvs(rng: np.random.Generator) -> None:
    n = 37
    for form in iqc.FORMS:
        q = QType.IQ3_XXS if form == "iq3xxs" else QType.IQ2_XS
        for k in (512, 768):
            w = torch.from_numpy(random_rows(q, n, k, rng, 0.05))
            x = torch.from_numpy(rng.standard_normal(k).astype(np.float32) * 3)
            x[32:64] = 0.0  # a block of zeros: dx = 0
            xq, dx, _ = quantize_x(x)
            for rows, bb in ((4, 8), (2, 4), (1, 2)):
                ref = gemv_iq_spread(xq, dx, w, n, k, q, bb=bb, rows=rows)
                y = torch.full((n,), float("nan"))
                iqc.gemv_iqc(xq, dx, w, n, k, form, out=y, bb=bb, rows=rows)
                diff = float((y - ref).abs().max())
                print(f"{form:10s} n {n} k {k} R {rows} BB {bb}: max |new - old| {diff:.3g}, "
                      f"|old| max {float(ref.abs().max()):.3g}")
                assert torch.equal(y.view(torch.int32), ref.view(torch.int32)), (form, k, rows)


def main() -> None:
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else int(np.random.SeedSequence().entropy % 2**31)
    print(f"seed {seed}")
    check_tables()
    check_gemvs(np.random.default_rng(seed))
    print("ok: every form bit-identical to gemv_iq_spread")


if __name__ == "__main__":
    main()
