"""Compact-table forms of gemv_q8's IQ2_XS / IQ3_XXS one-token GEMVs (prototypes, not used by
the engine): the same sums as gemv_q8.gemv_iq_spread, bit for bit, with smaller per-lane gathers
(a warp's gather costs about one L1 wavefront per distinct 128-byte line it touches).

    iq2xs_compact_dot   IQ2_XS: each grid row's 8 codes (0-2) as 2-bit fields of an int16
                        (1 KB table instead of gsel's 2 KB), spread to nibbles by shifts and
                        masks; the 8 signs from the 7 ksigns bits and their parity, spread to
                        bit 2 of each nibble (no table; SSEL: gathered from ssel as now)
    iq3xxs_compact_dot  IQ3_XXS: each grid row's 4 values as 3-bit level indices in the nibbles
                        of an int16 (512 B instead of grid4's 1 KB), one PRMT over the 8 level
                        bytes (two constant words) gives the 4 grid bytes; signs as now
    gemv_iqc(xq, dx, w, n, k, form, ...) -> y [n] f32; form one of FORMS

The tables are int16 on the device (iqc_tables), read zero-extended (& 0xFFFF: for sm_90 the
gathers compile to LDG.E.U16 with no extension op; without the mask IQ3_XXS's got a sign-extending
PRMT each).
"""
from __future__ import annotations

import gguf.quants as gq
import numpy as np
import torch
import triton
import triton.language as tl

from strata.kernels.gpu.bits import i2f
from strata.kernels.gpu.gemv_q8 import (
    IQ2_NEG,
    IQ2_POS,
    _dp4a,
    _i2f_signed,
    _iq2xs_sel,
    _iq_rows,
    _parity,
    _prmt,
    _sign_mask,
    _spread_args,
    _u32_at,
)
from strata.quant import QType, grids
from strata.quant.base import device_table

# IQ3_XXS's 8 grid levels as bytes: levels 0-3 (PRMT's first source), 4-7 (its second)
IQ3_LEVELS = (4, 12, 20, 28, 36, 44, 52, 62)
IQ3_LO = tl.constexpr(4 | 12 << 8 | 20 << 16 | 28 << 24)
IQ3_HI = tl.constexpr(36 | 44 << 8 | 52 << 16 | 62 << 24)

FORMS = ("iq2xs", "iq2xs_ssel", "iq3xxs")  # gemv_iqc's forms


@triton.jit
def _iq2_sel(e, g16, ssel, SSEL: tl.constexpr):
    """The PRMT selectors (gsel | ssel of gemv_q8) of IQ2_XS groups with u16 e: the grid row's
    2-bit codes (g16) spread to nibbles; the signs 4 in the nibbles of the negative values,
    gathered from ssel (SSEL) or from e's 7 ksigns bits and their parity."""
    x = tl.load(g16 + (e & 511)).to(tl.int32) & 0xFFFF
    x = (x | (x << 8)) & 0x00FF00FF
    x = (x | (x << 4)) & 0x0F0F0F0F
    x = (x | (x << 2)) & 0x33333333  # code k in nibble k
    if SSEL:
        s = tl.load(ssel + (e >> 9))
    else:
        s7 = e >> 9
        s = s7 | (_parity(s7) << 7)  # ggml's ksigns[s7]
        s = (s | (s << 12)) & 0x000F000F
        s = (s | (s << 6)) & 0x03030303
        s = ((s | (s << 3)) & 0x11111111) << 2  # sign bit k as 4 in nibble k
    return x | s


