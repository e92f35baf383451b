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
      do not matter. Split kernel variants (ATTN_VARIANTS; picked per case by
      attention_variant from tuning.ATTN_VARIANT): "ieee" the above; "fma"
      `_attn_split_fma_kernel`, no tl.dot (broadcast products and sums on the CUDA cores,
      exact float32, row blocks of pow2(T·G) <= 16); "tf32" the dots with TF32 inputs, picked
      only with fused=True (--kernels fused).
  paged_attention  one new token of each of B sequences over its own rows of a shared KV pool
      (the batched decode step, paged caches), 2 launches. `_paged_split_kernel`, grid
      (B, Hkv, S): the G query heads of a kv head of one row, a split of its keys, each key's
      pool row read from the row's index vector (`read`, from its block table: block_rows);
      exact float32 products on the CUDA cores, online softmax; S fixed by the rows a row may
      read (so a graph serves every length), each split's size derived on the device from the
      row's own length. `_paged_reduce_kernel`, grid (B, H), as `_attn_reduce_kernel` per row
      (with the sink logits). rows_rope_store (RoPE, the pool store) is torch ops.
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

import functools
import os
import sys
from dataclasses import dataclass
from types import ModuleType

import torch

from strata.kernels import torch_ops as layers
from strata.kernels.tuning import (
    ATTN_BLOCK_M,
    ATTN_FEW_ROWS,
    ATTN_FMA_TILE,
    ATTN_MIN_CHUNK,
    ATTN_TARGET_CTAS,
    ATTN_TF32_TILE,
    ATTN_VARIANT,
    NORM_ROUTE_MAX_EXPERTS,
    PAGED_TARGET_CTAS,
    ROUTE_SORT_MIN_EXPERTS,
)
from strata.runtime.kv_cache import dequantize_q8_0, quantize_q8_0

ROPE_STYLES = ("neox", "normal")


