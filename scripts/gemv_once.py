"""Launch the one-token GEMV kernels a few times each, eagerly, for a profiler to measure (Nsight
Compute: `scripts/gpu_bench.sh`'s `ncu` stage). No timing here: the kernel benchmark
(bench_moe_decode.py) times them; this gives ncu one plain launch of each to read counters from
(memory throughput, stall reasons, occupancy).

    python scripts/gemv_once.py [--shape 14336x4096] [--types Q4_K,Q6_K] [--q8]
        [--rows R,BK,STAGES,WARPS] [--moe 1,8,16]

--moe: instead, the Qwen3-30B-A3B MoE layer (128 experts Q4_K / Q4_K / Q6_K, top-8, D 2048, F
768, every expert resident) on the x8 per-pair kernels at each token count, row-tile-major and
pair-major grids (moe.pair_major) in turn: for ncu -k regex:_q8_kernel.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.kernels.gpu import matmul as mm  # noqa: E402
from strata.quant import QType, random_rows  # noqa: E402

# the spread GEMVs' (rows, blocks, warps, ld.global.cg (Q4_K)) launched with --q8
SPREAD = [(1, 4, 1, False), (1, 8, 1, False), (4, 4, 1, False), (4, 8, 1, True)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="14336x4096", help="rows x columns")
    p.add_argument("--types", default="Q4_K,Q6_K")
    p.add_argument("--q8", action="store_true",
                   help="also the int8-activation GEMVs (gemv_q8.py; Q4_K, Q6_K, IQ2_XS, "
                   "IQ3_XXS, and the latter three's run forms)")
    p.add_argument("--rows", default=None, metavar="R,BK,STAGES,WARPS",
                   help="also the rows kernel (matmul.gemv_rows) with this tile, x f32 and bf16")
    p.add_argument("--moe", default=None, metavar="T,T,...")
    p.add_argument("--launches", type=int, default=3)
    a = p.parse_args()
    if a.moe:
        moe_layer([int(t) for t in a.moe.split(",")], a.launches)
        return
    n, k = (int(v) for v in a.shape.split("x"))
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    x = torch.randn(1, k, device=dev)
    out = torch.empty(1, n, device=dev)
    for name in a.types.split(","):
        q = QType[name]
        w = torch.from_numpy(random_rows(q, n, k, rng, 0.02)).to(dev)
        for _ in range(a.launches):
            mm.quant_matmul(x, w, q, out=out)
        if a.q8 and q in (QType.Q4_K, QType.Q6_K, QType.IQ2_XS, QType.IQ3_XXS):
            from strata.kernels.gpu.gemv_q8 import (
                gemv_iq_run,
                gemv_iq_spread,
                gemv_q4k_spread,
                gemv_q6k_run,
                gemv_q6k_spread,
                quantize_x,
                run_tile,
            )

            xq, dx, xs4 = quantize_x(x[0])
            for _ in range(a.launches):
                for r, bb, wp, cg in SPREAD:
                    if q == QType.Q4_K:
                        gemv_q4k_spread(xq, xs4, w, n, k, out=out[0], bb=bb, warps=wp, rows=r,
                                        cg=cg)
                    elif q == QType.Q6_K:
                        gemv_q6k_spread(xq, dx, w, n, k, out=out[0], bb=bb, warps=wp, rows=r)
                    else:
                        gemv_iq_spread(xq, dx, w, n, k, q, out=out[0], bb=bb, warps=wp, rows=r)
                if q != QType.Q4_K and k % 2048 == 0:  # the run forms at gemv_x8's tile
                    r, sp, wp = run_tile(k)
                    if q == QType.Q6_K:
                        gemv_q6k_run(xq, dx, w, n, k, out=out[0], rows=r, split=sp, warps=wp)
                    else:
                        gemv_iq_run(xq, dx, w, n, k, q, out=out[0], rows=r, split=sp, warps=wp)
        if a.rows:
            tile = tuple(int(v) for v in a.rows.split(","))
            for xr in (x, x.to(torch.bfloat16)):
                for _ in range(a.launches):
                    mm.gemv_rows(xr, w, q, tile, out=out)
        torch.cuda.synchronize()
        print(f"{name} {n}x{k}: launched", flush=True)


def moe_layer(tokens: list[int], launches: int) -> None:
    from bench_kernels import moe_layer_args, prompt_layer  # (this folder: its layer)

    from strata.kernels.gpu.moe import moe_forward

    types = ("Q4_K", "Q4_K", "Q6_K")
    qt = tuple(QType[t] for t in types)
    d, f = prompt_layer(types)[3:5]
    for t in tokens:
        x, ids, wts, slot_of, gate, up, down, out, _ = moe_layer_args(types, t)
        for pm in (0, 1):
            for _ in range(launches):
                moe_forward(x, ids, wts, slot_of, gate, up, down, qt, d, f, out=out,
                            path="pairs", x8=True, tiles={"pair_major": (pm,)})
            torch.cuda.synchronize()
            print(f"MoE layer {t} tokens, pair_major {pm}: launched", flush=True)


if __name__ == "__main__":
    main()
