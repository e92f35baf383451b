"""strata bench: llama-bench's matrix (-p prompt lengths, -n decode tokens, each at every -d
depth, -r runs) as prompt and decode tok/s (median ± standard deviation of runs), with the hit
rate, bytes moved, memory peaks and the fraction of the bandwidth bound, the machine's ceilings
measured in the same run."""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
from dataclasses import asdict, replace

from strata.bench.ceilings import measure
from strata.bench.runner import DECODE_INPUTS, cell_name, run_bench
from strata.bench.table import Cell, markdown, matrix, model_info, rows
from strata.cli.engine_flags import (
    add_engine_arguments,
    engine_config,
    gib,
    refuse_spec,
    warn_unused,
)
from strata.cli.limits import check_ctx, check_seed
from strata.cli.output import atomic_path, check_folder
from strata.engine.generator import Engine
from strata.errors import StrataError

PLOT = "bench-sweep.png"  # --plot's default


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file (any shard of a split set)")
    p.add_argument("-p", "--n-prompt", default=None, metavar="N,N,...",
                   help="prompt tests ppN: N random prompt tokens timed, at each -d depth (128)")
    p.add_argument("-n", "--n-gen", type=int, default=None, metavar="N",
                   help="decode tests tgN: N decode steps timed, at each -d depth (64; 0: none)")
    p.add_argument("-d", "--n-depth", default=None, metavar="D,D,...",
                   help="depths of every test, as llama-bench's -d: each run's fresh KV cache "
                   "first filled with D random tokens, untimed, then the test timed (ppN @ dD, "
                   "tgN @ dD; 0)")
    p.add_argument("-r", "--repetitions", "--runs", dest="runs", type=int, default=3,
                   help="measured runs of each test after a warm-up run (3): the median ± the "
                   "standard deviation; the warm-up is run again, up to 3 times, while it "
                   "changes which layers' prompt chunks stream every expert")
    p.add_argument("--decode-input", default="random", choices=DECODE_INPUTS,
                   help="decode steps' inputs: uniform random tokens, a seeded draw (random: "
                   "llama-bench's tg), or each step's argmax fed back (greedy: a random "
                   "model's greedy output loops over a few tokens, which flatters the cache)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random tokens (0)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="one test instead of the matrix: a timed prompt of this many tokens "
                   "then --gen-len decode steps on it (pp128 + tg64 @ d128)")
    p.add_argument("--gen-len", type=int, default=None,
                   help="with --prompt-len: the decode steps (64)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--sweep-vram", default=None, metavar="GIB,GIB,...",
                   help="run once per VRAM budget and plot decode tok/s against it (--plot)")
    p.add_argument("--plot", default=PLOT, help=f"PNG for --sweep-vram ({PLOT})")
    add_engine_arguments(p)


def _budgets(spec: str) -> list[float]:
    try:
        out = [gib(x) for x in spec.split(",") if x.strip()]
    except argparse.ArgumentTypeError:
        raise StrataError(f"--sweep-vram {spec!r}: give sizes in GiB, e.g. 2,4,8") from None
    if not out or not all(0 < b < math.inf for b in out):
        raise StrataError(f"--sweep-vram {spec!r}: give sizes in GiB above 0 (finite numbers)")
    return out


def _lengths(spec: str, flag: str, least: int) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise StrataError(f"{flag} {spec!r}: give token counts, e.g. 128,512") from None
    if not out or min(out) < least:
        raise StrataError(f"{flag} {spec!r}: give token counts >= {least}")
    return out


def cells(args: argparse.Namespace) -> list[Cell]:
    """The tests to run: llama-bench's matrix, or the one test of --prompt-len/--gen-len."""
    new = args.n_prompt is not None or args.n_gen is not None or args.n_depth is not None
    old = args.prompt_len is not None or args.gen_len is not None
    if new and old:
        raise StrataError("give -p/-n/-d or --prompt-len/--gen-len, not both")
    if args.runs < 1:
        raise StrataError("--runs must be >= 1")
    if old:
        p = 128 if args.prompt_len is None else args.prompt_len
        n = 64 if args.gen_len is None else args.gen_len
        if p < 1 or n < 0:
            raise StrataError("--prompt-len must be >= 1, --gen-len >= 0")
        return [Cell(p, n, cell_name(p, n, timed_prompt=True))]
    prompts = _lengths(args.n_prompt or "128", "-p", 0)
    n = 64 if args.n_gen is None else args.n_gen
    if n < 0:
        raise StrataError("-n must be >= 0")
    out = matrix(prompts, n, _lengths(args.n_depth or "0", "-d", 0))
    if not out:
        raise StrataError("-p and -n give no test: ask for a prompt length or decode tokens > 0")
    return out


