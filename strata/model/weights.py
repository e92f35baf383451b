"""Model weights for the reference path.

Dense weights (attention, norms, router, shared expert, output head) are dequantized to float32 on
the target device once at load. Expert tensors and the token embedding stay in their GGUF blocks
(raw bytes: a view of the file's memory map on the CPU, a device copy on CUDA) and are
dequantized on demand, one routed expert or a handful of embedding rows at a time.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from strata.config import ModelConfig, expected_tensors, optional_tensors
from strata.gguf import ModelFile, TensorRef
from strata.kernels.tuning import DENSE_X8_MAX_T, EMBED_ON_HOST, X8_MIN_ROWS
from strata.quant import QType, dequant_rows, dequantize, dequantize_into

log = logging.getLogger("strata")

X8_TYPES = (QType.Q4_K, QType.Q6_K, QType.IQ2_XS, QType.IQ3_XXS)  # gemv_q8.gemv_x8's


@dataclass
class QuantTensor:
    """A tensor kept in its GGUF blocks. raw: uint8 [..., rows, row_nbytes]."""

    raw: torch.Tensor
    qtype: int
    n_cols: int
    fused_max_t: int = 1 << 30  # tokens up to which the fused kernels run (CUDA)
    x8: bool = False  # one token: x rounded to 8 bits for a large matrix of gemv_x8's types
    # (Q4_K, Q6_K, IQ2_XS, IQ3_XXS; --kernels fused); a few: moe_mmq.mmq_matmul_takes's, else
    # dense_x8.gemm_x8_tokens's (Q4_K, Q6_K)
    # the CPU: a 2-D matrix multiplied on ggml's kernels (strata.kernels.cpu.ggml_dense)
    cpu_matmul: Any = None

    @classmethod
    def load(cls, ref: TensorRef, device: torch.device) -> QuantTensor:
        return cls(torch.from_numpy(ref.data()).to(device), ref.qtype, ref.shape[-1])

    def rows(self, index: torch.Tensor | int) -> torch.Tensor:
        """Dequantized rows (or whole experts when raw is 3-D): float32 [..., n_cols]. A table
        in pinned host memory indexed from the device (the token embedding on CUDA,
        embed_on_host) is read by the device over PCIe, into rows on the index's device."""
        if isinstance(index, torch.Tensor) and index.is_cuda and not self.raw.is_cuda:
            from strata.kernels.gpu.host_rows import host_rows

            return dequantize(host_rows(self.raw, index), self.qtype, self.n_cols)
        return dequantize(self.raw[index], self.qtype, self.n_cols)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def fused_for(self, x: torch.Tensor) -> bool:
        """Whether x @ W.T runs the fused kernel: on CUDA, for at most fused_max_t tokens
        (--kernels), where the type has one."""
        return (self.raw.is_cuda and x.shape[0] <= self.fused_max_t
                and fused_matmul_available(self.qtype))

    def _x8_rows(self) -> bool:
        """A 2-D matrix the dp4a kernels read: rows of whole 256-value blocks, contiguous, 4-byte
        aligned (Q4_K: each row; the others read rows 2 mod 4 too)."""
        w = self.raw
        return (w.dim() == 2 and self.n_cols % 256 == 0 and w.stride(1) == 1
                and w.data_ptr() % 4 == 0 and (self.qtype != QType.Q4_K or w.stride(0) % 4 == 0))

    def _x8_for(self, x: torch.Tensor) -> bool:
        """One token, a Q4_K / Q6_K / IQ2_XS / IQ3_XXS matrix of X8_MIN_ROWS rows or more
        (_x8_rows)."""
        return (x.shape[0] == 1 and self.qtype in X8_TYPES and self.raw.shape[0] >= X8_MIN_ROWS
                and self._x8_rows())

    def _x8_tokens_for(self, x: torch.Tensor) -> bool:
        """2 to DENSE_X8_MAX_T tokens over a Q4_K or Q6_K matrix (_x8_rows;
        dense_x8.gemm_x8_tokens)."""
        return (1 < x.shape[0] <= DENSE_X8_MAX_T and self.qtype in (QType.Q4_K, QType.Q6_K)
                and self._x8_rows())

    def matmul_t(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias [N]) for a 2-D W [N, n_cols]: the fused kernel on CUDA where one
        exists (a one-token float32 GEMV adds the bias as it stores), else dequantizing a chunk
        of rows at a time. x: [T, n_cols] -> [T, N]"""
        if self.cpu_matmul is not None and not x.is_cuda:
            return _plus(self.cpu_matmul(x), bias)
        if self.fused_for(x):
            if self.x8 and self._x8_for(x):
                from strata.kernels.gpu.gemv_q8 import gemv_x8

                return _plus(gemv_x8(x, self.raw, self.qtype), bias)
            if self.x8 and x.shape[0] > 1:  # a few tokens over the head: the integer cores
                from strata.kernels.gpu.moe_mmq import mmq_matmul, mmq_matmul_takes

                if mmq_matmul_takes(x, self.raw, self.qtype):
                    return _plus(mmq_matmul(x, self.raw, self.qtype), bias)
                if self._x8_tokens_for(x):  # a batched step's: each row read once for all
                    from strata.kernels.gpu.dense_x8 import gemm_x8_tokens

                    return _plus(gemm_x8_tokens(x, self.raw, self.qtype), bias)
            from strata.kernels.gpu import quant_matmul

            return quant_matmul(x.contiguous(), self.raw, self.qtype, bias=bias)
        n = self.raw.shape[0]
        step = dequant_rows(self.n_cols)
        out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
        for i in range(0, n, step):
            out[:, i:i + step] = x @ self.rows(slice(i, i + step)).T
        return _plus(out, bias)


def _plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias


Weight = torch.Tensor | QuantTensor  # float32 [N, K], or kept in GGUF blocks


def host_table(ref: TensorRef) -> QuantTensor | None:
    """The tensor in pinned host memory (embed_on_host), or None where none could be pinned (it
    then loads on the device, past the plan by its bytes: said once)."""
    try:
        raw = torch.from_numpy(ref.data()).pin_memory()
    except RuntimeError as e:
        log.warning("the token embedding (%s) could not be pinned in host memory (%s): it goes "
                    "on the device, %d MiB past the memory plan", ref.name, e,
                    ref.info.nbytes >> 20)
        return None
    return QuantTensor(raw, ref.qtype, ref.shape[-1])


def embed_on_host(cfg: ModelConfig, device_type: str) -> bool:
    """The token embedding stays in pinned host memory, its rows read by the device
    (tuning.EMBED_ON_HOST): on CUDA, where the output head is a matrix of its own (a tied
    embedding is the head, multiplied every token)."""
    return device_type == "cuda" and EMBED_ON_HOST and not cfg.tied_output


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias [N]: in the GEMV's store where a fused one takes it). x: [T, K] ->
    [T, N]"""
    return _plus(x @ w.T, bias) if isinstance(w, torch.Tensor) else w.matmul_t(x, bias)


