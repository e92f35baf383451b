"""How fast the fused decode MoE kernels run when they read experts straight from the pinned host
arena (mapped, zero-copy over PCIe) instead of VRAM slots, against the ceilings of the same run.

    python scripts/bench_mapped.py [--json F]

One Qwen3-30B-A3B MoE layer (128 experts, 8 routed, Q4_K gate/up, Q6_K down, one token): the
experts' records live in VRAM slots and, as the arena keeps them, in host memory registered with
cudaHostRegister. Each timed call routes the token to 8 experts of a rotating set (so neither
the L2 nor a previous call holds them) and runs moe_forward with the slot table pointing at
VRAM, or at the host records. Then the decode step's gathered layer: 0, 1, 2, 4 or 8 of the
routed experts missing, gathered from the arena by gather_misses into staging rows and computed
with the hits in one moe_forward (and the gather alone); and the pinned copy of 8 records with
cudaMemcpyAsync, for comparison. Every figure is a CUDA-graph replay of 16 calls.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.bench.ceilings import measure  # noqa: E402
from strata.bench.graph_timing import graph_seconds  # noqa: E402
from strata.experts.arena import Arena  # noqa: E402
from strata.experts.layout import ExpertLayout  # noqa: E402
from strata.quant import QType, random_rows  # noqa: E402

E, K, D, F = 128, 8, 2048, 768


def records(lay: ExpertLayout, rng: np.random.Generator) -> np.ndarray:
    """[E, stride] records of valid random blocks."""
    out = np.zeros((E, lay.stride), np.uint8)
    parts = []
    for q, (rows, cols) in zip(lay.qtypes, ((F, D), (F, D), (D, F)), strict=True):
        parts.append(random_rows(QType(q), rows * 4, cols, rng, 0.02).reshape(-1))
    for e in range(E):
        start = 0
        for p, n in zip(parts, lay.part_nbytes, strict=True):
            off = (e % 4) * n
            out[e, start:start + n] = p[off:off + n]
            start += n
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from strata.kernels.gpu import moe_forward

    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    lay = ExpertLayout(0, (int(QType.Q4_K), int(QType.Q4_K), int(QType.Q6_K)), D, F)
    host = records(lay, rng)
    arena = Arena([lay], E, pin=True)
    arena.layers[0].numpy()[:] = host
    slots = torch.from_numpy(host).to(dev)
    x = torch.randn(1, D, device=dev)
    wts = torch.full((1, K), 1.0 / K, device=dev)
    # 16 routings that together touch every expert (8 distinct each)
    perm = [rng.permutation(E) for _ in range(2)]
    id_sets = [torch.tensor(p[j * K:(j + 1) * K][None], dtype=torch.int64, device=dev)
               for p in perm for j in range(E // K)]
    identity = torch.arange(E, dtype=torch.int32, device=dev)
    out = torch.zeros(1, D, device=dev)

    def run(storage: torch.Tensor, table: torch.Tensor, i: int) -> None:
        g, u, d = lay.views(storage)
        moe_forward(x, id_sets[i % len(id_sets)], wts, table, g, u, d, lay.qtypes, D, F,
                    out=out)

    ref = torch.zeros(1, D, device=dev)
    g, u, d = lay.views(slots)
    moe_forward(x, id_sets[0], wts, identity, g, u, d, lay.qtypes, D, F, out=ref)
    mapped = torch.zeros(1, D, device=dev)
    g, u, d = lay.views(arena.layers[0])
    moe_forward(x, id_sets[0], wts, identity, g, u, d, lay.qtypes, D, F, out=mapped)
    same = bool(torch.equal(ref, mapped))
    ceil = measure()
    res = {"pinned": arena.pinned, "mapped_equals_vram": same, "expert_bytes": lay.nbytes,
           "ceilings": ceil}
    t_vram = graph_seconds(lambda i: run(slots, identity, i))
    t_map = graph_seconds(lambda i: run(arena.layers[0], identity, i))
    res["layer_8_of_8_vram_us"] = t_vram * 1e6
    res["layer_8_of_8_mapped_us"] = t_map * 1e6
    res["mapped_gb_s"] = K * lay.nbytes / t_map / 1e9
    # the decode step's gathered layer: n of the 8 routed experts missing from VRAM, their
    # records gathered from the arena into staging rows by gather_misses, then one
    # moe_forward over slots and rows
    from strata.kernels.gpu import gather_misses

    rows = torch.empty(K, lay.stride, dtype=torch.uint8, device=dev)
    for n_miss in (0, 1, 2, 4, 8):
        tables = []
        for ids in id_sets:
            t = identity.clone()
            t[ids[0, :n_miss]] = -1
            tables.append(t)

        def gathered(i: int, tables: list = tables) -> None:
            ids, table = id_sets[i % len(id_sets)], tables[i % len(tables)]
            gather_misses(ids, table, arena.layers[0], rows, lay.nbytes)
            g, u, d = lay.views(slots)
            moe_forward(x, ids, wts, table, g, u, d, lay.qtypes, D, F, out=out,
                        miss=lay.views(rows))

        def gather_only(i: int, tables: list = tables) -> None:
            gather_misses(id_sets[i % len(id_sets)], tables[i % len(tables)], arena.layers[0],
                          rows, lay.nbytes)
        t_layer, t_gather = graph_seconds(gathered), graph_seconds(gather_only)
        res[f"gathered_layer_{n_miss}_missed_us"] = t_layer * 1e6
        res[f"gather_{n_miss}_missed_us"] = t_gather * 1e6
        if n_miss:
            res[f"gather_{n_miss}_missed_gb_s"] = n_miss * lay.nbytes / t_gather / 1e9
    # the gather alone in a few looping programs (gather_misses(programs=)), as a copy beside
    # compute runs: what it costs in rate against a program per block
    for n_miss in (1, 2, 6, 8):
        tables = []
        for ids in id_sets:
            t = identity.clone()
            t[ids[0, :n_miss]] = -1
            tables.append(t)
        for programs in (16, 32, 64, 132, 264):
            t = graph_seconds(lambda i, tb=tables, pr=programs: gather_misses(
                id_sets[i % len(id_sets)], tb[i % len(tb)], arena.layers[0], rows, lay.nbytes,
                programs=pr))
            res[f"gather_{n_miss}_missed_{programs}_programs_gb_s"] = n_miss * lay.nbytes / t / 1e9
    # the same bytes copied (8 records) with the copy engine
    dst = torch.empty(K, lay.stride, dtype=torch.uint8, device=dev)
    t_copy = graph_seconds(lambda i: dst.copy_(arena.layers[0][(i % 16) * 8:(i % 16) * 8 + 8],
                                            non_blocking=True))
    res["copy_8_records_us"] = t_copy * 1e6
    res["copy_gb_s"] = K * lay.stride / t_copy / 1e9
    for k, v in res.items():
        print(f"{k}: {v:.1f}" if isinstance(v, float) else f"{k}: {v}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    arena.close()


if __name__ == "__main__":
    main()
