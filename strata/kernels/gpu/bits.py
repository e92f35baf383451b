"""Byte-level helpers shared by the dequantize tiles (all `@triton.jit`, inlined by Triton).

Every tile reads the raw bytes of a weight row through a pointer `wr` (uint8, one per row) plus
int32 offsets inside the row, so only the row base needs 64-bit arithmetic. Multi-byte fields are
read through a pointer cast; every field read that way sits at an even offset of an even-sized
block, so the cast pointer is aligned for its type.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs


@triton.jit
def ld(ptr, mask):
    """tl.load with an optional mask (None: every group is inside the row); masked lanes read 0."""
    if mask is None:
        return tl.load(ptr)
    else:
        return tl.load(ptr, mask=mask, other=0)


@triton.jit
def u8(ptr, mask):
    """One byte as int32 0..255."""
    return ld(ptr, mask).to(tl.int32)


@triton.jit
def u16(ptr, mask):
    """A little-endian u16 at a 2-aligned byte pointer, as int32 0..65535."""
    return ld(ptr.to(tl.pointer_type(tl.int16)), mask).to(tl.int32) & 0xFFFF


@triton.jit
def u32(ptr, mask):
    """A little-endian u32 at a 2-aligned byte pointer, as int32 bits (two u16 reads: the
    blocks that hold u32 fields are only 2-aligned)."""
    return u16(ptr, mask) | (u16(ptr + 2, mask) << 16)


@triton.jit
def f16(ptr, mask):
    """A little-endian f16 at a 2-aligned byte pointer, widened exactly to float32."""
    return ld(ptr.to(tl.pointer_type(tl.float16)), mask).to(tl.float32)


@triton.jit
def u32x2(ptr, mask):
    """The two little-endian u32 at an 8-aligned byte pointer, as int32 bits: one 64-bit read."""
    v = ld(ptr.to(tl.pointer_type(tl.int64)), mask)
    return v.to(tl.int32), (v >> 32).to(tl.int32)


@triton.jit
def f16_bits(v):
    """The f16 in the low 16 bits of int32 v, widened exactly to float32."""
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def e8m0_half(e):
    """2^(e-128) in float32 for an E8M0 exponent e (int32 0..255): an MXFP4 block's scale with
    its values doubled to integers (strata.quant.mxfp4). bits = e >= 2 ? (e - 1) << 23 :
    0x00200000 << e (e < 2: subnormal)."""
    return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)


@triton.jit
def mx_doubled(nib):
    """Twice the E2M1 value of 4-bit codes nib (int32 0..15), as int32: 0, 1 for the low 3 bits
    m < 2, else (2 | (m & 1)) << ((m >> 1) - 1), i.e. 2, 3, 4, 6, 8, 12; negative where bit 3
    is set. Arithmetic, not a table: a per-weight gather is one more load a value."""
    m = nib & 7
    v = tl.where(m < 2, m, (2 | (m & 1)) << tl.maximum((m >> 1) - 1, 0))
    return tl.where(nib >= 8, -v, v)


@triton.jit
def mx_scaled(nib, d):
    """float32 d · twice the E2M1 value of 4-bit codes nib: an MXFP4 value with d its block's
    e8m0_half scale (the doubling folded into it), exact."""
    return d * i2f(mx_doubled(nib) + 12, 12)


@triton.jit
def mx_join_order(i):
    """Where column i of an MXFP4 tile built as tl.join(low nibbles, high nibbles) of each
    block's 16 bytes, reshaped flat, takes its value from: 32 (i // 32) + 16 (i % 2) +
    (i % 32) // 2 (the block, then byte j = (i % 32) // 2's low or high nibble). x's columns
    loaded in this order pair with it in a dot."""
    return (i // 32) * 32 + (i % 2) * 16 + (i % 32) // 2


@triton.jit
def i2f(q, bias: tl.constexpr):
    """Exact float32 of (q - bias) for int32 0 <= q < 2**23.

    Or-ing q into the mantissa of 2**23 (bits 0x4B000000) and subtracting 2**23 + bias costs one
    integer and one float op; a real int->float conversion runs at 1/8 of the float rate on
    Hopper, and there is one per weight.
    """
    return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)


@triton.jit
def locate(wr, k0, g, QK: tl.constexpr, QB: tl.constexpr, S: tl.constexpr):
    """Where the groups of the K step starting at k0 live: (b, i) with b [BN, G, 1] uint8
    pointers to their blocks and i [1, G, 1] the group's index inside its block.

    g [1, G, 1] is the group index inside the step (0..G-1, loop-invariant), so when a step
    covers whole blocks everything but one scalar offset is computed once, outside the K loop.
    """
    GPB: tl.constexpr = QK // S  # groups per block
    step = (k0 // QK) * QB  # scalar
    if g.shape[1] * S >= QK:  # the step covers whole blocks (and starts at a block)
        gu = g.to(tl.uint32)
        b = wr + step + ((gu // GPB) * QB).to(tl.int32)
        i = (gu % GPB).to(tl.int32)
    else:  # the step is part of one block
        b = wr + step
        i = (k0 % QK) // S + g
    return b, i


# Inline PTX for the per-weight hot paths (the interpreter runs the plain-Triton twin instead).
ASM = tl.constexpr(not knobs.runtime.interpret)


def _field_asm(lo_bits: int, hi_bits: int) -> str:
    """PTX for one value: q = lo field | hi field << lo_bits is put in mantissa bits
    pos..22 of 1.0 (pos = 23 - lo_bits - hi_bits), so f = 1 + q / 2^(lo_bits + hi_bits)
    exactly, and out = f * scale + bias (one FMA). Operands: $0 out, $1 lo byte (int32),
    [$2 hi byte], then n_lo [, n_hi]: left shifts that take each field from its bits of the byte
    to its place in the mantissa, then scale, bias. Every operand belongs to this value alone,
    so the result does not depend on how Triton packs values into registers."""
    pos = 23 - lo_bits - hi_bits
    if hi_bits == 0:
        return (f"{{ .reg .b32 t; shl.b32 t, $1, $2; "
                f"lop3.b32 t, t, {((1 << lo_bits) - 1) << pos}, 0x3F800000, 0xEA; "
                f"fma.rn.f32 $0, t, $3, $4; }}")
    return (f"{{ .reg .b32 t, u; shl.b32 t, $1, $3; shl.b32 u, $2, $4; "
            f"lop3.b32 u, u, {((1 << hi_bits) - 1) << (pos + lo_bits)}, 0x3F800000, 0xEA; "
            f"lop3.b32 t, t, {((1 << lo_bits) - 1) << pos}, u, 0xEA; "
            f"fma.rn.f32 $0, t, $5, $6; }}")


_ASM_4 = tl.constexpr(_field_asm(4, 0))
_ASM_2 = tl.constexpr(_field_asm(2, 0))
_ASM_8 = tl.constexpr(_field_asm(8, 0))
_ASM_4_1 = tl.constexpr(_field_asm(4, 1))
_ASM_4_2 = tl.constexpr(_field_asm(4, 2))
_ASM_2_1 = tl.constexpr(_field_asm(2, 1))


@triton.jit
def field_fma(lo, lo_shift, scale, bias, LO_BITS: tl.constexpr, FLIP: tl.constexpr = False):
    """scale * (1 + q / 2^LO_BITS) + bias with q = ((lo ^ (FLIP ? 0x80 : 0)) >> lo_shift) &
    (2^LO_BITS - 1): lo is the uint8 tensor of packed fields, the others broadcast to its shape.
    With scale = 2^LO_BITS d and bias = -d (2^LO_BITS + c) this is d * (q - c), rounded once
    (an FMA), without an int-to-float conversion."""
    v = lo.to(tl.int32)
    if FLIP:
        v = v ^ 0x80
    POS: tl.constexpr = 23 - LO_BITS
    if ASM:
        if LO_BITS == 4:
            code: tl.constexpr = _ASM_4
        elif LO_BITS == 2:
            code: tl.constexpr = _ASM_2
        else:
            tl.static_assert(LO_BITS == 8)
            code: tl.constexpr = _ASM_8
        n = tl.zeros(v.shape, tl.int32) + (POS - lo_shift)  # lo_shift may be a constant
        out = tl.inline_asm_elementwise(
            asm=code, constraints="=r,r,r,r,r",
            args=[v, n, tl.broadcast_to(scale, v.shape), tl.broadcast_to(bias, v.shape)],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        q = (v >> lo_shift) & ((1 << LO_BITS) - 1)
        out = scale * ((q << POS) | 0x3F800000).to(tl.float32, bitcast=True) + bias
    return out


@triton.jit
def fields_fma(lo, hi, lo_shift, hi_shift, scale, bias, LO_BITS: tl.constexpr,
               HI_BITS: tl.constexpr):
    """As field_fma with q = lo field | hi field << LO_BITS (HI_BITS from the bytes of hi)."""
    POS: tl.constexpr = 23 - LO_BITS - HI_BITS
    a = lo.to(tl.int32)
    b = hi.to(tl.int32)
    if ASM:
        if LO_BITS == 4 and HI_BITS == 1:
            code: tl.constexpr = _ASM_4_1
        elif LO_BITS == 4:
            tl.static_assert(HI_BITS == 2)
            code: tl.constexpr = _ASM_4_2
        else:
            tl.static_assert(LO_BITS == 2 and HI_BITS == 1)
            code: tl.constexpr = _ASM_2_1
        out = tl.inline_asm_elementwise(
            asm=code, constraints="=r,r,r,r,r,r,r",
            args=[a, b, tl.zeros(a.shape, tl.int32) + (POS - lo_shift),
                  tl.zeros(a.shape, tl.int32) + (POS + LO_BITS - hi_shift),
                  tl.broadcast_to(scale, a.shape), tl.broadcast_to(bias, a.shape)],
            dtype=tl.float32, is_pure=True, pack=1)
    else:
        q = (a >> lo_shift) & ((1 << LO_BITS) - 1)
        q = q | (((b >> hi_shift) & ((1 << HI_BITS) - 1)) << LO_BITS)
        out = scale * ((q << POS) | 0x3F800000).to(tl.float32, bitcast=True) + bias
    return out


@triton.jit
def to_f32(v):
    """bf16 / f32 -> f32. For bf16 the PTX widens two values per register with one op each
    (the compiler's own sequence spends a PRMT and a multiply on the upper half)."""
    if ASM and v.dtype == tl.bfloat16:
        return tl.inline_asm_elementwise(
            asm="shl.b32 $0, $2, 16; and.b32 $1, $2, 0xFFFF0000;",
            constraints="=r,=r,r", args=[v], dtype=tl.float32, is_pure=True, pack=2)
    else:
        return v.to(tl.float32)
