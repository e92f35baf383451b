"""Quant recipes: which GGML type each tensor gets, mimicking community GGUF files.

A recipe is a name, optionally followed by overrides: `Q4_K_M,blk.1.ffn_*_exps=IQ1_M,output=Q8_0`
(fnmatch patterns on tensor names; later ones win). Norms, biases and routers stay F32 as in
llama.cpp's quantizer. A type whose block does not divide a tensor's rows falls back the way
llama.cpp falls back (Q4_K -> Q5_0, Q6_K -> Q8_0, low-bit IQ -> IQ4_NL, ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fnmatch import fnmatchcase

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from strata.errors import StrataError

_LAYER = re.compile(r"^blk\.(\d+)\.")

# role of a tensor (from its name) -> type, for a uniform recipe of base type `t`
Rule = Callable[[str, int, int], Q]  # (role, layer, n_layers) -> type


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's use_more_bits: the first and last eighth of the layers, and every third."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def _uniform(t: Q, embd: Q | None = None, output: Q | None = None) -> Rule:
    def rule(role: str, layer: int, n_layers: int) -> Q:
        return {"embd": embd or t, "output": output or t}.get(role, t)
    return rule


def _k_mix(expert: Q, attn: Q, more: Q, embd: Q, output: Q) -> Rule:
    """The *_K_M pattern: attn_v and ffn_down get `more` bits on llama.cpp's chosen layers."""
    def rule(role: str, layer: int, n_layers: int) -> Q:
        if role in ("embd", "output"):
            return embd if role == "embd" else output
        if role in ("attn_v", "down") and _more_bits(layer, n_layers):
            return more
        return expert if role in ("gate", "up", "down") else attn
    return rule


def _iq(expert: Q, attn: Q = Q.Q4_K) -> Rule:
    """Low-bit community packs: experts at `expert`, attention at `attn`, head at Q6_K."""
    def rule(role: str, layer: int, n_layers: int) -> Q:
        if role in ("gate", "up", "down"):
            return expert
        return {"embd": Q.Q4_K, "output": Q.Q6_K, "attn_v": Q.Q6_K}.get(role, attn)
    return rule


def _iq2_xs_mix(role: str, layer: int, n_layers: int) -> Q:
    """IQ2_XS experts with the last layers at IQ1_M and one at Q4_K: a mixed pack by layer."""
    if role in ("gate", "up", "down"):
        if layer >= n_layers - max(1, n_layers // 16):
            return Q.IQ1_M
        return Q.Q4_K if layer == n_layers // 2 else Q.IQ2_XS
    return _iq(Q.IQ2_XS)(role, layer, n_layers)


_ALL = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K,
        Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS,
        Q.MXFP4, Q.F16, Q.BF16, Q.F32]


def _every_type(role: str, layer: int, n_layers: int) -> Q:
    """Each layer's gate, up and down (and attention) in different types, cycling over them all."""
    order = ["gate", "up", "down", "attn_q", "attn_k", "attn_v", "attn_o", "embd", "output",
             "shexp"]
    return _ALL[(3 * layer + order.index(role)) % len(_ALL)]


RECIPES: dict[str, Rule] = {
    "F32": _uniform(Q.F32), "F16": _uniform(Q.F16), "BF16": _uniform(Q.BF16),
    "Q8_0": _uniform(Q.Q8_0),
    "Q4_0": _uniform(Q.Q4_0, output=Q.Q6_K), "Q4_1": _uniform(Q.Q4_1, output=Q.Q6_K),
    "Q5_0": _uniform(Q.Q5_0, output=Q.Q6_K), "Q5_1": _uniform(Q.Q5_1, output=Q.Q6_K),
    "Q2_K": _k_mix(Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q2_K, Q.Q6_K),
    "Q3_K_M": _k_mix(Q.Q3_K, Q.Q3_K, Q.Q5_K, Q.Q3_K, Q.Q6_K),
    "Q4_K_M": _k_mix(Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K, Q.Q6_K),
    "Q5_K_M": _k_mix(Q.Q5_K, Q.Q5_K, Q.Q6_K, Q.Q5_K, Q.Q6_K),
    "Q6_K": _uniform(Q.Q6_K),
    "IQ4_XS": _iq(Q.IQ4_XS, Q.IQ4_XS), "IQ4_NL": _iq(Q.IQ4_NL, Q.IQ4_NL),
    "IQ3_XXS": _iq(Q.IQ3_XXS), "IQ3_S": _iq(Q.IQ3_S), "IQ2_S": _iq(Q.IQ2_S),
    "IQ2_XS": _iq(Q.IQ2_XS), "IQ2_XXS": _iq(Q.IQ2_XXS),
    "IQ1_M": _iq(Q.IQ1_M), "IQ1_S": _iq(Q.IQ1_S),
    "MXFP4": _iq(Q.MXFP4, Q.Q8_0),
    "IQ2_XS-MIX": _iq2_xs_mix,
    "ALL-TYPES": _every_type,
}

