"""strata perplexity: perplexity of a model on a text file, measured as llama.cpp's
llama-perplexity measures it, so the two can be set side by side.

The text is tokenized whole (the model's BOS rule; special-token text stays text unless
--parse-special), cut into chunks of --ctx tokens (512 unless given), and each chunk runs from
an empty KV cache. Only the second half of each chunk is scored: position j predicts token j + 1 for
j = ctx/2 .. ctx - 2, so every scored token sees at least ctx/2 tokens before it. Where the model
adds a BOS token, each chunk's first token is replaced by BOS. PPL = exp(mean NLL) over every
scored token; the +/- is the standard error of the mean NLL carried through exp (as
llama-perplexity prints it).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

from strata.cli.engine_flags import add_engine_arguments, engine_config, refuse_spec, warn_unused
from strata.engine.generator import Engine
from strata.errors import StrataError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file (any shard of a split set)")
    p.add_argument("--file", required=True, type=Path, help="the text to score")
    p.add_argument("--chunks", type=int, default=-1,
                   help="chunks scored at most (default -1: all)")
    p.add_argument("--parse-special", action="store_true",
                   help="turn special-token text such as <|im_end|> into its token")
    add_engine_arguments(p, ctx_help="tokens a chunk scores over, its KV cache too (512)")


def chunk_nll(engine: Engine, chunk: list[int]) -> np.ndarray:
    """The negative log-likelihoods of the chunk's second half, as llama-perplexity scores it."""
    first = len(chunk) // 2
    kv = engine.model.new_cache(len(chunk))
    logits = engine.run_prompt(chunk, kv, all_logits=True).float()  # [ctx, V]
    logp = torch.log_softmax(logits[first:-1].double(), dim=-1)
    target = torch.tensor(chunk[first + 1:], device=logp.device)
    return (-logp.gather(1, target[:, None])[:, 0]).cpu().numpy()


def perplexity(engine: Engine, ids: list[int], ctx: int, chunks: int = -1,
               progress: bool = False) -> tuple[float, float, int]:
    """(PPL, its +/-, chunks scored) of token ids in chunks of ctx tokens."""
    n = len(ids) // ctx if chunks < 0 else min(chunks, len(ids) // ctx)
    if n == 0:
        raise StrataError(f"--ctx {ctx}: the text has {len(ids)} tokens, fewer than one chunk")
    bos = engine.tokenizer.bos_id if engine.tokenizer.add_bos else None
    nll = []
    for i in range(n):
        chunk = ids[i * ctx:(i + 1) * ctx]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        nll.append(chunk_nll(engine, chunk))
        if progress:
            m = np.concatenate(nll).mean()
            print(f"[{i + 1}]{math.exp(m):.4f}", end=",", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    all_nll = np.concatenate(nll)
    mean = float(all_nll.mean())
    err = float(all_nll.std() / math.sqrt(max(1, all_nll.size - 1)))
    return math.exp(mean), err * math.exp(mean), n


def run(args: argparse.Namespace) -> int:
    refuse_spec(args, "perplexity")
    args.ctx = 512 if args.ctx is None else args.ctx
    if args.ctx < 4:
        raise StrataError(f"--ctx {args.ctx}: give at least 4 tokens a chunk")
    if args.chunks == 0 or args.chunks < -1:
        raise StrataError(f"--chunks {args.chunks}: give at least 1 (-1, the default: all)")
    try:
        text = args.file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"--file {args.file}: cannot read it as UTF-8 text "
                          f"({getattr(e, 'strerror', None) or e})") from None
    engine = Engine.load(args.model, config=engine_config(args))
    warn_unused(args, engine)
    if args.ctx > engine.config.context_length:
        raise StrataError(f"--ctx {args.ctx}: the model's context is "
                          f"{engine.config.context_length} tokens")
    ids = engine.tokenizer.encode(text, parse_special=args.parse_special)
    t0 = time.perf_counter()
    ppl, err, n = perplexity(engine, ids, args.ctx, args.chunks, progress=True)
    dt = time.perf_counter() - t0
    print(f"strata: {len(ids)} tokens, {n} chunks of {args.ctx} in {dt:.1f} s "
          f"({n * args.ctx / dt:.0f} tok/s)", file=sys.stderr)
    print(f"Final estimate: PPL = {ppl:.4f} +/- {err:.5f}")
    return 0
