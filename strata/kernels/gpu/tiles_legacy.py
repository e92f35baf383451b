"""Dequantize tiles of the 32-value block formats: Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 IQ4_NL MXFP4.

Tile convention (shared by every tiles_*.py): `wr` uint8 row pointers [BN, 1, 1]; the tile is the
K step starting at column k0 (scalar), cut into G groups of S consecutive values: `g` [1, G, 1]
is the group index inside the step, `s` [1, 1, S] the position inside the group; `m` is a group
mask [1, G, 1] or None; `tab`/`tab2` are float32 lookup tables. Returns float32 [BN, G, S]: the
values k0 + g * S + s of every row. bits.locate finds each group's block b and its index i in it.

4-bit formats use S=16: group i = 0 is the low nibbles of the 16 qs bytes, i = 1 the high ones.
Per-group fields ([BN, G, 1]) are read before the per-value bytes ([BN, G, S]) on purpose:
Triton's layout pass lets the last big load pick the register layout, and the x tile and the
accumulator then share it without shuffles through shared memory.
"""

from __future__ import annotations

import triton
import triton.language as tl

from strata.kernels.gpu.bits import (
    e8m0_half,
    f16,
    field_fma,
    i2f,
    ld,
    locate,
    mx_scaled,
    u8,
    u32,
)


@triton.jit
def q4_0(wr, k0, g, s, m, tab, tab2):
    """[d | qs 16], S=16: w = d * (q - 8) = 16 d f - 24 d with f = 1 + q / 16."""
    b, i = locate(wr, k0, g, 32, 18, 16)  # [BN, G, 1], [1, G, 1]
    d = f16(b, m)
    return field_fma(ld(b + 2 + s, m), i * 4, d * 16.0, d * -24.0, 4)  # [BN, G, S]


@triton.jit
def q4_1(wr, k0, g, s, m, tab, tab2):
    """[d | m | qs 16], S=16: w = d * q + m = 16 d f + (m - 16 d)."""
    b, i = locate(wr, k0, g, 32, 20, 16)
    d = f16(b, m) * 16.0
    mn = f16(b + 2, m)
    return field_fma(ld(b + 4 + s, m), i * 4, d, mn - d, 4)


@triton.jit
def q5_0(wr, k0, g, s, m, tab, tab2):
    """[d | qh u32 | qs 16], S=16: w = d * (q - 16), q = nibble | bit k of qh << 4."""
    b, i = locate(wr, k0, g, 32, 22, 16)
    d = f16(b, m)
    qh = u32(b + 2, m)  # [BN, G, 1]
    q = ((u8(b + 6 + s, m) >> (i * 4)) & 15) | (((qh >> (i * 16 + s)) & 1) << 4)
    return d * i2f(q, 16.0)


@triton.jit
def q5_1(wr, k0, g, s, m, tab, tab2):
    """[d | m | qh u32 | qs 16], S=16: w = d * q + m, q as in Q5_0."""
    b, i = locate(wr, k0, g, 32, 24, 16)
    d = f16(b, m)
    mn = f16(b + 2, m)
    qh = u32(b + 4, m)
    q = ((u8(b + 8 + s, m) >> (i * 4)) & 15) | (((qh >> (i * 16 + s)) & 1) << 4)
    return d * i2f(q, 0.0) + mn


@triton.jit
def q8_0(wr, k0, g, s, m, tab, tab2):
    """[d | qs int8 32], S=32: w = d * q; q + 128 is the byte with its top bit flipped, so
    w = 256 d f - 384 d with f = 1 + (q + 128) / 256."""
    b, i = locate(wr, k0, g, 32, 34, 32)
    d = f16(b, m)
    return field_fma(ld(b + 2 + s, m), 0, d * 256.0, d * -384.0, 8, True)


@triton.jit
def iq4_nl(wr, k0, g, s, m, tab, tab2):
    """[d | qs 16], S=16: w = d * levels[q]; tab = the 16 IQ4_NL levels."""
    b, i = locate(wr, k0, g, 32, 18, 16)
    d = f16(b, m)
    q = (u8(b + 2 + s, m) >> (i * 4)) & 15
    return d * tl.load(tab + q)


@triton.jit
def mxfp4(wr, k0, g, s, m, tab, tab2):
    """[e | qs 16], S=16: w = 2^(e - 128) * (twice the E2M1 value of q) (bits.e8m0_half,
    bits.mx_scaled: computed, not read from a table)."""
    b, i = locate(wr, k0, g, 32, 17, 16)
    e = u8(b, m)  # [BN, G, 1]
    d = e8m0_half(e)
    q = (u8(b + 1 + s, m) >> (i * 4)) & 15
    return mx_scaled(q, d)
