"""strata bench: prompt and decode tok/s (median of runs), hit rate, bytes moved, memory peaks and
the fraction of the bandwidth bound, with the machine's ceilings measured in the same run."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import asdict, replace

from strata.bench.ceilings import measure
from strata.bench.runner import run_bench
from strata.cli.engine_flags import add_engine_arguments, engine_config
from strata.cli.output import atomic_path, check_folder
from strata.engine.generator import Engine
from strata.errors import StrataError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="GGUF file (any shard of a split set)")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens (128)")
    p.add_argument("--gen-len", type=int, default=64, help="tokens to decode (64)")
    p.add_argument("--runs", type=int, default=3,
                   help="measured runs after a warm-up run (3); the warm-up is run again, up to "
                   "3 times, while it changes which layers' prompt chunks stream every expert")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--sweep-vram", default=None, metavar="GIB,GIB,...",
                   help="run once per VRAM budget and plot decode tok/s against it (--plot)")
    p.add_argument("--plot", default="bench-sweep.png", help="PNG for --sweep-vram")
    add_engine_arguments(p)


def _budgets(spec: str) -> list[float]:
    try:
        out = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise StrataError(f"--sweep-vram {spec!r}: give sizes in GiB, e.g. 2,4,8") from None
    if not out or min(out) <= 0:
        raise StrataError(f"--sweep-vram {spec!r}: give sizes in GiB above 0")
    return out


def run(args: argparse.Namespace) -> int:
    if args.prompt_len < 1 or args.gen_len < 0 or args.runs < 1:
        raise StrataError("--prompt-len and --runs must be >= 1, --gen-len >= 0")
    base = engine_config(args)
    for flag, path in (("--json", args.json), ("--plot", args.sweep_vram and args.plot)):
        if path:
            check_folder(path, flag)  # before the runs, not after
    budgets = _budgets(args.sweep_vram) if args.sweep_vram else [args.vram_budget]
    ceilings = measure()
    print("strata: ceilings " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in ceilings.items()), file=sys.stderr)
    results = []
    for budget in budgets:
        ec = replace(base, vram_budget_gib=budget)
        engine = Engine.load(args.model, config=ec)
        res = run_bench(engine, args.prompt_len, args.gen_len, args.runs, ceilings=ceilings)
        res.config = asdict(ec)
        results.append(res)
        head = f"strata bench ({'budget ' + str(budget) + ' GiB' if budget else 'default'}): "
        print(head + "\n  ".join(res.lines()), file=sys.stderr)
        del engine  # the engine holds cycles: collect them, or the next budget's arena is
        gc.collect()  # filled while this one is still mapped (host RAM peak twice the arena)
    if args.json:
        with atomic_path(args.json, "--json") as tmp, open(tmp, "w") as f:
            json.dump({"model": args.model, "ceilings": ceilings,
                       "results": [r.to_dict() for r in results]}, f, indent=1)
    if args.sweep_vram:
        plot_sweep(args.plot, budgets, [r.decode_tok_s for r in results], args.model)
        print(f"strata: wrote {args.plot}", file=sys.stderr)
    return 0


def plot_sweep(path: str, budgets: list[float], rates: list[float], title: str) -> None:
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
    ax.plot(budgets, rates, marker="o")
    ax.set_xlabel("VRAM budget (GiB)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(title.rsplit("/", 1)[-1], fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    with atomic_path(path, "--plot") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
