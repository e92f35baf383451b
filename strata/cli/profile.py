"""strata profile: record how often each (layer, expert) is routed to over a set of prompts."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from strata.cli.engine_flags import add_engine_arguments, engine_config, refuse_spec
from strata.cli.output import atomic_path, check_folder
from strata.engine.generator import Engine
from strata.errors import StrataError
from strata.experts.profile import save_profile
from strata.model.transformer import Segment


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file (any shard of a split set)")
    p.add_argument("--prompts", required=True,
                   help="text file: prompts separated by blank lines")
    p.add_argument("--out", required=True, help="profile file to write (JSON)")
    add_engine_arguments(p)


def read_prompts(path: str) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StrataError(f"--prompts {path}: cannot read it as UTF-8 text "
                          f"({getattr(e, 'strerror', None) or e})") from None
    prompts = [p.strip() for p in text.split("\n\n") if p.strip()]
    if not prompts:
        raise StrataError(f"--prompts {path}: no prompts in the file")
    return prompts


def run(args: argparse.Namespace) -> int:
    refuse_spec(args, "profile")
    prompts = read_prompts(args.prompts)
    check_folder(args.out, "--out")
    # every expert through the CPU pool: routing is what is recorded, the cache does not matter
    ec = replace(engine_config(args), offload="on", expert_cache="0", miss="cpu")
    engine = Engine.load(args.model, config=ec)
    experts = engine.model.experts
    tokens = 0
    for text in prompts:
        ids = engine.tokenizer.encode(text)[: engine.config.context_length]
        kv = engine.model.new_cache(len(ids))
        engine.model.forward(torch.tensor(ids), [Segment(kv, len(ids))])
        tokens += len(ids)
    counts = experts.stats.routed
    with atomic_path(args.out, "--out") as tmp:
        save_profile(tmp, engine.path.name, counts, tokens)
    share = counts / np.maximum(counts.sum(1, keepdims=True), 1)
    print(f"strata: profiled {len(prompts)} prompts, {tokens} tokens; wrote {args.out} "
          f"(busiest expert {100 * share.max():.1f}% of its layer)", file=sys.stderr)
    return 0
