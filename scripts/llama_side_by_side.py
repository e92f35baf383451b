"""Strata beside llama-bench on the same file at the same VRAM (gpu_bench.sh's matrix stage).

    ncmoe MODEL --budget GIB --ctx N     llama.cpp's -ncmoe (the first N layers' experts on the
                                         CPU) whose weights, KV cache and compute buffer fit the
                                         budget: the smallest N whose estimate fits
    peak SMI.txt                         the largest of nvidia-smi's memory.used samples (MiB)
    table STRATA.json LLAMA.json         the two results side by side: test, tok/s each, ratio,
                                         with each side's measured VRAM peak (--strata-peak /
                                         --llama-peak, MiB); every test either side ran (by
                                         its full name, depth included), in llama-bench's order

The estimate is a start: the stage reads llama.cpp's real peak from nvidia-smi and, when it
passes the budget, runs again with more layers' experts on the CPU (--over MIB gives how much).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.bench.runner import llama_name  # noqa: E402
from strata.config import ModelConfig  # noqa: E402
from strata.gguf import open_model  # noqa: E402

MIB = 1 << 20
# llama.cpp's CUDA compute buffer at its default -ub 512 (30B-A3B: 300-600 MiB measured by its
# own log lines) plus the CUDA context nvidia-smi counts (~500 MiB on the H200)
OVERHEAD = 1024 * MIB


def expert_bytes(mf, n_layers: int) -> list[int]:  # noqa: ANN001 (ModelFile)
    """Bytes of each layer's routed-expert tensors (ffn_*_exps)."""
    out = [0] * n_layers
    for name, t in mf.tensors.items():
        if name.startswith("blk.") and "_exps." in name:
            i = int(name.split(".")[1])
            if i < n_layers:
                out[i] += t.info.nbytes
    return out


def ncmoe(model: str, budget_gib: float, ctx: int, over_mib: float = 0.0) -> int:
    mf = open_model(model)
    cfg = ModelConfig.from_model(mf)
    per_layer = expert_bytes(mf, cfg.n_layers)
    kv = 2 * cfg.n_layers * ctx * cfg.kv_dim * 2  # f16 K and V, llama-bench's default
    need = mf.nbytes + kv + OVERHEAD + over_mib * MIB
    budget = budget_gib * (1 << 30)
    for n in range(cfg.n_layers + 1):
        if need - sum(per_layer[:n]) <= budget:
            return n
    return cfg.n_layers


def peak(path: str) -> float:
    vals = [float(x) for x in Path(path).read_text().split() if x.replace(".", "").isdigit()]
    return max(vals) if vals else float("nan")


_TEST = re.compile(r"(?:pp(\d+))?\+?(?:tg(\d+))?(?: @ d(\d+))?")


def _strata_key(row: dict) -> tuple[int, int, int]:
    """(n_prompt, n_gen, n_depth) of a row of `strata bench --json`'s table; rows written before
    those fields from the test name (pp128, tg64 @ d4096)."""
    if "n_depth" in row:
        return row["n_prompt"], row["n_gen"], row["n_depth"]
    m = _TEST.fullmatch(row["test"])
    if m is None:
        raise ValueError(f"strata's test {row['test']!r}: not a llama-bench test name")
    return tuple(int(x) if x else 0 for x in m.groups())


def _order(key: tuple[int, int, int]) -> tuple[int, int]:
    """llama-bench's order: by depth, then the pp tests, the tg tests, the pp+tg tests (within
    each, the order the tests came in)."""
    prompt, gen, depth = key
    return depth, (0 if not gen else 1 if not prompt else 2)


def table(strata_json: str, llama_json: str, label: str, strata_peak: float | None,
          llama_peak: float | None, ncmoe_n: int | None) -> str:
    s = json.loads(Path(strata_json).read_text())
    lb = json.loads(Path(llama_json).read_text())
    # both sides keyed by (n_prompt, n_gen, n_depth): pp128 and pp128 @ d16384 apart
    ours = {_strata_key(r): r["tok_s"] for r in s["table"]}
    theirs = {(r["n_prompt"], r["n_gen"], r.get("n_depth", 0)): r["avg_ts"] for r in lb}
    keys = sorted(list(theirs) + [k for k in ours if k not in theirs], key=_order)
    lines = [f"### {label}", "",
             f"VRAM peak (nvidia-smi): Strata {_mib(strata_peak)}, llama.cpp {_mib(llama_peak)}"
             + (f" (-ncmoe {ncmoe_n})" if ncmoe_n is not None else ""), "",
             "| test | Strata tok/s | llama.cpp tok/s | Strata / llama.cpp |",
             "| --- | ---: | ---: | ---: |"]
    for k in keys:
        a, b = ours.get(k), theirs.get(k)
        ratio = f"{a / b:.2f}" if a and b else "-"
        lines.append(f"| {llama_name(*k)} | {_num(a)} | {_num(b)} | {ratio} |")
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:,.1f}"


def _mib(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x / 1024:.2f} GiB"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("ncmoe")
    a.add_argument("model")
    a.add_argument("--budget", type=float, required=True, help="GiB")
    a.add_argument("--ctx", type=int, required=True, help="the longest test's tokens")
    a.add_argument("--over", type=float, default=0.0, help="MiB the last run passed the budget")
    b = sub.add_parser("peak")
    b.add_argument("smi")
    t = sub.add_parser("table")
    t.add_argument("strata_json")
    t.add_argument("llama_json")
    t.add_argument("--label", default="")
    t.add_argument("--strata-peak", type=float, default=None, help="MiB")
    t.add_argument("--llama-peak", type=float, default=None, help="MiB")
    t.add_argument("--ncmoe", type=int, default=None)
    args = p.parse_args()
    if args.cmd == "ncmoe":
        print(ncmoe(args.model, args.budget, args.ctx, args.over))
    elif args.cmd == "peak":
        print(f"{peak(args.smi):.0f}")
    else:
        print(table(args.strata_json, args.llama_json, args.label, args.strata_peak,
                    args.llama_peak, args.ncmoe))
    return 0


if __name__ == "__main__":
    sys.exit(main())
