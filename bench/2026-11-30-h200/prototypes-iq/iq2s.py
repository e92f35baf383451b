import sys; import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../..'))
import numpy as np, torch, triton, triton.language as tl
from strata.kernels.gpu.bits import ASM
from strata.kernels.gpu.gemv_q8 import _u32_at, _i2f_signed, i2f
from strata.quant import grids
import gguf.quants as gq

@triton.jit
def _prmt(a, b, s):
    if ASM:
        out = tl.inline_asm_elementwise(asm="prmt.b32 $0, $1, $2, $3;", constraints="=r,r,r,r",
                                        args=[a, b, s], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = s * 0
        for k in tl.static_range(4):
            i = (s >> (4 * k)) & 7
            byte = tl.where(i < 4, a >> (8 * (i & 3)), b >> (8 * (i & 3))) & 0xFF
            out |= byte << (8 * k)
    return out

@triton.jit
def _dp4a_ss(a, b, c):
    if ASM:
        out = tl.inline_asm_elementwise(asm="dp4a.s32.s32 $0, $1, $2, $3;", constraints="=r,r,r,r",
                                        args=[a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        out = c
        for k in tl.static_range(4):
            sa = (a >> (8 * k)) & 0xFF
            sb = (b >> (8 * k)) & 0xFF
            out += (sa - ((sa & 0x80) << 1)) * (sb - ((sb & 0x80) << 1))
    return out

@triton.jit
def iq2xs_smem_dot(wbase, ro, xw, dx, gsel, ssel, nb, BB: tl.constexpr):
    R: tl.constexpr = ro.shape[2]
    N: tl.constexpr = BB * 4 * R * 8
    bb = tl.arange(0, BB)[:, None, None, None, None]
    c = tl.arange(0, 4)[None, :, None, None, None]
    j = tl.arange(0, 8)[None, None, None, :, None]
    w = tl.arange(0, 2)[None, None, None, None, :]
    zero = tl.zeros((BB, 4, R, 8, 2), tl.int32)
    acc = tl.zeros((BB, 4, R, 8, 2), tl.float32)
    for b0 in range(0, nb, BB):
        b = b0 + bb
        m = b < nb
        o = ro + b * 74
        e = (_u32_at(wbase, o + 2 + 16 * c + 4 * (j // 2), 0, m) >> (16 * (j % 2))) & 0xFFFF  # [BB,4,R,8,1]
        ef = tl.reshape(e, (N,))
        sel = tl.gather(gsel, ef & 511, 0) | tl.gather(ssel, ef >> 9, 0)
        sel = tl.reshape(sel, (BB, 4, R, 8, 1))
        g = _prmt(0x002B1908 + zero, 0x00D5E7F8, sel >> (16 * w))
        xj = tl.load(xw + b * 64 + 16 * c + 2 * j + w, mask=m, other=0)
        dot = _dp4a_ss(g, xj, zero)
        b8 = (wbase.to(tl.pointer_type(tl.int8)) + o).to(tl.pointer_type(tl.uint8))
        sc = (tl.load(b8 + 66 + 2 * c + j // 4 + 0 * w, mask=m, other=0).to(tl.int32)
              >> (4 * ((j // 2) % 2))) & 15
        d = tl.load((b8 + 0 * (c + j + w)).to(tl.pointer_type(tl.int16)), mask=m,
                    other=0).to(tl.float16, bitcast=True).to(tl.float32)
        dxj = tl.load(dx + b * 8 + 2 * c + j // 4 + 0 * w, mask=m, other=0.0)
        acc += (d * (i2f(sc, 0.0) + 0.5) * 0.25 * dxj) * _i2f_signed(dot)
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=1), axis=0)

@triton.jit(do_not_specialize=["N", "K"])
def gemv_kernel(xq, dx, w, y, gsel, ssel, N, K, row_bytes, R: tl.constexpr, BB: tl.constexpr):
    n = tl.program_id(0) * R + tl.arange(0, R)
    ro = (tl.minimum(n, N - 1).to(tl.int64) * row_bytes)[None, None, :, None, None]
    gs = tl.load(gsel + tl.arange(0, 512))
    ss = tl.load(ssel + tl.arange(0, 128))
    s = iq2xs_smem_dot(w.to(tl.pointer_type(tl.int32)), ro, xq.to(tl.pointer_type(tl.int32)), dx, gs, ss, K // 256, BB)
    tl.store(y + n, s, mask=n < N)

def tables():
    g = grids._grid_np(gq.IQ2_XS)  # [512, 8] values 8, 25, 43
    code = np.select([g == 8, g == 25, g == 43], [0, 1, 2], -1)
    assert (code >= 0).all()
    gsel = (code.astype(np.int64) << (4 * np.arange(8))).sum(1).astype(np.uint32).view(np.int32)
    neg = grids._ksigns_np() < 0
    ssel = ((neg.astype(np.int64) * 4) << (4 * np.arange(8))).sum(1).astype(np.uint32).view(np.int32)
    return gsel, ssel
