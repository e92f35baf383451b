"""strata bench-spec: verify windows (--spec T) timed against plain decode on the same engine,
with drafts that replay the model's own greedy answer so that each window accepts a fixed
number of them (--accept A,A,...): the speed a drafter of that acceptance would give, and the
cost of windows that accept nothing (strata.bench.spec_bench)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

from strata.bench.spec_bench import markdown, run_spec_bench
from strata.cli.engine_flags import add_engine_arguments, engine_config, warn_unused
from strata.cli.limits import check_ctx, check_seed
from strata.cli.output import atomic_path, check_folder
from strata.engine.generator import Engine
from strata.errors import StrataError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file (any shard of a split set)")
    p.add_argument("--accept", default=None, metavar="A,A,...",
                   help="drafts each window accepts, one test each (--spec T - 1 and 0: a "
                   "drafter right on all but the last, and one never right)")
    p.add_argument("-p", "--n-prompt", type=int, default=128, metavar="N",
                   help="random prompt tokens before the decode (128; untimed)")
    p.add_argument("-n", "--n-gen", type=int, default=64, metavar="N",
                   help="greedy tokens decoded, plain and through windows (64)")
    p.add_argument("-r", "--repetitions", "--runs", dest="runs", type=int, default=3,
                   help="measured runs of each after a warm-up (3): medians")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt's tokens (0)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    add_engine_arguments(p)


def _accepts(spec: str | None, window: int) -> list[int]:
    if spec is None:
        return [window - 1, 0] if window > 1 else [0]
    try:
        out = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise StrataError(f"--accept {spec!r}: give counts of drafts, e.g. 3,0") from None
    if not out:
        raise StrataError(f"--accept {spec!r}: give counts of drafts, e.g. 3,0")
    return out


def run(args: argparse.Namespace) -> int:
    ec = engine_config(args)
    if not ec.spec:
        raise StrataError("bench-spec times verify windows: give --spec T (e.g. --spec 4)")
    if args.runs < 1:
        raise StrataError("--runs must be >= 1")
    if args.n_prompt < 1:
        raise StrataError(f"-p {args.n_prompt}: give at least 1 prompt token")
    if args.n_gen < 2:
        raise StrataError(f"-n {args.n_gen}: give at least 2 tokens to decode")
    check_seed(args.seed)
    accepts = _accepts(args.accept, ec.spec)
    bad = [a for a in accepts if not 0 <= a <= ec.spec]
    if bad:
        raise StrataError(f"--accept {bad[0]}: give 0 .. --spec {ec.spec} drafts a window")
    need = args.n_prompt + args.n_gen
    check_ctx(ec.ctx, need, f"-p {args.n_prompt} and -n {args.n_gen}")
    if args.json:
        check_folder(args.json, "--json")
    # (the windows' drafts come from the run; the engine is loaded as --spec T runs, with
    # n-gram drafts in place until then: its window graphs and plan as in use)
    engine = Engine.load(args.model, config=replace(ec, draft="ngram"))
    warn_unused(args, engine)
    if need > engine.config.context_length:
        raise StrataError(f"-p {args.n_prompt} and -n {args.n_gen}: {need} tokens exceed the "
                          f"model's context of {engine.config.context_length}")
    results = run_spec_bench(engine, args.n_prompt, args.n_gen, accepts, args.runs, args.seed)
    backend = "CUDA" if engine.model.device.type == "cuda" else "CPU"
    print(f"strata bench-spec: {args.model} on {backend}, greedy decode of {args.n_gen} tokens "
          f"after {args.n_prompt} random prompt tokens, medians of {args.runs} run(s)",
          file=sys.stderr)
    print(markdown(results))
    if args.json:
        with atomic_path(args.json, "--json") as tmp, open(tmp, "w") as f:
            json.dump({"model": args.model, "backend": backend, "config": asdict(ec),
                       "results": [r.to_dict() for r in results]}, f, indent=1)
    return 0
