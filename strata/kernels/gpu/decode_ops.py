"""Fused float32 kernels for the non-expert part of a decode step (T = 1..4 tokens of ONE sequence),
built to be captured in a CUDA graph.

    inv_freq = rope_inv_freq(rope_dim, theta, device)            # once per model
    h = add_rms_norm(x, delta, attn_norm, eps)                   # x += delta; h = rms_norm(x)
    q = qk_rope_store(q, k, v, q_norm, k_norm, eps, pos, inv_freq, "neox", k_cache, v_cache)
    o = decode_attention(q, k_cache, v_cache, length, hd ** -0.5)             # [T, H*hd]
    ids, weights = route_topk(h @ router.T, n_used, norm_topk)
    h, ids, weights = norm_route(x, delta, ffn_norm, eps, router, n_used, norm_topk, sync)

Every op computes the float32 reference op of strata.kernels.torch_ops (rms_norm, rope_tables +
apply_rope, attention, route) in another summation order: 1e-7..1e-6 of the output's scale under
the interpreter, tests/test_decode_ops.py holds 1e-5. Graph safety: no host sync, no `.item()`, no
Python branch on a device value and no allocation whose size depends on one; the decode position
(`pos`) and the number of valid cache rows (`length`) are read on the device, so a captured graph
is replayed with `pos.fill_(p)`, `length.fill_(p + T)`. Every launch grid is fixed by shapes and
the cache capacity. Tensors not on CUDA take a torch path built from the reference ops (the same
semantics, also graph safe), except under Triton's interpreter (TRITON_INTERPRET=1), which runs
the kernels on CPU tensors.

Kernels and launches:
  rms_norm, add_rms_norm  `_rms_norm_kernel`, one CTA per token row (the whole row in
      registers), 1 launch. add_rms_norm stores x + delta back into x before normalizing.
  qk_rope_store  `_qk_rope_kernel`, one CTA per (token, head) of the H query and Hkv kv heads,
      1 launch: optional per-head RMS norm, RoPE on the first rope_dim dims (cos/sin computed
      from the float32 inv_freq table exactly as rope_tables does, then __nv_cosf/__nv_sinf),
      q to its output, k and v to cache rows pos + t. Rows past the capacity are not written
      (a guard against corrupting memory; the torch path raises instead).
  decode_attention  flash decoding, 2 launches. `_attn_split_kernel`, grid (Hkv·RB, S): one CTA
      per kv head, block of 16 of the T·G query rows that read that head (G = H / Hkv,
      RB = cdiv(T·G, 16): 1 for T·G <= 16, so each key and value row is read from memory once;
      2 for T = 4 with G = 8, the second read mostly from L2) and key split. Scores and p·V go
      through tl.dot in exact float32 (input_precision "ieee": FMA, no TF32), online softmax in
      float32. S is fixed from the capacity (`attention_splits`); the split size is derived on
      the device from `length`: chunk = max(MIN_CHUNK, roundup(cdiv(length, S), BLOCK_N)), so
      the work spreads over the splits at every length, and splits starting past `length` exit
      at once. Each split writes (max, sum, unnormalized output) per query row;
      `_attn_reduce_kernel`, grid (H, T), combines the live splits (cdiv(length, chunk) of
      them). Keys at or past `length` are never read (masked loads), so stale or garbage rows
      do not matter.
  router_logits  `_rows_dot_kernel`, one token against E float32 router rows: BN rows per CTA,
      E / BN CTAs (cuBLAS picked a GEMV taking ~18 us for 128 x 2048 on an H200; a product and
      a row sum took two kernels), float32 sums in a fixed order.
  route_topk  `_route_kernel`, one CTA per token, 1 launch: softmax over E; each expert's rank
      is the number of experts that beat it (one [E, E] comparison summed by rows: a larger
      logit, or an equal one with a lower id), and the k of rank < k are stored at their rank;
      optional renormalization, optionally an atomic count per routed expert. Selection is on
      the logits (softmax is monotone, so this is the order of the exact probabilities); ties
      go to the lower expert id, NaN logits rank as -inf. torch.topk, which the reference
      uses, promises no order among ties. (k rounds of argmax, the kernel before, chained 2-3
      reductions a round.)
  norm_route  `_norm_route_kernel`, one token, 1 launch for what add_rms_norm, router_logits
      and route_topk do in 3: E / 2 CTAs each recompute x + delta and its norm (the row from
      L2) and two router rows' logits; the last CTA to finish (an atomic count, acquire-release
      at GPU scope after a CTA barrier) stores x and h, which the others have read by then,
      routes the logits row and sets the count back to zero for the next launch (a captured
      graph replays it as is). The caller owns the count (`sync`): one per stream.

Legend: T new tokens (1..4), D hidden, H query heads, Hkv kv heads, G = H / Hkv, hd head dim,
C cache capacity (rows), E experts, K experts used per token, S attention key splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton import knobs

from strata.kernels import torch_ops as layers
from strata.kernels.tuning import ATTN_BLOCK_M, ATTN_MIN_CHUNK, ATTN_TARGET_CTAS

ROPE_STYLES = ("neox", "normal")
# the running max before the first key: finite, so exp(m_old - m_new) never computes inf - inf
_NEG = tl.constexpr(-1.0e30)


def fused_decode_available(device: torch.device | str) -> bool:
    """True when the Triton kernels run for tensors on `device` (CUDA with a driver)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda or bool(knobs.runtime.interpret)


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Attention partials: left uninitialized; tests swap in a NaN-filled version so a read of
    anything the split kernel did not write shows up in the output."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