def fused_decode_available(device: torch.device | str) -> bool:
    """True when the Triton kernels run for tensors on `device` (CUDA with a driver)."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available()


def _use_kernels(t: torch.Tensor) -> bool:
    return t.is_cuda or _interpreting()


def _interpreting() -> bool:
    """Triton's interpreter is on (TRITON_INTERPRET, or its knob where Triton is loaded); read
    without importing Triton, which a CPU-only install may not have."""
    if os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes"):
        return True
    knobs = sys.modules.get("triton.knobs")
    return bool(knobs is not None and knobs.runtime.interpret)


@functools.cache
def _kernels() -> ModuleType:
    """decode_kernels.py (the Triton kernel bodies), imported on the first launch."""
    from strata.kernels.gpu import decode_kernels

    return decode_kernels


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    """The smallest power of two >= n (triton.next_power_of_2)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Attention partials: left uninitialized; tests swap in a NaN-filled version so a read of
    anything the split kernel did not write shows up in the output."""
    return torch.empty(shape, dtype=dtype, device=device)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


KV_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
             torch.int8: "int8 (q8_0, with scales)"}


def _q8_scales(cache: torch.Tensor, scales: torch.Tensor | None, name: str) -> None:
    """An int8 cache comes with its q8_0 scales, float16 [C, Hkv, hd/32]; no other one does."""
    if cache.dtype != torch.int8:
        _check(scales is None, f"{name}: scales belong to an int8 (q8_0) cache only")
        return
    c, hkv, hd = cache.shape
    _check(scales is not None and hd % 32 == 0, f"{name}: an int8 cache needs its q8_0 scales "
           "and a head dim that is a multiple of 32")
    _f32(scales, name + " scales", (c, hkv, hd // 32), {torch.float16: "float16"})
    _check(scales.device == cache.device, f"{name} scales must be on the cache's device")


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


def _norm_launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor, extra: torch.Tensor | None = None) -> None:
    t, d = x.shape
    block = _pow2(d)
    warps = min(16, max(1, block // 512))
    rows = 1 if delta is None or delta.dim() == 2 else delta.shape[1]
    _kernels()._rms_norm_kernel[(t,)](
        x, x if delta is None else delta, weight, out, x if extra is None else extra, d,
        x.stride(0), 0 if delta is None else delta.stride(0),
        delta.stride(1) if rows > 1 else 0, out.stride(0),
        0 if extra is None else extra.stride(0), eps, HAS_DELTA=delta is not None, R=rows,
        BLOCK=block, HAS_EXTRA=extra is not None, num_warps=warps)


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
                 out: torch.Tensor | None = None,
                 extra: torch.Tensor | None = None) -> torch.Tensor:
    """The residual step: x += delta in place, then returns rms_norm(x, weight, eps).
    x [T, D] f32 (rows contiguous), weight [D] f32 -> [T, D] f32. One launch. delta: [T, D]
    f32, or [T, R, D] (rows of D contiguous; a token's K expert outputs, moe_forward's
    sum_pairs=False) whose R rows are added to each other in order, then to x. extra: [T, D]
    f32 (rows contiguous; the shared expert's row), added after delta's rows, before x: the
    sum of delta with extra as its row R + 1, without the copy that would join them."""
    out = _norm_args(x, weight, out)
    _delta_args(x, delta)
    if extra is not None:
        _f32(extra, "extra", tuple(x.shape))
        _check(extra.stride(-1) == 1 and extra.device == x.device,
               "extra's rows must be contiguous, on x's device")
    if x.shape[0] == 0:
        return out
    if _use_kernels(x):
        _norm_launch(x, delta, weight, eps, out, extra)
    else:
        s = layers.sum_rows(delta)  # (the pairs in the kernel's order)
        x.add_(s if extra is None else s + extra)
        out.copy_(layers.rms_norm(x, weight, eps))
    return out


# ---- q/k norm + RoPE + KV cache store ------------------------------------------------------------


def rope_inv_freq(rope_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """float32 [rope_dim/2]: theta^(-2i/rope_dim), computed exactly as layers.rope_tables does
    (on `device`, so the table matches the reference run there)."""
    _check(rope_dim > 0 and rope_dim % 2 == 0, f"rope_dim must be even, got {rope_dim}")
    return 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32,
                                        device=device) / rope_dim)


def qk_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                  pos: torch.Tensor, inv_freq: torch.Tensor, style: str,
                  k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                  v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head RMS norm (q_norm, k_norm: f32 [hd] or None), RoPE at positions pos + t on the
    first rope_dim = 2·len(inv_freq) dims ("neox" or "normal" pairs), k and v written to cache
    rows pos + t; returns the rotated q. One launch.

    q [T, H, hd], k, v [T, Hkv, hd] f32 (any strides with the last dim contiguous: views of one
    fused qkv tensor are fine); pos int32/int64 [1] on the device; inv_freq f32 [rope_dim/2]
    (rope_inv_freq); k_cache, v_cache [C, Hkv, hd] of one type, f32, f16 or bf16 (k and v
    rounded to it), or int8 with k_scales, v_scales f16 [C, Hkv, hd/32] (q8_0: each row
    quantized in blocks of 32, kv_cache.quantize_q8_0), last dim contiguous -> [T, H, hd] f32
    (new, or `out`). The caller keeps pos + T <= C."""
    _check(q.dim() == 3 and k.dim() == 3, "q must be [T, H, hd] and k [T, Hkv, hd]")
    _rope_args(q, k, v, q_norm, k_norm, inv_freq, style, k_cache, v_cache, k_scales, v_scales,
               "cache")
    _device_int(pos, "pos", q.device)
    t, h, hd = q.shape
    if out is None:
        out = torch.empty((t, h, hd), dtype=torch.float32, device=q.device)
    _f32(out, "out", (t, h, hd))
    if t == 0:
        return out
    if _use_kernels(q):
        return _rope_launch(q, k, v, q_norm, k_norm, eps, pos, inv_freq, style, k_cache,
                            v_cache, k_scales, v_scales, out)
    positions = pos.reshape(1).long() + torch.arange(t, device=q.device)  # [T], on the device
    out.copy_(_rope_store_torch(q, k, v, q_norm, k_norm, eps, positions, inv_freq, style,
                                k_cache, v_cache, positions, k_scales, v_scales))
    return out


def _rope_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
               k_norm: torch.Tensor | None, inv_freq: torch.Tensor, style: str,
               k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
               v_scales: torch.Tensor | None, kind: str) -> None:
    """The checks qk_rope_store and rows_rope_store share (kind: "cache" or "pool", the names
    in their messages)."""
    t, h, hd = q.shape
    hkv = k.shape[1]
    kn, vn = f"k_{kind}", f"v_{kind}"
    for name, x, shape in (("q", q, (t, h, hd)), ("k", k, (t, hkv, hd)), ("v", v, (t, hkv, hd)),
                           (kn, k_cache, (k_cache.shape[0], hkv, hd)),
                           (vn, v_cache, (k_cache.shape[0], hkv, hd))):
        _f32(x, name, shape, KV_DTYPES if name in (kn, vn) else None)
        _check(x.device == q.device, f"{name} must be on q's device")
    _check(k_cache.dtype == v_cache.dtype, f"{kn} and {vn} must have one type, got "
           f"{k_cache.dtype} and {v_cache.dtype}")
    _q8_scales(k_cache, k_scales, kn)
    _q8_scales(v_cache, v_scales, vn)
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


def _rope_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor | None,
                 k_norm: torch.Tensor | None, eps: float, pos: torch.Tensor,
                 inv_freq: torch.Tensor, style: str, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, k_scales: torch.Tensor | None,
                 v_scales: torch.Tensor | None, out: torch.Tensor,
                 write: torch.Tensor | None = None) -> torch.Tensor:
    """`_qk_rope_kernel` over checked arguments (_rope_args): token t at position pos + t into
    cache row pos + t, or with `write` (rows_rope_store) at pos[t] into row write[t]."""
    t, h, hd = q.shape
    hkv = k.shape[1]
    q8 = k_cache.dtype == torch.int8
    ks, vs = (k_scales, v_scales) if q8 else (k_cache, v_cache)  # (unread without q8_0)
    _kernels()._qk_rope_kernel[(t, h + hkv)](
        q, k, v, q if q_norm is None else q_norm, q if k_norm is None else k_norm, inv_freq,
        pos, out, k_cache, v_cache, ks, vs, eps, h, k_cache.shape[0], q.stride(0), q.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), HAS_QN=q_norm is not None,
        HAS_KN=k_norm is not None, HD=hd, ROPE_DIM=2 * inv_freq.numel(), NEOX=style == "neox",
        BLOCK_D=_pow2(hd), Q8=q8, write=write, ROWS=write is not None, num_warps=1)
    return out