def qkv_linear(x: torch.Tensor, lw: LayerWeights, bias: bool = False,
               contiguous: bool = True) -> tuple[torch.Tensor, ...]:
    """x @ wq.T, x @ wk.T, x @ wv.T, with one matmul for those fused into lw.qkv; with bias,
    + bq, bk, bv (one add where the three are fused: lw.bqkv). contiguous=False: the fused
    product's parts as column views of it (rows strided; a batched step's kernels take them
    so), else copies."""
    if lw.qkv is None:
        out = (linear(x, lw.wq), linear(x, lw.wk), linear(x, lw.wv))
    else:
        w, n = lw.qkv
        mats = (lw.wq, lw.wk, lw.wv)
        if n == 2 and _pair_launch(x, w, lw.wv):  # q, k and a v of another type: one launch
            from strata.kernels.gpu.matmul import gemv_pair

            qk, v = gemv_pair(x.contiguous(), (w.raw, w.qtype), (lw.wv.raw, lw.wv.qtype))
            out = (*qk.split([_rows(lw.wq), _rows(lw.wk)], dim=1), v)
        else:
            y = linear(x, w, lw.bqkv if bias else None)
            if bias and lw.bqkv is not None:
                bias = False
            # contiguous: a no-op for one token (its row is), a copy for longer inputs
            parts = y.split([_rows(m) for m in mats[:n]], dim=1)
            out = (*(p.contiguous() if contiguous else p for p in parts),
                   *(linear(x, m) for m in mats[n:]))
    if bias:
        out = (out[0] + lw.bq, out[1] + lw.bk, out[2] + lw.bv)
    return out


