"""The Triton kernel bodies of decode_ops.py (its launchers and torch paths load this module only
when a kernel runs: on CUDA, or under Triton's interpreter). What each computes, its grid and its
launch: decode_ops.py's module doc.
"""

from __future__ import annotations

import triton
import triton.language as tl

# the running max before the first key: finite, so exp(m_old - m_new) never computes inf - inf
_NEG = tl.constexpr(-1.0e30)


@triton.jit
def _norm_row(x, delta, w, d, dm, stride_r, D, eps, HAS_DELTA: tl.constexpr, R: tl.constexpr,
              extra=None, HAS_EXTRA: tl.constexpr = False):
    """(v, y) for one row: v = x [+ Σ_r delta_r (+ extra), the rows added to each other in order
    first], y = v * rsqrt(mean(v^2) + eps) * w (pointers at the row's first element)."""
    # the weight first: loaded after the sum it would cost a second memory latency behind the
    # reduction's barriers (the compiler keeps the order written)
    wv = tl.load(w + d, mask=dm, other=0.0)
    v = tl.load(x + d, mask=dm, other=0.0)
    if HAS_DELTA:
        s = tl.load(delta + d, mask=dm, other=0.0)
        for r in tl.static_range(1, R):
            s = s + tl.load(delta + r * stride_r + d, mask=dm, other=0.0)
        if HAS_EXTRA:  # (a row R + 1 kept apart: the shared expert's)
            s = s + tl.load(extra + d, mask=dm, other=0.0)
        v = v + s
    return v, v * tl.math.rsqrt(tl.sum(v * v, axis=0) / D + eps) * wv


@triton.jit
def _rms_norm_kernel(x, delta, w, out, extra, D, stride_x, stride_d, stride_r, stride_o,
                     stride_e, eps, HAS_DELTA: tl.constexpr, R: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_EXTRA: tl.constexpr = False):
    # [x[t] += Σ_r delta[t, r] (+ extra[t])]; out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    dm = d < D
    xr = x + t * stride_x
    v, y = _norm_row(xr, delta + t * stride_d, w, d, dm, stride_r, D, eps, HAS_DELTA, R,
                     extra + t * stride_e, HAS_EXTRA)
    if HAS_DELTA:
        tl.store(xr + d, v, mask=dm)
    tl.store(out + t * stride_o + d, y, mask=dm)


@triton.jit
def _norm_rope(src, w, eps, pos_f, inv_freq, HAS_NORM: tl.constexpr, HD: tl.constexpr,
               ROPE_DIM: tl.constexpr, NEOX: tl.constexpr, BLOCK_D: tl.constexpr):
    """One head row [BLOCK_D] of src: rms-normed with w (if HAS_NORM), then rotated.

    out[d] = x[d]·cos(a_i) + sign·x[d']·sin(a_i) for d < ROPE_DIM, x[d] beyond, where d' is d's
    partner (neox: d ± ROPE_DIM/2; normal: d ^ 1), i the pair index and sign -1 on the pair's
    first element: the a·c - b·s, b·c + a·s of apply_rope."""
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    if NEOX:
        first = d < ROPE_DIM // 2
        partner = tl.where(first, d + ROPE_DIM // 2, d - ROPE_DIM // 2)
        i = tl.where(first, d, d - ROPE_DIM // 2)
    else:
        first = d % 2 == 0
        partner = d ^ 1
        i = d // 2
    rot = d < ROPE_DIM
    x = tl.load(src + d, mask=dm, other=0.0)
    xp = tl.load(src + partner, mask=rot, other=0.0)
    if HAS_NORM:
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) / HD + eps)
        x = x * r * tl.load(w + d, mask=dm, other=0.0)
        xp = xp * r * tl.load(w + partner, mask=rot, other=0.0)
    ang = pos_f * tl.load(inv_freq + i, mask=rot, other=0.0)
    sign = tl.where(first, -1.0, 1.0)
    return tl.where(rot, x * tl.cos(ang) + sign * xp * tl.sin(ang), x)