def _rope_store_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                      positions: torch.Tensor, inv_freq: torch.Tensor, style: str,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
                      k_scales: torch.Tensor | None,
                      v_scales: torch.Tensor | None) -> torch.Tensor:
    """The torch form of qk_rope_store and rows_rope_store: q/k norms, RoPE of each token at
    its position (positions int64 [T]), k and v stored at cache rows `rows` [T] (rounded to the
    cache's type, or q8_0 with their scales) -> the rotated q [T, H, hd]. Graph safe."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # as in rope_tables
    cos, sin = angles.cos(), angles.sin()
    if q_norm is not None:
        q = layers.rms_norm(q, q_norm, eps)
    if k_norm is not None:
        k = layers.rms_norm(k, k_norm, eps)
    q = layers.apply_rope(q, cos, sin, style)
    k = layers.apply_rope(k, cos, sin, style)
    if k_cache.dtype == torch.int8:
        for cache, scales, x in ((k_cache, k_scales, k), (v_cache, v_scales, v)):
            qx, dx = quantize_q8_0(x)
            cache.index_copy_(0, rows, qx)
            scales.index_copy_(0, rows, dx)
    else:
        k_cache.index_copy_(0, rows, k.to(k_cache.dtype))
        v_cache.index_copy_(0, rows, v.to(v_cache.dtype).contiguous())
    return q


# ---- decode attention (flash decoding) ----------------------------------------------------------


def attention_splits(capacity: int, n_kv_heads: int) -> int:
    """S, the number of key splits (grid axis 1 of the split kernel): fixed by the capacity, so
    one captured graph serves every length; enough for ~ATTN_TARGET_CTAS CTAs at full length,
    no more than capacity / ATTN_MIN_CHUNK."""
    return max(1, min(_cdiv(capacity, ATTN_MIN_CHUNK), ATTN_TARGET_CTAS // n_kv_heads))


# split kernel variants: tl.dot in exact float32 (the first kernel), no dot (exact float32 on
# the CUDA cores), tl.dot with TF32 inputs (--kernels fused only)
ATTN_VARIANTS = ("ieee", "fma", "tf32")


def attention_variant(t: int, g: int, kv_dtype: torch.dtype, fused: bool) -> str:
    """The split kernel variant the launch picks (tuning.ATTN_VARIANT): by T·G, the kernels mode
    (fused: --kernels fused, which allows TF32; else float32-exact) and the cache type."""
    cache = {torch.float32: "f32", torch.int8: "q8_0"}.get(kv_dtype, "half")
    return ATTN_VARIANT[(t * g <= ATTN_FEW_ROWS, fused, cache)]


@dataclass(frozen=True)
class AttnLaunch:
    """One split kernel launch's tile: rows a CTA (BLOCK_M), keys a step (BLOCK_N), pipeline
    stages, warps, and the fma variant's lanes along d (dc)."""

    variant: str
    block_m: int
    block_n: int
    stages: int
    warps: int
    dc: int = 0


