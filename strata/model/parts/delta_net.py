"""The Gated DeltaNet mixer of the hybrid models (qwen35moe, qwen3next; config_hybrid.py says
how their files hold it): linear attention whose state is a matrix S [dk, dv] per value head.

    qkv = conv1d(W_qkv h) over the last K inputs, then silu     short causal conv, per channel
    q, k = l2norm(q), l2norm(k); q *= dk^-0.5                   each key head, then shared by
                                                                Hv/Hk value heads
    g = ssm_a * softplus(W_a h + dt_bias)    (log decay, <= 0)  beta = sigmoid(W_b h)
    S = exp(g) S;  S += k (beta (v - S^T k))^T;  o = S^T q      the gated delta rule, per token
    out = W_out (rms_norm(o, ssm_norm) * silu(W_z h))           the gated RMS norm, per head

The rule runs in two forms that agree: recurrent (one token at a time: decode) and chunked
(DELTA_CHUNK tokens at once through a triangular solve: prompts). Each sequence's conv window
and S live in its DeltaState (KVCache.state), layer `self.slot` of them.

Legend: T tokens, D hidden, C conv channels 2*Hk*dk + Hv*dv, Hk key heads, Hv value heads,
dk = dv head dim, K conv kernel, L chunk length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.config import ModelConfig
from strata.kernels.torch_ops import delta_rule_step
from strata.kernels.tuning import DELTA_CHUNK, DELTA_FLA
from strata.model.layers import rms_norm
from strata.model.parts.context import Context, Segments, StaticStep, decode_ops
from strata.model.weights import DeltaWeights, linear


def l2norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, state: torch.Tensor,
                    keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time. q, k [T, H, dk] (q scaled), v [T, H, dv],
    g, beta [T, H], state [H, dk, dv] -> (o [T, H, dv], the new state). keep [T, H, dk, dv]:
    written with the state after each token (a verify window's rollback)."""
    S, out = state, []
    for t in range(q.shape[0]):
        o, S = delta_rule_step(S, q[t], k[t], v[t], g[t], beta[t])
        out.append(o)
        if keep is not None:
            keep[t] = S
    return torch.stack(out), S