KV_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _f32(t: torch.Tensor, name: str, shape: tuple[int, ...] | None = None,
         dtypes: dict[torch.dtype, str] | None = None) -> None:
    """float32 (or one of `dtypes`: {type: name}), this shape, contiguous in its last dim."""
    dtypes = dtypes or {torch.float32: "float32"}
    _check(t.dtype in dtypes, f"{name} must be {', '.join(dtypes.values())}, got {t.dtype}")
    if shape is not None:
        _check(tuple(t.shape) == shape, f"{name} must be {list(shape)}, got {list(t.shape)}")
    _check(t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] == 1,
           f"{name} must be contiguous in its last dim")


def _device_int(t: torch.Tensor, name: str, device: torch.device) -> None:
    _check(t.dtype in (torch.int32, torch.int64) and t.numel() == 1 and t.device == device,
           f"{name} must be an int32/int64 tensor of one element on {device}, got "
           f"{t.dtype} {list(t.shape)} on {t.device}")


# ---- rms_norm / add_rms_norm ---------------------------------------------------------------------


@triton.jit
def _norm_row(x, delta, w, d, dm, stride_r, D, eps, HAS_DELTA: tl.constexpr, R: tl.constexpr):
    """(v, y) for one row: v = x [+ Σ_r delta_r, the rows added to each other in order first],
    y = v * rsqrt(mean(v^2) + eps) * w (pointers at the row's first element)."""
    # the weight first: loaded after the sum it would cost a second memory latency behind the
    # reduction's barriers (the compiler keeps the order written)
    wv = tl.load(w + d, mask=dm, other=0.0)
    v = tl.load(x + d, mask=dm, other=0.0)
    if HAS_DELTA:
        s = tl.load(delta + d, mask=dm, other=0.0)
        for r in tl.static_range(1, R):
            s = s + tl.load(delta + r * stride_r + d, mask=dm, other=0.0)
        v = v + s
    return v, v * tl.math.rsqrt(tl.sum(v * v, axis=0) / D + eps) * wv


@triton.jit
def _rms_norm_kernel(x, delta, w, out, D, stride_x, stride_d, stride_r, stride_o, eps,
                     HAS_DELTA: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):
    # [x[t] += Σ_r delta[t, r]]; out[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * w
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    dm = d < D
    xr = x + t * stride_x
    v, y = _norm_row(xr, delta + t * stride_d, w, d, dm, stride_r, D, eps, HAS_DELTA, R)
    if HAS_DELTA:
        tl.store(xr + d, v, mask=dm)
    tl.store(out + t * stride_o + d, y, mask=dm)


