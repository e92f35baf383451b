"""strata synth: write a synthetic GGUF model (real layout and metadata, random weights)."""

from __future__ import annotations

import argparse
import glob
import sys
from dataclasses import replace
from pathlib import Path

from strata.cli.limits import check_seed
from strata.cli.output import check_free
from strata.errors import StrataError
from strata.synth.balance import routing_balance
from strata.synth.presets import PRESETS, get_preset
from strata.synth.recipes import RECIPES, Recipe
from strata.synth.writer import plan_tensors, write_model
from strata.units import fmt_bytes, parse_size

MAX_LAYERS = 1024  # --layers: past every preset's (235b-a22b: 94), and a plan that stays small


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="output .gguf path (split sets: OUT-0000i-of-0000n.gguf)")
    p.add_argument("--arch", choices=["qwen3moe", "qwen2moe", "llama", "qwen35moe", "qwen3next",
                                      "glm4moe", "deepseek2", "gpt-oss", "qwen3", "qwen2"],
                   help="architecture (tiny preset; the real presets fix it; qwen3, qwen2: "
                   "dense, a --draft beside a MoE model of the same vocabulary)")
    p.add_argument("--preset", default="tiny", help=f"shape: {', '.join(PRESETS)} (tiny)")
    p.add_argument("--quant", default="Q4_K_M", help="recipe, optionally with overrides "
                   "PATTERN=TYPE, e.g. 'IQ2_XS,blk.2.ffn_*_exps=IQ1_M' "
                   f"(recipes: {', '.join(RECIPES)}) (Q4_K_M)")
    p.add_argument("--layers", type=int, default=None,
                   help="keep the preset's widths but use this many layers")
    p.add_argument("--seed", type=int, default=0, help="random seed (0)")
    p.add_argument("--split-max-tensors", type=int, default=0,
                   help="write a split set of at most this many tensors a file (0: one file)")
    p.add_argument("--split-max-size", default="0",
                   help="write a split set of files of at most this size, e.g. 4G (0: one file)")
    p.add_argument("--force", action="store_true", help="overwrite an existing file")


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if out.suffix != ".gguf":
        raise StrataError(f"{out}: the output name must end in .gguf")
    # (a split set's shards too: OUT-00001-of-00003.gguf, ...)
    there = ([out] if out.exists() else []) + sorted(
        out.parent.glob(f"{glob.escape(out.stem)}-[0-9]*-of-[0-9]*.gguf"))
    if there and not args.force:
        raise StrataError(f"{there[0]} exists; pass --force to overwrite it")
    old_files = {path: path.stat().st_ino for path in there}
    check_seed(args.seed)
    preset, recipe = get_preset(args.preset, args.arch), Recipe(args.quant)
    if args.layers is not None:
        if not 1 <= args.layers <= MAX_LAYERS:
            raise StrataError(f"--layers {args.layers}: give 1 to {MAX_LAYERS}")
        # (dense first layers: at most all but one, so that a routed layer remains)
        preset = replace(preset, n_layers=args.layers,
                         n_dense_lead=min(preset.n_dense_lead, args.layers - 1))
    try:
        split_size = parse_size(args.split_max_size)
    except (ValueError, OverflowError):  # (OverflowError: inf)
        split_size = -1
    if split_size < 0:
        raise StrataError(f"--split-max-size {args.split_max_size!r}: give a size like 4G or "
                          "500M (0: one file)")
    if args.split_max_tensors < 0:
        raise StrataError(f"--split-max-tensors {args.split_max_tensors}: give 0 (no split) or "
                          "more")
    total = sum(t.nbytes for t in plan_tensors(preset, recipe))
    check_free(out, total, "synth")
    print(f"strata: writing {out}: {fmt_bytes(total)} of tensors", file=sys.stderr)
    write_model(out, preset, recipe, args.seed, args.split_max_tensors, split_size,
                progress=sys.stderr.isatty())
    # --force: an old file the new model did not write over (a single file beside a new split
    # set, shards beside a new single file or a set of another count) goes too: it still has
    # its inode (the new files were moved into place)
    for path, inode in old_files.items():
        if path.exists() and path.stat().st_ino == inode:
            path.unlink()
    first = out if out.exists() else \
        sorted(out.parent.glob(f"{glob.escape(out.stem)}-00001-of-*.gguf"))[0]
    print(f"strata: wrote {out} ({preset.arch} {args.preset}, {recipe.name}, "
          f"{fmt_bytes(total)})", file=sys.stderr)
    if preset.n_experts:  # (a dense draft routes nothing)
        print(routing_balance(first, seed=args.seed), file=sys.stderr)
    return 0
