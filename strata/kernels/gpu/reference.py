"""Pure-torch references for every kernel here: dequantize (strata.quant, bit-exact with gguf-py)
then float32 matmul. Tests compare the fused kernels against these."""

from __future__ import annotations

import torch

from strata.kernels.torch_ops import expert_mlp, glu
from strata.quant import QType, dequantize


def matmul_ref(x: torch.Tensor, w: torch.Tensor, qtype: int | QType) -> torch.Tensor:
    """y[t, n] = Σ_k x[t, k] · W[n, k] in float32. x [M, K], w uint8 [N, row_nbytes(K)]."""
    return x.float() @ dequantize(w, qtype, x.shape[1]).T


def moe_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
            slot_of_expert: torch.Tensor, gate_slots: torch.Tensor, up_slots: torch.Tensor,
            down_slots: torch.Tensor, qtypes: tuple[int, int, int], d_model: int,
            d_expert: int, x8: bool = False,
            bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
            act: str = "swiglu") -> torch.Tensor:
    """float32 [T, D]: Σ over resident pairs of weights[t, k] · down(silu(gate x) · up x),
    one pair at a time (the slow, obvious order); with bias (gate, up [E, F], down [E, D]) and
    act, torch_ops.expert_mlp of the pair's expert instead. x8: as moe_forward's x8, x rounded
    to 8 bits (round8) for a gate and up both Q4_K, IQ2_XS or IQ3_XXS, and h for a Q4_K, Q6_K,
    IQ2_XS or IQ3_XXS down (calls without bias only); for an all-MXFP4 expert (with or without
    bias) x and h both (the MXFP4 kernels take the routing weight into h before its rounding,
    this reference after: they differ by that rounding's order)."""
    qg, qu, qd = qtypes
    out = torch.zeros(x.shape[0], d_model, dtype=torch.float32, device=x.device)
    xf = x.float()
    mx8 = x8 and qg == qu == qd == QType.MXFP4
    if mx8 or x8 and qg == qu and qg in (QType.Q4_K, QType.IQ2_XS, QType.IQ3_XXS):
        xf = round8(xf)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            s = int(slot_of_expert[int(ids[t, k])])
            if s < 0:
                continue
            e = int(ids[t, k])
            if bias is not None and mx8:
                bg, bu, bd = (b[e].float() for b in bias)
                h = glu(dequantize(gate_slots[s], qg, d_model) @ xf[t] + bg,
                        dequantize(up_slots[s], qu, d_model) @ xf[t] + bu, act)
                y = dequantize(down_slots[s], qd, d_expert) @ round8(h) + bd
                out[t] += float(weights[t, k]) * y
                continue
            if bias is not None:
                w = (dequantize(gate_slots[s], qg, d_model), dequantize(up_slots[s], qu, d_model),
                     dequantize(down_slots[s], qd, d_expert))
                y = expert_mlp(xf[t:t + 1], *w, *(b[e].float() for b in bias), act)[0]
                out[t] += float(weights[t, k]) * y
                continue
            g = dequantize(gate_slots[s], qg, d_model) @ xf[t]  # [F]
            u = dequantize(up_slots[s], qu, d_model) @ xf[t]
            h = torch.nn.functional.silu(g) * u
            if mx8 or x8 and qd in (QType.Q4_K, QType.Q6_K, QType.IQ2_XS, QType.IQ3_XXS):
                h = round8(h)
            out[t] += float(weights[t, k]) * (dequantize(down_slots[s], qd, d_expert) @ h)
    return out


def round8(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] float32 (K a multiple of 32) rounded to 8 bits per 32 values, as ggml's
    q8 activations: d = max|x| / 127, x̂ = d · round(x (127 / max|x|)) (halves to even; both
    quotients rounded to nearest, as quantize_x's)."""
    v = x.float().reshape(*x.shape[:-1], -1, 32)
    amax = v.abs().amax(-1, keepdim=True)
    # (127 / amax would be torch's reciprocal times 127, an ulp off the quotient at times)
    q = torch.round(v * torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, 0))
    return (q * (amax / 127)).reshape(x.shape)
