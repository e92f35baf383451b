"""The layer's parts (strata.model.parts), each against a plain torch reference written out here
(loops over heads and tokens, no shared code), in both contexts: segments (prompt chunks and
batched decode) and the static decode step (its CPU path: the same ops the graphs capture)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from strata.config import ModelConfig
from strata.experts import ReferenceExperts
from strata.model.layers import rope_tables
from strata.model.parts import Head, Layer, Segment, Segments, StaticStep, layer_spec
from strata.model.parts.attention import GQAAttention
from strata.model.parts.ffn import DenseFFN, RoutedExperts, Routing
from strata.model.parts.norm import SharedRows, add_norm
from strata.model.weights import ExpertWeights, LayerWeights, QuantTensor, fuse_router_gate
from strata.quant import QType
from strata.runtime.kv_cache import KVCache

# D hidden, H / Hkv heads (GQA 2:1), hd head dim, E experts, K used, F expert hidden
D, H, HKV, HD, E, K, F, S = 32, 4, 2, 8, 5, 2, 12, 10
EPS = 1e-6
CFG = ModelConfig(arch="qwen3moe", n_layers=1, d_model=D, n_heads=H, n_kv_heads=HKV,
                  head_dim=HD, n_vocab=50, context_length=64, rms_eps=EPS, rope_theta=1e4,
                  rope_dim=HD, rope_style="neox", n_experts=E, n_experts_used=K, d_expert=F,
                  d_shared=0, norm_topk=True, qkv_bias=False, qk_norm=True, tied_output=False)


def rand(gen: torch.Generator, *shape: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=gen) * std


def f32_blocks(t: torch.Tensor) -> QuantTensor:
    """A float32 tensor as GGUF F32 blocks (raw bytes), as an expert tensor is held."""
    return QuantTensor(t.contiguous().view(torch.uint8), int(QType.F32), t.shape[-1])


def weights(gen: torch.Generator, cfg: ModelConfig = CFG, shared: bool = False,
            dense: bool = False) -> LayerWeights:
    s = D ** -0.5
    lw = LayerWeights(
        attn_norm=1 + 0.1 * rand(gen, D), wq=rand(gen, H * HD, D, std=s),
        wk=rand(gen, HKV * HD, D, std=s), wv=rand(gen, HKV * HD, D, std=s),
        wo=rand(gen, D, H * HD, std=(H * HD) ** -0.5),
        bq=rand(gen, H * HD) if cfg.qkv_bias else None,
        bk=rand(gen, HKV * HD) if cfg.qkv_bias else None,
        bv=rand(gen, HKV * HD) if cfg.qkv_bias else None,
        q_norm=1 + 0.1 * rand(gen, HD) if cfg.qk_norm else None,
        k_norm=1 + 0.1 * rand(gen, HD) if cfg.qk_norm else None,
        ffn_norm=1 + 0.1 * rand(gen, D), router=None if dense else rand(gen, E, D),
        experts=None if dense else ExpertWeights(
            f32_blocks(rand(gen, E, F, D, std=s)), f32_blocks(rand(gen, E, F, D, std=s)),
            f32_blocks(rand(gen, E, D, F, std=F ** -0.5))))
    if shared:
        lw.shared_gate = rand(gen, D, std=s)
        lw.shared_w1, lw.shared_w3 = rand(gen, S, D, std=s), rand(gen, S, D, std=s)
        lw.shared_w2 = rand(gen, D, S, std=S ** -0.5)
    if dense:
        lw.ffn_gate, lw.ffn_up = rand(gen, F, D, std=s), rand(gen, F, D, std=s)
        lw.ffn_down = rand(gen, D, F, std=F ** -0.5)
    return lw


# ---- plain references, written out ---------------------------------------------------------------


def ref_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * w


def ref_rope(x: torch.Tensor, pos: int, style: str) -> torch.Tensor:
    """One head's vector [hd] at position pos, pair by pair."""
    out = x.clone()
    half = HD // 2
    for i in range(half):
        angle = pos * 1e4 ** (-2 * i / HD)
        c, s = math.cos(angle), math.sin(angle)
        a, b = (i, i + half) if style == "neox" else (2 * i, 2 * i + 1)
        out[a] = x[a] * c - x[b] * s
        out[b] = x[b] * c + x[a] * s
    return out


