"""The Triton kernel bodies of delta_ops.py (loaded only when a kernel runs: on CUDA, or under
Triton's interpreter). What each computes: delta_ops.py's module doc."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _conv_step_kernel(x, window, w, y, C, K: tl.constexpr, BLOCK: tl.constexpr):
    # y[c] = silu(Σ_j window[j, c] w[c, j] + x[c] w[c, K-1]); window rows move up, x last
    c = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = c < C
    xv = tl.load(x + c, mask=m, other=0.0)
    acc = xv * tl.load(w + c * K + (K - 1), mask=m, other=0.0)
    for j in tl.static_range(K - 1):
        acc += tl.load(window + j * C + c, mask=m, other=0.0) * tl.load(w + c * K + j, mask=m,
                                                                         other=0.0)
    for j in tl.static_range(K - 2):  # (row j + 1 is read before its own turn overwrites it)
        tl.store(window + j * C + c, tl.load(window + (j + 1) * C + c, mask=m), mask=m)
    if K > 1:
        tl.store(window + (K - 2) * C + c, xv, mask=m)
    tl.store(y + c, acc * tl.sigmoid(acc), mask=m)


@triton.jit
def _delta_step_kernel(x, g, beta, state, out, eps, scale, HK: tl.constexpr, R: tl.constexpr,
                       DK: tl.constexpr, DV: tl.constexpr, TILED: tl.constexpr,
                       BK: tl.constexpr, BV: tl.constexpr, GATES: tl.constexpr = False,
                       a=None, dt_bias=None, HV: tl.constexpr = 0):
    # value head j, columns vb*BV..: q, k of its key head L2-normed (q scaled); S = e^g S;
    # S += k (beta (v - S^T k))^T; out = S^T q. GATES: g holds beta's and alpha's logits [2 Hv]
    # (beta unread), the head's gates computed here as _gates_kernel computes them
    j = tl.program_id(0)
    vb = tl.program_id(1)
    if TILED:
        kh = j % HK
    else:
        kh = j // R
    dk = tl.arange(0, BK)
    mk = dk < DK
    q = tl.load(x + kh * DK + dk, mask=mk, other=0.0)
    k = tl.load(x + HK * DK + kh * DK + dk, mask=mk, other=0.0)
    q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + eps)
    dv = vb * BV + tl.arange(0, BV)
    mv = dv < DV
    v = tl.load(x + 2 * HK * DK + j * DV + dv, mask=mv, other=0.0)
    if GATES:
        bj, gj = _gates(tl.load(g + j), tl.load(g + HV + j), tl.load(a + j), tl.load(dt_bias + j))
    else:
        gj = tl.load(g + j)
        bj = tl.load(beta + j)
    offs = j.to(tl.int64) * DK * DV + dk[:, None] * DV + dv[None, :]
    mkv = mk[:, None] & mv[None, :]
    S = tl.load(state + offs, mask=mkv, other=0.0) * tl.exp(gj)  # [BK, BV]
    delta = bj * (v - tl.sum(S * k[:, None], axis=0))  # [BV]
    S = S + k[:, None] * delta[None, :]
    tl.store(state + offs, S, mask=mkv)
    tl.store(out + j * DV + dv, tl.sum(S * q[:, None], axis=0), mask=mv)


@triton.jit
def _chunk_scan_kernel(u0, w, inner, qg, kg, dend, state, out, n, DK: tl.constexpr,
                       DV: tl.constexpr, L: tl.constexpr, BV: tl.constexpr):
    # head h, state columns vb*BV..; over the chunks c in order (S in registers):
    #   u = u0[c] - w[c] S;  out[c] = qg[c] S + inner[c] u;  S = dend[c] S + kg[c]^T u
    h = tl.program_id(0).to(tl.int64)
    vb = tl.program_id(1)
    dk = tl.arange(0, DK)
    ll = tl.arange(0, L)
    dv = vb * BV + tl.arange(0, BV)
    mv = dv < DV
    S = tl.load(state + h * DK * DV + dk[:, None] * DV + dv[None, :], mask=mv[None, :],
                other=0.0)  # [DK, BV]
    for c in range(n):
        base = h * n + c
        rows_k = base * L * DK + ll[:, None] * DK + dk[None, :]  # [L, DK]
        rows_v = base * L * DV + ll[:, None] * DV + dv[None, :]  # [L, BV]
        W = tl.load(w + rows_k)
        u = tl.load(u0 + rows_v, mask=mv[None, :], other=0.0) - tl.dot(
            W, S, input_precision="ieee")
        A = tl.load(inner + base * L * L + ll[:, None] * L + ll[None, :])
        o = tl.dot(tl.load(qg + rows_k), S, input_precision="ieee") + tl.dot(
            A, u, input_precision="ieee")
        tl.store(out + rows_v, o, mask=mv[None, :])
        K = tl.load(kg + rows_k)
        S = S * tl.load(dend + base) + tl.dot(tl.trans(K), u, input_precision="ieee")
    tl.store(state + h * DK * DV + dk[:, None] * DV + dv[None, :], S, mask=mv[None, :])


@triton.jit
def _gates_kernel(ba, a, dt_bias, beta, g, HV, BLOCK: tl.constexpr):
    # row t: beta = sigmoid(ba[t, :Hv]); g = a * softplus(ba[t, Hv:] + dt_bias) (softplus as
    # torch's: the input itself past 20)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    m = j < HV
    bv, gv = _gates(tl.load(ba + t * 2 * HV + j, mask=m, other=0.0),
                    tl.load(ba + t * 2 * HV + HV + j, mask=m, other=0.0),
                    tl.load(a + j, mask=m, other=0.0), tl.load(dt_bias + j, mask=m, other=0.0))
    tl.store(beta + t * HV + j, bv, mask=m)
    tl.store(g + t * HV + j, gv, mask=m)


@triton.jit
def _gates(b, al, a, dt_bias):
    """(beta, g) = (sigmoid(b), a * softplus(al + dt_bias)), softplus as torch's: the input
    itself past 20."""
    x = al + dt_bias
    sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    return tl.sigmoid(b), a * sp


@triton.jit
def _gated_norm_kernel(o, z, w, out, DV, eps, BLOCK: tl.constexpr):
    # row r (a token's head): out = o * rsqrt(mean(o^2) + eps) * w * silu(z)
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    m = d < DV
    wv = tl.load(w + d, mask=m, other=0.0)
    zv = tl.load(z + r * DV + d, mask=m, other=0.0)
    ov = tl.load(o + r * DV + d, mask=m, other=0.0)
    y = ov * tl.math.rsqrt(tl.sum(ov * ov, axis=0) / DV + eps) * wv
    tl.store(out + r * DV + d, y * (zv * tl.sigmoid(zv)), mask=m)