def _pair_launch(x: torch.Tensor, a: Weight, b: Weight) -> bool:
    """One token on x's device, and both matrices in blocks that run fused kernels for it
    (QuantTensor.fused_for: --kernels off keeps them off here too): matmul.gemv_pair."""
    return (x.shape[0] == 1 and isinstance(a, QuantTensor) and isinstance(b, QuantTensor)
            and a.fused_for(x) and b.fused_for(x) and a.raw.device == x.device
            and b.raw.device == x.device)


def _rows(w: Weight) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else w.raw.shape[0]


def _same_format(a: Weight, b: Weight) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape[1:] == b.shape[1:])
    return a.qtype == b.qtype and a.n_cols == b.n_cols and a.raw.shape[1:] == b.raw.shape[1:]


def _stack_rows(mats: list[Weight]) -> tuple[Weight, list[Weight]]:
    """One matrix of the rows of mats (one format), and each of mats as a row view of it."""
    if isinstance(mats[0], torch.Tensor):
        fused: Weight = torch.cat(mats)
        data = fused
    else:
        fused = replace(mats[0], raw=torch.cat([m.raw for m in mats]))
        data = fused.raw
    start, views = 0, []
    for m in mats:
        rows = data[start:start + _rows(m)]
        views.append(rows if isinstance(m, torch.Tensor) else replace(m, raw=rows))
        start += _rows(m)
    return fused, views


def fuse_qkvz(dw: DeltaWeights) -> None:
    """A linear layer's qkv and z projections (one format) as one matrix (dw.qkvz), each a row
    view of it: one GEMV for a decode token, where the two read the same normed input."""
    if _same_format(dw.qkv, dw.z):
        dw.qkvz, (dw.qkv, dw.z) = _stack_rows([dw.qkv, dw.z])


def fuse_qkv(lw: LayerWeights) -> None:
    """Put the leading q, k (and v) projections that share a format into one matrix (lw.qkv)
    and make wq, wk (wv) row views of it: the same bytes, one GEMV for a decode token."""
    mats = [lw.wq, lw.wk, lw.wv]
    n = 1
    while n < 3 and _same_format(mats[0], mats[n]):
        n += 1
    if n < 2:
        return
    fused, views = _stack_rows(mats[:n])
    lw.wq, lw.wk = views[0], views[1]
    if n == 3:
        lw.wv = views[2]
        if lw.bq is not None and lw.bk is not None and lw.bv is not None:
            b = torch.cat([lw.bq, lw.bk, lw.bv])
            lw.bq, lw.bk, lw.bv = b.split([len(lw.bq), len(lw.bk), len(lw.bv)])
            lw.bqkv = b
    lw.qkv = (fused, n)


def fuse_router_gate(lw: LayerWeights) -> None:
    """A shared expert's gate row after the router's rows in one matrix (lw.router_gate), the
    router and the gate views of it: one GEMV for the routing logits and the gate's
    (decode_ops.route_topk's and norm_route's gate)."""
    r, g = lw.router, lw.shared_gate
    if (isinstance(r, torch.Tensor) and isinstance(g, torch.Tensor) and r.dim() == 2
            and g.shape == (r.shape[1],) and r.dtype == g.dtype == torch.float32):
        lw.router_gate = torch.cat([r, g[None]]).contiguous()
        lw.router, lw.shared_gate = lw.router_gate[:-1], lw.router_gate[-1]


@functools.cache
def fused_matmul_available(qtype: int) -> bool:
    try:
        from strata.kernels.gpu import has_fused
    except ImportError:
        return False
    return has_fused(qtype)


