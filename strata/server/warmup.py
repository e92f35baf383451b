"""The engine's first passes, run at load instead of in the first request: a short prompt, a few
decode steps of one sequence (on CUDA: the first step compiles and warms every kernel, the
second captures the step's graphs on the pooled KV storage every later request reuses, the third
replays them), one prompt of each bucket the prompt graphs took (strata.engine.chunk_graph: its
first chunk runs and captures it, so a request's chunk replays) and, with --spec, one verify
window of each size they took, and one batched decode pass of two sequences. Then the expert
counters go back to zero, so /health and /metrics count requests only.

The routing of the warm-up's tokens is seen by the cache policy like any other (a few dozen
tokens; the policy's counts halve as requests come)."""

from __future__ import annotations

import time
from typing import Any

import torch

from strata.model.parts import Segment

PROMPT_TOKENS = 32  # a prompt chunk that takes the prompt path (over 4 tokens on every device)
DECODE_STEPS = 3  # eager, capture, replay


def warm_up(engine: Any) -> float:
    """-> seconds taken. Leaves no state behind but the kernels built and the graphs captured."""
    t0 = time.perf_counter()
    model = engine.model
    text = engine.tokenizer.encode("Strata warms up its kernels and decode graphs. " * 8)
    ids = _tokens(text, PROMPT_TOKENS)
    kv = model.new_cache(PROMPT_TOKENS + DECODE_STEPS + 1)
    engine.run_prompt(ids, kv)
    for t in ids[:DECODE_STEPS]:
        model.decode(t, kv)
    chunks = getattr(model, "chunks", None)
    if chunks is not None and chunks.why is None:
        for size in chunks.buckets:  # (a prompt of the bucket's size lands in that bucket)
            if kv.limit is not None and size + 1 > kv.limit:
                break
            bucket_kv = model.new_cache(size + 1)
            engine.run_prompt(_tokens(text, size), bucket_kv)
            del bucket_kv
        for n in range(1, chunks.windows + 1):  # --spec: a verify window of each size
            window_kv = model.new_cache(n + 1)
            model.forward(torch.tensor(ids[:n]), [Segment(window_kv, n)], all_logits=True)
            del window_kv
    other = model.new_cache(PROMPT_TOKENS + 2)
    engine.run_prompt(ids[::-1], other)
    with torch.inference_mode():
        model.forward(torch.tensor(ids[:2]), [Segment(kv, 1), Segment(other, 1)])
    del kv, other  # (their storage back to the decode step's pool)
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    stats = getattr(model.experts, "stats", None)
    if hasattr(stats, "reset"):
        stats.reset()
    return time.perf_counter() - t0


def _tokens(text: list[int], n: int) -> list[int]:
    """n tokens: the text's, repeated as often as it takes."""
    return (text * (n // max(len(text), 1) + 1))[:n]
