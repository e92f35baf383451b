"""strata check: run two engine configurations on the same tokens and compare their logits.

    strata check MODEL --a "--offload off" --b "--device cuda --vram-budget 4 --prefill 64"
    strata check MODEL --b "--device cuda --vram-budget 10" --decode 16   # decode steps too

Prints first-token (the last prompt position) and all-position KL(a || b), max abs diff and top-1
agreement; exit code 1 when they differ beyond --max-kl or disagree on a top token. With
--decode N the last N tokens go through one decode step each (the CUDA-graph decode step where
the configuration has one) instead of the prompt, and their positions are reported apart.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import sys

import numpy as np
import torch

from strata.cli.engine_flags import add_engine_arguments, engine_config
from strata.cli.logits import compute_logits, parse_tokens
from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.errors import StrataError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file (any shard of a split set)")
    p.add_argument("--a", default="--offload off", help="engine flags of configuration A "
                   "(default: the reference path, --offload off)")
    p.add_argument("--b", required=True, help="engine flags of configuration B, e.g. "
                   "\"--device cuda --vram-budget 4 --prefill 64\"")
    p.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens (64)")
    p.add_argument("--tokens", default=None, help="comma-separated token ids instead")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompt (0)")
    p.add_argument("--max-kl", type=float, default=1e-4, help="tolerance (1e-4)")
    p.add_argument("--decode", type=int, default=0, metavar="N",
                   help="run the last N tokens as decode steps, one token each (0)")


def parse_flags(name: str, text: str) -> EngineConfig:
    p = argparse.ArgumentParser(prog=f"strata check --{name}", add_help=False,
                                exit_on_error=False)
    add_engine_arguments(p)
    try:
        args, rest = p.parse_known_args(shlex.split(text))
    except (argparse.ArgumentError, ValueError) as e:
        raise StrataError(f"--{name} {text!r}: {e}") from None
    if rest:
        raise StrataError(f"--{name} {text!r}: not an engine flag: {' '.join(rest)}")
    return engine_config(args)


def decode_logits(engine: Engine, ids: list[int], n_decode: int) -> np.ndarray:
    """float32 logits [len(ids), V]: the first tokens as the prompt (in the engine's chunks),
    then one decode step per remaining token."""
    n = len(ids) - n_decode
    kv = engine.model.new_cache(len(ids))
    out = [engine.run_prompt(ids[:n], kv, all_logits=True).float().cpu().numpy()]
    for t in ids[n:]:
        out.append(engine.model.decode(t, kv).float().cpu().numpy().copy())
    return np.concatenate(out)


def kl_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    la = torch.log_softmax(torch.from_numpy(a).double(), -1)
    lb = torch.log_softmax(torch.from_numpy(b).double(), -1)
    return (la.exp() * (la - lb)).sum(-1).numpy()


def run(args: argparse.Namespace) -> int:
    ca, cb = parse_flags("a", args.a), parse_flags("b", args.b)
    logits = []
    ids: list[int] | None = None
    for ec in (ca, cb):
        engine = Engine.load(args.model, config=ec)
        if ids is None:
            n_vocab = engine.config.n_vocab
            if args.tokens:
                ids = parse_tokens(args.tokens, n_vocab)
            else:
                ids = np.random.default_rng(args.seed).integers(0, n_vocab,
                                                                args.prompt_len).tolist()
            engine.check_prompt(ids, 0)
            if not 0 <= args.decode < len(ids):
                raise StrataError(f"--decode {args.decode}: give 0 .. {len(ids) - 1} (the "
                                  "tokens after the first go through decode steps)")
        logits.append(decode_logits(engine, ids, args.decode) if args.decode
                      else compute_logits(engine, ids))
        del engine
        gc.collect()
    a, b = logits
    kl = kl_rows(a, b)
    top = a.argmax(-1) == b.argmax(-1)
    diff = np.abs(a - b)
    print(f"first token:   KL {kl[-1]:.3e}  max abs diff {diff[-1].max():.3e}  "
          f"top-1 {'same' if top[-1] else 'DIFFERENT'}")
    print(f"all {len(ids):>5} pos: KL max {kl.max():.3e} mean {kl.mean():.3e}  max abs diff "
          f"{diff.max():.3e}  top-1 agree {100 * top.mean():.1f}%")
    if args.decode:
        d = slice(len(ids) - args.decode, None)
        print(f"{args.decode:>5} decode steps: KL max {kl[d].max():.3e}  max abs diff "
              f"{diff[d].max():.3e}  top-1 agree {100 * top[d].mean():.1f}%")
    ok = kl.max() <= args.max_kl and top.all()
    print("same within tolerance" if ok else f"DIFFERENT beyond --max-kl {args.max_kl:g} or on "
          "a top token", file=sys.stderr if not ok else sys.stdout)
    return 0 if ok else 1
