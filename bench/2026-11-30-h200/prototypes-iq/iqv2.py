import sys; import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../..'))
import numpy as np, torch, triton, triton.language as tl
from strata.kernels.gpu.gemv_q8 import _u32_at, _i2f_signed, i2f
from iq2s import _prmt, _dp4a_ss, tables as iq2_tables
from strata.quant import grids
import gguf.quants as gq

@triton.jit
def _smem(tab, idx):
    """tab[idx] for a table held across the program's warps (tl.gather through shared memory)."""
    S: tl.constexpr = idx.shape
    N: tl.constexpr = S[0] * S[1] * S[2] * S[3] * S[4]
    return tl.reshape(tl.gather(tab, tl.reshape(idx, (N,)), 0), S)

@triton.jit
def iq2xs_v2_dot(wbase, ro, xw, dx, gsel, ssel, nb, BB: tl.constexpr):
    R: tl.constexpr = ro.shape[2]
    bb = tl.arange(0, BB)[:, None, None, None, None]
    c = tl.arange(0, 4)[None, :, None, None, None]
    j2 = tl.arange(0, 4)[None, None, None, :, None]
    jj = tl.arange(0, 2)[None, None, None, None, :]
    zero = tl.zeros((BB, 4, R, 4, 2), tl.int32)
    acc = tl.zeros((BB, 4, R, 4), tl.float32)
    for b0 in range(0, nb, BB):
        b = b0 + bb
        m = b < nb
        o = ro + b * 74
        e = (_u32_at(wbase, o + 2 + 16 * c + 4 * j2, 0, m) >> (16 * jj)) & 0xFFFF  # [BB,4,R,4,2]
        sel = _smem(gsel, e & 511) | _smem(ssel, e >> 9)
        x2 = tl.load(xw.to(tl.pointer_type(tl.int64)) + b * 32 + 8 * c + 2 * j2 + jj, mask=m, other=0)
        dot = _dp4a_ss(_prmt(0x002B1908 + zero, 0x00D5E7F8, sel >> 16), (x2 >> 32).to(tl.int32),
                       _dp4a_ss(_prmt(0x002B1908 + zero, 0x00D5E7F8, sel), x2.to(tl.int32), zero))
        dot = tl.sum(dot, axis=4)  # [BB,4,R,4]: the 16 values of a scale
        b8 = (wbase.to(tl.pointer_type(tl.int8)) + o).to(tl.pointer_type(tl.uint8))
        b8 = tl.reshape(b8, (BB, 1, R, 1))
        c4 = tl.reshape(c, (1, 4, 1, 1))
        k4 = tl.reshape(j2, (1, 1, 1, 4))
        m4 = tl.reshape(m, (BB, 1, 1, 1))
        sc = (tl.load(b8 + 66 + 2 * c4 + k4 // 2, mask=m4, other=0).to(tl.int32) >> (4 * (k4 % 2))) & 15
        d = tl.load(b8.to(tl.pointer_type(tl.int16)), mask=m4, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        dxj = tl.load(dx + tl.reshape(b, (BB, 1, 1, 1)) * 8 + 2 * c4 + k4 // 2, mask=m4, other=0.0)
        acc += (d * dxj) * ((i2f(sc, 0.0) + 0.5) * 0.25 * _i2f_signed(dot))
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=1), axis=0)

@triton.jit
def iq3xxs_v2_dot(wbase, ro, xw, dx, grid4, smlo, smhi, nb, BB: tl.constexpr):
    R: tl.constexpr = ro.shape[2]
    bb = tl.arange(0, BB)[:, None, None, None, None]
    c = tl.arange(0, 4)[None, :, None, None, None]
    j2 = tl.arange(0, 4)[None, None, None, :, None]
    jj = tl.arange(0, 2)[None, None, None, None, :]
    zero = tl.zeros((BB, 4, R, 4, 2), tl.int32)
    acc = tl.zeros((BB, 4, R, 2), tl.float32)
    for b0 in range(0, nb, BB):
        b = b0 + bb
        m = b < nb
        o = ro + b * 98
        q4 = _u32_at(wbase, o + 2 + 16 * c + 4 * j2, 0, m)  # [BB,4,R,4,1]: group j's two indices at bytes 2jj, 2jj+1
        aux = _u32_at(wbase, o + 66 + 4 * (2 * c + j2 // 2), 0, m)  # [BB,4,R,4,1]
        s7 = (aux >> (7 * (2 * (j2 % 2) + jj))) & 127  # [BB,4,R,4,2]
        i0 = (q4 >> (16 * jj)) & 255
        i1 = (q4 >> (16 * jj + 8)) & 255
        g0 = _smem(grid4, i0)
        g1 = _smem(grid4, i1)
        m0 = _smem(smlo, s7)
        m1 = _smem(smhi, s7)
        g0 = (g0 ^ m0) + (m0 & 0x01010101)
        g1 = (g1 ^ m1) + (m1 & 0x01010101)
        x2 = tl.load(xw.to(tl.pointer_type(tl.int64)) + b * 32 + 8 * c + 2 * j2 + jj, mask=m, other=0)
        dot = _dp4a_ss(g1, (x2 >> 32).to(tl.int32), _dp4a_ss(g0, x2.to(tl.int32), zero))
        dot = tl.sum(tl.reshape(dot, (BB, 4, R, 2, 4)), axis=4)  # [BB,4,R,2]: 32 values of a scale
        b8 = tl.reshape((wbase.to(tl.pointer_type(tl.int8)) + o), (BB, 1, R, 1))
        m4 = tl.reshape(m, (BB, 1, 1, 1))
        h4 = tl.arange(0, 2)[None, None, None, :]
        a2 = _u32_at(wbase, tl.reshape(o, (BB, 1, R, 1)) + 66 + 4 * (2 * tl.reshape(c, (1, 4, 1, 1)) + h4), 0, m4)
        d = tl.load(b8.to(tl.pointer_type(tl.int16)), mask=m4, other=0).to(tl.float16, bitcast=True).to(tl.float32)
        c4 = tl.reshape(c, (1, 4, 1, 1))
        dxj = tl.load(dx + tl.reshape(b, (BB, 1, 1, 1)) * 8 + 2 * c4 + h4, mask=m4, other=0.0)
        acc += (d * dxj) * ((i2f((a2 >> 28) & 15, 0.0) + 0.5) * 0.5 * _i2f_signed(dot))
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=1), axis=0)

@triton.jit(do_not_specialize=["N", "K"])
def gemv_v2_kernel(xq, dx, w, y, t0, t1, t2, N, K, row_bytes, IQ3: tl.constexpr, R: tl.constexpr, BB: tl.constexpr):
    n = tl.program_id(0) * R + tl.arange(0, R)
    ro = (tl.minimum(n, N - 1).to(tl.int64) * row_bytes)[None, None, :, None, None]
    wb, xw = w.to(tl.pointer_type(tl.int32)), xq.to(tl.pointer_type(tl.int32))
    if IQ3:
        s = iq3xxs_v2_dot(wb, ro, xw, dx, tl.load(t0 + tl.arange(0, 256)), tl.load(t1 + tl.arange(0, 128)),
                          tl.load(t2 + tl.arange(0, 128)), K // 256, BB)
    else:
        s = iq2xs_v2_dot(wb, ro, xw, dx, tl.load(t0 + tl.arange(0, 512)), tl.load(t1 + tl.arange(0, 128)), K // 256, BB)
    tl.store(y + n, s, mask=n < N)

def iq3_tables():
    from strata.kernels.gpu.gemv_q8 import _grid_bytes
    g = _grid_bytes(gq.IQ3_XXS, 256, 4).reshape(256)
    sm = np.where(grids._ksigns_np() < 0, 255, 0).astype(np.uint8).reshape(128, 8).view(np.int32)  # [128,2]
    return g, np.ascontiguousarray(sm[:, 0]), np.ascontiguousarray(sm[:, 1])

def tables(iq3):
    if iq3:
        return iq3_tables()
    g, s = iq2_tables()
    return g, s, s
