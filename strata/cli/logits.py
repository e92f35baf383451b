"""strata logits: float32 logits [n_tokens, vocab] of a token sequence, one row per position."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from strata.cli.engine_flags import add_engine_arguments, engine_config, refuse_spec, warn_unused
from strata.cli.limits import check_ctx, check_kv_memory
from strata.cli.output import atomic_path, check_folder
from strata.engine.generator import Engine
from strata.errors import StrataError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file (any shard of a split set)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="comma-separated token ids, e.g. 1,2,3")
    src.add_argument("--text", help="text to tokenize (with the model's BOS rule)")
    p.add_argument("--out", required=True, help="output .npy file")
    add_engine_arguments(p)


def parse_tokens(spec: str, n_vocab: int) -> list[int]:
    try:
        ids = [int(t) for t in spec.split(",") if t.strip()]
    except ValueError:
        raise StrataError(f"--tokens {spec!r}: give comma-separated integers") from None
    bad = [t for t in ids if not 0 <= t < n_vocab]
    if bad:
        raise StrataError(f"--tokens: ids {bad[:5]} are outside the vocabulary (0..{n_vocab - 1})")
    if not ids:
        raise StrataError("--tokens: no token ids given")
    return ids


def compute_logits(engine: Engine, ids: list[int]) -> np.ndarray:
    """float32 logits [len(ids), V], the prompt run in the engine's chunks."""
    kv = engine.model.new_cache(len(ids))
    return engine.run_prompt(ids, kv, all_logits=True).float().cpu().numpy()


def run(args: argparse.Namespace) -> int:
    refuse_spec(args, "logits")
    dest = args.out if args.out.endswith(".npy") else args.out + ".npy"  # as np.save names it
    check_folder(args.out, "--out")  # before the model loads
    check_folder(dest, "--out")
    engine = Engine.load(args.model, config=engine_config(args))
    warn_unused(args, engine)
    flag = "--tokens" if args.tokens is not None else "--text"
    if args.tokens is not None:
        ids = parse_tokens(args.tokens, engine.config.n_vocab)
    else:
        ids = engine.tokenizer.encode(args.text)
    if not ids:
        raise StrataError(f"{flag}: the text gives no tokens")
    check_ctx(args.ctx, len(ids), f"the {len(ids)} tokens of {flag}")
    engine.check_prompt(ids, 0)
    check_kv_memory(engine, len(ids), flag)
    out = compute_logits(engine, ids)
    with atomic_path(dest, "--out") as tmp, open(tmp, "wb") as f:
        np.save(f, out)
    print(f"strata: wrote logits {list(out.shape)} to {dest}", file=sys.stderr)
    return 0