def dense(ref: TensorRef, device: torch.device) -> torch.Tensor:
    """A whole tensor dequantized to float32 on `device`, in chunks of rows."""
    raw = torch.from_numpy(ref.data())
    flat = raw.reshape(-1, raw.shape[-1])
    out = torch.empty(flat.shape[0], ref.shape[-1], dtype=torch.float32, device=device)
    return dequantize_into(flat, ref.qtype, ref.shape[-1], out).reshape(ref.shape)


@dataclass(frozen=True)
class ExpertBias:
    """The experts' biases and activation beyond plain SwiGLU (gpt-oss): float32 gate, up
    [E, F] and down [E, D]; act "swiglu_oai": the clamped SwiGLU (strata.arch.gpt_oss)."""

    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    act: str = "swiglu_oai"


@dataclass
class ExpertWeights:
    """One layer's routed experts: gate/up [E, F, D] and down [E, D, F], in GGUF blocks;
    bias: their biases and activation where the architecture has them (gpt-oss)."""

    gate: QuantTensor
    up: QuantTensor
    down: QuantTensor
    bias: ExpertBias | None = None

    @property
    def nbytes(self) -> int:
        return self.gate.nbytes + self.up.nbytes + self.down.nbytes


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [D]
    wq: Weight  # [H*hd, D]
    wk: Weight  # [Hkv*hd, D]
    wv: Weight  # [Hkv*hd, D]
    wo: Weight  # [D, H*hd]
    bq: torch.Tensor | None
    bk: torch.Tensor | None
    bv: torch.Tensor | None
    q_norm: torch.Tensor | None  # [hd]
    k_norm: torch.Tensor | None
    ffn_norm: torch.Tensor  # [D]
    router: torch.Tensor | None  # [E, D] (None: a dense feed-forward, ffn_gate/up/down)
    experts: ExpertWeights | None  # None when the offload runtime holds the experts
    shared_gate: torch.Tensor | None = None  # [D]: sigmoid(x . w) scales the shared expert
    # on CUDA, [E + 1, D]: the router's rows, then the shared gate's (router and shared_gate are
    # views of it: fuse_router_gate)
    router_gate: torch.Tensor | None = None
    shared_w1: Weight | None = None  # gate [S, D]
    shared_w3: Weight | None = None  # up [S, D]
    shared_w2: Weight | None = None  # down [D, S]
    # the leading n of q, k, v in one matrix (n = 2 or 3) when they share a format, so a decode
    # token runs one GEMV for them; wq/wk/wv are then row views of it (fuse_qkv)
    qkv: tuple[Weight, int] | None = None
    # q, k and v's biases in one vector where all three are fused (bq, bk, bv its views): one add
    bqkv: torch.Tensor | None = None
    # a dense feed-forward (parts.spec.layer_spec's "dense" layers): gate, up [F, D], down [D, F]
    ffn_gate: Weight | None = None
    ffn_up: Weight | None = None
    ffn_down: Weight | None = None
    # sigmoid routing (glm4moe, deepseek2): added to the router's scores to choose the top K [E]
    router_bias: torch.Tensor | None = None
    # multi-head latent attention (deepseek2; wq is attn_q_b, or attn_q without a q LoRA, and
    # wk, wv are None): q_a [Lq, D] and its norm [Lq], kv_a_mqa [L + R, D] and the latent's
    # norm [L], k_b [H, L, N], v_b [H, V, L] (float32)
    wq_a: Weight | None = None
    q_a_norm: torch.Tensor | None = None
    wkv_a: Weight | None = None
    kv_a_norm: torch.Tensor | None = None
    k_b: torch.Tensor | None = None
    v_b: torch.Tensor | None = None

    # a Gated DeltaNet mixer's weights (parts.delta_net.DeltaWeights; wq .. wo are then None)
    delta: DeltaWeights | None = None
    # gpt-oss: the attention output's bias [D], a sink logit per head [H], the router's logit
    # bias [E] (the experts' own ride on ExpertWeights.bias and, offloaded, ExpertLayout.bias)
    bo: torch.Tensor | None = None
    sinks: torch.Tensor | None = None
    router_logit_bias: torch.Tensor | None = None