def ref_attention(lw: LayerWeights, h: torch.Tensor, pos0: int, past: tuple | None,
                  cfg: ModelConfig = CFG) -> tuple[torch.Tensor, tuple]:
    """h [T, D] at positions pos0.. after `past` (keys, values of earlier positions) -> the
    mixer's output [T, D] and every key and value so far ([pos0 + T, Hkv, hd] each)."""
    T = h.shape[0]
    q = (h @ lw.wq.T + (lw.bq if cfg.qkv_bias else 0)).view(T, H, HD)
    k = (h @ lw.wk.T + (lw.bk if cfg.qkv_bias else 0)).view(T, HKV, HD)
    v = (h @ lw.wv.T + (lw.bv if cfg.qkv_bias else 0)).view(T, HKV, HD)
    if cfg.qk_norm:
        q, k = ref_norm(q, lw.q_norm), ref_norm(k, lw.k_norm)
    q = torch.stack([torch.stack([ref_rope(q[t, j], pos0 + t, cfg.rope_style)
                                  for j in range(H)]) for t in range(T)])
    k = torch.stack([torch.stack([ref_rope(k[t, j], pos0 + t, cfg.rope_style)
                                  for j in range(HKV)]) for t in range(T)])
    keys = k if past is None else torch.cat([past[0], k])
    values = v if past is None else torch.cat([past[1], v])
    out = torch.zeros(T, H * HD)
    for t in range(T):
        for j in range(H):
            g = j // (H // HKV)  # the kv head this query head reads
            seen = pos0 + t + 1
            scores = keys[:seen, g] @ q[t, j] / math.sqrt(HD)
            out[t, j * HD:(j + 1) * HD] = torch.softmax(scores, 0) @ values[:seen, g]
    return out @ lw.wo.T, (keys, values)


def ref_swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
               down: torch.Tensor) -> torch.Tensor:
    a = h @ gate.T
    return (a * torch.sigmoid(a) * (h @ up.T)) @ down.T


def ref_routed(lw: LayerWeights, h: torch.Tensor, norm_topk: bool = True) -> torch.Tensor:
    """Token by token: softmax over E, the top K (renormalized), Σ w * swiglu_e; + shared."""
    g, u, d = (t.raw.view(torch.float32) for t in (lw.experts.gate, lw.experts.up,
                                                    lw.experts.down))
    out = torch.zeros_like(h)
    for t in range(h.shape[0]):
        p = torch.softmax(h[t] @ lw.router.T, 0)
        w, ids = torch.topk(p, K)
        if norm_topk:
            w = w / w.sum()
        for wk, e in zip(w, ids.tolist(), strict=True):
            out[t] += wk * ref_swiglu(h[t:t + 1], g[e], u[e], d[e])[0]
        if lw.shared_w1 is not None:
            gate = torch.sigmoid(h[t] @ lw.shared_gate)
            out[t] += gate * ref_swiglu(h[t:t + 1], lw.shared_w1, lw.shared_w3, lw.shared_w2)[0]
    return out


# ---- contexts ------------------------------------------------------------------------------------


def segments(kv: KVCache, n: int, cfg: ModelConfig = CFG) -> Segments:
    pos = torch.arange(kv.length, kv.length + n)
    cos, sin = rope_tables(pos, cfg.rope_dim, cfg.rope_theta)
    return Segments([Segment(kv, n)], cos, sin, ReferenceExperts())


def static_step(kv: KVCache, cfg: ModelConfig = CFG, unsummed: bool = False) -> StaticStep:
    """unsummed: the experts hand back each pair's row, [T, K, D], where the layer does not ask
    for the sum (as moe_forward's decode kernels do on CUDA)."""
    from strata.kernels.gpu import decode_ops as ops

    ex = ReferenceExperts()
    lw_of = {}

    def experts(layer, h, ids, wts, sum_pairs):  # noqa: ANN001, ANN202
        if unsummed and not sum_pairs:
            return torch.stack([ex.run(layer, lw_of[layer].experts, h, ids[:, k:k + 1],
                                       wts[:, k:k + 1]) for k in range(ids.shape[1])], 1)
        return ex.run(layer, lw_of[layer].experts, h, ids, wts)

    ctx = StaticStep(kv, torch.tensor([kv.length]), torch.tensor([kv.length + 1]),
                     ops.rope_inv_freq(cfg.rope_dim, cfg.rope_theta, "cpu"),
                     torch.zeros(1, dtype=torch.int32), True, lambda i: None, experts)
    ctx.lw_of = lw_of  # (the test's: which weights the experts callable reads)
    return ctx


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