def _norm_launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor) -> None:
    t, d = x.shape
    block = triton.next_power_of_2(d)
    warps = min(16, max(1, block // 512))
    rows = 1 if delta is None or delta.dim() == 2 else delta.shape[1]
    _rms_norm_kernel[(t,)](
        x, x if delta is None else delta, weight, out, d, x.stride(0),
        0 if delta is None else delta.stride(0), delta.stride(1) if rows > 1 else 0,
        out.stride(0), eps, HAS_DELTA=delta is not None, R=rows, BLOCK=block, num_warps=warps)


def _norm_args(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    _check(x.dim() == 2, f"x must be [T, D], got {list(x.shape)}")
    _f32(x, "x")
    _f32(weight, "weight", (x.shape[1],))
    _check(weight.is_contiguous() and weight.device == x.device, "weight must be contiguous, "
           "on x's device")
    if out is None:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    _f32(out, "out", tuple(x.shape))
    _check(out.device == x.device, "out must be on x's device")
    return out


def _delta_args(x: torch.Tensor, delta: torch.Tensor) -> None:
    """delta of a residual step: f32 [T, D] like x, or [T, R, D] with rows of D contiguous."""
    if delta.dim() == 3:
        _f32(delta, "delta", (x.shape[0], delta.shape[1], x.shape[1]))
        _check(delta.stride(2) == 1, "delta's rows must be contiguous")
    else:
        _f32(delta, "delta", tuple(x.shape))
    _check(delta.device == x.device, "delta must be on x's device")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight per row. x [T, D] f32 (rows contiguous), weight [D]
    f32 -> out [T, D] f32 (new, or `out`; out may be x). One launch."""
    out = _norm_args(x, weight, out)
    if x.shape[0] == 0:
        return out
    if _use_kernels(x):
        _norm_launch(x, None, weight, eps, out)
    else:
        out.copy_(layers.rms_norm(x, weight, eps))
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """The residual step: x += delta in place, then returns rms_norm(x, weight, eps).
    x [T, D] f32 (rows contiguous), weight [D] f32 -> [T, D] f32. One launch. delta: [T, D]
    f32, or [T, R, D] (rows of D contiguous; a token's K expert outputs, moe_forward's
    sum_pairs=False) whose R rows are added to each other in order, then to x."""
    out = _norm_args(x, weight, out)
    _delta_args(x, delta)
    if x.shape[0] == 0:
        return out
    if _use_kernels(x):
        _norm_launch(x, delta, weight, eps, out)
    else:
        if delta.dim() == 3:  # the same order as the kernel's
            total = delta[:, 0].clone()
            for r in range(1, delta.shape[1]):
                total += delta[:, r]
            delta = total
        x.add_(delta)
        out.copy_(layers.rms_norm(x, weight, eps))
    return out


# ---- q/k norm + RoPE + KV cache store ------------------------------------------------------------


def rope_inv_freq(rope_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """float32 [rope_dim/2]: theta^(-2i/rope_dim), computed exactly as layers.rope_tables does
    (on `device`, so the table matches the reference run there)."""
    _check(rope_dim > 0 and rope_dim % 2 == 0, f"rope_dim must be even, got {rope_dim}")
    return 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32,
                                        device=device) / rope_dim)


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
def _qk_rope_kernel(q, k, v, qn, kn, inv_freq, pos, qo, kc, vc, eps, H, C,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_qot, stride_qoh, stride_kcr, stride_kch, stride_vcr, stride_vch,
                    HAS_QN: tl.constexpr, HAS_KN: tl.constexpr, HD: tl.constexpr,
                    ROPE_DIM: tl.constexpr, NEOX: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (t, j): j < H: query head j -> qo[t, j]; else kv head g = j - H -> cache row pos + t
    t = tl.program_id(0)
    j = tl.program_id(1)
    row = tl.load(pos).to(tl.int64) + t
    pos_f = row.to(tl.float32)
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
        tl.store(kc + row * stride_kcr + g * stride_kch + d, y.to(kc.dtype.element_ty), mask=ok)
        vv = tl.load(v + t * stride_vt + g * stride_vh + d, mask=dm, other=0.0)
        tl.store(vc + row * stride_vcr + g * stride_vch + d, vv.to(vc.dtype.element_ty),
                 mask=ok)


def qk_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                  pos: torch.Tensor, inv_freq: torch.Tensor, style: str,
                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head RMS norm (q_norm, k_norm: f32 [hd] or None), RoPE at positions pos + t on the
    first rope_dim = 2·len(inv_freq) dims ("neox" or "normal" pairs), k and v written to cache
    rows pos + t; returns the rotated q. One launch.

    q [T, H, hd], k, v [T, Hkv, hd] f32 (any strides with the last dim contiguous: views of one
    fused qkv tensor are fine); pos int32/int64 [1] on the device; inv_freq f32 [rope_dim/2]
    (rope_inv_freq); k_cache, v_cache [C, Hkv, hd] of one type, f32, f16 or bf16 (k and v
    rounded to it), last dim contiguous -> [T, H, hd] f32 (new, or `out`). The caller keeps
    pos + T <= C."""
    _check(q.dim() == 3 and k.dim() == 3, "q must be [T, H, hd] and k [T, Hkv, hd]")
    t, h, hd = q.shape
    hkv = k.shape[1]
    for name, x, shape in (("q", q, (t, h, hd)), ("k", k, (t, hkv, hd)), ("v", v, (t, hkv, hd)),
                           ("k_cache", k_cache, (k_cache.shape[0], hkv, hd)),
                           ("v_cache", v_cache, (k_cache.shape[0], hkv, hd))):
        _f32(x, name, shape, KV_DTYPES if name.endswith("cache") else None)
        _check(x.device == q.device, f"{name} must be on q's device")
    _check(k_cache.dtype == v_cache.dtype, f"k_cache and v_cache must have one type, got "
           f"{k_cache.dtype} and {v_cache.dtype}")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None:
            _f32(w, name, (hd,))
            _check(w.is_contiguous() and w.device == q.device, f"{name} must be contiguous")
    _f32(inv_freq, "inv_freq")
    rope_dim = 2 * inv_freq.numel()
    _check(inv_freq.dim() == 1 and inv_freq.is_contiguous() and 0 < rope_dim <= hd
           and inv_freq.device == q.device, f"inv_freq must be contiguous [rope_dim/2] with "
           f"rope_dim <= hd = {hd}, got {list(inv_freq.shape)}")
    _check(style in ROPE_STYLES, f"style must be one of {ROPE_STYLES}, got {style!r}")
    _device_int(pos, "pos", q.device)
    if out is None:
        out = torch.empty((t, h, hd), dtype=torch.float32, device=q.device)
    _f32(out, "out", (t, h, hd))
    if t == 0:
        return out
    if _use_kernels(q):
        _qk_rope_kernel[(t, h + hkv)](
            q, k, v, q if q_norm is None else q_norm, q if k_norm is None else k_norm, inv_freq,
            pos, out, k_cache, v_cache, eps, h, k_cache.shape[0], q.stride(0), q.stride(1),
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            HAS_QN=q_norm is not None, HAS_KN=k_norm is not None, HD=hd, ROPE_DIM=rope_dim,
            NEOX=style == "neox", BLOCK_D=triton.next_power_of_2(hd), num_warps=1)
        return out
    positions = pos.reshape(1).long() + torch.arange(t, device=q.device)  # [T], on the device
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # as in rope_tables
    cos, sin = angles.cos(), angles.sin()
    if q_norm is not None:
        q = layers.rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = layers.rms_norm(k, k_norm, eps)
    out.copy_(layers.apply_rope(q, cos, sin, style))
    k_cache.index_copy_(0, positions, layers.apply_rope(k, cos, sin, style).to(k_cache.dtype))
    v_cache.index_copy_(0, positions, v.to(v_cache.dtype).contiguous())
    return out


# ---- decode attention (flash decoding) ----------------------------------------------------------


def attention_splits(capacity: int, n_kv_heads: int) -> int:
    """S, the number of key splits (grid axis 1 of the split kernel): fixed by the capacity, so
    one captured graph serves every length; enough for ~ATTN_TARGET_CTAS CTAs at full length,
    no more than capacity / ATTN_MIN_CHUNK."""
    return max(1, min(triton.cdiv(capacity, ATTN_MIN_CHUNK), ATTN_TARGET_CTAS // n_kv_heads))


@triton.jit
def _split_chunk(n, S, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys per split for n valid keys: a multiple of BLOCK_N, at least MIN_CHUNK, and at most S
    splits needed (both kernels compute it the same way)."""
    return tl.maximum(tl.cdiv(tl.cdiv(n, S), BLOCK_N) * BLOCK_N, MIN_CHUNK)


@triton.jit
def _attn_split_kernel(q, kc, vc, length, part_o, part_ml, scale, T, H, S, RB,
                       stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
                       HD: tl.constexpr, G: tl.constexpr, MIN_CHUNK: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       STAGES: tl.constexpr):
    # program (g·RB + b, s): query rows r = b·BLOCK_M + i of kv head g, r = t·G + (h - g·G), against
    # keys [s·chunk, min((s+1)·chunk, n)); row r sees keys j <= n - T + t.
    # Writes part_o[s, t, h] = Σ_j p_j v_j and part_ml[s, t, h] = (max score, Σ_j p_j),
    # p_j = exp(score_j - max) (max = _NEG, sum 0, o 0 for a row that sees none of the keys).
    g = tl.program_id(0) // RB
    s = tl.program_id(1)
    n = tl.load(length).to(tl.int32)
    chunk = _split_chunk(n, S, MIN_CHUNK, BLOCK_N)
    start = s * chunk
    if start < n:
        end = tl.minimum(start + chunk, n)
        r = (tl.program_id(0) % RB) * BLOCK_M + tl.arange(0, BLOCK_M)
        t = r // G
        h = g * G + r % G
        rm = r < T * G
        d = tl.arange(0, BLOCK_D)
        dm = d < HD
        qt = tl.load(q + (t * stride_qt + h * stride_qh)[:, None] + d[None, :],
                     mask=rm[:, None] & dm[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        last = n - T + t  # [BLOCK_M]
        m_i = tl.full((BLOCK_M,), _NEG, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        kbase = kc + g.to(tl.int64) * stride_kh
        vbase = vc + g.to(tl.int64) * stride_vh
        for j0 in tl.range(start, end, BLOCK_N, num_stages=STAGES):
            j = j0 + tl.arange(0, BLOCK_N)
            jm = j < end
            ld = jm[:, None] & dm[None, :]
            kt = tl.load(kbase + j.to(tl.int64)[:, None] * stride_kr + d[None, :], mask=ld,
                         other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_D]; rows >= n never read
            # exact float32 products ("ieee": FMA, no TF32 rounding)
            sc = tl.dot(qt, tl.trans(kt), input_precision="ieee") * scale  # [BLOCK_M, BLOCK_N]
            sc = tl.where(jm[None, :] & (j[None, :] <= last[:, None]), sc, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(sc, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(sc - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(vbase + j.to(tl.int64)[:, None] * stride_vr + d[None, :], mask=ld,
                         other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, vt, input_precision="ieee")
            m_i = m_new
        row = ((s * T + t) * H + h).to(tl.int64)  # [BLOCK_M], into [S, T, H]
        tl.store(part_o + row[:, None] * HD + d[None, :], acc, mask=rm[:, None] & dm[None, :])
        tl.store(part_ml + row * 2, m_i, mask=rm)
        tl.store(part_ml + row * 2 + 1, l_i, mask=rm)


@triton.jit
def _attn_reduce_kernel(part_o, part_ml, length, out, T, H, S, stride_ot,
                        HD: tl.constexpr, MIN_CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    # program (h, t): out[t, h] = Σ_s w_s o_s / Σ_s w_s l_s, w_s = exp(m_s - max_s m_s), over
    # the live splits only (the others were never written)
    h = tl.program_id(0)
    t = tl.program_id(1)
    n = tl.load(length).to(tl.int32)
    live = tl.cdiv(n, _split_chunk(n, S, MIN_CHUNK, BLOCK_N))
    sv = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    dm = d < HD
    mx = tl.full((BLOCK_S,), float("-inf"), tl.float32)
    for s0 in tl.range(0, live, BLOCK_S):
        s = s0 + sv
        row = (s * T + t) * H + h
        mx = tl.maximum(mx, tl.load(part_ml + row * 2, mask=s < live, other=float("-inf")))
    m = tl.max(mx, axis=0)
    lsum = tl.zeros((BLOCK_S,), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s0 in tl.range(0, live, BLOCK_S):
        s = s0 + sv
        sm = s < live
        row = ((s * T + t) * H + h).to(tl.int64)
        w = tl.exp(tl.load(part_ml + row * 2, mask=sm, other=float("-inf")) - m)
        lsum += w * tl.load(part_ml + row * 2 + 1, mask=sm, other=0.0)
        o = tl.load(part_o + row[:, None] * HD + d[None, :], mask=sm[:, None] & dm[None, :],
                    other=0.0)
        acc += tl.sum(w[:, None] * o, axis=0)
    tl.store(out + t * stride_ot + h * HD + d, acc / tl.sum(lsum, axis=0), mask=dm)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     length: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     n_splits: int | None = None) -> torch.Tensor:
    """Causal GQA attention of T new tokens at positions length-T .. length-1 over cache rows
    0 .. length-1: query t sees keys j <= length - T + t; head h reads kv head h // (H / Hkv).
    softmax(q k^T · scale) v, as layers.attention (whose scale is hd^-0.5).

    q [T, H, hd] f32 (last dim contiguous); k_cache, v_cache [C, Hkv, hd] of one type, f32, f16
    or bf16 (read as f32; last dim contiguous); length int32/int64 [1] on the device,
    T <= length <= C (the new tokens' rows included) -> [T, H·hd] f32 (new, or `out`, rows
    contiguous). Two launches; n_splits overrides attention_splits(C, Hkv) (tests, tuning). Rows
    >= length are never read."""
    _check(q.dim() == 3 and k_cache.dim() == 3, "q must be [T, H, hd], caches [C, Hkv, hd]")
    t, h, hd = q.shape
    cap, hkv = k_cache.shape[:2]
    _f32(q, "q")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        _f32(c, name, (cap, hkv, hd), KV_DTYPES)
        _check(c.device == q.device, f"{name} must be on q's device")
    _check(k_cache.dtype == v_cache.dtype, f"k_cache and v_cache must have one type, got "
           f"{k_cache.dtype} and {v_cache.dtype}")
    _check(hkv > 0 and h % hkv == 0, f"H = {h} must be a multiple of Hkv = {hkv}")
    _device_int(length, "length", q.device)
    if out is None:
        out = torch.empty((t, h * hd), dtype=torch.float32, device=q.device)
    _f32(out, "out", (t, h * hd))
    if t == 0:
        return out
    if not _use_kernels(q):
        return out.copy_(_attention_torch(q, k_cache, v_cache, length, scale))
    s = n_splits or attention_splits(cap, hkv)
    g = h // hkv
    rb = triton.cdiv(t * g, ATTN_BLOCK_M)  # row blocks per kv head
    block_d = triton.next_power_of_2(hd)
    block_n = max(16, min(32, 4096 // block_d))
    part_o = scratch((s, t, h, hd), torch.float32, q.device)
    part_ml = scratch((s, t, h, 2), torch.float32, q.device)
    _attn_split_kernel[(hkv * rb, s)](
        q, k_cache, v_cache, length, part_o, part_ml, scale, t, h, s, rb, q.stride(0),
        q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HD=hd, G=g, MIN_CHUNK=ATTN_MIN_CHUNK, BLOCK_M=ATTN_BLOCK_M, BLOCK_N=block_n,
        BLOCK_D=block_d, STAGES=2, num_warps=8)
    block_s = min(triton.next_power_of_2(s), max(1, 4096 // block_d))
    _attn_reduce_kernel[(h, t)](
        part_o, part_ml, length, out, t, h, s, out.stride(0), HD=hd, MIN_CHUNK=ATTN_MIN_CHUNK,
        BLOCK_N=block_n, BLOCK_S=block_s, BLOCK_D=block_d, num_warps=4)
    return out


def _attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     length: torch.Tensor, scale: float) -> torch.Tensor:
    """layers.attention over the whole cache with the causal mask built on the device; rows at
    and past `length` are zeroed first (they are masked, but a NaN there would still poison
    SDPA's sums)."""
    t, h, hd = q.shape
    n = length.reshape(1).long()
    keys = torch.arange(k_cache.shape[0], device=q.device)
    valid = (keys < n)[:, None, None]
    k = torch.where(valid, k_cache.float(), 0.0)
    v = torch.where(valid, v_cache.float(), 0.0)
    last = n - t + torch.arange(t, device=q.device)  # [T]
    mask = keys[None, :] <= last[:, None]  # [T, C]
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=True)  # [H, T, hd]
    return o.transpose(0, 1).reshape(t, h * hd)


# ---- routing -------------------------------------------------------------------------------------


@triton.jit
def _rows_dot_kernel(x, w, y, N, D, stride_w, BN: tl.constexpr, BD: tl.constexpr):
    # y[n] = Σ_d w[n, d] · x[d] for BN rows n
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
    tl.store(y + n, tl.sum(acc, axis=1), mask=n < N)


def router_logits(h: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """h @ router.T: h [T, D] f32, router [E, D] f32 (rows contiguous) -> [T, E] f32. One token
    on CUDA: `_rows_dot_kernel` (see the module doc); otherwise torch."""
    if h.shape[0] != 1 or not _use_kernels(h) or router.dtype != torch.float32:
        return h @ router.T
    _f32(h, "h")
    e, d = router.shape
    _check(h.shape[1] == d and router.stride(1) == 1 and h.stride(1) == 1,
           f"h [1, {d}] and router [E, {d}] with contiguous rows")
    out = torch.empty((1, e), dtype=torch.float32, device=h.device)
    bn = 2
    bd = min(1024, triton.next_power_of_2(d))
    _rows_dot_kernel[(triton.cdiv(e, bn),)](h, router, out, e, d, router.stride(0), BN=bn,
                                            BD=bd, num_warps=4)
    return out


@triton.jit
def _finite(row, j, jm):
    """logits row[j] (loaded past L1: another CTA may have just written them), NaN and the
    masked tail as -inf, so the ranks below stay a permutation."""
    v = tl.load(row + j, mask=jm, other=float("-inf"), cache_modifier=".cg")
    return tl.where(v == v, v, float("-inf"))


@triton.jit
def _route_row(row, out, ids, wts, counts, skip, E, K: tl.constexpr, NORM: tl.constexpr,
               COUNT: tl.constexpr, SKIP: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_J: tl.constexpr):
    """route() of one logits row (at `row`) into ids / wts row `out`: softmax over E, each
    expert's rank = how many beat it (a larger logit, or an equal one with a lower id), and the
    K of rank < K stored at their rank (largest first, ties to the lower id): one [E, E]
    comparison, summed in BLOCK_J columns a step, instead of K rounds of argmax, each two or
    three reductions long. With SKIP an expert with skip[e] >= 0 is stored as id -1."""
    e = tl.arange(0, BLOCK_E)
    em = e < E
    x = _finite(row, e, em)
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
    p = ex / tl.sum(ex, axis=0)
    sel = em & (rank < K)
    if NORM:
        p = p / tl.sum(tl.where(sel, p, 0.0), axis=0)
    out_i = e
    if SKIP:
        out_i = tl.where(tl.load(skip + e, mask=sel, other=-1) >= 0, -1, e)
    tl.store(ids + out * K + rank, out_i.to(tl.int64), mask=sel)
    tl.store(wts + out * K + rank, p, mask=sel)
    if COUNT:
        tl.atomic_add(counts + e, tl.full((BLOCK_E,), 1, tl.int32), mask=sel)


@triton.jit
def _route_kernel(logits, ids, wts, counts, skip, E, stride_l, K: tl.constexpr,
                  NORM: tl.constexpr, COUNT: tl.constexpr, SKIP: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr):
    # one program per token row
    t = tl.program_id(0).to(tl.int64)
    _route_row(logits + t * stride_l, t, ids, wts, counts, skip, E, K, NORM, COUNT, SKIP,
               BLOCK_E, BLOCK_J)


def _route_blocks(e: int) -> dict:
    """BLOCK_E and BLOCK_J of the rank comparison: [BLOCK_E, BLOCK_J] a step, at most 16K."""
    block_e = triton.next_power_of_2(e)
    return dict(BLOCK_E=block_e, BLOCK_J=max(1, min(block_e, 16384 // block_e)))


@triton.jit
def _norm_route_kernel(x, delta, w, router, h, logits, ids, wts, counts, skip, sync, D, E,
                       stride_r, stride_w, eps, HAS_DELTA: tl.constexpr, R: tl.constexpr,
                       STORE_H: tl.constexpr, K: tl.constexpr, NORM: tl.constexpr,
                       COUNT: tl.constexpr, SKIP: tl.constexpr, BN: tl.constexpr,
                       BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_J: tl.constexpr):
    # every program: v = x [+ Σ delta], y = rms_norm(v) * w (the row recomputed from L2 in each),
    # logits[n] = router[n] · y for its BN rows; the last program to finish (an atomic count)
    # stores v into x (only then: the others read x) and y into h, routes the logits row and
    # sets the count back to 0 for the next launch (graph replays)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    nm = n < E
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
                   BLOCK_J)
        tl.atomic_xchg(sync, 0)


def norm_route(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
               router: torch.Tensor, k: int, norm_topk: bool, sync: torch.Tensor,
               counts: torch.Tensor | None = None, skip: torch.Tensor | None = None,
               ids: torch.Tensor | None = None, store_h: bool = True, fuse: bool = True,
               ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A decode token's residual step and routing in one launch: [x += delta in place,]
    h = rms_norm(x, weight, eps), logits = h @ router.T, then route_topk(logits, k, norm_topk,
    counts, skip, ids) -> (h or None with store_h=False, ids, weights). As add_rms_norm (or
    rms_norm without delta), router_logits and route_topk called in turn, which is what runs
    for T > 1, off CUDA, for a router that is not float32 and with fuse=False (timing).

    x [1, D] f32 (the residual; rows contiguous), delta [1, D] or [1, R, D] f32 or None,
    weight [D] f32, router [E, D] (rows contiguous). sync: int32 [1] on the device, zero,
    owned by the caller and left zero: the kernel's count of finished programs (launches that
    may run at once, as on two streams, need one each)."""
    t = x.shape[0] if x.dim() == 2 else 0
    fused = (fuse and t == 1 and _use_kernels(x) and router.dtype == torch.float32
             and router.dim() == 2 and router.shape[1] == x.shape[1] and router.stride(1) == 1)
    if not fused:
        h = rms_norm(x, weight, eps) if delta is None else add_rms_norm(x, delta, weight, eps)
        got_ids, wts = route_topk(router_logits(h, router), k, norm_topk, counts, skip, ids)
        return (h if store_h else None), got_ids, wts
    h = _norm_args(x, weight, None if store_h else x)  # (x: a pointer the kernel won't write)
    rows = 1
    if delta is not None:
        _delta_args(x, delta)
        rows = delta.shape[1] if delta.dim() == 3 else 1
    e, d = router.shape
    _route_args(1, e, k, counts, skip, ids)
    _check(sync.dtype == torch.int32 and sync.numel() == 1 and sync.device == x.device,
           f"sync must be an int32 tensor of one element on {x.device}")
    if ids is None:
        ids = torch.empty((1, k), dtype=torch.int64, device=x.device)
    wts = torch.empty((1, k), dtype=torch.float32, device=x.device)
    logits = torch.empty((e,), dtype=torch.float32, device=x.device)
    bn = 2
    block_d = triton.next_power_of_2(d)
    _norm_route_kernel[(triton.cdiv(e, bn),)](
        x, x if delta is None else delta, weight, router, h, logits, ids, wts,
        ids if counts is None else counts, ids if skip is None else skip, sync, d, e,
        delta.stride(-2) if rows > 1 else 0, router.stride(0), eps, HAS_DELTA=delta is not None,
        R=rows, STORE_H=store_h, K=k, NORM=bool(norm_topk), COUNT=counts is not None,
        SKIP=skip is not None, BN=bn, BLOCK_D=block_d, **_route_blocks(e),
        num_warps=4 if block_d <= 4096 else 8)
    return (h if store_h else None), ids, wts


def _route_args(t: int, e: int, k: int, counts: torch.Tensor | None, skip: torch.Tensor | None,
                ids: torch.Tensor | None) -> None:
    """route_topk's k, counts, skip and ids for T tokens over E experts."""
    _check(0 < k <= e, f"k must be in 1..E = {e}, got {k}")
    for name, v in (("counts", counts), ("skip", skip)):
        if v is not None:
            _check(v.dtype == torch.int32 and v.shape == (e,) and v.is_contiguous(),
                   f"{name} must be int32 [{e}], contiguous")
    if ids is not None:
        _check(ids.dtype == torch.int64 and ids.shape == (t, k) and ids.is_contiguous(),
               f"ids must be int64 [{t}, {k}], contiguous")


def route_topk(logits: torch.Tensor, k: int, norm_topk: bool,
               counts: torch.Tensor | None = None, skip: torch.Tensor | None = None,
               ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """route() after its matmul: softmax over E, the top k, optionally renormalized to sum 1.
    logits [T, E] f32 (rows contiguous; = h @ router.T) -> ids int64 [T, k], weights f32 [T, k],
    largest first. Ties: the lower expert id first (see the module doc). One launch.
    counts: int32 [E] on the device, += 1 for every pair routed to an expert (atomics).
    skip: int32 [E] (an expert cache's slot table): an expert with skip[e] >= 0 is returned as
    id -1 in its place (decode prefetch: the best experts not in VRAM). ids: written into
    (int64 [T, k], contiguous) instead of a new tensor."""
    _check(logits.dim() == 2, f"logits must be [T, E], got {list(logits.shape)}")
    _f32(logits, "logits")
    t, e = logits.shape
    _route_args(t, e, k, counts, skip, ids)
    if not _use_kernels(logits):
        probs = torch.softmax(logits, dim=-1)
        weights, top = torch.topk(probs, k, dim=-1)
        if norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        if counts is not None:
            flat = top.reshape(-1)
            counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        if skip is not None:
            top = torch.where(skip[top] >= 0, -1, top)
        if ids is None:
            return top, weights
        ids.copy_(top)
        return ids, weights
    ids = torch.empty((t, k), dtype=torch.int64, device=logits.device) if ids is None else ids
    weights = torch.empty((t, k), dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, weights
    _route_kernel[(t,)](logits, ids, weights, ids if counts is None else counts,
                        ids if skip is None else skip, e, logits.stride(0), K=k,
                        NORM=bool(norm_topk), COUNT=counts is not None, SKIP=skip is not None,
                        **_route_blocks(e), num_warps=4)
    return ids, weights