@dataclass
class NextNWeights:
    """A nextn (multi-token prediction) layer, kept for speculative decoding: its transformer
    layer, eh_proj [D, 2D] over [enorm(embedding); hnorm(hidden)], and its head's norm (and
    head and embedding where the file has its own)."""

    layer: LayerWeights
    eh_proj: Weight
    enorm: torch.Tensor  # [D]
    hnorm: torch.Tensor  # [D]
    head_norm: torch.Tensor | None
    head: Weight | None = None  # [V, D] (None: the model's output head)
    embed: QuantTensor | None = None  # [V, D] (None: the model's embedding)


@dataclass
class ModelWeights:
    embed: QuantTensor  # [V, D] in blocks; rows dequantized per token
    layers: list[LayerWeights]
    output_norm: torch.Tensor  # [D]
    output: Weight  # [V, D]
    nextn: list[NextNWeights] = field(default_factory=list)  # after the layers (glm4moe)
    # MTP blocks (hybrid qwen35moe): each block's tensors by name without "blk.N.", in blocks
    mtp: list[dict[str, QuantTensor]] = field(default_factory=list)

    @classmethod
    def load(cls, mf: ModelFile, cfg: ModelConfig, device: torch.device, quant_dense: bool = False,
             experts: bool = True, fused_max_t: int = 1 << 30,
             x8: bool = False, cpu_ggml: bool = False) -> ModelWeights:
        """quant_dense keeps matrices in their GGUF blocks (dequantized per use) to save memory;
        experts=False leaves the routed experts to the offload runtime; x8: QuantTensor.x8;
        cpu_ggml: those matrices multiplied on ggml's CPU kernels (QuantTensor.cpu_matmul)."""
        from strata.config_hybrid import ffn_norm_name
        from strata.model.parts.spec import layer_spec  # (parts import this module)

        t = mf.tensors
        # the tensors config.check_tensors checked: one beyond them (a shared expert or a bias in
        # one layer only, which the metadata does not describe) is not read
        known = expected_tensors(cfg) | optional_tensors(cfg)

        def d(name: str) -> torch.Tensor:
            return dense(t[name], device)

        def m(name: str) -> Weight:
            if not quant_dense:
                return d(name)
            qt = QuantTensor.load(t[name], device)
            qt.fused_max_t, qt.x8 = fused_max_t, x8
            if cpu_ggml:
                from strata.kernels.cpu.ggml_dense import GgmlMatmul
                from strata.kernels.cpu.ggml_lib import supported

                if qt.raw.dim() == 2 and supported(qt.qtype):
                    qt.cpu_matmul = GgmlMatmul(qt.raw, qt.qtype, qt.n_cols)
            return qt

        def opt(name: str, matrix: bool = False) -> Weight | None:
            return (m(name) if matrix else d(name)) if name in t and name in known else None

        layers = []
        # (glm4moe / deepseek2's nextn layers load as layers; a hybrid's MTP blocks stay raw)
        for i in range(cfg.n_layers + (0 if cfg.full_attn_interval else cfg.n_nextn)):
            p = f"blk.{i}."
            ffn_norm = d(p + ffn_norm_name(cfg) + ".weight")
            if cfg.kv_lora:
                attn = _mla_weights(cfg, p, d, m, opt) | dict(
                    attn_norm=d(p + "attn_norm.weight"), ffn_norm=ffn_norm)
            elif layer_spec(cfg, i).mixer == "delta":  # hybrid models' linear layers
                attn = dict(attn_norm=d(p + "attn_norm.weight"), wq=None, wk=None, wv=None,
                            wo=None, bq=None, bk=None, bv=None, q_norm=None, k_norm=None,
                            ffn_norm=ffn_norm, delta=load_delta(cfg, p, d, m))
            else:
                attn = dict(attn_norm=d(p + "attn_norm.weight"), wq=m(p + "attn_q.weight"),
                            wk=m(p + "attn_k.weight"), wv=m(p + "attn_v.weight"),
                            wo=m(p + "attn_output.weight"), bq=opt(p + "attn_q.bias"),
                            bk=opt(p + "attn_k.bias"), bv=opt(p + "attn_v.bias"),
                            q_norm=opt(p + "attn_q_norm.weight"),
                            k_norm=opt(p + "attn_k_norm.weight"), ffn_norm=ffn_norm)
            if layer_spec(cfg, i).ffn == "dense":
                layers.append(LayerWeights(
                    **attn, router=None, experts=None, ffn_gate=m(p + "ffn_gate.weight"),
                    ffn_up=m(p + "ffn_up.weight"), ffn_down=m(p + "ffn_down.weight")))
                continue
            ex = ExpertWeights(*(QuantTensor.load(t[p + f"ffn_{w}_exps.weight"], device)
                                 for w in ("gate", "up", "down")),
                               bias=expert_bias(mf, cfg, i, device)) if experts else None
            if cfg.moe_bias:
                attn |= dict(bo=d(p + "attn_output.bias"),
                             router_logit_bias=d(p + "ffn_gate_inp.bias"))
            if cfg.attn_sinks:
                attn["sinks"] = d(p + "attn_sinks.weight")
            layers.append(LayerWeights(
                **attn, router=d(p + "ffn_gate_inp.weight"), experts=ex,
                shared_gate=opt(p + "ffn_gate_inp_shexp.weight"),
                shared_w1=opt(p + "ffn_gate_shexp.weight", True),
                shared_w3=opt(p + "ffn_up_shexp.weight", True),
                shared_w2=opt(p + "ffn_down_shexp.weight", True),
                router_bias=opt(p + "exp_probs_b.bias"),
            ))
        if device.type == "cuda":  # (on the CPU the matrices stay views of the file's pages)
            for lw in layers:
                if lw.wk is not None:  # (MLA and Gated DeltaNet layers have no k / v)
                    fuse_qkv(lw)
                if lw.delta is not None:
                    fuse_qkvz(lw.delta)
                fuse_router_gate(lw)
        layers, nextn_layers = layers[:cfg.n_layers], layers[cfg.n_layers:]
        nextn = []
        for i, lw in enumerate(nextn_layers, cfg.n_layers):
            p = f"blk.{i}.nextn."
            nextn.append(NextNWeights(
                lw, m(p + "eh_proj.weight"), d(p + "enorm.weight"), d(p + "hnorm.weight"),
                opt(p + "shared_head_norm.weight"), opt(p + "shared_head_head.weight", True),
                QuantTensor.load(t[p + "embed_tokens.weight"], device)
                if p + "embed_tokens.weight" in t else None))
        ref = t["token_embd.weight"]
        embed = host_table(ref) if embed_on_host(cfg, device.type) else None
        if embed is None:
            embed = QuantTensor.load(ref, device)
        output = m("token_embd.weight" if cfg.tied_output else "output.weight")
        # a hybrid model's MTP blocks (cfg.n_nextn) kept as they are in the file (views of its
        # pages), unused by the forward: speculative decoding reads them
        mtp = [{n[len(f"blk.{j}."):]: QuantTensor.load(ref, torch.device("cpu"))
                for n, ref in t.items() if n.startswith(f"blk.{j}.") and n in known}
               for j in range(cfg.n_layers, cfg.n_layers + cfg.n_nextn)
               ] if cfg.full_attn_interval else []
        return cls(embed, layers, d("output_norm.weight"), output, nextn, mtp)


