"""How fast the fused decode MoE kernels run when they read experts straight from the pinned host
arena (mapped, zero-copy over PCIe) instead of VRAM slots, against the ceilings of the same run.

    python scripts/bench_mapped.py [--json F]

One Qwen3-30B-A3B MoE layer (128 experts, 8 routed, Q4_K gate/up, Q6_K down, one token): the
experts' records live in VRAM slots and, as the arena keeps them, in host memory registered with
cudaHostRegister. Each timed call routes the token to 8 experts of a rotating set (so neither
the L2 nor a previous call holds them) and runs moe_forward with the slot table pointing at
VRAM, or at the host records. Also: 1, 2 and 4 missed experts (the rest resident), and the
pinned copy of the same bytes with cudaMemcpyAsync, for comparison.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.bench.ceilings import measure  # noqa: E402
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


def time_calls(fn, n: int = 64) -> float:  # noqa: ANN001
    """Median seconds of one call, timed with CUDA events around batches of 16 calls."""
    for _ in range(3):
        fn(0)
    torch.cuda.synchronize()
    times = []
    for r in range(n // 16):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for i in range(16):
            fn(r * 16 + i)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / 16)
    return statistics.median(times)


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
    none = torch.full((E,), -1, dtype=torch.int32, device=dev)
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
    t_vram = time_calls(lambda i: run(slots, identity, i))
    t_map = time_calls(lambda i: run(arena.layers[0], identity, i))
    res["layer_8_of_8_vram_us"] = t_vram * 1e6
    res["layer_8_of_8_mapped_us"] = t_map * 1e6
    res["mapped_gb_s"] = K * lay.nbytes / t_map / 1e9
    # some misses: the layer as the decode step runs it (hits from VRAM, misses mapped)
    for n_miss in (1, 2, 4):
        def mixed(i: int, n_miss: int = n_miss) -> None:
            ids = id_sets[i % len(id_sets)]
            hit_t = identity.clone()
            hit_t[ids[0, :n_miss]] = -1
            miss_t = none.clone()
            miss_t[ids[0, :n_miss]] = ids[0, :n_miss].int()
            for storage, table in ((slots, hit_t), (arena.layers[0], miss_t)):
                g, u, d = lay.views(storage)
                moe_forward(x, ids, wts, table, g, u, d, lay.qtypes, D, F, out=out)
        res[f"layer_{n_miss}_missed_mapped_us"] = time_calls(mixed) * 1e6
    # the same bytes copied (8 records) with the copy engine
    dst = torch.empty(K, lay.stride, dtype=torch.uint8, device=dev)
    t_copy = time_calls(lambda i: dst.copy_(arena.layers[0][(i % 16) * 8:(i % 16) * 8 + 8],
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
