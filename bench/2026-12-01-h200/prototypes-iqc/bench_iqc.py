"""Time iqc.py's compact-table GEMVs against gemv_q8.gemv_iq_spread on the GPU: IQ2_XS and
IQ3_XXS rows of 14336 x 4096, x rounded to 8 bits once outside the time (the GEMV alone, as
scripts/bench_moe_decode.py's "GEMV alone" lines); first, every new form against the old one
bit for bit on smaller matrices (same tile). Each figure is the median of CUDA-graph replays of
16 calls, each call on its own copy of the weights (so the L2 cannot hold them); GB/s counts the
matrix's weight bytes.

    python3 bench/2026-12-01-h200/prototypes-iqc/bench_iqc.py [--json F] [--check-only]
    .venv/bin/python bench/2026-12-01-h200/prototypes-iqc/bench_iqc.py --interpret   # CPU: check
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[2])]
if "--interpret" in sys.argv:
    import check_iqc  # noqa: F401 (sets TRITON_INTERPRET=1 before triton loads, patches it)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from iqc import FORMS, gemv_iqc  # noqa: E402

from strata.kernels.gpu.gemv_q8 import gemv_iq_spread, quantize_x  # noqa: E402
from strata.quant import QType, random_rows  # noqa: E402

CALLS = 16
OLD_TILES = [(4, 8), (2, 8)]  # gemv_iq_spread's (rows, bb)
NEW_TILES = [(r, bb) for r in (2, 4) for bb in (4, 8)]


def qtype_of(form: str) -> QType:
    return QType.IQ3_XXS if form == "iq3xxs" else QType.IQ2_XS


def check(dev: torch.device, shapes: list, rng: np.random.Generator) -> None:
    """Each form and tile against gemv_iq_spread with the same tile: bit-identical outputs."""
    for n, k in shapes:
        for q in (QType.IQ2_XS, QType.IQ3_XXS):
            w = torch.from_numpy(random_rows(q, n, k, rng, 0.02)).to(dev)
            xq, dx, _ = quantize_x(torch.randn(k, generator=torch.Generator().manual_seed(n))
                                   .to(dev))
            for form in [f for f in FORMS if qtype_of(f) == q]:
                for r, bb in NEW_TILES:
                    ref = gemv_iq_spread(xq, dx, w, n, k, q, bb=bb, rows=r)
                    y = gemv_iqc(xq, dx, w, n, k, form, bb=bb, rows=r)
                    same = torch.equal(y.view(torch.int32), ref.view(torch.int32))
                    diff = float((y - ref).abs().max())
                    print(f"check {form} {n}x{k} (R {r}, BB {bb}): "
                          f"{'bit-identical' if same else 'DIFFERENT'}, max diff {diff:.3g}",
                          flush=True)
                    assert same, (form, n, k, r, bb)


def time_form(q: QType, copies: list, form: str | None, r: int, bb: int, xq: torch.Tensor,
              dx: torch.Tensor, out: torch.Tensor) -> float:
    """Seconds a call of the old GEMV (form None) or gemv_iqc's form, tile (r, bb)."""
    from strata.bench.graph_timing import graph_seconds

    n, k = out.numel(), xq.numel()

    def call(i: int) -> None:
        w = copies[i % len(copies)]
        if form is None:
            gemv_iq_spread(xq, dx, w, n, k, q, out=out, bb=bb, rows=r)
        else:
            gemv_iqc(xq, dx, w, n, k, form, out=out, bb=bb, rows=r)

    return graph_seconds(call, CALLS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--interpret", action="store_true",
                    help="on the CPU under Triton's interpreter: the check, on small rows")
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    if a.interpret:
        check(torch.device("cpu"), [(37, 768)], rng)
        print("ok (interpreter: check only)")
        return
    from strata.bench.ceilings import hbm_copy_gbs

    dev = torch.device("cuda")
    check(dev, [(37, 768), (1029, 4096)], rng)
    if a.check_only:
        return
    hbm = hbm_copy_gbs()
    print(f"HBM copy {hbm:.0f} GB/s")
    n, k = 14336, 4096
    xq, dx, _ = quantize_x(torch.randn(k, device=dev))
    out = torch.empty(n, device=dev)
    res = {"hbm_copy_GBs": hbm, "gemv_us": {}}
    for q in (QType.IQ2_XS, QType.IQ3_XXS):
        one = torch.from_numpy(random_rows(q, n, k, rng, 0.02)).to(dev)
        copies = [one] + [one.clone() for _ in range(max(1, min(CALLS - 1,
                                                                 (256 << 20) // one.numel())))]
        nbytes = one.numel()
        runs = [(f"old gemv_iq_spread (R {r}, BB {bb})", r, bb, None) for r, bb in OLD_TILES]
        runs += [(f"{f} (R {r}, BB {bb})", r, bb, f) for f in FORMS if qtype_of(f) == q
                 for r, bb in NEW_TILES]
        for name, r, bb, form in runs:
            t = time_form(q, copies, form, r, bb, xq, dx, out)
            key = f"{q.name} {n}x{k} {name}"
            res["gemv_us"][key] = t * 1e6
            print(f"{key}: {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s "
                  f"({100 * nbytes / t / 1e9 / hbm:.0f}% of HBM copy)", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
