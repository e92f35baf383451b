"""Dequantize tiles of the K-quants: Q2_K Q3_K Q4_K Q5_K Q6_K (256-value super-blocks).

Tile convention: see tiles_legacy.py. A group is one sub-block (S=16 or 32 values sharing one
scale), so scales are read once per group ([BN, G, 1]) and broadcast over its values. Inside a
super-block, i is the sub-block and value k = i * S + s; the byte and shift of each packed field
follow from the layouts in strata/quant/kquants.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from strata.kernels.gpu.bits import f16, f16_bits, field_fma, fields_fma, i2f, ld, locate, u8, u32x2


@triton.jit
def q2_k(wr, k0, g, s, m, tab, tab2):
    """[scales 16 | qs 64 | d | dmin], S=16: w = d * (sc & 15) * q - dmin * (sc >> 4).
    q of value k: byte 16 + (k // 128) * 32 + k % 32, bits 2 * ((k // 32) % 4)."""
    b, i = locate(wr, k0, g, 256, 84, 16)
    sc = u8(b + i, m)  # [BN, G, 1]
    dl = f16(b + 80, m) * i2f(sc & 15, 0.0) * 4.0
    ml = f16(b + 82, m) * i2f(sc >> 4, 0.0)
    qs = ld(b + 16 + (i // 8) * 32 + (i % 2) * 16 + s, m)  # uint8 [BN, G, S]
    return field_fma(qs, ((i // 2) % 4) * 2, dl, -(dl + ml), 2)  # q = 4 (f - 1)


@triton.jit
def q3_k(wr, k0, g, s, m, tab, tab2):
    """[hmask 32 | qs 64 | scales 12 | d], S=16: w = d * (sc - 32) * (q2 + 4 * hbit - 4).
    hbit of value k: byte k % 32, bit k // 32. 6-bit sc of sub-block i: nibble i // 8 of byte
    96 + i % 8, top 2 bits at 2 * (i // 4) of byte 104 + i % 4."""
    b, i = locate(wr, k0, g, 256, 110, 16)
    lo = (u8(b + 96 + i % 8, m) >> ((i // 8) * 4)) & 15
    hi = (u8(b + 104 + i % 4, m) >> ((i // 4) * 2)) & 3
    dl = f16(b + 108, m) * i2f(lo | (hi << 4), 32.0)
    hmask = ld(b + (i % 2) * 16 + s, m)
    qs = ld(b + 32 + (i // 8) * 32 + (i % 2) * 16 + s, m)
    # q = q2 | hbit << 2 = 8 (f - 1); w = dl * (q - 4)
    return fields_fma(qs, hmask, ((i // 2) % 4) * 2, i // 2, dl * 8.0, dl * -12.0, 2, 1)


@triton.jit
def scale_min(b1, b2, b3, i):
    """6-bit (scale, min) of sub-block i from header bytes 4 + j, 8 + j, 12 + j (j = i % 4)."""
    sc = tl.where(i < 4, b1 & 63, (b3 & 15) | ((b1 >> 6) << 4))
    mn = tl.where(i < 4, b2 & 63, (b3 >> 4) | ((b2 >> 6) << 4))
    return sc, mn


@triton.jit
def _scale_min_k4(b, i, m):
    """6-bit (scale, min) of sub-block i from the 12 bytes at b + 4 (see kquants.scale_min_k4)."""
    j = i % 4
    return scale_min(u8(b + 4 + j, m), u8(b + 8 + j, m), u8(b + 12 + j, m), i)


@triton.jit
def _header_k4(b, i, m, WIDE: tl.constexpr):
    """(d, dmin, sc, mn) of sub-block i from the Q4_K / Q5_K header [d | dmin | scales 12] at b.
    WIDE: the header as two u64 reads (b 8-aligned: the 144- and 176-byte blocks are, when the
    row is) instead of two u16 and three byte reads."""
    if WIDE:
        h0, h1 = u32x2(b, m)  # d | dmin, scale bytes 0-3
        h2, h3 = u32x2(b + 8, m)  # scale bytes 4-11
        sh = (i % 4) * 8
        sc, mn = scale_min((h1 >> sh) & 255, (h2 >> sh) & 255, (h3 >> sh) & 255, i)
        d = f16_bits(h0)
        dmin = f16_bits(h0 >> 16)
    else:
        sc, mn = _scale_min_k4(b, i, m)
        d = f16(b, m)
        dmin = f16(b + 2, m)
    return d, dmin, sc, mn


@triton.jit
def q4_k(wr, k0, g, s, m, tab, tab2, WIDE: tl.constexpr = False):
    """[d | dmin | scales 12 | qs 128], S=32: w = d * sc * q - dmin * mn.
    Sub-block i: nibble i % 2 of bytes 16 + (i // 2) * 32 + s."""
    b, i = locate(wr, k0, g, 256, 144, 32)
    d, dmin, sc, mn = _header_k4(b, i, m, WIDE)
    dl = d * i2f(sc, 0.0) * 16.0
    ml = dmin * i2f(mn, 0.0)
    qs = ld(b + 16 + (i // 2) * 32 + s, m)  # uint8 [BN, G, S]
    return field_fma(qs, (i % 2) * 4, dl, -(dl + ml), 4)  # q = 16 (f - 1)


@triton.jit
def q5_k(wr, k0, g, s, m, tab, tab2, WIDE: tl.constexpr = False):
    """[d | dmin | scales 12 | qh 32 | qs 128], S=32: as Q4_K with q |= (bit i of qh[s]) << 4."""
    b, i = locate(wr, k0, g, 256, 176, 32)
    d, dmin, sc, mn = _header_k4(b, i, m, WIDE)
    dl = d * i2f(sc, 0.0) * 32.0
    ml = dmin * i2f(mn, 0.0)
    qh = ld(b + 16 + s, m)
    qs = ld(b + 48 + (i // 2) * 32 + s, m)
    return fields_fma(qs, qh, (i % 2) * 4, i, dl, -(dl + ml), 4, 1)  # q = 32 (f - 1)


@triton.jit
def q6_k(wr, k0, g, s, m, tab, tab2):
    """[ql 128 | qh 64 | scales int8 16 | d], S=16: w = d * sc * (q - 32), q = ql | qh << 4.
    Value k: ql nibble (k // 64) % 2 of byte (k // 128) * 64 + k % 64; qh bits
    2 * ((k // 32) % 4) of byte 128 + (k // 128) * 32 + k % 32."""
    b, i = locate(wr, k0, g, 256, 210, 16)
    dl = f16(b + 208, m) * i2f(u8(b + 192 + i, m) ^ 0x80, 128.0)
    qh = ld(b + 128 + (i // 8) * 32 + (i % 2) * 16 + s, m)
    ql = ld(b + (i // 8) * 64 + (i % 4) * 16 + s, m)
    # q = 64 (f - 1); w = dl * (q - 32)
    return fields_fma(ql, qh, ((i // 4) % 2) * 4, ((i // 2) % 4) * 2, dl * 64.0, dl * -96.0,
                      4, 2)