# where a type's block does not divide the row length (llama.cpp's fallbacks)
_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0,
             Q.IQ1_S: Q.IQ4_NL, Q.IQ1_M: Q.IQ4_NL, Q.IQ2_XXS: Q.IQ4_NL, Q.IQ2_XS: Q.IQ4_NL,
             Q.IQ2_S: Q.IQ4_NL, Q.IQ3_XXS: Q.IQ4_NL, Q.IQ3_S: Q.IQ4_NL, Q.IQ4_XS: Q.IQ4_NL}

_ROLES = {"token_embd": "embd", "output": "output", "attn_q": "attn_q", "attn_k": "attn_k",
          "attn_v": "attn_v", "attn_output": "attn_o", "ffn_gate_exps": "gate",
          "ffn_up_exps": "up", "ffn_down_exps": "down", "ffn_gate_shexp": "shexp",
          "ffn_up_shexp": "shexp", "ffn_down_shexp": "shexp",
          # dense first layers and nextn's projection (glm4moe, deepseek2): dense matrices
          "ffn_gate": "shexp", "ffn_up": "shexp", "ffn_down": "shexp", "eh_proj": "shexp",
          # deepseek2's latent attention (k_b / v_b stay F32, as 3-D tensors)
          "attn_q_a": "attn_q", "attn_q_b": "attn_q", "attn_kv_a_mqa": "attn_k",
          # hybrid linear attention: its projections take the attention's types
          "attn_qkv": "attn_q", "attn_gate": "attn_q", "ssm_in": "attn_q", "ssm_out": "attn_o"}


class Recipe:
    def __init__(self, spec: str):
        name, *overrides = [s.strip() for s in spec.split(",")]
        if name.upper() not in RECIPES:
            raise StrataError(f"--quant {spec}: unknown recipe {name!r} (choose from "
                              f"{', '.join(RECIPES)})")
        self.name, self.rule = name.upper(), RECIPES[name.upper()]
        self.overrides: list[tuple[str, Q]] = []
        for o in overrides:
            pattern, _, tname = o.partition("=")
            if tname.upper() not in Q.__members__ or Q[tname.upper()] not in _ALL:
                raise StrataError(f"--quant {spec}: {o!r} must be PATTERN=TYPE with TYPE one of "
                                  f"{', '.join(t.name for t in _ALL)}")
            self.overrides.append((pattern, Q[tname.upper()]))

    def type_for(self, name: str, shape: tuple[int, ...], n_layers: int) -> Q:
        base = name.removesuffix(".weight").removesuffix(".bias")
        role = _ROLES.get(base.split(".")[-1])
        if role is None or len(shape) == 1 or name.endswith(".bias"):
            return Q.F32  # norms, biases (gpt-oss's experts' too), routers, the shared gate
        m = _LAYER.match(name)
        t = self.rule(role, int(m[1]) if m else 0, n_layers)
        for pattern, ot in self.overrides:
            if fnmatchcase(name, pattern) or fnmatchcase(base, pattern):
                t = ot
        while shape[-1] % GGML_QUANT_SIZES[t][0]:
            t = _FALLBACK.get(t, Q.F16)
        return t