# ---- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", [
    CFG,  # qwen3moe: q/k norms, neox pairs
    replace(CFG, arch="qwen2moe", qk_norm=False, qkv_bias=True),  # biases
    replace(CFG, arch="llama", qk_norm=False, rope_style="normal"),  # adjacent pairs
])
def test_gqa_attention_against_the_written_out_reference(cfg):
    """A prompt of 5 tokens, then one more in each context: the mixer's output and the KV rows
    it stored are the reference's; the static step (decode_ops' CPU path) agrees with it."""
    gen = torch.Generator().manual_seed(1)
    lw = weights(gen, cfg)
    mixer = GQAAttention(cfg, lw, 0)
    kv = KVCache(1, HKV, HD, torch.device("cpu"), 16)
    h = rand(gen, 6, D)
    got = mixer.forward(h[:5], segments(kv, 5, cfg))
    kv.advance(5)
    want, past = ref_attention(lw, h[:5], 0, None, cfg)
    assert close(got, want) and close(kv.k[0][:5], past[0]) and close(kv.v[0][:5], past[1])
    want6, every = ref_attention(lw, h[5:], 5, past, cfg)
    for ctx in (segments(kv, 1, cfg), static_step(kv, cfg)):
        got6 = mixer.forward(h[5:], ctx)
        assert close(got6, want6), type(ctx).__name__
        assert close(kv.k[0][:6], every[0]) and close(kv.v[0][:6], every[1])


def test_routed_experts_against_the_written_out_reference():
    """Routing and experts (with and without the shared expert, renormalized or not), in a
    segments context and, for one token, the static step's."""
    gen = torch.Generator().manual_seed(2)
    for shared in (False, True):
        for norm_topk in (True, False):
            cfg = replace(CFG, norm_topk=norm_topk)
            lw = weights(gen, cfg, shared=shared)
            ffn = RoutedExperts(cfg, lw, 0)
            x, attn = rand(gen, 3, D), rand(gen, 3, D)
            kv = KVCache(1, HKV, HD, torch.device("cpu"), 4)
            x1 = x.clone()
            r = ffn.begin(x1, attn, segments(kv, 3))
            assert torch.equal(x1, x + attn)  # the residual step, in place
            h = ref_norm(x + attn, lw.ffn_norm)
            assert close(r.h, h) and r.ids.shape == (3, K)
            assert close(ffn.finish(r, segments(kv, 3)), ref_routed(lw, h, norm_topk))
            ctx = static_step(kv)
            ctx.lw_of[0] = lw
            x1 = x[:1].clone()
            r = ffn.begin(x1, attn[:1], ctx)
            assert close(ffn.finish(r, ctx), ref_routed(lw, h[:1], norm_topk))


def test_dense_ffn_against_a_hand_written_swiglu():
    """The dense feed-forward (architectures whose first layers are dense): norm, then
    down(silu(gate h) * up h), in both contexts."""
    gen = torch.Generator().manual_seed(3)
    lw = weights(gen, dense=True)
    ffn = DenseFFN(CFG, lw, 0)
    assert not ffn.routed and ffn.shared is None
    x, attn = rand(gen, 4, D), rand(gen, 4, D)
    kv = KVCache(1, HKV, HD, torch.device("cpu"), 4)
    for ctx, n in ((segments(kv, 4), 4), (static_step(kv), 1)):
        x1 = x[:n].clone()
        r = ffn.begin(x1, attn[:n], ctx)
        assert r.ids is None and torch.equal(x1, x[:n] + attn[:n])
        h = ref_norm(x[:n] + attn[:n], lw.ffn_norm)
        assert close(ffn.finish(r, ctx), ref_swiglu(h, lw.ffn_gate, lw.ffn_up, lw.ffn_down))


def test_a_dense_layer_is_built_where_the_spec_says():
    gen = torch.Generator().manual_seed(4)
    assert layer_spec(CFG, 0).ffn == "routed" and layer_spec(CFG, 0).mixer == "gqa"
    layer = Layer(0, GQAAttention(CFG, weights(gen, dense=True), 0),
                  DenseFFN(CFG, weights(gen, dense=True), 0), 1 + rand(gen, D), EPS)
    kv = KVCache(1, HKV, HD, torch.device("cpu"), 4)
    out = layer.forward(rand(gen, 2, D), None, segments(kv, 2))
    assert out.shape == (2, D) and torch.isfinite(out).all()


def test_add_norm_in_both_contexts():
    gen = torch.Generator().manual_seed(5)
    x, delta, w = rand(gen, 1, D), rand(gen, 1, D), 1 + rand(gen, D)
    kv = KVCache(1, HKV, HD, torch.device("cpu"), 4)
    for ctx in (segments(kv, 1), static_step(kv)):
        x1 = x.clone()
        assert close(add_norm(x1, None, w, EPS, ctx), ref_norm(x, w))
        assert close(add_norm(x1, delta, w, EPS, ctx), ref_norm(x + delta, w))
        assert torch.equal(x1, x + delta)


