import sys, os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../..'))
import triton, triton.language as tl
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from strata.kernels.gpu.gemv_q8 import _u32_at, _i2f_signed, i2f, _dp4a

@triton.jit
def _iq2_raw(wbase, ro, xw, dx, b, nb, c, j, w):
    m = b < nb
    o = ro + b * 74
    e = (_u32_at(wbase, o + 2 + 16 * c + 4 * (j // 2), w * 0, m) >> (16 * (j % 2))) & 0xFFFF
    b8 = (wbase.to(tl.pointer_type(tl.int8)) + o).to(tl.pointer_type(tl.uint8))
    sc = tl.load(b8 + 66 + 2 * c + j // 4 + 0 * w, mask=m, other=0).to(tl.int32)
    d = tl.load((b8 + 0 * (c + j + w)).to(tl.pointer_type(tl.int16)), mask=m, other=0)
    xj = tl.load(xw + b * 64 + 16 * c + 2 * j + w, mask=m, other=0)
    dxj = tl.load(dx + b * 8 + 2 * c + j // 4 + 0 * w, mask=m, other=0.0)
    return e, sc, d, xj, dxj

@triton.jit
def iq2xs_ahead_dot(wbase, ro, xw, dx, grid8, smask, nb, BB: tl.constexpr):
    R: tl.constexpr = ro.shape[2]
    bb = tl.arange(0, BB)[:, None, None, None, None]
    c = tl.arange(0, 4)[None, :, None, None, None]
    j = tl.arange(0, 8)[None, None, None, :, None]
    w = tl.arange(0, 2)[None, None, None, None, :]
    zero = tl.zeros((BB, 4, R, 8, 2), tl.int32)
    acc = tl.zeros((BB, 4, R, 8, 2), tl.float32)
    e, sc, d, xj, dxj = _iq2_raw(wbase, ro, xw, dx, bb, nb, c, j, w)
    for b0 in range(0, nb, BB):
        e1, sc1, d1, xj1, dxj1 = _iq2_raw(wbase, ro, xw, dx, b0 + BB + bb, nb, c, j, w)
        g = tl.load(grid8 + (e & 511) * 2 + w)
        s = tl.load(smask + (e >> 9) * 2 + w)
        dot = _dp4a(g, xj, zero) - 2 * _dp4a(g & s, xj, zero)
        scv = (sc >> (4 * ((j // 2) % 2))) & 15
        df = d.to(tl.float16, bitcast=True).to(tl.float32)
        acc += (df * (i2f(scv, 0.0) + 0.5) * 0.25 * dxj) * _i2f_signed(dot)
        e, sc, d, xj, dxj = e1, sc1, d1, xj1, dxj1
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=1), axis=0)

@triton.jit
def _iq3_raw(wbase, ro, xw, dx, b, nb, c, j, w):
    m = b < nb
    o = ro + b * 98
    q4 = _u32_at(wbase, o + 2 + 16 * c + 4 * (j // 2), w * 0, m)
    aux = _u32_at(wbase, o + 66 + 4 * (2 * c + j // 4), w * 0, m)
    d = tl.load((wbase.to(tl.pointer_type(tl.int8)) + o + 0 * (c + j + w)).to(tl.pointer_type(tl.int16)), mask=m, other=0)
    xj = tl.load(xw + b * 64 + 16 * c + 2 * j + w, mask=m, other=0)
    dxj = tl.load(dx + b * 8 + 2 * c + j // 4 + 0 * w, mask=m, other=0.0)
    return q4, aux, d, xj, dxj

@triton.jit
def iq3xxs_ahead_dot(wbase, ro, xw, dx, grid4, smask, nb, BB: tl.constexpr):
    R: tl.constexpr = ro.shape[2]
    bb = tl.arange(0, BB)[:, None, None, None, None]
    c = tl.arange(0, 4)[None, :, None, None, None]
    j = tl.arange(0, 8)[None, None, None, :, None]
    w = tl.arange(0, 2)[None, None, None, None, :]
    zero = tl.zeros((BB, 4, R, 8, 2), tl.int32)
    acc = tl.zeros((BB, 4, R, 8, 2), tl.float32)
    q4, aux, d, xj, dxj = _iq3_raw(wbase, ro, xw, dx, bb, nb, c, j, w)
    for b0 in range(0, nb, BB):
        q41, aux1, d1, xj1, dxj1 = _iq3_raw(wbase, ro, xw, dx, b0 + BB + bb, nb, c, j, w)
        idx = (q4 >> (8 * (2 * (j % 2) + w))) & 255
        g = tl.load(grid4 + idx)
        s = tl.load(smask + ((aux >> (7 * (j % 4))) & 127) * 2 + w)
        dot = _dp4a(g, xj, zero) - 2 * _dp4a(g & s, xj, zero)
        df = d.to(tl.float16, bitcast=True).to(tl.float32)
        acc += (df * (i2f((aux >> 28) & 15, 0.0) + 0.5) * 0.5 * dxj) * _i2f_signed(dot)
        q4, aux, d, xj, dxj = q41, aux1, d1, xj1, dxj1
    return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=4), axis=3), axis=1), axis=0)

@triton.jit(do_not_specialize=["N", "K"])
def gemv_ahead_kernel(xq, dx, w, y, grid, smask, N, K, row_bytes, IQ3: tl.constexpr, R: tl.constexpr, BB: tl.constexpr):
    n = tl.program_id(0) * R + tl.arange(0, R)
    ro = (tl.minimum(n, N - 1).to(tl.int64) * row_bytes)[None, None, :, None, None]
    wb, xw = w.to(tl.pointer_type(tl.int32)), xq.to(tl.pointer_type(tl.int32))
    if IQ3:
        s = iq3xxs_ahead_dot(wb, ro, xw, dx, grid, smask, K // 256, BB)
    else:
        s = iq2xs_ahead_dot(wb, ro, xw, dx, grid, smask, K // 256, BB)
    tl.store(y + n, s, mask=n < N)

from iq2s import _prmt, _dp4a_ss

@triton.jit
def iq2xs_prmt_dot(wbase, ro, xw, dx, gsel, ssel, nb, BB: tl.constexpr):
    R: tl.constexpr = ro.shape[2]
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
        sel = tl.load(gsel + (e & 511)) | tl.load(ssel + (e >> 9))
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
def gemv_prmt_kernel(xq, dx, w, y, gsel, ssel, N, K, row_bytes, R: tl.constexpr, BB: tl.constexpr):
    n = tl.program_id(0) * R + tl.arange(0, R)
    ro = (tl.minimum(n, N - 1).to(tl.int64) * row_bytes)[None, None, :, None, None]
    s = iq2xs_prmt_dot(w.to(tl.pointer_type(tl.int32)), ro, xq.to(tl.pointer_type(tl.int32)), dx, gsel, ssel, K // 256, BB)
    tl.store(y + n, s, mask=n < N)
