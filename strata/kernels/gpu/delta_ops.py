"""One decode token of a Gated DeltaNet layer (model/parts/delta_net.py) over its static state:
two launches on CUDA (graph-safe: in place, no host sync), the same math in torch elsewhere.

    conv_step(x, window, w)         y = silu(causal depthwise conv of [window; x]), window moves
                                    on by one (in place). grid: C / CONV_STEP_BLOCK
    delta_step(x, g, beta, S, ...)  q, k L2-normed per key head (q * dk^-0.5), then per value
                                    head S = e^g S; S += k (beta (v - S^T k))^T (in place);
                                    o = S^T q. grid: (Hv, dv / BV), each program S[:, BV]

and for prompts, the sequential part of the chunked rule (delta_net.delta_chunked computes the
rest with batched matmuls and a triangular solve):

    chunk_scan(u0, w, inner, qg, kg, dend, S)   per chunk c in order: u = u0 - w S;
                                    o = qg S + inner u; S = dend S + kg^T u. One launch,
                                    grid (H, dv / CHUNK_SCAN_BV), S[:, BV] in registers

or, where flash-linear-attention (`fla-core`, an optional GPU package) is installed, the whole
chunked rule through its kernels (fla_rule: its chunk_gated_delta_rule, the kernels HF
transformers' Qwen3.5/3.6 and Qwen3-Next use on CUDA).

and the glue around the rule, a launch each on CUDA: delta_gates (beta and the log decay g
from the [T, 2 Hv] product of the gates' rows), gated_norm (each head's RMS norm times silu of
its output gate).

Legend: C conv channels 2*Hk*dk + Hv*dv, K kernel, Hk / Hv key / value heads, dk = dv.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.kernels.gpu.decode_ops import _check, _f32, _pow2, _use_kernels
from strata.kernels.torch_ops import delta_rule_step, rms_norm
from strata.kernels.tuning import (
    CHUNK_SCAN_BV,
    CHUNK_SCAN_STAGES,
    CONV_STEP_BLOCK,
    DELTA_STEP_TILE,
)


def conv_step(x: torch.Tensor, window: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [C], window [K-1, C] (updated), w [C, K], all f32 contiguous -> y [C] f32."""
    C, K = w.shape
    for name, t, shape in (("x", x, (C,)), ("window", window, (K - 1, C)), ("w", w, (C, K))):
        _f32(t, name, shape)
        _check(t.is_contiguous() and t.device == x.device, f"{name} must be contiguous")
    if not _use_kernels(x):
        full = torch.cat([window, x[None]])  # [K, C]
        y = (full.T * w).sum(-1)
        window.copy_(full[1:])
        return F.silu(y)
    from strata.kernels.gpu.delta_kernels import _conv_step_kernel

    y = torch.empty_like(x)
    _conv_step_kernel[(-(-C // CONV_STEP_BLOCK),)](x, window, w, y, C, K=K,
                                                     BLOCK=CONV_STEP_BLOCK)
    return y


def delta_step(x: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor | None,
               state: torch.Tensor, hk: int, tiled: bool, eps: float,
               gates: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
               ) -> torch.Tensor:
    """x [C] (after the conv), g, beta [Hv], state [Hv, dk, dv] (updated), f32 contiguous;
    value head j reads key head j % hk (tiled) or j // (Hv / hk) -> o [Hv, dv] f32. gates:
    (ba [2 Hv], a, dt_bias [Hv]) in place of g and beta (None): the gates computed inside the
    same launch, as delta_gates computes them."""
    hv, dk, dv = state.shape
    _check(dk == dv and hv % hk == 0, "state must be [Hv, dk, dk] with Hv a multiple of hk")
    if gates is not None:
        _check(g is None and beta is None, "delta_step: gates or g and beta, not both")
        ba, a, dt_bias = gates
        if not _use_kernels(x):  # (delta_gates checks them)
            (beta,), (g,) = delta_gates(ba[None], a, dt_bias)
            gates = None
        else:
            _gate_args(ba[None], a, dt_bias)
    for name, t, shape in (("x", x, ((2 * hk + hv) * dk,)), ("g", g, (hv,)),
                           ("beta", beta, (hv,)), ("state", state, (hv, dk, dv))):
        if t is None:  # (gates: their logits instead)
            continue
        _f32(t, name, shape)
        _check(t.is_contiguous() and t.device == x.device, f"{name} must be contiguous")
    r = hv // hk
    if not _use_kernels(x):
        key = hk * dk
        q, k = x[:key].view(hk, dk), x[key:2 * key].view(hk, dk)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + eps) * dk ** -0.5
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + eps)
        if r > 1:
            q, k = ((y.repeat(r, 1) if tiled else y.repeat_interleave(r, 0)) for y in (q, k))
        o, S = delta_rule_step(state, q, k, x[2 * key:].view(hv, dv), g, beta)
        state.copy_(S)
        return o
    from strata.kernels.gpu.delta_kernels import _delta_step_kernel

    bv, warps = DELTA_STEP_TILE
    out = torch.empty(hv, dv, dtype=torch.float32, device=x.device)
    bk = 1 << max(dk - 1, 0).bit_length()
    extra = {}
    if gates is not None:  # (g: beta's and alpha's logits; beta unread)
        ba, a, dt_bias = gates
        g = beta = ba
        extra = dict(GATES=True, a=a, dt_bias=dt_bias, HV=hv)
    _delta_step_kernel[(hv, -(-dv // bv))](x, g, beta, state, out, eps, dk ** -0.5, HK=hk, R=r,
                                            DK=dk, DV=dv, TILED=tiled, BK=bk, BV=bv, **extra,
                                            num_warps=warps)
    return out


def _tiles_fit(chunk: int, dk: int) -> bool:
    """The scan kernel's tiles: tl.dot wants powers of two of at least 16."""
    return all(n >= 16 and n & (n - 1) == 0 for n in (chunk, dk))


def chunk_scan_applies(t: torch.Tensor, chunk: int, dk: int) -> bool:
    """chunk_scan runs for tensors like `t` (CUDA, or Triton's interpreter) at this chunk and
    head dim; elsewhere the caller's torch loop does its work."""
    return _use_kernels(t) and _tiles_fit(chunk, dk)


def chunk_scan(u0: torch.Tensor, w: torch.Tensor, inner: torch.Tensor, qg: torch.Tensor,
               kg: torch.Tensor, dend: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """u0 [H, n, L, dv], w, qg, kg [H, n, L, dk], inner [H, n, L, L], dend [H, n] (e^G at each
    chunk's end), state [H, dk, dv], f32 -> (out [H, n, L, dv], the new state). In float32
    (tl.dot in "ieee": no tf32 rounding)."""
    H, n, L, dv = u0.shape
    dk = w.shape[-1]
    _check(_tiles_fit(L, dk), f"chunk {L} and head dim {dk} must be powers of two >= 16")
    _check(_use_kernels(u0), "chunk_scan runs on CUDA (or under Triton's interpreter)")
    u0, w, inner, qg, kg, dend = (t.contiguous() for t in (u0, w, inner, qg, kg, dend))
    for name, t, shape in (("u0", u0, (H, n, L, dv)), ("w", w, (H, n, L, dk)),
                           ("inner", inner, (H, n, L, L)), ("qg", qg, (H, n, L, dk)),
                           ("kg", kg, (H, n, L, dk)), ("dend", dend, (H, n)),
                           ("state", state, (H, dk, dv))):
        _f32(t, name, shape)
    S = state.contiguous().clone()
    out = torch.empty_like(u0)
    from strata.kernels.gpu.delta_kernels import _chunk_scan_kernel

    _chunk_scan_kernel[(H, -(-dv // CHUNK_SCAN_BV))](u0, w, inner, qg, kg, dend, S, out, n,
                                                      DK=dk, DV=dv, L=L, BV=CHUNK_SCAN_BV,
                                                      num_stages=CHUNK_SCAN_STAGES)
    return out, S


def delta_gates(ba: torch.Tensor, a: torch.Tensor,
                dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ba [T, 2 Hv] (beta's logits, then alpha's), a, dt_bias [Hv], f32 contiguous -> beta =
    sigmoid(ba[:, :Hv]), g = a * softplus(ba[:, Hv:] + dt_bias), each [T, Hv]: one launch on
    CUDA (four elementwise ones in torch)."""
    t, hv = _gate_args(ba, a, dt_bias)
    if not _use_kernels(ba):
        return torch.sigmoid(ba[:, :hv]), a * F.softplus(ba[:, hv:] + dt_bias)
    from strata.kernels.gpu.delta_kernels import _gates_kernel

    beta = torch.empty((t, hv), dtype=torch.float32, device=ba.device)
    g = torch.empty_like(beta)
    if t:
        _gates_kernel[(t,)](ba, a, dt_bias, beta, g, hv, BLOCK=_pow2(hv))
    return beta, g


def _gate_args(ba: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor) -> tuple[int, int]:
    """delta_gates' checks -> (T, Hv)."""
    t, hv2 = ba.shape
    hv = hv2 // 2
    for name, x, shape in (("ba", ba, (t, 2 * hv)), ("a", a, (hv,)), ("dt_bias", dt_bias, (hv,))):
        _f32(x, name, shape)
        _check(x.is_contiguous() and x.device == ba.device, f"{name} must be contiguous")
    return t, hv


def gated_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """o, z [N, dv] (each token's heads as rows), w [dv], f32 contiguous -> rms_norm(o, w, eps)
    * silu(z) [N, dv]: the Gated DeltaNet's output gate, one launch on CUDA."""
    n, dv = o.shape
    for name, x, shape in (("o", o, (n, dv)), ("z", z, (n, dv)), ("w", w, (dv,))):
        _f32(x, name, shape)
        _check(x.is_contiguous() and x.device == o.device, f"{name} must be contiguous")
    if not _use_kernels(o):
        return rms_norm(o, w, eps) * F.silu(z)
    from strata.kernels.gpu.delta_kernels import _gated_norm_kernel

    out = torch.empty_like(o)
    if n:
        _gated_norm_kernel[(n,)](o, z, w, out, dv, eps, BLOCK=_pow2(dv))
    return out


_FLA: list = []


def fla_rule():  # noqa: ANN201 (fla's chunk_gated_delta_rule, or None)
    """fla's chunk_gated_delta_rule where `fla` imports (pip install fla-core), else None:
    o, S = rule(q, k, v, g, beta, scale=, initial_state=, output_final_state=True) with
    q, k [1, T, H, dk], v [1, T, Hv, dv], g (log decay), beta [1, T, Hv], S [1, Hv, dk, dv]."""
    if not _FLA:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        except Exception:  # noqa: BLE001 (not installed, or built for another triton/torch)
            chunk_gated_delta_rule = None
        _FLA.append(chunk_gated_delta_rule)
    return _FLA[0]