def run(args: argparse.Namespace) -> int:
    refuse_spec(args, "bench")
    tests = cells(args)
    check_seed(args.seed)
    base = engine_config(args)
    need = max(c.depth + c.prompt_len + c.gen_len for c in tests)
    check_ctx(base.ctx, need, "the longest test's depth, prompt and decode tokens")
    if base.ctx is None and need > 4096:  # plan the KV cache for the longest test
        base = replace(base, ctx=need)
    if args.plot != PLOT and not args.sweep_vram:
        raise StrataError(f"--plot {args.plot}: draws the curve of --sweep-vram; give "
                          "--sweep-vram too, or drop --plot")
    for flag, path in (("--json", args.json), ("--plot", args.sweep_vram and args.plot)):
        if path:
            check_folder(path, flag)  # before the runs, not after
    budgets = _budgets(args.sweep_vram) if args.sweep_vram else [args.vram_budget]
    # (the ceilings' test buffers inside a quarter of the smallest budget: nvidia-smi's peak
    # of the run counts them too)
    small = min((b for b in budgets if b), default=None)
    ceilings = measure(int(small * (1 << 30)) // 4 if small else None)
    print("strata: ceilings " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in ceilings.items()), file=sys.stderr)
    info = model_info(args.model)
    print(f"strata: decode inputs: {_inputs(args)}", file=sys.stderr)
    results, backend = [], "CPU"
    for i, budget in enumerate(budgets):
        ec = replace(base, vram_budget_gib=budget)
        engine = Engine.load(args.model, config=ec)
        if i == 0:
            warn_unused(args, engine)
        backend = "CUDA" if engine.model.device.type == "cuda" else "CPU"
        if need > engine.config.context_length:
            raise StrataError(f"a test needs {need} tokens of context; the model has "
                              f"{engine.config.context_length}")
        head = f"strata bench ({'budget ' + str(budget) + ' GiB' if budget else 'default'}): "
        for c in tests:
            res = run_bench(engine, c.prompt_len, c.gen_len, args.runs, seed=args.seed,
                            ceilings=ceilings, decode_input=args.decode_input, test=c.name,
                            depth=c.depth)
            res.config = asdict(ec)
            results.append(res)
            print(head + "\n  ".join(res.lines()), file=sys.stderr)
        del engine  # the engine holds cycles: collect them, or the next budget's arena is
        gc.collect()  # filled while this one is still mapped (host RAM peak twice the arena)
    table = rows(results)
    print(f"decode inputs: {_inputs(args)}; KV cache {base.kv_type}; t/s: median ± standard "
          f"deviation of {args.runs} run(s)\n" + markdown(info, backend, table))
    if args.json:
        with atomic_path(args.json, "--json") as tmp, open(tmp, "w") as f:
            json.dump({"model": args.model, "model_info": info.to_dict(), "backend": backend,
                       "decode_input": args.decode_input, "seed": args.seed,
                       "ceilings": ceilings, "table": table,
                       "results": [r.to_dict() for r in results]}, f, indent=1)
    if args.sweep_vram:
        curves = {c.name: [r.decode_tok_s for r in results if r.test == c.name]
                  for c in tests if c.gen_len}
        plot_sweep(args.plot, budgets, curves, args.model)
        print(f"strata: wrote {args.plot}", file=sys.stderr)
    return 0


def _inputs(args: argparse.Namespace) -> str:
    if args.decode_input == "greedy":
        return "greedy (each step's argmax fed back)"
    return f"random tokens (uniform over the vocabulary, seed {args.seed}; llama-bench's tg)"


def plot_sweep(path: str, budgets: list[float], curves: dict[str, list[float]],
               title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise StrataError("--sweep-vram draws with matplotlib: pip install matplotlib") from None
    except Exception as e:  # a broken install fails in its own ways (the numbers are printed)
        raise StrataError(f"--plot {path}: matplotlib failed to load ({type(e).__name__}: {e}); "
                          "the results above (and --json) are complete; reinstall matplotlib "
                          "to draw the plot") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rates in curves.items():
        ax.plot(budgets, rates, marker="o", label=name)
    if len(curves) > 1:
        ax.legend(fontsize=8)
    ax.set_xlabel("VRAM budget (GiB)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(title.rsplit("/", 1)[-1], fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    with atomic_path(path, "--plot") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