@triton.jit
def iq2xs_compact_dot(wbase, ro, xw, dx, g16, ssel, nb, BB: tl.constexpr, SSEL: tl.constexpr):
    """gemv_q8.iq2xs_spread_dot with the selectors from _iq2_sel (g16: the int16 grid codes of
    iqc_tables; ssel: gemv_q8's, read only with SSEL)."""
    R: tl.constexpr = ro.shape[2]
    bb = tl.arange(0, BB)[:, None, None, None, None]  # [BB, 1, 1, 1, 1]
    c = tl.arange(0, 4)[None, :, None, None, None]
    j = tl.arange(0, 8)[None, None, None, :, None]  # the quarter's group
    w = tl.arange(0, 2)[None, None, None, None, :]  # the group's word (4 values)
    zero = tl.zeros((BB, 4, R, 8, 2), tl.int32)
    acc = tl.zeros((BB, 4, R, 8, 2), tl.float32)
    for b0 in range(0, nb, BB):
        b = b0 + bb
        m = b < nb
        o = ro + b * 74  # [BB, 1, R, 1, 1]: the block's bytes in each row
        # group j's u16: half j % 2 of the word at o + 2 + 16c + 4 (j // 2)
        e = (_u32_at(wbase, o + 2 + 16 * c + 4 * (j // 2), 0, m) >> (16 * (j % 2))) & 0xFFFF
        sel = _iq2_sel(e, g16, ssel, SSEL)  # [BB, 4, R, 8, 1]
        g = _prmt(IQ2_POS + zero, IQ2_NEG, sel >> (16 * w))  # [BB, 4, R, 8, 2]: signed bytes
        xj = tl.load(xw + b * 64 + 16 * c + 2 * j + w, mask=m, other=0)  # [BB, 4, 1, 8, 2]
        dot = _dp4a(g, xj, zero, True)
        b8 = (wbase.to(tl.pointer_type(tl.int8)) + o).to(tl.pointer_type(tl.uint8))
        sc = (tl.load(b8 + 66 + 2 * c + j // 4 + 0 * w, mask=m, other=0).to(tl.int32)
              >> (4 * ((j // 2) % 2))) & 15
        d = tl.load((b8 + 0 * (c + j + w)).to(tl.pointer_type(tl.int16)), mask=m,
                    other=0).to(tl.float16, bitcast=True).to(tl.float32)
        dxj = tl.load(dx + b * 8 + 2 * c + j // 4 + 0 * w, mask=m, other=0.0)
        acc += (d * (i2f(sc, 0.0) + 0.5) * 0.25 * dxj) * _i2f_signed(dot)
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=1), axis=0)


@triton.jit
def iq3xxs_compact_dot(wbase, ro, xw, dx, g16, nb, BB: tl.constexpr):
    """gemv_q8.iq3xxs_spread_dot with each group word's 4 grid bytes one PRMT of
    (IQ3_LO, IQ3_HI) by the row's level indices (g16: iqc_tables' int16 nibbles)."""
    R: tl.constexpr = ro.shape[2]
    bb = tl.arange(0, BB)[:, None, None, None, None]  # [BB, 1, 1, 1, 1]
    c = tl.arange(0, 4)[None, :, None, None, None]
    j = tl.arange(0, 8)[None, None, None, :, None]
    w = tl.arange(0, 2)[None, None, None, None, :]
    zero = tl.zeros((BB, 4, R, 8, 2), tl.int32)
    acc = tl.zeros((BB, 4, R, 8, 2), tl.float32)
    for b0 in range(0, nb, BB):
        b = b0 + bb
        m = b < nb
        o = ro + b * 98  # [BB, 1, R, 1, 1]
        # index byte 16c + 2j + w of qs: byte 2 (j % 2) + w of the word at o + 2 + 16c + 4 (j // 2)
        q4 = _u32_at(wbase, o + 2 + 16 * c + 4 * (j // 2), w * 0, m)
        idx = (q4 >> (8 * (2 * (j % 2) + w))) & 255
        aux = _u32_at(wbase, o + 66 + 4 * (2 * c + j // 4), w * 0, m)  # [BB, 4, R, 8, 2]
        lv = tl.load(g16 + idx).to(tl.int32) & 0xFFFF  # (zero-extended: no sign-extend op)
        g = _prmt(IQ3_LO + zero, IQ3_HI, lv)  # 4 grid bytes
        s = _sign_mask(aux >> (7 * (j % 4)), w)
        xj = tl.load(xw + b * 64 + 16 * c + 2 * j + w, mask=m, other=0)
        dot = _dp4a((g ^ s) + (s & 0x01010101), xj, zero, True)  # bytes negated where s is
        d = tl.load((wbase.to(tl.pointer_type(tl.int8)) + o + 0 * (c + j + w))
                    .to(tl.pointer_type(tl.int16)), mask=m,
                    other=0).to(tl.float16, bitcast=True).to(tl.float32)
        dxj = tl.load(dx + b * 8 + 2 * c + j // 4 + 0 * w, mask=m, other=0.0)
        acc += (d * (i2f((aux >> 28) & 15, 0.0) + 0.5) * 0.5 * dxj) * _i2f_signed(dot)
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=1), axis=0)


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_iqc_kernel(xq, dx, w, y, t0, t1, N, K, row_bytes, FORM: tl.constexpr,
                     R: tl.constexpr, BB: tl.constexpr):
    # y[n] = Σ_k W[n, k] x̂[k] for R rows n a program; FORM: FORMS' index
    n = tl.program_id(0) * R + tl.arange(0, R)
    wbase = w.to(tl.pointer_type(tl.int32))
    ro = _iq_rows(n, N, row_bytes)
    xw = xq.to(tl.pointer_type(tl.int32))
    if FORM == 2:
        s = iq3xxs_compact_dot(wbase, ro, xw, dx, t0, K // 256, BB)
    else:
        s = iq2xs_compact_dot(wbase, ro, xw, dx, t0, t1, K // 256, BB, FORM == 1)
    tl.store(y + n, s, mask=n < N)


def iq2xs_codes16() -> np.ndarray:
    """int16 [512]: each IQ2_XS grid row's 8 codes (0-2: values 8, 25, 43), code k at bits
    2k, 2k + 1."""
    gsel = _iq2xs_sel()[0].view(np.uint32).astype(np.int64)
    code = (gsel[:, None] >> (4 * np.arange(8))) & 15
    return (code << (2 * np.arange(8))).sum(1).astype(np.uint16).view(np.int16)


def iq3xxs_levels16() -> np.ndarray:
    """int16 [256]: each IQ3_XXS grid row's 4 values as level indices (IQ3_LEVELS) in
    nibbles, value k in nibble k."""
    g = grids._grid_np(gq.IQ3_XXS)
    lv = np.unique(g)
    if tuple(lv) != IQ3_LEVELS:
        raise ValueError(f"IQ3_XXS grid levels {lv}, expected {IQ3_LEVELS}")
    idx = np.searchsorted(lv, g).astype(np.int64)  # [256, 4]
    return (idx << (4 * np.arange(4))).sum(1).astype(np.int16)


def iqc_tables(form: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(t0, t1) of gemv_iqc's form: IQ2_XS the int16 codes and gemv_q8's ssel (int32 [128]);
    IQ3_XXS the int16 level indices, twice (t1 unused)."""
    if form == "iq3xxs":
        t = device_table("iqc_iq3xxs_levels16", device, iq3xxs_levels16)
        return t, t
    return (device_table("iqc_iq2xs_codes16", device, iq2xs_codes16),
            device_table("iq2xs_ssel", device, lambda: _iq2xs_sel()[1]))


def gemv_iqc(xq: torch.Tensor, dx: torch.Tensor, w: torch.Tensor, n: int, k: int, form: str,
             out: torch.Tensor | None = None, bb: int = 8, warps: int = 0,
             rows: int = 1) -> torch.Tensor:
    """gemv_q8.gemv_iq_spread's y = W x̂ with a compact-table form (FORMS: "iq2xs", "iq2xs_ssel"
    for IQ2_XS rows, "iq3xxs" for IQ3_XXS rows); the same tile arguments."""
    q = QType.IQ3_XXS if form == "iq3xxs" else QType.IQ2_XS
    y, warps = _spread_args(w, n, k, q, xq, out, f"gemv_iqc ({form})", bb, rows, warps)
    t0, t1 = iqc_tables(form, w.device)
    if n:
        _gemv_iqc_kernel[(triton.cdiv(n, rows),)](
            xq, dx, w, y, t0, t1, n, k, w.stride(0), FORM=FORMS.index(form), R=rows, BB=bb,
            num_warps=warps)
    return y
