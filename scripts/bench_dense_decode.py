"""Time a decode token's dense GEMVs at a model's shapes: the float32 FMA GEMV (what runs under
tuning.X8_MIN_ROWS rows), the 8-bit-activation GEMV at its default tile (x's rounding included),
and the 8-bit GEMV's tiles on x rounded once (Q4_K and Q6_K spread forms). With --tokens, a
batched decode step's dense matmuls of M tokens at each M: quant_matmul's route (what runs), the
integer tensor-core kernel (moe_mmq.mmq_matmul) and the rows-once 8-bit kernel
(dense_x8.gemm_x8_tokens) at a few tiles each.

    python scripts/bench_dense_decode.py                         # Qwen3.6-35B-A3B's shapes
    python scripts/bench_dense_decode.py --shapes 8192x2048:Q4_K,512x2048:Q6_K --json out.json
    python scripts/bench_dense_decode.py --shapes 5120x2048:Q4_K,2048x4096:Q4_K --tokens 8,16

Each time is the median of CUDA-graph replays over enough weight copies (>= 256 MB) that L2
cannot hold them (bench_kernels.py's method), so launch gaps are not in it: a decode step's graph
pays them besides. Qwen3.6's decode step ran 34 8-bit Q4_K GEMVs at 7.4 us and 40 FMA GEMVs at
6.1 us a launch on an H200 (bench/2026-12-07-h200-group.md): the tile table and X8_MIN_ROWS are
set from what this prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_kernels import _copies, _graph_time, _weights  # noqa: E402

from strata.quant import QType, row_nbytes  # noqa: E402

# Qwen3.6-35B-A3B (d 2048): the delta layers' qkv (8192) and gate (4096) rows, their output
# (2048 x 4096), the attention layers' gated q (8192), k / v (512; v Q6_K on some layers), o
QWEN36 = "8192x2048:Q4_K,4096x2048:Q4_K,2048x4096:Q4_K,512x2048:Q4_K,512x2048:Q6_K"
Q4K_TILES = [(r, bb, w) for r in (2, 4, 8) for bb in (4, 8) for w in (1, 2)]
Q6K_TILES = [(r, bb, w) for r in (1, 2, 4) for bb in (4, 8) for w in (1, 2)]
MMQ_TILES = [(16, 64, 4), (16, 32, 4), (16, 128, 4), (16, 64, 2)]
X8_TOKEN_ROWS = (2, 4, 8)


def parse(spec: str) -> list[tuple[int, int, QType]]:
    out = []
    for part in spec.split(","):
        dims, _, t = part.partition(":")
        n, _, k = dims.partition("x")
        out.append((int(n), int(k), QType[t]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=QWEN36, help="NxK:TYPE,... (rows x columns)")
    ap.add_argument("--tokens", default="", help="M,M,...: a batched step's matmuls of M tokens")
    ap.add_argument("--rep-ms", type=int, default=25)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from strata.kernels.gpu import quant_matmul
    from strata.kernels.gpu.gemv_q8 import (
        gemv_q4k_spread,
        gemv_q6k_spread,
        gemv_x8,
        quantize_x,
    )
    from strata.kernels.tuning import GEMV_X8_TILE

    rows = []
    for n, k, qt in parse(a.shapes):
        ws = _weights(qt, n, k, _copies(n * row_nbytes(qt, k)))
        x = torch.randn(1, k, device="cuda")
        xq, dx, xs4 = quantize_x(x[0])
        y = torch.empty(n, device="cuda")
        nbytes = n * row_nbytes(qt, k)
        row = {"n": n, "k": k, "type": qt.name, "weight_bytes": nbytes}
        row["fma_us"] = 1e6 * _graph_time([partial(quant_matmul, x, w, qt) for w in ws],
                                          a.rep_ms)
        row["quantize_us"] = 1e6 * _graph_time([partial(quantize_x, x[0])] * len(ws), a.rep_ms)
        if qt in GEMV_X8_TILE:
            row["x8_default_tile"] = list(GEMV_X8_TILE[qt])
            row["x8_us"] = 1e6 * _graph_time([partial(gemv_x8, x, w, qt) for w in ws], a.rep_ms)
        row["tiles_us"] = {}
        for r, bb, warps in {QType.Q4_K: Q4K_TILES, QType.Q6_K: Q6K_TILES}.get(qt, []):
            fn, xs = ((gemv_q4k_spread, xs4) if qt == QType.Q4_K else (gemv_q6k_spread, dx))
            calls = [partial(fn, xq, xs, w, n, k, out=y, bb=bb, warps=warps, rows=r) for w in ws]
            try:
                row["tiles_us"][f"{r}x{bb}x{warps}"] = 1e6 * _graph_time(calls, a.rep_ms)
            except Exception as e:  # (a tile the shape refuses: said, the rest go on)
                row["tiles_us"][f"{r}x{bb}x{warps}"] = f"{type(e).__name__}: {e}"
        timed = {t: v for t, v in row["tiles_us"].items() if isinstance(v, float)}
        best = min(timed, key=timed.get) if timed else None
        row["best_tile"] = best
        gbs = nbytes / (timed[best] * 1e-6) / 1e9 if best else 0.0
        print(f"{n}x{k} {qt.name} ({nbytes / 2**20:.2f} MiB): FMA {row['fma_us']:.2f} us, "
              f"8-bit default {row.get('x8_us', float('nan')):.2f} us (rounding "
              f"{row['quantize_us']:.2f}), best tile {best} "
              f"{timed.get(best, float('nan')):.2f} us ({gbs:.0f} GB/s); "
              + " ".join(f"{t} {v:.2f}" for t, v in timed.items()), flush=True)
        rows.append(row)
    for n, k, qt in parse(a.shapes) if a.tokens else ():
        rows.append(time_tokens(n, k, qt, [int(m) for m in a.tokens.split(",")], a.rep_ms))
    if a.json:
        Path(a.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                            "rows": rows}, indent=1))


def time_tokens(n: int, k: int, qt: QType, tokens: list[int], rep_ms: int) -> dict:
    """One matrix's batched-step matmuls at each M: us per call of each form and tile."""
    from strata.kernels.gpu import quant_matmul
    from strata.kernels.gpu.dense_x8 import gemm_x8_tokens, tokens_tile
    from strata.kernels.gpu.moe_mmq import mmq_matmul

    ws = _weights(qt, n, k, _copies(n * row_nbytes(qt, k)))
    row = {"n": n, "k": k, "type": qt.name, "tokens": {}}
    for m in tokens:
        x = torch.randn(m, k, device="cuda")
        forms = {"quant_matmul": [partial(quant_matmul, x, w, qt) for w in ws]}
        for tile in MMQ_TILES:
            forms["mmq " + "x".join(map(str, tile))] = [partial(mmq_matmul, x, w, qt, tile=tile)
                                                       for w in ws]
        for r in X8_TOKEN_ROWS:
            forms[f"x8 rows {r}"] = [partial(gemm_x8_tokens, x, w, qt, tokens_tile(k, r))
                                     for w in ws]
        got = {}
        for name, calls in forms.items():
            try:
                got[name] = 1e6 * _graph_time(calls, rep_ms)
            except Exception as e:  # (a form the shape refuses: said, the rest go on)
                got[name] = f"{type(e).__name__}: {e}"
        row["tokens"][m] = got
        timed = {f: v for f, v in got.items() if isinstance(v, float)}
        print(f"{n}x{k} {qt.name} at {m} tokens: " + ", ".join(
            f"{f} {v:.2f}" for f, v in timed.items()) + " us", flush=True)
    return row


if __name__ == "__main__":
    main()
