"""Where a decode step's time goes: GPU kernels (torch.profiler over eager steps) and the host's
share (the offload executor's host layers), then the step time with CUDA graphs.

    python scripts/profile_decode.py MODEL --vram-budget 40 [--steps 16] [--json F]

Prints the kernels by total GPU time per step, the host time per step spent in the executor's
host layers (`OffloadExperts.misses`, `OffloadExperts.run`), and the median step time with and
without graphs (same engine, same tokens).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from strata.config import EngineConfig
from strata.engine.decode_step import DecodeStep
from strata.engine.generator import Engine


def timed_steps(engine: Engine, n: int, token: int = 100) -> list[float]:
    kv = engine.model.new_cache(64 + n)
    engine.run_prompt(list(range(1, 33)), kv)
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits = engine.model.decode(token, kv)
        token = int(logits[0].argmax())
        out.append(time.perf_counter() - t0)
    return out


def host_share(engine: Engine, n: int) -> dict[str, float]:
    """Seconds per step inside the executor's host-layer calls (wrapped with timers)."""
    ex = engine.model.experts
    spent = {"misses": 0.0, "run": 0.0, "cpu_pool": 0.0}
    for name in ("misses", "run"):
        fn = getattr(ex, name)

        def wrap(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - t0
        setattr(ex, name, wrap)
    cpu0 = ex.stats.cpu_s
    timed_steps(engine, n)
    spent["cpu_pool"] = ex.stats.cpu_s - cpu0
    for name in ("misses", "run"):
        delattr(ex, name)
    return {k: v / n for k, v in spent.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--vram-budget", type=float, default=None)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    engine = Engine.load(a.model, config=EngineConfig(device="cuda", vram_budget_gib=a.vram_budget,
                                                      decode_step="eager"))
    step: DecodeStep = engine.model.step
    timed_steps(engine, 4)  # warm up (compiles)
    eager = timed_steps(engine, a.steps)
    host = host_share(engine, a.steps)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        timed_steps(engine, a.steps)
    rows = []
    for ev in prof.key_averages():
        gpu_us = getattr(ev, "device_time_total", 0.0) or getattr(ev, "cuda_time_total", 0.0)
        if gpu_us > 0:
            rows.append((gpu_us / a.steps, ev.count / a.steps, ev.key))
    rows.sort(reverse=True)
    gpu_total = sum(r[0] for r in rows)
    step.graphs = True
    graphs = timed_steps(engine, a.steps + 2)[2:]  # an eager step, a capture, then replays
    res = {"budget": a.vram_budget, "pieces": len(step.pieces),
           "eager_ms": 1e3 * statistics.median(eager), "graphs_ms": 1e3 * statistics.median(graphs),
           "gpu_kernels_ms": gpu_total / 1e3, "host_ms": {k: 1e3 * v for k, v in host.items()},
           "kernels": [{"us_per_step": round(u, 1), "launches_per_step": c, "name": k[:120]}
                       for u, c, k in rows[:30]]}
    print(f"budget {a.vram_budget} GiB, {len(step.pieces)} pieces: step {res['eager_ms']:.2f} ms "
          f"eager, {res['graphs_ms']:.2f} ms with graphs; GPU kernels {res['gpu_kernels_ms']:.2f} "
          "ms per step; host layers " + ", ".join(f"{k} {v:.2f} ms" for k, v in
                                                  res["host_ms"].items()))
    for r in res["kernels"]:
        print(f"  {r['us_per_step']:9.1f} us  {r['launches_per_step']:6.1f}x  {r['name']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