@triton.jit
def _qk_rope_kernel(q, k, v, qn, kn, inv_freq, pos, qo, kc, vc, ks, vs, eps, H, C,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_qot, stride_qoh, stride_kcr, stride_kch, stride_vcr, stride_vch,
                    stride_ksr, stride_ksh, stride_vsr, stride_vsh,
                    HAS_QN: tl.constexpr, HAS_KN: tl.constexpr, HD: tl.constexpr,
                    ROPE_DIM: tl.constexpr, NEOX: tl.constexpr, BLOCK_D: tl.constexpr,
                    Q8: tl.constexpr, write=None, ROWS: tl.constexpr = False):
    # program (t, j): j < H: query head j -> qo[t, j]; else kv head g = j - H -> cache row pos + t
    # (ROWS: token t of its own sequence, at position pos[t], its row write[t] of a pool)
    t = tl.program_id(0)
    j = tl.program_id(1)
    if ROWS:
        at = tl.load(pos + t).to(tl.int64)
        row = tl.load(write + t).to(tl.int64)
    else:
        at = tl.load(pos).to(tl.int64) + t
        row = at
    pos_f = at.to(tl.float32)
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    if j < H:
        y = _norm_rope(q + t * stride_qt + j * stride_qh, qn, eps, pos_f, inv_freq, HAS_QN, HD,
                       ROPE_DIM, NEOX, BLOCK_D)
        tl.store(qo + t * stride_qot + j * stride_qoh + d, y, mask=dm)
    else:
        g = j - H
        y = _norm_rope(k + t * stride_kt + g * stride_kh, kn, eps, pos_f, inv_freq, HAS_KN, HD,
                       ROPE_DIM, NEOX, BLOCK_D)
        ok = dm & (row < C)  # (rounded to the cache's type: --kv-type)
        vv = tl.load(v + t * stride_vt + g * stride_vh + d, mask=dm, other=0.0)
        if Q8:  # 8-bit blocks of 32 with a float16 scale, as llama.cpp's q8_0
            nb = tl.arange(0, BLOCK_D // 32)
            sm = (nb < HD // 32) & (row < C)
            qk, dk = _q8_0(y, BLOCK_D)
            tl.store(kc + row * stride_kcr + g * stride_kch + d, qk, mask=ok)
            tl.store(ks + row * stride_ksr + g * stride_ksh + nb, dk, mask=sm)
            qv, dv = _q8_0(vv, BLOCK_D)
            tl.store(vc + row * stride_vcr + g * stride_vch + d, qv, mask=ok)
            tl.store(vs + row * stride_vsr + g * stride_vsh + nb, dv, mask=sm)
        else:
            tl.store(kc + row * stride_kcr + g * stride_kch + d, y.to(kc.dtype.element_ty),
                     mask=ok)
            tl.store(vc + row * stride_vcr + g * stride_vch + d, vv.to(vc.dtype.element_ty),
                     mask=ok)


@triton.jit
def _q8_0(x, BLOCK_D: tl.constexpr):
    """A row [BLOCK_D] (zeros past its length) -> (int8 [BLOCK_D], float16 scales
    [BLOCK_D/32]): d = max|x| / 127 per block of 32, q = round(x · (1/d)), half away from zero
    (kv_cache.quantize_q8_0, llama.cpp's q8_0)."""
    xb = tl.reshape(x, (BLOCK_D // 32, 32))
    dq = tl.max(tl.abs(xb), axis=1) / 127.0
    inv = tl.where(dq == 0.0, 0.0, 1.0 / dq)
    y = xb * inv[:, None]
    qb = tl.where(y < 0.0, -1.0, 1.0) * tl.floor(tl.abs(y) + 0.5)
    return tl.reshape(qb, (BLOCK_D,)).to(tl.int8), dq.to(tl.float16)


@triton.jit
def _split_chunk(n, S, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split for n valid keys: a multiple of BLOCK_N, at least MIN_CHUNK, and at most S
    splits needed (both kernels compute it the same way)."""
    return tl.maximum(tl.cdiv(tl.cdiv(n, S), BLOCK_N) * BLOCK_N, MIN_CHUNK)


@triton.jit
def _window_lo(n, T, WINDOW: tl.constexpr):
    """The first key any of the T rows sees: 0, or with a sliding window the first of row 0's
    (both attention kernels split [lo, n) the same way)."""
    lo = n * 0
    if WINDOW:  # (None, as a caller that names no WINDOW compiles it: 0)
        lo = tl.maximum(n - T + 1 - WINDOW, 0)
    return lo


@triton.jit
def _split_span(length, T, S, RB, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_M: tl.constexpr, WINDOW: tl.constexpr):
    # a split program's (kv head g, split s, length n, its keys [start, end), its query rows r)
    g = tl.program_id(0) // RB
    s = tl.program_id(1)
    n = tl.load(length).to(tl.int32)
    lo = _window_lo(n, T, WINDOW)
    chunk = _split_chunk(n - lo, S, MIN_CHUNK, BLOCK_N)
    start = lo + s * chunk
    end = tl.minimum(start + chunk, n)
    r = (tl.program_id(0) % RB) * BLOCK_M + tl.arange(0, BLOCK_M)
    return g, s, n, start, end, r


@triton.jit
def _query_rows(r, g, T, G: tl.constexpr, HD: tl.constexpr, BLOCK_D: tl.constexpr):
    # a split program's query rows r of kv head g: token t, head h, the rows that exist (rm),
    # and the head dims d with their mask
    d = tl.arange(0, BLOCK_D)
    return r // G, g * G + r % G, r < T * G, d, d < HD


@triton.jit
def _rescaled_add(acc, alpha, p, v, TF32: tl.constexpr):
    """The online softmax's output step: acc rescaled by alpha, plus p @ v (TF32 or exact)."""
    if TF32:
        pv = tl.dot(p, v, input_precision="tf32")
    else:
        pv = tl.dot(p, v, input_precision="ieee")
    return acc * alpha[:, None] + pv


@triton.jit
def _softmax_step(sc, m_i, l_i):
    # the online softmax over one tile of scores sc [M, N] (keys not seen at -inf): the tile's
    # p, the factor alpha the running sums scale by, the new running max and sum
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(sc - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _seen(j, jm, last, WINDOW: tl.constexpr):
    # [M, N]: row m sees key j when j is in the tile, j <= last[m] and (a sliding WINDOW)
    # j > last[m] - WINDOW
    seen = jm[None, :] & (j[None, :] <= last[:, None])
    if WINDOW:
        seen = seen & (j[None, :] > last[:, None] - WINDOW)
    return seen


@triton.jit
def _store_split(part_o, part_ml, row, acc, m_i, l_i, rm, d, dm, HD: tl.constexpr):
    # a split's partials of rows `row` (int64 [M]): Σ p v, and (max score, Σ p)
    tl.store(part_o + row[:, None] * HD + d[None, :], acc, mask=rm[:, None] & dm[None, :])
    tl.store(part_ml + row * 2, m_i, mask=rm)
    tl.store(part_ml + row * 2 + 1, l_i, mask=rm)


@triton.jit
def _attn_split_kernel(q, kc, vc, ks, vs, length, part_o, part_ml, scale, T, H, S, RB,
                       stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                       stride_ksr, stride_ksh, stride_vsr, stride_vsh,
                       HD: tl.constexpr, G: tl.constexpr, MIN_CHUNK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       STAGES: tl.constexpr, Q8: tl.constexpr = False,
                       WINDOW: tl.constexpr = 0, TF32: tl.constexpr = False):
    # TF32: both products on tl.dot with TF32 inputs (10-bit mantissas; --kernels fused only),
    # else exact float32 ("ieee"; unnamed, None, is that too).
    # program (g·RB + b, s): query rows r = b·BLOCK_M + i of kv head g, r = t·G + (h - g·G), against
    # keys [lo + s·chunk, min(lo + (s+1)·chunk, n)); row r sees keys j <= n - T + t (and, with a
    # sliding WINDOW, j > n - T + t - WINDOW; lo = the first key row 0 sees, else 0).
    # Writes part_o[s, t, h] = Σ_j p_j v_j and part_ml[s, t, h] = (max score, Σ_j p_j),
    # p_j = exp(score_j - max) (max = _NEG, sum 0, o 0 for a row that sees none of the keys).
    g, s, n, start, end, r = _split_span(length, T, S, RB, MIN_CHUNK, BLOCK_N, BLOCK_M,
                                         WINDOW)
    if start < n:
        t, h, rm, d, dm = _query_rows(r, g, T, G, HD, BLOCK_D)
        qt = tl.load(q + (t * stride_qt + h * stride_qh)[:, None] + d[None, :],
                     mask=rm[:, None] & dm[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        last = n - T + t  # [BLOCK_M]
        m_i = tl.full((BLOCK_M,), _NEG, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        kbase = kc + g.to(tl.int64) * stride_kh
        vbase = vc + g.to(tl.int64) * stride_vh
        ksbase = ks + g.to(tl.int64) * stride_ksh  # (q8_0's scales: read only when Q8)
        vsbase = vs + g.to(tl.int64) * stride_vsh
        for j0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            j = j0 + tl.arange(0, BLOCK_N)
            jm = j < end
            ld = jm[:, None] & dm[None, :]
            kt = tl.load(kbase + j.to(tl.int64)[:, None] * stride_kr + d[None, :], mask=ld,
                         other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]; rows >= n never read
            if Q8:
                kt = kt * tl.load(ksbase + j.to(tl.int64)[:, None] * stride_ksr
                                  + (d // 32)[None, :], mask=ld, other=0.0).to(tl.float32)
            if TF32:
                sc = tl.dot(qt, tl.trans(kt), input_precision="tf32") * scale
            else:  # exact float32 products ("ieee": FMA, no TF32 rounding)
                sc = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale
            sc = tl.where(_seen(j, jm, last, WINDOW), sc, float("-inf"))
            p, alpha, m_new, l_i = _softmax_step(sc, m_i, l_i)
            vt = tl.load(vbase + j.to(tl.int64)[:, None] * stride_vr + d[None, :], mask=ld,
                         other=0.0).to(tl.float32)
            if Q8:
                vt = vt * tl.load(vsbase + j.to(tl.int64)[:, None] * stride_vsr
                                  + (d // 32)[None, :], mask=ld, other=0.0).to(tl.float32)
            acc = _rescaled_add(acc, alpha, p, vt, TF32)  # [BLOCK_M, BLOCK_D]
            m_i = m_new
        row = ((s * T + t) * H + h).to(tl.int64)  # [BLOCK_M], into [S, T, H]
        _store_split(part_o, part_ml, row, acc, m_i, l_i, rm, d, dm, HD)


@triton.jit
def _attn_split_fma_kernel(q, kc, vc, ks, vs, length, part_o, part_ml, scale, T, H, S, RB,
                           stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                           stride_ksr, stride_ksh, stride_vsr, stride_vsh,
                           HD: tl.constexpr, G: tl.constexpr, MIN_CHUNK: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                           STAGES: tl.constexpr, DC: tl.constexpr, Q8: tl.constexpr = False,
                           WINDOW: tl.constexpr = 0):
    # _attn_split_kernel's programs, rows, keys and outputs without tl.dot: exact float32 on the
    # CUDA cores, BLOCK_M any power of two (no dead rows of a 16-row dot tile). Keys load as
    # [NC, BLOCK_N, DC] (d = c·DC + e), DC/4 lanes along d (4 values each) and the rest along
    # the keys: a small DC sums more of d within a thread (fewer shuffles) but holds q's NC
    # pieces for every row in each thread (registers); scores = Σ_c Σ_e of
    # q [BLOCK_M, NC, 1, DC] · k [1, NC, BLOCK_N, DC]. p·V accumulates p [BLOCK_M, BLOCK_N, 1] ·
    # v [1, BLOCK_N, BLOCK_D] into acc3 [BLOCK_M, BLOCK_N, BLOCK_D] unsummed (the keys of a
    # tile lie across warps: summing them each step would cross warps), summed over the keys
    # once at the end.
    NC: tl.constexpr = BLOCK_D // DC
    g, s, n, start, end, r = _split_span(length, T, S, RB, MIN_CHUNK, BLOCK_N, BLOCK_M,
                                         WINDOW)
    if start < n:
        t, h, rm, d, dm = _query_rows(r, g, T, G, HD, BLOCK_D)
        dk = tl.arange(0, NC)[:, None, None] * DC + tl.arange(0, DC)[None, None, :]  # [NC, 1, DC]
        dkm = dk < HD
        q4 = tl.load(q + (t * stride_qt + h * stride_qh)[:, None, None, None] + dk[None],
                     mask=rm[:, None, None, None] & dkm[None], other=0.0)  # [BLOCK_M, NC, 1, DC]
        last = n - T + t  # [BLOCK_M]
        m_i = tl.full((BLOCK_M,), _NEG, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_D), tl.float32)
        kbase = kc + g.to(tl.int64) * stride_kh
        vbase = vc + g.to(tl.int64) * stride_vh
        ksbase = ks + g.to(tl.int64) * stride_ksh  # (q8_0's scales: read only when Q8)
        vsbase = vs + g.to(tl.int64) * stride_vsh
        for j0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            j = j0 + tl.arange(0, BLOCK_N)
            jm = j < end
            jk = j.to(tl.int64)[None, :, None]  # [1, BLOCK_N, 1]
            ldk = jm[None, :, None] & dkm
            kt = tl.load(kbase + jk * stride_kr + dk, mask=ldk,
                         other=0.0).to(tl.float32)  # [NC, BLOCK_N, DC]; rows >= n never read
            if Q8:
                kt = kt * tl.load(ksbase + jk * stride_ksr + dk // 32, mask=ldk,
                                  other=0.0).to(tl.float32)
            sc = tl.sum(tl.sum(q4 * kt[None], axis=1), axis=2) * scale  # [BLOCK_M, BLOCK_N]
            sc = tl.where(_seen(j, jm, last, WINDOW), sc, float("-inf"))
            p, alpha, m_new, l_i = _softmax_step(sc, m_i, l_i)
            jv = j.to(tl.int64)[:, None]  # [BLOCK_N, 1]
            ldv = jm[:, None] & dm[None, :]
            vt = tl.load(vbase + jv * stride_vr + d[None, :], mask=ldv,
                         other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]
            if Q8:
                vt = vt * tl.load(vsbase + jv * stride_vsr + (d // 32)[None, :], mask=ldv,
                                  other=0.0).to(tl.float32)
            acc3 = acc3 * alpha[:, None, None] + p[:, :, None] * vt[None, :, :]
            m_i = m_new
        acc = tl.sum(acc3, axis=1)  # [BLOCK_M, BLOCK_D]
        row = ((s * T + t) * H + h).to(tl.int64)  # [BLOCK_M], into [S, T, H]
        _store_split(part_o, part_ml, row, acc, m_i, l_i, rm, d, dm, HD)


@triton.jit
def _combine_splits(part_o, part_ml, out_row, n, lo, R, r, h, H, S, sinks,
                    HD: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINKS: tl.constexpr,
                    gate=None, stride_gr=0, stride_gh=0, HAS_GATE: tl.constexpr = False):
    # out_row[h] = Σ_s w_s o_s / (Σ_s w_s l_s [+ exp(sink_h - m)]), w_s = exp(m_s - m),
    # m = max(max_s m_s [, sink_h]), over the live splits of rows lo .. n-1 only (the others
    # were never written); split s of query row r of R at part row (s·R + r)·H + h; a sink
    # takes its share of the softmax and gives no value. HAS_GATE: times sigmoid of row r's
    # output gate for head h (qwen35moe's), at gate + r·stride_gr + h·stride_gh
    live = tl.cdiv(n - lo, _split_chunk(n - lo, S, MIN_CHUNK, BLOCK_N))
    sv = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    mx = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    for s0 in tl.range(0, live, BLOCK_S):
        s = s0 + sv
        row = (s * R + r) * H + h
        mx = tl.maximum(mx, tl.load(part_ml + row * 2, mask=s < live, other=float("-inf")))
    m = tl.max(mx, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks + h).to(tl.float32)
        m = tl.maximum(m, sink)
    lsum = tl.zeros((BLOCK_S,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in tl.range(0, live, BLOCK_S):
        s = s0 + sv
        sm = s < live
        row = ((s * R + r) * H + h).to(tl.int64)
        w = tl.exp(tl.load(part_ml + row * 2, mask=sm, other=float("-inf")) - m)
        lsum += w * tl.load(part_ml + row * 2 + 1, mask=sm, other=0.0)
        o = tl.load(part_o + row[:, None] * HD + d[None, :], mask=sm[:, None] & dm[None, :],
                    other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    den = tl.sum(lsum, axis=0)
    if HAS_SINKS:
        den += tl.exp(sink - m)
    y = acc / den
    if HAS_GATE:
        gr = gate + r.to(tl.int64) * stride_gr + h * stride_gh
        y = y * tl.sigmoid(tl.load(gr + d, mask=dm, other=0.0))
    tl.store(out_row + h * HD + d, y, mask=dm)


@triton.jit
def _attn_reduce_kernel(part_o, part_ml, length, out, T, H, S, stride_ot, sinks,
                        HD: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                        WINDOW: tl.constexpr = 0, HAS_SINKS: tl.constexpr = False,
                        gate=None, stride_gt=0, stride_gh=0, HAS_GATE: tl.constexpr = False):
    # program (h, t): the live splits of token t's head h combined (_combine_splits), times
    # sigmoid(gate[t, h]) with HAS_GATE
    h = tl.program_id(0)
    t = tl.program_id(1)
    n = tl.load(length).to(tl.int32)
    _combine_splits(part_o, part_ml, out + t * stride_ot, n, _window_lo(n, T, WINDOW), T, t, h,
                    H, S, sinks, HD, MIN_CHUNK, BLOCK_N, BLOCK_S, BLOCK_D, HAS_SINKS,
                    gate, stride_gt, stride_gh, HAS_GATE)


@triton.jit
def _rows_dot_kernel(x, w, y, N, D, stride_w, BN: tl.constexpr, BD: tl.constexpr,
                     SIGMOID: tl.constexpr = False, bias=None, BIAS: tl.constexpr = False):
    # y[n] = Σ_d w[n, d] · x[d] (+ bias[n]) for BN rows n (SIGMOID: its sigmoid)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = (n < N)[:, None]
    acc = tl.zeros((BN, BD), tl.float32)
    for d0 in tl.range(0, D, BD):
        d = d0 + tl.arange(0, BD)
        dm = d < D
        xv = tl.load(x + d, mask=dm, other=0.0)
        wv = tl.load(w + n.to(tl.int64)[:, None] * stride_w + d[None, :], mask=nm & dm[None, :],
                     other=0.0)
        acc += wv * xv[None, :]
    out = tl.sum(acc, axis=1)
    if BIAS:
        out += tl.load(bias + n, mask=n < N, other=0.0)
    if SIGMOID:
        out = tl.sigmoid(out)
    tl.store(y + n, out, mask=n < N)


@triton.jit
def _finite(row, j, jm):
    """logits row[j] (loaded past L1: another CTA may have just written them), NaN and the
    masked tail as -inf, so the ranks below stay a permutation."""
    v = tl.load(row + j, mask=jm, other=float("-inf"), cache_modifier=".cg")
    return tl.where(v == v, v, float("-inf"))


@triton.jit
def _route_row(row, out, ids, wts, counts, skip, E, K: tl.constexpr, NORM: tl.constexpr,
               COUNT: tl.constexpr, SKIP: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_J: tl.constexpr, SORT: tl.constexpr = False):
    """route() of one logits row (at `row`) into ids / wts row `out`: softmax over E, each
    expert's rank = how many beat it (a larger logit, or an equal one with a lower id), and the
    K of rank < K stored at their rank (largest first, ties to the lower id): one [E, E]
    comparison, summed in BLOCK_J columns a step, instead of K rounds of argmax, each two or
    three reductions long; SORT: the K largest found by a bitonic top-k instead
    (`_route_row_sorted`, the same ids). With SKIP an expert with skip[e] >= 0 is stored as id
    -1."""
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = _finite(row, e, em)
    if SORT:
        _route_row_sorted(x, e, out, ids, wts, counts, skip, K, NORM, COUNT, SKIP, BLOCK_E)
        return
    rank = tl.zeros((BLOCK_E,), tl.int32)
    for j0 in tl.static_range(0, BLOCK_E, BLOCK_J):
        # [BLOCK_J, BLOCK_E], summed over j: Triton lays the last dim across the threads, so
        # each thread sums its expert's column in registers (with e first, each of the 128
        # rows was a reduction across the CTA: 4.4 us a call on an H200 against 2.7 for K
        # rounds of argmax on one warp)
        j = j0 + tl.arange(0, BLOCK_J)
        xj = _finite(row, j, j < E)[:, None]
        beats = (xj > x[None, :]) | ((xj == x[None, :]) & (j[:, None] < e[None, :]))
        rank += tl.sum((beats & (j < E)[:, None]).to(tl.int32), axis=0)
    ex = tl.exp(x - tl.max(x, axis=0))
    _store_route(ex / tl.sum(ex, axis=0), e, rank, em & (rank < K), out, ids, wts, counts, skip,
                 K, NORM, COUNT, SKIP)


@triton.jit
def _store_route(p, expert, at, sel, out, ids, wts, counts, skip, K: tl.constexpr,
                 NORM: tl.constexpr, COUNT: tl.constexpr, SKIP: tl.constexpr):
    """The routed experts of one row into ids / wts row `out`: where sel, expert[i] with its
    probability p[i] at position at[i] (its rank), p renormalized over sel with NORM; with SKIP
    an expert with skip[e] >= 0 stored as id -1; with COUNT each counted once in counts."""
    if NORM:
        p = p / tl.sum(tl.where(sel, p, 0.0), axis=0)
    out_i = expert
    if SKIP:
        out_i = tl.where(tl.load(skip + expert, mask=sel, other=-1) >= 0, -1, expert)
    tl.store(ids + out * K + at, out_i.to(tl.int64), mask=sel)
    tl.store(wts + out * K + at, p, mask=sel)
    if COUNT:
        tl.atomic_add(counts + expert, sel.to(tl.int32), mask=sel)


@triton.jit
def _route_row_sorted(x, e, out, ids, wts, counts, skip, K: tl.constexpr, NORM: tl.constexpr,
                      COUNT: tl.constexpr, SKIP: tl.constexpr, BLOCK_E: tl.constexpr):
    """_route_row's stores from a bitonic top-k (tl.topk, log2(E) merge rounds on the row)
    in place of its [E, E] rank comparison: each logit becomes an int64 key, its float32 bits
    in an order-keeping form (a negative one's low 31 bits flipped; -0.0 as +0.0) above and
    BLOCK_E - 1 - e below, so the larger key is the larger logit, ties to the lower id; the
    top KP (K to a power of two) keys come largest first, and the first K are stored at their
    rank. x [BLOCK_E]: the row, -inf past E (_finite)."""
    KP: tl.constexpr = triton.next_power_of_2(K)
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - e).to(tl.int64)
    top = tl.topk(key, KP)  # [KP], largest first
    r = tl.arange(0, KP)
    tid = (BLOCK_E - 1 - (top & 0xFFFFFFFF)).to(tl.int32)
    tb = (top >> 32).to(tl.int32)
    v = tl.where(tb < 0, tb ^ 0x7FFFFFFF, tb).to(tl.float32, bitcast=True)
    m = tl.max(x, axis=0)
    _store_route(tl.exp(v - m) / tl.sum(tl.exp(x - m), axis=0), tid, r, r < K, out, ids, wts,
                 counts, skip, K, NORM, COUNT, SKIP)


@triton.jit
def _route_kernel(logits, ids, wts, counts, skip, gate, E, stride_l, K: tl.constexpr,
                  NORM: tl.constexpr, COUNT: tl.constexpr, SKIP: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr, SORT: tl.constexpr = False,
                  GATE: tl.constexpr = False):
    # one program per token row; GATE: the row's logit E (a shared expert's gate) -> its sigmoid
    t = tl.program_id(0).to(tl.int64)
    _route_row(logits + t * stride_l, t, ids, wts, counts, skip, E, K, NORM, COUNT, SKIP,
               BLOCK_E, BLOCK_J, SORT)
    if GATE:
        tl.store(gate + t, tl.sigmoid(tl.load(logits + t * stride_l + E, cache_modifier=".cg")))


@triton.jit
def _norm_route_kernel(x, delta, w, router, h, logits, ids, wts, counts, skip, sync, gate, D,
                       E, stride_r, stride_w, eps, HAS_DELTA: tl.constexpr, R: tl.constexpr,
                       STORE_H: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr,
                       COUNT: tl.constexpr, SKIP: tl.constexpr, BN: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr,
                       SORT: tl.constexpr = False, GATE: tl.constexpr = False):
    # every program: v = x [+ Σ delta], y = rms_norm(v) * w (the row recomputed from L2 in each),
    # logits[n] = router[n] · y for its BN rows; the last program to finish (an atomic count)
    # stores v into x (only then: the others read x) and y into h, routes the logits row and
    # sets the count back to 0 for the next launch (graph replays). GATE: router row E is a
    # shared expert's gate, its logit's sigmoid stored in gate
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < E + GATE
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    rw = tl.load(router + n.to(tl.int64)[:, None] * stride_w + d[None, :],
                 mask=nm[:, None] & dm[None, :], other=0.0)  # issued before the norm's sum
    v, y = _norm_row(x, delta, w, d, dm, stride_r, D, eps, HAS_DELTA, R)
    tl.store(logits + n, tl.sum(rw * y[None, :], axis=1), mask=nm)
    tl.debug_barrier()  # every thread's logits stored before the count's release
    if tl.atomic_add(sync, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
        if HAS_DELTA:
            tl.store(x + d, v, mask=dm)
        if STORE_H:
            tl.store(h + d, y, mask=dm)
        _route_row(logits, 0, ids, wts, counts, skip, E, K, NORM, COUNT, SKIP, BLOCK_E,
                   BLOCK_J, SORT)
        if GATE:  # (past L1 as the row: another CTA wrote it)
            tl.store(gate, tl.sigmoid(tl.load(logits + E, cache_modifier=".cg")))
        tl.atomic_xchg(sync, 0)


@triton.jit
def _paged_split_kernel(q, kc, vc, ks, vs, read, length, part_o, part_ml, scale, B, H, S,
                        stride_qb, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                        stride_ksr, stride_ksh, stride_vsr, stride_vsh, stride_rb,
                        HD: tl.constexpr, G: tl.constexpr, MIN_CHUNK: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        Q8: tl.constexpr = False, WINDOW: tl.constexpr = 0,
                        TF32: tl.constexpr = False, STAGES: tl.constexpr = 1):
    # program (b, g, s): the G query heads of kv head g of row b (one new token at position
    # n - 1, n = length[b]) over split s of its keys [lo, n), pool rows read[b, j]; online
    # softmax in float32, exact products on the CUDA cores (no tl.dot), or with TF32
    # (--kernels fused) both products on TF32 tensor cores (BLOCK_M >= 16: rows past G
    # masked). Writes (max, sum, unnormalized output) per head into [S, B, H];
    # _paged_reduce_kernel combines the splits.
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1).to(tl.int64)
    s = tl.program_id(2)
    n = tl.load(length + b).to(tl.int32)
    lo = _window_lo(n, 1, WINDOW)  # (one query a row: the token sees j > n - 1 - WINDOW)
    chunk = _split_chunk(n - lo, S, MIN_CHUNK, BLOCK_N)
    start = lo + s * chunk
    end = tl.minimum(start + chunk, n)
    if start < n:
        r = tl.arange(0, BLOCK_M)
        rm = r < G
        h = g * G + r  # [BLOCK_M]
        d = tl.arange(0, BLOCK_D)
        dm = d < HD
        qv = tl.load(q + b * stride_qb + h[:, None] * stride_qh + d[None, :],
                     mask=rm[:, None] & dm[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        m_i = tl.full((BLOCK_M,), _NEG, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for j0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            j = j0 + tl.arange(0, BLOCK_N)
            jm = j < end
            rows = tl.load(read + b * stride_rb + j, mask=jm, other=0).to(tl.int64)  # [BLOCK_N]
            ld = jm[:, None] & dm[None, :]
            kt = tl.load(kc + rows[:, None] * stride_kr + g * stride_kh + d[None, :], mask=ld,
                         other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]; rows >= n never read
            vt = tl.load(vc + rows[:, None] * stride_vr + g * stride_vh + d[None, :], mask=ld,
                         other=0.0).to(tl.float32)
            if Q8:
                kt = kt * tl.load(ks + rows[:, None] * stride_ksr + g * stride_ksh
                                  + (d // 32)[None, :], mask=ld, other=0.0).to(tl.float32)
                vt = vt * tl.load(vs + rows[:, None] * stride_vsr + g * stride_vsh
                                  + (d // 32)[None, :], mask=ld, other=0.0).to(tl.float32)
            if TF32:
                sc = tl.dot(qv, tl.trans(kt), input_precision="tf32") * scale
            else:
                sc = tl.sum(qv[:, None, :] * kt[None, :, :], axis=2) * scale  # [BLOCK_M, BLOCK_N]
            sc = tl.where(jm[None, :], sc, float("-inf"))
            p, alpha, m_new, l_i = _softmax_step(sc, m_i, l_i)
            if TF32:
                acc = _rescaled_add(acc, alpha, p, vt, True)
            else:
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * vt[None, :, :], axis=1)
            m_i = m_new
        row = ((s * B + b) * H + h).to(tl.int64)  # [BLOCK_M], into [S, B, H]
        _store_split(part_o, part_ml, row, acc, m_i, l_i, rm, d, dm, HD)


@triton.jit
def _paged_reduce_kernel(part_o, part_ml, length, out, B, H, S, stride_ob, sinks,
                         HD: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                         WINDOW: tl.constexpr = 0, HAS_SINKS: tl.constexpr = False):
    # program (b, h): _attn_reduce_kernel's combination for row b at its own length
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(length + b).to(tl.int32)
    _combine_splits(part_o, part_ml, out + b.to(tl.int64) * stride_ob, n,
                    _window_lo(n, 1, WINDOW), B, b, h, H, S, sinks, HD, MIN_CHUNK, BLOCK_N,
                    BLOCK_S, BLOCK_D, HAS_SINKS)


@triton.jit
def _latent_split_kernel(ql, qp, cache, read, length, part_o, part_ml, scale, B, H, S,
                         stride_qb, stride_qh, stride_pb, stride_ph, stride_cr, stride_rb,
                         L: tl.constexpr, R: tl.constexpr, MIN_CHUNK: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_L: tl.constexpr,
                         BLOCK_R: tl.constexpr, STAGES: tl.constexpr, PAGED: tl.constexpr,
                         TF32: tl.constexpr):
    # program (b, hb, s): heads hb·BLOCK_H .. of row b (one token at position n - 1,
    # n = length[b]) over split s of its cached rows [0, n) (MLA's absorbed form); position j's
    # row is cache row j (one sequence) or read[b, j] (PAGED: a pool through a block table).
    # score_hj = (q_lat_h · c_j + q_pe_h · k_pe_j) · scale over the rows [c ; k_pe] [L + R];
    # acc_h = Σ_j p_hj c_j [L] (the latent, which the caller multiplies by v_b). Every head
    # reads the same rows: a block of BLOCK_N rows is loaded once for the CTA's BLOCK_H heads,
    # the rows of tl.dot's tile. Online softmax in float32; the products exact float32
    # ("ieee": FMA, no TF32) or, with TF32 (--kernels fused), on TF32 tensor cores. Writes
    # (max, sum, unnormalized latent) per head into [S, B, H]; _paged_reduce_kernel combines.
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(length + b).to(tl.int32)
    chunk = _split_chunk(n, S, MIN_CHUNK, BLOCK_N)
    start = s * chunk
    end = tl.minimum(start + chunk, n)
    if start < n:
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hm = h < H
        dl = tl.arange(0, BLOCK_L)
        dlm = dl < L
        dr = tl.arange(0, BLOCK_R)
        drm = dr < R
        qlt = tl.load(ql + b * stride_qb + h[:, None] * stride_qh + dl[None, :],
                      mask=hm[:, None] & dlm[None, :], other=0.0)  # [BLOCK_H, BLOCK_L]
        qpt = tl.load(qp + b * stride_pb + h[:, None] * stride_ph + dr[None, :],
                      mask=hm[:, None] & drm[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
        m_i = tl.full((BLOCK_H,), _NEG, tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
        for j0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            j = j0 + tl.arange(0, BLOCK_N)
            jm = j < end
            if PAGED:
                rows = tl.load(read + b * stride_rb + j, mask=jm, other=0).to(tl.int64)
            else:
                rows = j.to(tl.int64)
            base = cache + rows[:, None] * stride_cr  # [BLOCK_N, 1]; rows >= n never read
            c = tl.load(base + dl[None, :], mask=jm[:, None] & dlm[None, :],
                        other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_L]
            kp = tl.load(base + L + dr[None, :], mask=jm[:, None] & drm[None, :],
                         other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
            if TF32:
                sc = (tl.dot(qlt, tl.trans(c), input_precision="tf32")
                      + tl.dot(qpt, tl.trans(kp), input_precision="tf32"))
            else:
                sc = (tl.dot(qlt, tl.trans(c), input_precision="ieee")
                      + tl.dot(qpt, tl.trans(kp), input_precision="ieee"))
            sc = tl.where(jm[None, :], sc * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            p, alpha, m_new, l_i = _softmax_step(sc, m_i, l_i)
            acc = _rescaled_add(acc, alpha, p, c, TF32)  # [BLOCK_H, BLOCK_L]
            m_i = m_new
        row = ((s * B + b) * H + h).to(tl.int64)  # [BLOCK_H], into [S, B, H]
        _store_split(part_o, part_ml, row, acc, m_i, l_i, hm, dl, dlm, L)
