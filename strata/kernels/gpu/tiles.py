"""One dequantize-tile dispatcher over every fused GGML type (QT is a constexpr, so each
compiled kernel holds only its type's tile). Tile convention: see tiles_legacy.py."""

from __future__ import annotations

import triton
import triton.language as tl

from strata.kernels.gpu import tiles_iquants as iq
from strata.kernels.gpu import tiles_kquants as kq
from strata.kernels.gpu import tiles_legacy as lg


@triton.jit
def dequant_tile(QT: tl.constexpr, wr, k0, g, s, m, tab, tab2, WIDE: tl.constexpr = False):
    """float32 [BN, G, S]: values k0 + g * S + s of the rows at `wr` (GGML type id QT).
    WIDE: the rows are 8-aligned, so Q4_K and Q5_K read their block headers as two u64."""
    if QT == 2:
        w = lg.q4_0(wr, k0, g, s, m, tab, tab2)
    elif QT == 3:
        w = lg.q4_1(wr, k0, g, s, m, tab, tab2)
    elif QT == 6:
        w = lg.q5_0(wr, k0, g, s, m, tab, tab2)
    elif QT == 7:
        w = lg.q5_1(wr, k0, g, s, m, tab, tab2)
    elif QT == 8:
        w = lg.q8_0(wr, k0, g, s, m, tab, tab2)
    elif QT == 10:
        w = kq.q2_k(wr, k0, g, s, m, tab, tab2)
    elif QT == 11:
        w = kq.q3_k(wr, k0, g, s, m, tab, tab2)
    elif QT == 12:
        w = kq.q4_k(wr, k0, g, s, m, tab, tab2, WIDE)
    elif QT == 13:
        w = kq.q5_k(wr, k0, g, s, m, tab, tab2, WIDE)
    elif QT == 14:
        w = kq.q6_k(wr, k0, g, s, m, tab, tab2)
    elif QT == 16:
        w = iq.iq2_xxs(wr, k0, g, s, m, tab, tab2)
    elif QT == 17:
        w = iq.iq2_xs(wr, k0, g, s, m, tab, tab2)
    elif QT == 18:
        w = iq.iq3_xxs(wr, k0, g, s, m, tab, tab2)
    elif QT == 19:
        w = iq.iq1_s(wr, k0, g, s, m, tab, tab2)
    elif QT == 20:
        w = lg.iq4_nl(wr, k0, g, s, m, tab, tab2)
    elif QT == 21:
        w = iq.iq3_s(wr, k0, g, s, m, tab, tab2)
    elif QT == 22:
        w = iq.iq2_s(wr, k0, g, s, m, tab, tab2)
    elif QT == 23:
        w = iq.iq4_xs(wr, k0, g, s, m, tab, tab2)
    elif QT == 29:
        w = iq.iq1_m(wr, k0, g, s, m, tab, tab2)
    else:
        tl.static_assert(QT == 39, "no dequantize tile for this GGML type")
        w = lg.mxfp4(wr, k0, g, s, m, tab, tab2)
    return w
