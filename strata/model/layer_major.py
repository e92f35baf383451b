"""Layer-major prefill: one sequence's long prompt layer by layer instead of chunk by chunk.

Chunk-major (MoETransformer.forward once per chunk) sends each chunk through every layer: where a
layer's experts stream through the ring, every chunk copies them all again (an 8K prompt in 8
chunks copies the model's experts 8 times). Layer-major keeps the whole prompt's hidden states
between layers and runs every chunk through a layer before the next layer:

    x = embed(tokens)                               [T, D]
    per layer:
      per chunk c, in order:  r_c = layer.begin(x[c], delta[c], ctx_c)
                              attention appends chunk c's KV rows and reads those of the
                              chunks before it (the cache's length is set to c's start);
                              a recurrent state moves past chunk c
      the routed experts:     out = run_experts over every chunk's tokens     [T, D]
                              once: the executor computes them in windows its scratch holds,
                              each streamed expert copied once (OffloadExperts.run)
      per chunk c:            delta[c] = layer.finish(r_c, ctx_c with out[c] ready)
    logits = head(x, delta)                         [1, V]; [T, V] chunk by chunk

The layer's parts are the same calls as a chunk-major pass's; only where the experts' sum comes
from changes (Segments.ready). Live beside one chunk's tensors: x, delta, the experts' input and
output, four [T, D] float32 tensors (and the routing, [T, K] twice).

Legend: T prompt tokens, D hidden, K experts a token, V vocab; c a chunk's rows.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from strata.experts.compute import windows
from strata.model.layers import rope_tables
from strata.model.parts import Layer, Segment, Segments
from strata.runtime.waits import PROGRESS, to_device


def forward_layers(model, tokens: torch.Tensor, kv, chunk: int,  # noqa: ANN001
                   all_logits: bool = False, marks: object | None = None) -> torch.Tensor:
    """model: the MoETransformer; tokens [T] of one sequence, appended to kv (KVCache or
    LatentCache, not paged) -> logits float32: [T, V] when all_logits, else the last
    position's [1, V]. marks.after(i) after layer i and after the head."""
    T, base = tokens.shape[0], kv.length
    cuts = windows(T, chunk)  # the chunks (the last one shorter)
    kv.reserve(base + T)  # (the storage grows before any layer writes past base)
    model.experts.before_pass(T)
    timer = model.gpu_timer()
    t0 = timer.start() if timer else None
    positions = to_device(torch.arange(base, base + T), model.device)
    cfg = model.cfg
    cos, sin = rope_tables(positions, cfg.rope_dim, cfg.rope_theta, cfg.yarn)
    whole = model.context([Segment(kv, T)], cos, sin, timer)  # (the experts' and the head's)
    ctxs = [model.context([Segment(kv, b - a)], cos[a:b], sin[a:b], timer, start=base + a)
            for a, b in cuts]
    x = model.w.embed.rows(tokens.to(model.device))  # [T, D]
    delta = None  # [T, D]: each layer's output, added by the next residual step
    try:
        for i, layer in enumerate(model.layers):
            delta = _layer(layer, x, delta, kv, base, cuts, ctxs, whole)
            if marks is not None:
                marks.after(i)
    finally:
        kv.length = base  # (each chunk set it to its start)
    if model.hidden_hook is not None:  # (before advance, as forward's)
        model.hidden_hook([Segment(kv, T)], x if delta is None else x + delta)
    kv.advance(T)
    if all_logits:  # chunk by chunk: [T, V] is the output's size, not a chunk's
        logits = torch.cat([model.head.forward(x[a:b], None if delta is None else delta[a:b],
                                               c) for (a, b), c in zip(cuts, ctxs, strict=True)])
    else:
        logits = model.head.forward(x, delta, whole, rows=to_device(torch.tensor([T - 1]),
                                                                    model.device))
    if marks is not None:
        marks.after(len(model.layers))
    if timer:
        timer.stop(t0)
    return logits


def _layer(layer: Layer, x: torch.Tensor, delta: torch.Tensor | None, kv, base: int,  # noqa: ANN001
           cuts: list[tuple[int, int]], ctxs: list[Segments], whole: Segments) -> torch.Tensor:
    """Every chunk through one layer: x [T, D] updated in place, the layer's output returned
    ([T, D], in delta's storage where there is one: each chunk's old rows were added to x by
    its begin before any finish writes them)."""
    rs = []
    for c, ((a, b), ctx) in enumerate(zip(cuts, ctxs, strict=True)):
        PROGRESS.at("prompt", layer=layer.index, chunk=c, position=base + a)
        kv.length = base + a
        rs.append(layer.begin(x[a:b], None if delta is None else delta[a:b], ctx))
    kv.length = base
    ready: list[torch.Tensor | None] = [None] * len(cuts)
    if layer.ffn.routed:  # the routed experts once, over every chunk's tokens
        h = torch.cat([r.h for r in rs])  # [T, D]
        rs = [r._replace(h=h[a:b]) for r, (a, b) in zip(rs, cuts, strict=True)]
        out = whole.run_experts(layer.ffn.layer, layer.ffn.lw.experts, h,
                                torch.cat([r.ids for r in rs]), torch.cat([r.wts for r in rs]))
        ready = [out[a:b] for a, b in cuts]
    if delta is None:
        delta = torch.empty_like(x)
    for r, (a, b), ctx, rows in zip(rs, cuts, ctxs, ready, strict=True):
        delta[a:b] = layer.finish(r, ctx if rows is None else replace(ctx, ready=rows))
    return delta