def expert_bias(mf: ModelFile, cfg: ModelConfig, layer: int,
                device: torch.device) -> ExpertBias | None:
    """Layer `layer`'s expert biases and activation (gpt-oss), float32 on `device`; None for an
    architecture with plain SwiGLU experts."""
    if not cfg.moe_bias:
        return None
    p = f"blk.{layer}."
    g, u, dn = (dense(mf.tensors[p + f"ffn_{w}_exps.bias"], device) for w in ("gate", "up", "down"))
    return ExpertBias(g, u, dn, cfg.expert_act)


def _mla_weights(cfg: ModelConfig, p: str, d, m, opt) -> dict:  # noqa: ANN001 (load's readers)
    """Layer p's latent attention weights (LayerWeights fields); an older file's attn_kv_b
    [H * (N + V), L] is split into k_b [H, L, N] and v_b [H, V, L] here."""
    H, N, V = cfg.n_heads, cfg.head_dim - cfg.rope_dim, cfg.d_v
    if cfg.mla_split:
        k_b, v_b = d(p + "attn_k_b.weight"), d(p + "attn_v_b.weight")
    else:
        kv_b = d(p + "attn_kv_b.weight").view(H, N + V, cfg.kv_lora)
        k_b, v_b = kv_b[:, :N].transpose(1, 2).contiguous(), kv_b[:, N:].contiguous()
    lora = cfg.q_lora > 0
    return dict(wq=m(p + ("attn_q_b.weight" if lora else "attn_q.weight")), wk=None, wv=None,
                wo=m(p + "attn_output.weight"), bq=None, bk=None, bv=None, q_norm=None,
                k_norm=None, wq_a=m(p + "attn_q_a.weight") if lora else None,
                q_a_norm=opt(p + "attn_q_a_norm.weight"), wkv_a=m(p + "attn_kv_a_mqa.weight"),
                kv_a_norm=d(p + "attn_kv_a_norm.weight"), k_b=k_b, v_b=v_b)