def test_shared_rows_add_as_one_more_row():
    """A static step's K routed rows unsummed with the shared expert's row beside them
    (norm.SharedRows): every residual step adds them bit for bit as the rows joined into K + 1
    would be (the fused step's order), the head with all rows or picked ones, and strata
    check's token_rows reads them so."""
    from strata.cli.check import token_rows
    from strata.model.parts.norm import SharedRows

    gen = torch.Generator().manual_seed(7)
    x, rows, shared, w = rand(gen, 1, D), rand(gen, 1, 3, D), rand(gen, 1, D), 1 + rand(gen, D)
    joined = torch.cat([rows, shared[:, None]], 1)
    kv = KVCache(1, HKV, HD, torch.device("cpu"), 4)
    for ctx in (segments(kv, 1), static_step(kv)):
        x1, x2 = x.clone(), x.clone()
        h1 = add_norm(x1, SharedRows(rows, shared), w, EPS, ctx)
        h2 = add_norm(x2, joined if ctx.static else joined.sum(1), w, EPS, ctx)
        assert torch.equal(x1, x2) if ctx.static else close(x1, x2)
        assert close(h1, h2)
    assert torch.equal(x + SharedRows(rows, shared).total(),
                       x + (rows[:, 0] + rows[:, 1] + rows[:, 2] + shared))
    assert (token_rows(SharedRows(rows, shared)) == token_rows(joined)).all()
    head = Head(1 + rand(gen, D), rand(gen, 7, D), EPS)
    xs, rs, ss = rand(gen, 3, D), rand(gen, 3, 2, D), rand(gen, 3, D)
    total = rs[:, 0] + rs[:, 1] + ss
    want = ref_norm(xs + total, head.norm) @ head.weight.T
    for ctx in (segments(kv, 3), static_step(kv)):
        assert close(head.forward(xs.clone(), SharedRows(rs, ss), ctx), want)
        assert close(head.forward(xs.clone(), SharedRows(rs, ss), ctx, rows=torch.tensor([1])),
                     want[1:2])
    picked = SharedRows(rs, ss).index_select(0, torch.tensor([2, 0]))
    assert torch.equal(picked.total(), total[[2, 0]])


def test_a_layer_gives_the_same_token_in_both_contexts():
    """One layer (mixer, routed experts, shared expert) over a 4-token prompt, then a token
    through Layer.forward with segments and through begin / finish in a static step: the same
    output and the same residual; Head's rows pick positions."""
    gen = torch.Generator().manual_seed(6)
    lw = weights(gen, shared=True)
    layer = Layer.build(CFG, lw, 0)
    assert isinstance(layer.ffn, RoutedExperts) and layer.ffn.shared is not None
    tokens = rand(gen, 5, D)
    outs = []
    for static in (False, True, "unsummed", "joint"):
        if static == "joint":  # the router and the shared gate one matrix, as on CUDA
            fuse_router_gate(lw)
            assert lw.router_gate is not None and lw.router.data_ptr() == lw.router_gate.data_ptr()
            layer = Layer.build(CFG, lw, 0)
        kv = KVCache(1, HKV, HD, torch.device("cpu"), 8)
        layer.forward(tokens[:4].clone(), None, segments(kv, 4))
        kv.advance(4)
        x = tokens[4:].clone()
        if static:
            ctx = static_step(kv, unsummed=static == "unsummed")
            ctx.lw_of[0] = lw
            r = layer.begin(x, None, ctx)
            assert isinstance(r, Routing)
            # the gate's sigmoid from the routing launch where the matrices are joined
            assert (r.shared_w is not None) == (static == "joint")
            if r.shared_w is not None:
                assert close(r.shared_w, torch.sigmoid(r.h @ lw.shared_gate[:, None]))
            out = layer.finish(r, ctx)
            # the experts' K rows unsummed: the shared expert's row rides beside them
            assert isinstance(out, SharedRows) == (static == "unsummed")
            outs.append((out.total() if isinstance(out, SharedRows) else out, x))
        else:
            outs.append((layer.forward(x, None, segments(kv, 1)), x))
    for out, x in outs[1:]:
        assert close(outs[0][0], out) and close(outs[0][1], x)
    head = Head(1 + rand(gen, D), rand(gen, 7, D), EPS)
    x, delta = rand(gen, 3, D), rand(gen, 3, D)
    kv = KVCache(1, HKV, HD, torch.device("cpu"), 4)
    every = head.forward(x.clone(), delta, segments(kv, 3))
    assert close(every, ref_norm(x + delta, head.norm) @ head.weight.T)
    assert close(head.forward(x.clone(), delta, segments(kv, 3), rows=torch.tensor([2])),
                 every[2:])