def delta_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, state: torch.Tensor, chunk: int = DELTA_CHUNK,
                  kernel: bool = False,
                  fla: bool = DELTA_FLA) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule over chunks of `chunk` tokens. Within a chunk, with G the cumulative log
    decay and S0 the state before it, the new values U solve (I + A) U = beta V - beta e^G K S0,
    A[i, j] = beta_i e^(G_i - G_j) k_i.k_j (j < i); then
        O   = (e^G Q) S0 + ((Q K^T) * e^(G_i - G_j), j <= i) U
        S_L = e^G_L S0 + (e^(G_L - G) K)^T U
    Arguments as delta_recurrent's; T need not be a multiple of `chunk` (the tail is padded
    with tokens that neither decay nor write the state). kernel: the scan over the chunks in
    one Triton launch (delta_ops.chunk_scan: CUDA, --kernels fused) where it applies; with fla
    too, the whole rule through flash-linear-attention's kernels where it is installed
    (delta_ops.fla_rule; q arrives scaled, so its scale is 1)."""
    T, H, dk = k.shape
    if kernel and fla and q.is_cuda:
        from strata.kernels.gpu import delta_ops

        rule = delta_ops.fla_rule()
        if rule is not None:
            o, S = rule(q[None], k[None], v[None], g[None], beta[None], scale=1.0,
                        initial_state=state[None].contiguous(), output_final_state=True)
            return o[0], S[0]
    pad = -T % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    # [H, n, L, ...]
    q, k, v = (x.transpose(0, 1).reshape(H, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.transpose(0, 1).reshape(H, n, chunk) for x in (g, beta))
    G = g.cumsum(-1)  # [H, n, L]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * decay.tril(-1)  # [H, n, L, L] strictly lower
    eye = torch.eye(chunk, device=q.device)
    rhs = torch.cat([v * beta[..., None], kb * G.exp()[..., None]], dim=-1)
    sol = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    u0, w = sol[..., :v.shape[-1]], sol[..., v.shape[-1]:]  # U = u0 - w S0
    inner = (q @ k.transpose(-1, -2)) * decay  # [H, n, L, L]
    qg = q * G.exp()[..., None]
    kg = k * (G[..., -1:] - G).exp()[..., None]
    if kernel:
        from strata.kernels.gpu import delta_ops

        if delta_ops.chunk_scan_applies(u0, chunk, dk):
            o, S = delta_ops.chunk_scan(u0, w, inner, qg, kg, G[..., -1].exp(), state)
            return o.reshape(H, n * chunk, -1)[:, :T].transpose(0, 1), S
    S, out = state, []
    for c in range(n):
        u = u0[:, c] - w[:, c] @ S  # [H, L, dv]
        out.append(qg[:, c] @ S + inner[:, c] @ u)
        S = S * G[:, c, -1].exp()[:, None, None] + kg[:, c].transpose(-1, -2) @ u
    o = torch.stack(out, 1).reshape(H, n * chunk, -1)[:, :T]  # [H, T, dv]
    return o.transpose(0, 1), S


class GatedDeltaNet:
    def __init__(self, cfg: ModelConfig, lw, layer: int):  # noqa: ANN001 (LayerWeights)
        self.w: DeltaWeights = lw.delta
        self.layer = layer
        # this layer's index among the linear ones: its rows of DeltaState
        self.slot = sum(cfg.is_linear(i) for i in range(layer))
        self.hk, self.hv, self.dk = cfg.ssm_groups, cfg.ssm_heads, cfg.ssm_state
        self.eps = cfg.rms_eps

    def forward(self, h: torch.Tensor, ctx: Context) -> torch.Tensor:
        """h [T, D] -> [T, D]; each sequence's DeltaState moves past its tokens."""
        w, T = self.w, h.shape[0]
        if w.qkvz is not None:  # one product for both (weights.fuse_qkvz)
            y = linear(h, w.qkvz)
            c = y.shape[1] - self.hv * self.dk
            qkv, z = y[:, :c], y[:, c:].reshape(T, self.hv, self.dk)  # [T, C], [T, Hv, dv]
        else:
            qkv = linear(h, w.qkv)  # [T, C]
            z = linear(h, w.z).view(T, self.hv, self.dk)
        fast = ctx.static or ctx.fused_attention  # (a launch each on CUDA: delta_ops)
        gates = None
        if fast:  # beta and alpha's rows in one product, then both gates
            from strata.kernels.gpu import delta_ops

            ba = decode_ops().router_logits(h, w.ba)  # [T, 2 Hv]
            if ctx.static and ctx.rows is None:  # one token: the gates in the step's launch
                g = beta = None
                gates = (ba[0], w.a, w.dt_bias)
            else:
                beta, g = delta_ops.delta_gates(ba, w.a, w.dt_bias)  # [T, Hv] each
        else:
            ba = h @ w.ba.T
            beta = torch.sigmoid(ba[:, :self.hv])  # [T, Hv]
            g = w.a * F.softplus(ba[:, self.hv:] + w.dt_bias)  # [T, Hv]
        if ctx.static:
            o = self._step(qkv, g, beta, ctx, gates)
        else:
            o = self._segments(qkv, g, beta, ctx)
        if fast:  # each token's heads as rows: norm and output gate together
            o = delta_ops.gated_norm(o.reshape(-1, self.dk).contiguous(),
                                     z.reshape(-1, self.dk).contiguous(), w.norm, self.eps)
        else:
            o = rms_norm(o, w.norm, self.eps) * F.silu(z)  # [T, Hv, dv]
        return linear(o.reshape(T, -1), w.out)

    def _segments(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  ctx: Segments) -> torch.Tensor:
        if ctx.real is not None:  # a padded chunk: its padding neither decays nor writes S
            g, beta = g * ctx.real[:, None], beta * ctx.real[:, None]
        out, start = [], 0
        for s in ctx.segments:
            sl, st = slice(start, start + s.length), s.kv.state
            rec = st.window if st.recording else None  # a verify window: keep every state
            if rec is not None:
                if rec.tokens != s.length:
                    raise ValueError(f"a verify window of {rec.tokens} tokens ran {s.length}")
                full = torch.cat([st.conv[self.slot], qkv[sl]])  # [K-1+t, C]
                k1 = st.conv.shape[1]
                for t in range(s.length):  # the conv window after token t
                    rec.conv[t, self.slot] = full[t + 1:t + 1 + k1]
            x = self._conv(qkv[sl], st.conv[self.slot], ctx.last)  # [t, C]
            q, k, v = self._heads(x)
            if s.length == 1 or rec is not None:  # (a window: token by token, as decode)
                o, S = delta_recurrent(q, k, v, g[sl], beta[sl], st.ssm[self.slot],
                                       None if rec is None else rec.ssm[:, self.slot])
            else:
                o, S = delta_chunked(q, k, v, g[sl], beta[sl], st.ssm[self.slot],
                                     kernel=ctx.fused_attention)
            st.ssm[self.slot] = S
            out.append(o)
            start += s.length
        return torch.cat(out)  # [T, Hv, dv]

    def _step(self, qkv: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor | None,
              ctx: StaticStep, gates: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """One token over the sequence's static state, updated in place (two launches on CUDA,
        kernels/gpu/delta_ops.py: no host sync, shapes fixed, so a CUDA graph captures it);
        gates: (ba [2 Hv], a, dt_bias) in place of g and beta, computed in the step's launch."""
        if ctx.rows is not None:  # one token of each of B sequences (the batched step)
            return self._rows(qkv, g, beta, ctx)
        from strata.kernels.gpu import delta_ops

        st = ctx.kv.state
        x = delta_ops.conv_step(qkv[0].contiguous(), st.conv[self.slot], self.w.conv)
        if gates is not None:
            o = delta_ops.delta_step(x, None, None, st.ssm[self.slot], self.hk, self.w.tiled,
                                     self.eps, gates=gates)
        else:
            o = delta_ops.delta_step(x, g[0].contiguous(), beta[0].contiguous(),
                                     st.ssm[self.slot], self.hk, self.w.tiled, self.eps)
        return o[None]  # [1, Hv, dv]

    def _rows(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              ctx: StaticStep) -> torch.Tensor:
        """One token of each of B sequences, each with its own state entry of the pool (gathered,
        moved one token as delta_recurrent does, written back; torch ops, graph safe).
        qkv [B, C], g, beta [B, Hv] -> o [B, Hv, dv]"""
        r = ctx.rows
        conv, ssm = r.pool.conv[self.slot], r.pool.ssm[self.slot]  # [S, K-1, C], [S, ...]
        full = torch.cat([conv[r.state], qkv[:, None]], dim=1)  # [B, K, C]
        x = F.silu((full * self.w.conv.T[None]).sum(1))  # the causal conv's last output [B, C]
        conv.index_copy_(0, r.state, full[:, 1:].contiguous())
        q, k, v = self._heads(x)  # [B, Hv, dk], [B, Hv, dk], [B, Hv, dv]
        o, S = delta_rule_step(ssm[r.state], q, k, v, g, beta)  # S [B, Hv, dk, dv]
        ssm.index_copy_(0, r.state, S)
        return o

    def _conv(self, x: torch.Tensor, window: torch.Tensor,
              last: torch.Tensor | None = None) -> torch.Tensor:
        """The causal depthwise conv of x [t, C] after the window's K-1 inputs [K-1, C], then
        silu; the window moves to the last K-1 inputs (in place): those up to row `last` (int64
        [1] on the device) of a padded chunk."""
        t = x.shape[0]
        full = torch.cat([window, x])  # [K-1+t, C]
        # one multiply-add per tap (K = 4) rather than F.conv1d, whose CUDA setup (cuDNN) takes
        # device memory outside the allocator and the plan: with this and fla's prompt kernels
        # (no torch.linalg solve) Qwen3.6-35B-A3B at a 4 GiB budget peaked at 3.5 GiB of device
        # memory on an H100, 5.3 before (bench/2026-12-06-h100-matrix.md)
        y = full[:t] * self.w.conv[:, 0]
        for j in range(1, self.w.conv.shape[1]):
            y += full[j:j + t] * self.w.conv[:, j]
        if last is None:
            window.copy_(full[t:])
        else:  # rows last+1 .. last+K-1 of full: the K-1 inputs before row last+1
            k1 = window.shape[0]
            window.copy_(full.index_select(0, last + 1 + torch.arange(k1, device=x.device)))
        return F.silu(y)

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [t, C] -> q, k [t, Hv, dk] (normed, shared by each key head's value heads; q
        scaled), v [t, Hv, dv]."""
        t, key = x.shape[0], self.hk * self.dk
        q = l2norm(x[:, :key].reshape(t, self.hk, self.dk), self.eps)
        k = l2norm(x[:, key:2 * key].reshape(t, self.hk, self.dk), self.eps)
        v = x[:, 2 * key:].reshape(t, self.hv, self.dk)
        r = self.hv // self.hk
        if r > 1:
            q, k = ((y.repeat(1, r, 1) if self.w.tiled else y.repeat_interleave(r, dim=1))
                    for y in (q, k))
        return q * self.dk ** -0.5, k, v
