"""Dequantize tiles of the i-quants: IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_XS.

Tile convention: see tiles_legacy.py. For the grid formats a group is the 8 values of one grid
index (two indices of the 4-wide IQ3 grids), so the index, its signs and its scale are read
once per group ([BN, G, 1]) and the grid rows are contiguous reads of 8 (or 2 x 4) floats:
    w = db * grid[index, s] * sign[s]
`tab` is the float32 grid [G_rows, S] flattened, `tab2` the float32 ksigns table [128, 8] (+-1
for the 8 signs of each 7-bit index) or the IQ4_NL levels. Layouts: strata/quant/iquants.py,
iq1.py, iq4.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from strata.kernels.gpu.bits import f16, i2f, locate, u8, u16, u32


@triton.jit
def iq2_xxs(wr, k0, g, s, m, tab, tab2):
    """[d | 8 x (4 index bytes | u32 ksigns 0-27, scale 28-31)], S=8, grid 256 x 8:
    db = d * (0.5 + scale) / 4; group i: sub-block i // 4, grid row r = i % 4."""
    b, i = locate(wr, k0, g, 256, 66, 8)
    sub = b + 2 + (i // 4) * 8
    idx = u8(sub + i % 4, m)  # [BN, G, 1]
    word = u32(sub + 4, m)
    db = f16(b, m) * (i2f((word >> 28) & 15, 0.0) + 0.5) * 0.25
    ks = (word >> ((i % 4) * 7)) & 127
    return db * tl.load(tab + idx * 8 + s) * tl.load(tab2 + ks * 8 + s)


@triton.jit
def iq2_xs(wr, k0, g, s, m, tab, tab2):
    """[d | 32 x u16 (index 0-8, ksigns 9-15) | scales 8], S=8, grid 512 x 8:
    db = d * (0.5 + scale) / 4 with one 4-bit scale per 16 values (two groups)."""
    b, i = locate(wr, k0, g, 256, 74, 8)
    word = u16(b + 2 + i * 2, m)  # [BN, G, 1]
    sc = (u8(b + 66 + i // 4, m) >> (((i // 2) % 2) * 4)) & 15
    db = f16(b, m) * (i2f(sc, 0.0) + 0.5) * 0.25
    return db * tl.load(tab + (word & 511) * 8 + s) * tl.load(tab2 + (word >> 9) * 8 + s)


@triton.jit
def iq2_s(wr, k0, g, s, m, tab, tab2):
    """[d | qs 32 | signs 32 | qh 8 | scales 8], S=8, grid 1024 x 8: index = qs[i] | 2 bits of
    qh << 8, sign of value s = bit s of signs[i]; db as IQ2_XS."""
    b, i = locate(wr, k0, g, 256, 82, 8)
    idx = u8(b + 2 + i, m) | (((u8(b + 66 + i // 4, m) >> ((i % 4) * 2)) & 3) << 8)
    sc = (u8(b + 74 + i // 4, m) >> (((i // 2) % 2) * 4)) & 15
    db = f16(b, m) * (i2f(sc, 0.0) + 0.5) * 0.25
    neg = ((u8(b + 34 + i, m) >> s) & 1) != 0  # [BN, G, S]
    v = db * tl.load(tab + idx * 8 + s)
    return tl.where(neg, -v, v)


@triton.jit
def iq3_xxs(wr, k0, g, s, m, tab, tab2):
    """[d | qs 64 | 8 x u32 (ksigns 0-27, scale 28-31)], S=8, grid 256 x 4:
    db = d * (0.5 + scale) / 2. Group i (8 values, one ksigns index) holds the two grid
    indices qs[2i], qs[2i + 1] and sign group i % 4 of sub-block i // 4."""
    b, i = locate(wr, k0, g, 256, 98, 8)
    word = u32(b + 66 + (i // 4) * 4, m)  # [BN, G, 1]
    db = f16(b, m) * (i2f((word >> 28) & 15, 0.0) + 0.5) * 0.5
    ks = (word >> ((i % 4) * 7)) & 127
    sign = tl.load(tab2 + ks * 8 + s)  # [BN, G, S]
    idx = (u16(b + 2 + i * 2, m) >> ((s // 4) * 8)) & 255  # [BN, G, S]: index of value s
    return db * tl.load(tab + idx * 4 + s % 4) * sign


@triton.jit
def iq3_s(wr, k0, g, s, m, tab, tab2):
    """[d | qs 64 | qh 8 | signs 32 | scales 4], S=8, grid 512 x 4: index j = qs[j] | bit j % 8
    of qh[j // 8] << 8 (group i holds j = 2i, 2i + 1); sign of value s = bit s of signs[i];
    db = d * (1 + 2 * scale) with one 4-bit scale per 32 values."""
    b, i = locate(wr, k0, g, 256, 110, 8)
    sc = (u8(b + 106 + i // 8, m) >> (((i // 4) % 2) * 4)) & 15
    db = f16(b, m) * i2f(sc * 2 + 1, 0.0)
    qh = u8(b + 66 + i // 4, m)  # [BN, G, 1]
    pair = u16(b + 2 + i * 2, m)
    neg = ((u8(b + 74 + i, m) >> s) & 1) != 0  # [BN, G, S]
    j = s // 4  # which of the two indices
    idx = ((pair >> (j * 8)) & 255) | (((qh >> ((i % 4) * 2 + j)) & 1) << 8)
    v = db * tl.load(tab + idx * 4 + s % 4)
    return tl.where(neg, -v, v)


@triton.jit
def iq1_s(wr, k0, g, s, m, tab, tab2):
    """[d | qs 32 | 8 x u16 qh], S=8, grid 2048 x 8 (values -1, 0, 1): qh = 4 x 3 high index
    bits | scale << 12 | delta sign << 15; w = d * (2 * scale + 1) * (grid + delta)."""
    b, i = locate(wr, k0, g, 256, 50, 8)
    h = u16(b + 34 + (i // 4) * 2, m)  # [BN, G, 1]
    idx = u8(b + 2 + i, m) | (((h >> ((i % 4) * 3)) & 7) << 8)
    dl = f16(b, m) * i2f(((h >> 12) & 7) * 2 + 1, 0.0)
    delta = tl.where((h & 0x8000) != 0, -0.125, 0.125)
    return dl * (tl.load(tab + idx * 8 + s) + delta)


@triton.jit
def iq1_m(wr, k0, g, s, m, tab, tab2):
    """[qs 32 | qh 16 | 4 x u16 scales], S=8: nibble i of qh = 3 high index bits | delta sign << 3;
    scales = sixteen 3-bit s (one per 16 values) and the f16 d in the top nibbles of the 4 words;
    w = d * (2 * s + 1) * (grid + delta)."""
    b, i = locate(wr, k0, g, 256, 56, 8)
    nib = (u8(b + 32 + i // 2, m) >> ((i % 2) * 4)) & 15  # [BN, G, 1]
    idx = u8(b + i, m) | ((nib & 7) << 8)
    delta = tl.where((nib & 8) != 0, -0.125, 0.125)
    dbits = (u16(b + 48, m) >> 12) | ((u16(b + 50, m) >> 12) << 4)
    dbits = dbits | ((u16(b + 52, m) >> 12) << 8) | ((u16(b + 54, m) >> 12) << 12)
    d = dbits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    f = i // 2  # the 3-bit scale field of these 16 values
    s3 = (u16(b + 48 + (f // 4) * 2, m) >> ((f % 4) * 3)) & 7
    return d * i2f(s3 * 2 + 1, 0.0) * (tl.load(tab + idx * 8 + s) + delta)


@triton.jit
def iq4_xs(wr, k0, g, s, m, tab, tab2):
    """[d | scales_h u16 | scales_l 4 | qs 128], S=16: w = d * (sc - 32) * levels[q]; sub-block
    j = i // 2 holds nibble half i % 2 of bytes 8 + 16 j + s; 6-bit sc = nibble j % 2 of
    scales_l[j // 2] | bits 2j of scales_h << 4. tab = the 16 IQ4_NL levels."""
    b, i = locate(wr, k0, g, 256, 136, 16)
    j = i // 2
    lo = (u8(b + 4 + j // 2, m) >> ((j % 2) * 4)) & 15
    hi = (u16(b + 2, m) >> (j * 2)) & 3
    dl = f16(b, m) * i2f(lo | (hi << 4), 32.0)
    q = (u8(b + 8 + j * 16 + s, m) >> ((i % 2) * 4)) & 15
    return dl * tl.load(tab + q)