# ---- a Gated DeltaNet layer's weights (hybrid models: config_hybrid, parts/delta_net.py) ----


@dataclass
class DeltaWeights:
    """One linear layer's weights, the value heads in the file's order (`tiled`: value head j
    reads key head j % Hk, else j // (Hv/Hk))."""

    qkv: Weight  # [C, D]: q [Hk*dk], k [Hk*dk], v [Hv*dv]
    z: Weight  # [Hv*dv, D] the output gate
    ba: torch.Tensor  # [2 Hv, D] float32: beta's Hv rows, then alpha's (one launch for both)
    conv: torch.Tensor  # [C, K]
    dt_bias: torch.Tensor  # [Hv]
    a: torch.Tensor  # [Hv] = -exp(A_log)
    norm: torch.Tensor  # [dv]
    out: Weight  # [D, Hv*dv]
    tiled: bool
    qkvz: Weight | None = None  # qkv's rows then z's, both views of it (fuse_qkvz; CUDA)


def take_rows(w: Weight, rows: torch.Tensor) -> Weight:
    """The rows `rows` of a matrix, dense or in GGUF blocks (each row is whole blocks)."""
    return w[rows] if isinstance(w, torch.Tensor) else replace(w, raw=w.raw[rows])


def load_delta(cfg: ModelConfig, p: str, d, m) -> DeltaWeights:  # noqa: ANN001 (loaders)
    """Layer `p`'s weights (d: a float32 tensor, m: a matrix, by tensor name). qwen3next's
    ssm_in / ssm_ba interleave q, k, v, z (and beta, alpha) per key head: their rows are taken
    apart here, once."""
    hk, hv, dk = cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state
    r = hv // hk
    if cfg.ssm_layout == "next":
        w = m(p + "ssm_in.weight")  # per key head: q dk, k dk, v r*dk, z r*dk rows
        block = torch.arange(hk)[:, None] * (2 * dk + 2 * r * dk)

        def span(lo: int, n: int) -> torch.Tensor:  # rows lo .. lo+n of every key head's block
            return (block + lo + torch.arange(n)).flatten()

        qkv = take_rows(w, torch.cat([span(0, dk), span(dk, dk), span(2 * dk, r * dk)]))
        z = take_rows(w, span(2 * dk + r * dk, r * dk))
    else:
        qkv, z = m(p + "attn_qkv.weight"), m(p + "attn_gate.weight")
    if cfg.ssm_layout == "qwen35":  # (Hv rows each: float32 like the router)
        beta, alpha = d(p + "ssm_beta.weight"), d(p + "ssm_alpha.weight")
    else:  # ssm_ba: per key head r betas, then r alphas
        ba = d(p + "ssm_ba.weight")
        block = torch.arange(hk)[:, None] * (2 * r)
        beta = take_rows(ba, (block + torch.arange(r)).flatten())
        alpha = take_rows(ba, (block + r + torch.arange(r)).flatten())
    return DeltaWeights(qkv, z, torch.cat([beta, alpha]), d(p + "ssm_conv1d.weight"),
                        d(p + "ssm_dt.bias"),
                        d(p + "ssm_a"), d(p + "ssm_norm.weight"), m(p + "ssm_out.weight"),
                        tiled=cfg.ssm_layout == "qwen35")