def attention_launch(variant: str, t: int, g: int, hd: int) -> AttnLaunch:
    """The tile of `variant` for T tokens, G query heads a kv head and head dim hd."""
    _check(variant in ATTN_VARIANTS, f"attention variant {variant!r}: choose from {ATTN_VARIANTS}")
    block_d = _pow2(hd)
    if variant == "fma":
        tile, dc, stages, warps = ATTN_FMA_TILE
        bm = min(ATTN_BLOCK_M, _pow2(t * g))
        return AttnLaunch(variant, bm, max(4, min(64, tile // (bm * block_d))), stages, warps,
                          min(dc, block_d))
    if variant == "tf32":
        step, stages, warps = ATTN_TF32_TILE
        return AttnLaunch(variant, ATTN_BLOCK_M, max(16, min(128, step // block_d)), stages, warps)
    return AttnLaunch(variant, ATTN_BLOCK_M, max(16, min(32, 4096 // block_d)), 2, 8)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     length: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     n_splits: int | None = None, window: int = 0,
                     sinks: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                     v_scales: torch.Tensor | None = None, fused: bool = False,
                     variant: str | None = None, tile: AttnLaunch | None = None,
                     gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of T new tokens at positions length-T .. length-1 over cache rows
    0 .. length-1: query t sees keys j <= length - T + t; head h reads kv head h // (H / Hkv).
    softmax(q k^T · scale) v, as layers.attention (whose scale is hd^-0.5).

    q [T, H, hd] f32 (last dim contiguous); k_cache, v_cache [C, Hkv, hd] of one type, f32, f16
    or bf16 (read as f32; last dim contiguous), or int8 with k_scales, v_scales (q8_0, read as
    q · scale); length int32/int64 [1] on the device,
    T <= length <= C (the new tokens' rows included) -> [T, H·hd] f32 (new, or `out`, rows
    contiguous). Two launches; n_splits overrides attention_splits(C, Hkv) (tests, tuning). Rows
    >= length are never read. gpt-oss: window > 0, query t sees only its last `window` keys
    (j > length - T + t - window; the splits cover those rows only); sinks f32 [H], a logit per
    head in the softmax's denominator that adds no value. The split kernel's variant: `variant`
    (tests, benchmarks), else attention_variant's pick; fused (--kernels fused) lets it pick
    TF32 dots, otherwise every product is exact float32. tile: the split kernel's variant and
    tile instead of both (benchmarks; attention_launch's for the variant otherwise). gate
    [T, H, hd] f32 (any strides, the last dim contiguous: a view of the q projection's rows):
    the output times sigmoid(gate), in the reduce launch (qwen35moe's output gate)."""
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
    _q8_scales(k_cache, k_scales, "k_cache")
    _q8_scales(v_cache, v_scales, "v_cache")
    q8 = k_cache.dtype == torch.int8
    _device_int(length, "length", q.device)
    if out is None:
        out = torch.empty((t, h * hd), dtype=torch.float32, device=q.device)
    _f32(out, "out", (t, h * hd))
    if t == 0:
        return out
    _check(window >= 0, f"window must be >= 0, got {window}")
    if sinks is not None:
        _f32(sinks, "sinks", (h,))
        _check(sinks.is_contiguous() and sinks.device == q.device, "sinks must be contiguous")
    if gate is not None:
        _f32(gate, "gate", (t, h, hd))
        _check(gate.stride(2) == 1 and gate.device == q.device,
               "gate's last dim must be contiguous, on q's device")
    g = h // hkv
    if tile is None:
        tile = attention_launch(variant or attention_variant(t, g, k_cache.dtype, fused), t, g,
                                hd)
    _check(tile.variant in ATTN_VARIANTS and _pow2(tile.block_m) == tile.block_m
           and _pow2(tile.block_n) == tile.block_n
           and (tile.variant == "fma" or tile.block_m >= 16 and tile.block_n >= 16)
           and (tile.variant != "fma" or tile.dc >= 4 and _pow2(tile.dc) == tile.dc
                and _pow2(hd) % tile.dc == 0), f"attention tile {tile}: powers of two, "
           "dots at 16 rows and keys at least, fma's dc a power of two >= 4 dividing hd")
    if not _use_kernels(q):
        if q8:
            k_cache, v_cache = (dequantize_q8_0(k_cache, k_scales),
                                dequantize_q8_0(v_cache, v_scales))
        o = _attention_torch(q, k_cache, v_cache, length, scale, window, sinks)
        return out.copy_(o if gate is None else o * torch.sigmoid(gate.reshape(t, h * hd)))
    s = n_splits or attention_splits(cap, hkv)
    rb = _cdiv(t * g, tile.block_m)  # row blocks per kv head
    block_d = _pow2(hd)
    block_n = tile.block_n
    part_o = scratch((s, t, h, hd), torch.float32, q.device)
    part_ml = scratch((s, t, h, 2), torch.float32, q.device)
    ks, vs = (k_scales, v_scales) if q8 else (k_cache, v_cache)  # (unread without q8_0)
    args = (q, k_cache, v_cache, ks, vs, length, part_o, part_ml, scale, t, h, s, rb,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0),
            v_cache.stride(1), ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1))
    const = dict(HD=hd, G=g, MIN_CHUNK=ATTN_MIN_CHUNK, BLOCK_M=tile.block_m, BLOCK_N=block_n,
                 BLOCK_D=block_d, STAGES=tile.stages, Q8=q8, WINDOW=window,
                 num_warps=tile.warps)
    if tile.variant == "fma":
        _kernels()._attn_split_fma_kernel[(hkv * rb, s)](*args, DC=tile.dc, **const)
    else:
        _kernels()._attn_split_kernel[(hkv * rb, s)](*args, TF32=tile.variant == "tf32",
                                                     **const)
    _reduce_splits(_kernels()._attn_reduce_kernel, (h, t), part_o, part_ml, length, out, t, h,
                   s, sinks, q, block_n, block_d, window, gate)
    return out


def _reduce_splits(kernel, grid: tuple[int, int], part_o: torch.Tensor,  # noqa: ANN001
                   part_ml: torch.Tensor, length: torch.Tensor, out: torch.Tensor, rows: int,
                   h: int, s: int, sinks: torch.Tensor | None, q: torch.Tensor, block_n: int,
                   block_d: int, window: int, gate: torch.Tensor | None = None) -> None:
    """The reduce launch of both split kernels (_attn_reduce_kernel over a sequence's T
    tokens, _paged_reduce_kernel over a pool's B rows): the live splits combined per head
    (times sigmoid(gate): the sequence's kernel only)."""
    block_s = min(_pow2(s), max(1, 4096 // block_d))
    extra = {} if gate is None else dict(gate=gate, stride_gt=gate.stride(0),
                                         stride_gh=gate.stride(1), HAS_GATE=True)
    kernel[grid](part_o, part_ml, length, out, rows, h, s, out.stride(0),
                 q if sinks is None else sinks, HD=out.shape[1] // h, MIN_CHUNK=ATTN_MIN_CHUNK,
                 BLOCK_N=block_n, BLOCK_S=block_s, BLOCK_D=block_d, WINDOW=window,
                 HAS_SINKS=sinks is not None, **extra, num_warps=4)


def _attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     length: torch.Tensor, scale: float, window: int = 0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """layers.attention over the whole cache with the causal mask built on the device; rows at
    and past `length` are zeroed first (they are masked, but a NaN there would still poison
    SDPA's sums). With a window and sinks: the same mask within the window, the softmax with
    each head's sink logit (explicit scores: SDPA takes no sink)."""
    t, h, hd = q.shape
    n = length.reshape(1).long()
    keys = torch.arange(k_cache.shape[0], device=q.device)
    valid = (keys < n)[:, None, None]
    k = torch.where(valid, k_cache.float(), 0.0)
    v = torch.where(valid, v_cache.float(), 0.0)
    last = n - t + torch.arange(t, device=q.device)  # [T]
    mask = keys[None, :] <= last[:, None]  # [T, C]
    if window:
        mask &= keys[None, :] > last[:, None] - window
    if sinks is not None:
        g = h // k.shape[1]
        kh, vh = (x.repeat_interleave(g, 1).transpose(0, 1) for x in (k, v))  # [H, C, hd]
        sc = (q.transpose(0, 1) @ kh.transpose(1, 2)) * scale  # [H, T, C]
        sc = torch.where(mask, sc, float("-inf"))
        sink = sinks.float()[:, None, None].expand(h, t, 1)
        p = torch.softmax(torch.cat([sc, sink], dim=-1), dim=-1)[..., :-1]
        return (p @ vh).transpose(0, 1).reshape(t, h * hd)
    o = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
        enable_gqa=True)  # [H, T, hd]
    return o.transpose(0, 1).reshape(t, h * hd)


# ---- B sequences of one KV pool (the batched decode step) ---------------------------------------


def rows_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, eps: float,
                    pos: torch.Tensor, inv_freq: torch.Tensor, style: str,
                    k_pool: torch.Tensor, v_pool: torch.Tensor, write: torch.Tensor,
                    k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None) -> torch.Tensor:
    """qk_rope_store for B rows of a batched step (a token each; a prompt's chunk: rows of one
    sequence): row b at position pos[b], its k and v written to pool row write[b]; returns the
    rotated q. One launch on CUDA (or under the interpreter), else torch ops (both graph safe:
    no host sync, shapes fixed by B).

    q [B, H, hd], k, v [B, Hkv, hd] f32; pos, write int64 [B] on the device; k_pool, v_pool
    [R, Hkv, hd] f32 / f16 / bf16, or int8 with k_scales, v_scales f16 [R, Hkv, hd/32] (q8_0)
    -> [B, H, hd] f32. write holds distinct rows except the padded rows' scratch row."""
    _check(q.dim() == 3 and k.dim() == 3 and pos.shape == (q.shape[0],)
           and write.shape == pos.shape, "q [B, H, hd], k [B, Hkv, hd], pos and write [B]")
    _q8_scales(k_pool, k_scales, "k_pool")
    _q8_scales(v_pool, v_scales, "v_pool")
    if _use_kernels(q) and q.shape[0]:
        _rope_args(q, k, v, q_norm, k_norm, inv_freq, style, k_pool, v_pool, k_scales, v_scales,
                   "pool")
        for name, t in (("pos", pos), ("write", write)):
            _check(t.dtype in (torch.int32, torch.int64) and t.device == q.device,
                   f"{name} must be int32/int64 [B] on {q.device}")
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        return _rope_launch(q, k, v, q_norm, k_norm, eps, pos.contiguous(), inv_freq, style,
                            k_pool, v_pool, k_scales, v_scales, out, write.contiguous())
    return _rope_store_torch(q, k, v, q_norm, k_norm, eps, pos.long(), inv_freq, style, k_pool,
                             v_pool, write, k_scales, v_scales).contiguous()


def block_rows(table: torch.Tensor, block: int, span: int) -> torch.Tensor:
    """The pool rows of positions 0 .. span-1 of each sequence: table int64 [B, nb] (block ids,
    nb * block >= span) -> int64 [B, span], row = table[b, j // block] * block + j % block."""
    j = torch.arange(span, device=table.device)
    return table[:, j // block] * block + j % block


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                    read: torch.Tensor, length: torch.Tensor, scale: float, window: int = 0,
                    sinks: torch.Tensor | None = None, k_scales: torch.Tensor | None = None,
                    v_scales: torch.Tensor | None = None, fused: bool = False) -> torch.Tensor:
    """decode_attention for B rows of a batched step (a new token each; a prompt's chunk: rows
    of one sequence), each over its sequence's rows of a shared pool: row b's token is at
    position length[b] - 1 and sees its positions j < length[b] (and j > length[b] - 1 -
    window with a window), whose keys and values are pool rows read[b, j]. softmax(q k^T ·
    scale) v per head, with gpt-oss's sink logit per head when given (as _attention_torch).

    q [B, H, hd] f32; k_pool, v_pool [R, Hkv, hd] f32 / f16 / bf16, or int8 with k_scales,
    v_scales (q8_0); read int64 [B, Tk]; length int64 [B] on the device, 1 <= length[b] <= Tk
    -> [B, H·hd] f32. On CUDA (or under the interpreter) flash decoding in two launches:
    `_paged_split_kernel`, program (b, kv head, key split), each row reading its own keys only,
    up to its length; `_paged_reduce_kernel`, program (b, h), combining the splits. Exact
    float32 products on the CUDA cores, or with `fused` (--kernels fused) on TF32 tensor cores
    (decode_attention's "tf32" tile). Elsewhere torch ops (_paged_torch), every row reading Tk
    rows masked past its length. Both graph safe."""
    _check(q.dim() == 3 and k_pool.dim() == 3 and read.dim() == 2 and read.shape[0] == q.shape[0]
           and length.shape == (q.shape[0],), "q [B, H, hd], pools [R, Hkv, hd], read [B, Tk], "
           "length [B]")
    _q8_scales(k_pool, k_scales, "k_pool")
    _q8_scales(v_pool, v_scales, "v_pool")
    b, h, hd = q.shape
    if _use_kernels(q):
        return _paged_launch(q, k_pool, v_pool, read, length, scale, window, sinks, k_scales,
                             v_scales, fused=fused)
    return _paged_torch(q, k_pool, v_pool, read, length, scale, window, sinks, k_scales, v_scales)


def _paged_torch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 read: torch.Tensor, length: torch.Tensor, scale: float, window: int,
                 sinks: torch.Tensor | None, k_scales: torch.Tensor | None,
                 v_scales: torch.Tensor | None) -> torch.Tensor:
    """paged_attention in torch ops (the CPU's): each row's Tk pool rows gathered head-major by
    one index_select a pool, so both products are plain bmm over B·Hkv contiguous matrices
    with no copy between; rows past a length are masked out of the scores (the pool's rows are
    zeros until written, so their zero weights never meet a NaN). Graph safe (no host sync).
    On the tiny model's batched step (B 8, Tk ~190, Hkv 2, hd 64) 180 us a layer against 550
    for pool[read] as [B, Tk, Hkv, hd] (torch's advanced indexing, then a copy for each
    product's permuted operand), one thread (bench/2026-12-06-cpu-serve.md)."""
    b, h, hd = q.shape
    tk, hkv = read.shape[1], k_pool.shape[1]
    g = h // hkv
    # pool row read[b, j], kv head i: row read[b, j] * Hkv + i of the pool seen as [R·Hkv, hd]
    heads = torch.arange(hkv, device=q.device)[None, :, None]
    idx = (read.long()[:, None, :] * hkv + heads).reshape(-1)  # [B·Hkv·Tk]
    kv = []
    for pool, scales in ((k_pool, k_scales), (v_pool, v_scales)):
        x = pool.reshape(-1, hd).index_select(0, idx)  # [B·Hkv·Tk, hd]
        if pool.dtype == torch.int8:
            x = dequantize_q8_0(x, scales.reshape(-1, scales.shape[-1]).index_select(0, idx))
        kv.append(x.float().view(b * hkv, tk, hd))
    k, v = kv
    keys = torch.arange(tk, device=q.device)[None, :]  # [1, Tk]
    n = length.long()[:, None]  # [B, 1]
    masked = keys >= n  # [B, Tk]
    if window:
        masked |= keys <= n - 1 - window
    sc = torch.bmm(q.reshape(b * hkv, g, hd), k.transpose(1, 2)).view(b, hkv, g, tk)
    sc = sc.mul_(scale).masked_fill_(masked[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, hkv, g, 1).expand(b, hkv, g, 1)
        p = torch.softmax(torch.cat([sc, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(sc, dim=-1)
    o = torch.bmm(p.reshape(b * hkv, g, tk), v)  # [B·Hkv, G, hd]
    return o.view(b, h * hd)


def paged_tile(g: int, hd: int, fused: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, stages, warps) of _paged_split_kernel for G query heads a kv head of
    dim hd: exact, the G heads' rows with [BLOCK_M, BLOCK_N, BLOCK_D] products of at most 8K
    values a step (registers); fused, decode_attention's tf32 tile (16 query rows, G of them
    real)."""
    block_m = _pow2(g)
    if fused:
        tile = attention_launch("tf32", 1, g, hd)
        return max(block_m, tile.block_m), tile.block_n, tile.stages, tile.warps
    return block_m, max(4, min(64, 8192 // (block_m * _pow2(hd)))), 1, 4


def _paged_launch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                  read: torch.Tensor, length: torch.Tensor, scale: float, window: int,
                  sinks: torch.Tensor | None, k_scales: torch.Tensor | None,
                  v_scales: torch.Tensor | None, n_splits: int | None = None,
                  fused: bool = False) -> torch.Tensor:
    """paged_attention's kernels: checks, tiles, two launches (n_splits: tests)."""
    b, h, hd = q.shape
    hkv = k_pool.shape[1]
    _f32(q, "q")
    for name, c in (("k_pool", k_pool), ("v_pool", v_pool)):
        _f32(c, name, (k_pool.shape[0], hkv, hd), KV_DTYPES)
        _check(c.device == q.device, f"{name} must be on q's device")
    _check(hkv > 0 and h % hkv == 0, f"H = {h} must be a multiple of Hkv = {hkv}")
    _check(read.dtype == torch.int64 and read.stride(1) == 1 and read.device == q.device,
           "read must be int64 [B, Tk] with contiguous rows, on q's device")
    _check(length.dtype in (torch.int32, torch.int64) and length.device == q.device,
           f"length must be int32/int64 [B] on {q.device}")
    if sinks is not None:
        _f32(sinks, "sinks", (h,))
        _check(sinks.is_contiguous() and sinks.device == q.device, "sinks must be contiguous")
    out = torch.empty((b, h * hd), dtype=torch.float32, device=q.device)
    if b == 0:
        return out
    g = h // hkv
    block_d = _pow2(hd)
    block_m, block_n, stages, warps = paged_tile(g, hd, fused)
    # splits fixed by the rows a row may read (a captured graph serves every length), enough
    # for ~PAGED_TARGET_CTAS programs at full length; each split's size is derived on the
    # device from the row's length (splits past it exit at once)
    s = n_splits or max(1, min(_cdiv(read.shape[1], ATTN_MIN_CHUNK),
                               PAGED_TARGET_CTAS // (b * hkv)))
    q8 = k_pool.dtype == torch.int8
    ks, vs = (k_scales, v_scales) if q8 else (k_pool, v_pool)  # (unread without q8_0)
    part_o = scratch((s, b, h, hd), torch.float32, q.device)
    part_ml = scratch((s, b, h, 2), torch.float32, q.device)
    length = length.contiguous()
    _kernels()._paged_split_kernel[(b, hkv, s)](
        q, k_pool, v_pool, ks, vs, read, length, part_o, part_ml, scale, b, h, s, q.stride(0),
        q.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        ks.stride(0), ks.stride(1), vs.stride(0), vs.stride(1), read.stride(0), HD=hd, G=g,
        MIN_CHUNK=ATTN_MIN_CHUNK, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, Q8=q8,
        WINDOW=window, TF32=fused, STAGES=stages, num_warps=warps)
    _reduce_splits(_kernels()._paged_reduce_kernel, (b, h), part_o, part_ml, length, out, b, h,
                   s, sinks, q, block_n, block_d, window)
    return out


# ---- routing -------------------------------------------------------------------------------------


def router_logits(h: torch.Tensor, router: torch.Tensor, sigmoid: bool = False,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """h @ router.T (+ bias): h [T, D] f32, router [E, D] f32 (rows contiguous), bias [E] f32
    contiguous (gpt-oss's router) -> [T, E] f32 (sigmoid: their sigmoid, in the same launch: a
    shared expert's gate). One token on CUDA: `_rows_dot_kernel` (see the module doc);
    otherwise torch."""
    if h.shape[0] != 1 or not _use_kernels(h) or router.dtype != torch.float32:
        y = h @ router.T if bias is None else h @ router.T + bias
        return torch.sigmoid(y) if sigmoid else y
    if bias is not None:
        _f32(bias, "bias", (router.shape[0],))
        _check(bias.is_contiguous() and bias.device == h.device, "bias must be contiguous")
    _f32(h, "h")
    e, d = router.shape
    _check(h.shape[1] == d and router.stride(1) == 1 and h.stride(1) == 1,
           f"h [1, {d}] and router [E, {d}] with contiguous rows")
    out = torch.empty((1, e), dtype=torch.float32, device=h.device)
    bn = 2
    bd = min(1024, _pow2(d))
    _kernels()._rows_dot_kernel[(_cdiv(e, bn),)](h, router, out, e, d, router.stride(0), BN=bn,
                                            BD=bd, SIGMOID=sigmoid,
                                            bias=out if bias is None else bias,
                                            BIAS=bias is not None, num_warps=4)
    return out


def _route_blocks(e: int) -> dict:
    """BLOCK_E and BLOCK_J of the rank comparison ([BLOCK_E, BLOCK_J] a step, at most 16K), and
    SORT: a bitonic top-k in its place (tuning.ROUTE_SORT_MIN_EXPERTS)."""
    block_e = _pow2(e)
    least = ROUTE_SORT_MIN_EXPERTS
    return dict(BLOCK_E=block_e, BLOCK_J=max(1, min(block_e, 16384 // block_e)),
                SORT=least is not None and e >= least)


def norm_route(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
               router: torch.Tensor, k: int, norm_topk: bool, sync: torch.Tensor,
               counts: torch.Tensor | None = None, skip: torch.Tensor | None = None,
               ids: torch.Tensor | None = None, store_h: bool = True, fuse: bool = True,
               gate: torch.Tensor | None = None,
               ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """A decode token's residual step and routing in one launch: [x += delta in place,]
    h = rms_norm(x, weight, eps), logits = h @ router.T, then route_topk(logits, k, norm_topk,
    counts, skip, ids) -> (h or None with store_h=False, ids, weights). As add_rms_norm (or
    rms_norm without delta), router_logits and route_topk called in turn, which is what runs
    for T > 1, off CUDA, for a router that is not float32, of over NORM_ROUTE_MAX_EXPERTS
    experts, and with fuse=False (timing).

    x [1, D] f32 (the residual; rows contiguous), delta [1, D] or [1, R, D] f32 or None,
    weight [D] f32, router [E, D] (rows contiguous). sync: int32 [1] on the device, zero,
    owned by the caller and left zero: the kernel's count of finished programs (launches that
    may run at once, as on two streams, need one each). gate (float32 [1, 1], written): the
    router has E + 1 rows, the last a shared expert's gate (as route_topk's gate)."""
    t = x.shape[0] if x.dim() == 2 else 0
    n_gate = int(gate is not None)
    fused = (fuse and t == 1 and _use_kernels(x) and router.dtype == torch.float32
             and router.dim() == 2 and router.shape[1] == x.shape[1] and router.stride(1) == 1
             and router.shape[0] - n_gate <= NORM_ROUTE_MAX_EXPERTS)
    if not fused:
        h = rms_norm(x, weight, eps) if delta is None else add_rms_norm(x, delta, weight, eps)
        got_ids, wts = route_topk(router_logits(h, router), k, norm_topk, counts, skip, ids,
                                  gate)
        return (h if store_h else None), got_ids, wts
    h = _norm_args(x, weight, None if store_h else x)  # (x: a pointer the kernel won't write)
    rows = 1
    if delta is not None:
        _delta_args(x, delta)
        rows = delta.shape[1] if delta.dim() == 3 else 1
    rows_all, d = router.shape
    e = rows_all - n_gate
    _route_args(1, e, k, counts, skip, ids)
    _gate_arg(gate, 1, x.device)
    _check(sync.dtype == torch.int32 and sync.numel() == 1 and sync.device == x.device,
           f"sync must be an int32 tensor of one element on {x.device}")
    if ids is None:
        ids = torch.empty((1, k), dtype=torch.int64, device=x.device)
    wts = torch.empty((1, k), dtype=torch.float32, device=x.device)
    logits = torch.empty((rows_all,), dtype=torch.float32, device=x.device)
    bn = 2
    block_d = _pow2(d)
    _kernels()._norm_route_kernel[(_cdiv(rows_all, bn),)](
        x, x if delta is None else delta, weight, router, h, logits, ids, wts,
        ids if counts is None else counts, ids if skip is None else skip, sync,
        wts if gate is None else gate, d, e, delta.stride(-2) if rows > 1 else 0,
        router.stride(0), eps, HAS_DELTA=delta is not None, R=rows, STORE_H=store_h, K=k,
        NORM=bool(norm_topk), COUNT=counts is not None, SKIP=skip is not None, BN=bn,
        BLOCK_D=block_d, **_route_blocks(e), GATE=gate is not None,
        num_warps=4 if block_d <= 4096 else 8)
    return (h if store_h else None), ids, wts


def _gate_arg(gate: torch.Tensor | None, t: int, device: torch.device) -> None:
    if gate is not None:
        _check(gate.dtype == torch.float32 and gate.shape == (t, 1) and gate.is_contiguous()
               and gate.device == device, f"gate must be float32 [{t}, 1], contiguous, on "
               f"{device}")


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
               ids: torch.Tensor | None = None,
               gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """route() after its matmul: softmax over E, the top k, optionally renormalized to sum 1.
    logits [T, E] f32 (rows contiguous; = h @ router.T) -> ids int64 [T, k], weights f32 [T, k],
    largest first. Ties: the lower expert id first (see the module doc). One launch.
    counts: int32 [E] on the device, += 1 for every pair routed to an expert (atomics).
    skip: int32 [E] (an expert cache's slot table): an expert with skip[e] >= 0 is returned as
    id -1 in its place (decode prefetch: the best experts not in VRAM). ids: written into
    (int64 [T, k], contiguous) instead of a new tensor. gate (float32 [T, 1], written): logits
    has E + 1 columns, the last a shared expert's gate logit (its router row joined to the
    router's: one GEMV for both); the first E are routed and gate gets the last's sigmoid."""
    _check(logits.dim() == 2, f"logits must be [T, E], got {list(logits.shape)}")
    _f32(logits, "logits")
    t, e = logits.shape
    if gate is not None:
        e -= 1
        _gate_arg(gate, t, logits.device)
        if not _use_kernels(logits):
            gate.copy_(torch.sigmoid(logits[:, e:]))
            logits = logits[:, :e]
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
    _kernels()._route_kernel[(t,)](logits, ids, weights, ids if counts is None else counts,
                        ids if skip is None else skip, weights if gate is None else gate, e,
                        logits.stride(0), K=k, NORM=bool(norm_topk), COUNT=counts is not None,
                        SKIP=skip is not None, **_route_blocks(e), GATE=gate is not None,
                        num_warps=4)
    return ids, weights
