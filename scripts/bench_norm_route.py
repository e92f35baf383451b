"""Time a decode token's fused residual add, RMS norm, router and top-k (decode_ops.norm_route)
by its top-k (the rank comparison at each BLOCK_J, the bitonic top-k), for the routers of
Qwen3-30B-A3B (128 experts, top 8) and Qwen3.5/3.6-MoE (256, top 8), D 2048, against the three
launches it replaces (fuse=False) with either top-k.

    python scripts/bench_norm_route.py [--json F]

Medians over CUDA-graph replays of 16 calls (strata.bench.graph_timing), each call on its own
router copy (so the L2 does not hold them all). Each top-k's fused launch is also checked
against torch's routing on 64 random rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.bench.graph_timing import graph_seconds  # noqa: E402
from strata.kernels.gpu import decode_ops  # noqa: E402


def layer_seconds(e: int, d: int, k: int, fuse: bool) -> float:
    """One call's median seconds for a router of e experts over d, top k."""
    dev = torch.device("cuda")
    x = torch.randn(1, d, device=dev)
    delta = torch.randn(1, d, device=dev) * 0.01
    w = torch.rand(d, device=dev) + 0.5
    routers = [torch.randn(e, d, device=dev) * 0.02 for _ in range(16)]
    sync = torch.zeros(1, dtype=torch.int32, device=dev)
    return graph_seconds(lambda i: decode_ops.norm_route(x, delta, w, 1e-6, routers[i], k, True,
                                                         sync, fuse=fuse))


def agrees(e: int, d: int, k: int) -> str:
    """Whether the fused launch's ids and weights (this process's top-k pick) equal the torch
    reference's on 64 random rows (logits without near ties: a misrouting is then a bug)."""
    dev = torch.device("cuda")
    sync = torch.zeros(1, dtype=torch.int32, device=dev)
    bad = 0
    for i in range(64):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(1, d, generator=g).to(dev)
        w = (torch.rand(d, generator=g) + 0.5).to(dev)
        router = (torch.randn(e, d, generator=g) * 0.02).to(dev)
        h, ids, wts = decode_ops.norm_route(x.clone(), None, w, 1e-6, router, k, True, sync)
        logits = h @ router.T
        top = torch.topk(logits, k + 1, dim=-1)
        if float((top.values[0, k - 1] - top.values[0, k]).abs()) < 1e-4:
            continue  # (a near tie: either pick is right)
        p = torch.softmax(logits, -1).gather(1, top.indices[:, :k])
        bad += not (torch.equal(ids, top.indices[:, :k])
                    and torch.allclose(wts, p / p.sum(-1, keepdim=True), rtol=1e-4, atol=1e-6))
    return f"{bad} of 64 rows DIFFER" if bad else "ids and weights agree with torch's on 64 rows"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    d, k, rows = 2048, 8, []
    blocks = decode_ops._route_blocks
    decode_ops.NORM_ROUTE_MAX_EXPERTS = 1 << 20  # (fused at every E here: that is the question)
    for e in (128, 256):
        for sort in (False, True):
            decode_ops.ROUTE_SORT_MIN_EXPERTS = 1 if sort else None
            pick = "bitonic top-k" if sort else "rank comparison"
            for bj in ((None,) if sort else (None, 8, 16, 32, 64)):
                if bj is not None and bj > e:
                    continue
                decode_ops._route_blocks = (blocks if bj is None else
                                            lambda n, bj=bj: blocks(n) | dict(BLOCK_J=bj))
                us = 1e6 * layer_seconds(e, d, k, True)
                label = (pick if sort else f"{pick}, BLOCK_J {blocks(e)['BLOCK_J']} (default)"
                         if bj is None else f"{pick}, BLOCK_J {bj}")
                check = agrees(e, d, k) if bj is None else ""
                rows.append(dict(experts=e, variant=f"fused, {label}", us=us, check=check))
                print(f"E {e}: fused, {label}: {us:.2f} us" + (f" ({check})" if check else ""))
            decode_ops._route_blocks = blocks
            us = 1e6 * layer_seconds(e, d, k, False)
            rows.append(dict(experts=e, variant=f"three launches, {pick}", us=us))
            print(f"E {e}: three launches, {pick}: {us:.2f} us")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
