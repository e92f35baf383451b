"""Where a decode step's time goes: GPU kernels (torch.profiler over eager steps) and the host's
share (the offload executor's host layers), then the step time with CUDA graphs.

    python scripts/profile_decode.py MODEL --vram-budget 40 [--steps 16] [--json F]
        [--prefetch N] [--cpu-share N] [--threads T] [--trace F] [--unfused-route] [--batch N]

Prints the kernels of the decode steps by total GPU time per step, the host time per step spent
in the executor's calls (`OffloadExperts.decode_misses`, the CPU pool, cache admissions...,
prompt included), and the median step time with and without graphs (same engine, same tokens).
--trace writes a Chrome trace of a few replayed (graph) steps, every stream's kernels on one time
line: where PCIe idles between a layer's gathers, and what overlaps them.
--batch N (2..16) then times what `strata serve --batch N` runs: the one-sequence step over a
cache of the server's paged KV pool (its kernels too), and the batched step at each batch size
(past N: one sequence's chunk beside the others' tokens; its kernels a step, replayed, in the
json; 8, 16 and 32 rows printed)
(graphs replayed; the sequences after a 128-token prompt each).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import numpy as np
import torch

from strata.bench.profiling import kernel_rows, print_rows
from strata.config import EngineConfig
from strata.engine.decode_step import DecodeStep
from strata.engine.generator import Engine


def timed_steps(engine: Engine, n: int, seed: int = 0,
                around: contextlib.AbstractContextManager | None = None,
                pool: object = None) -> list[float]:
    """n decode steps after a 128-token random prompt (as strata bench runs them); `around`
    (a profiler) is entered for the decode steps only; pool (a KVSlots): the cache one of its
    slots, as the server's."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, engine.config.n_vocab, 128).tolist()
    kv = engine.model.new_cache(len(prompt) + n) if pool is None else pool.take()
    token = int(engine.run_prompt(prompt, kv)[0].argmax())
    out = []
    with around or contextlib.nullcontext():
        for _ in range(n):
            if engine.model.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            logits = engine.model.decode(token, kv)
            token = int(logits[0].argmax())
            out.append(time.perf_counter() - t0)
    if pool is not None:
        pool.give(kv)
    return out


def batch_steps(engine: Engine, pool, batch, n: int,  # noqa: ANN001
                kernels: dict | None = None) -> dict[int, float]:
    """Median ms of a batched step (graphs: an eager step and a capture first) at each of its
    sizes, each sequence after a 128-token random prompt (past the pool's slots, the first
    sequence takes the rows the others leave, as a prompt's chunk beside them, at the same
    positions each step); with `kernels` (a dict), each size's kernels a step (kernel_rows over
    n more steps, replayed) go into kernels[size]."""
    rng = np.random.default_rng(1)
    out = {}
    act = torch.profiler.ProfilerActivity

    def run(tokens: list[int], caches: list, takes: list[int]) -> list[int]:
        start = caches[0].length
        last = batch(tokens, caches, takes).argmax(-1).tolist()
        if takes[0] > 1:  # (the chunk again at its positions next step)
            caches[0].truncate(start)
            return tokens[:takes[0]] + last[1:]
        return last

    for size in batch.sizes:
        caches = [pool.take() for _ in range(min(size, pool.n_slots))]
        takes = [1 + size - len(caches)] + [1] * (len(caches) - 1)
        for kv in caches:
            engine.run_prompt(rng.integers(0, engine.config.n_vocab, 128).tolist(), kv)
        tokens = rng.integers(0, engine.config.n_vocab, size).tolist()
        times = []
        for _ in range(n + 2):
            if engine.model.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            tokens = run(tokens, caches, takes)
            times.append(time.perf_counter() - t0)
        out[size] = 1e3 * statistics.median(times[2:])
        if kernels is not None:
            dev = engine.model.device.type
            prof = torch.profiler.profile(activities=[act.CUDA if dev == "cuda" else act.CPU])
            with prof:
                for _ in range(n):
                    tokens = run(tokens, caches, takes)
            kernels[size] = kernel_rows(prof, dev, n, top=1 << 30)
        for kv in caches:
            pool.give(kv)
    return out


def host_share(engine: Engine, n: int) -> dict[str, float]:
    """Milliseconds per step inside the executor's host-side calls (wrapped with timers), and
    the pairs computed on the CPU and copied per step."""
    ex = engine.model.experts
    targets = {"decode_misses": ex, "run": ex, "cpu_pool": ex.pool, "admit": ex.cache,
               "before_compute": ex.cache, "fused_run": ex.fused, "staged": ex,
               "admit_after": ex, "flush": ex.cache}
    attrs = {"cpu_pool": "run", "fused_run": "run", "staged": "_run_staged",
             "admit_after": "_admit_after"}
    spent = dict.fromkeys(targets, 0.0)
    for name, obj in targets.items():
        attr = attrs.get(name, name)
        fn = getattr(obj, attr)

        def wrap(*a, _fn=fn, _name=name, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - t0
        setattr(obj, attr, wrap)
    st = ex.stats
    before = (st.cpu.sum(), st.streamed.sum(), st.hits.sum())
    timed_steps(engine, n)
    for name, obj in targets.items():
        delattr(obj, attrs.get(name, name))
    out = {f"{k}_ms": 1e3 * v / n for k, v in spent.items()}
    out.update(cpu_pairs=float(st.cpu.sum() - before[0]) / n,
               copied_pairs=float(st.streamed.sum() - before[1]) / n)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--vram-budget", type=float, default=None)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--json", default=None)
    p.add_argument("--device", default="cuda")
    p.add_argument("--prefetch", default="auto", help="auto (the engine's default) or N")
    p.add_argument("--cpu-share", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU pool threads (the engine's)")
    p.add_argument("--trace", default=None, help="Chrome trace of 8 steps here (6 replayed)")
    p.add_argument("--unfused-route", action="store_true",
                   help="a layer's residual step, router and top-k as three launches (timing)")
    p.add_argument("--kv-type", default="f16", help="KV cache elements (strata's CUDA default)")
    p.add_argument("--batch", type=int, default=1,
                   help="also the server's paged pool of N sequences and its batched step")
    a = p.parse_args()
    prefetch = None if a.prefetch == "auto" else int(a.prefetch)
    DecodeStep.fuse_route = not a.unfused_route
    engine = Engine.load(a.model, config=EngineConfig(device=a.device, offload="on",
                                                      vram_budget_gib=a.vram_budget,
                                                      decode_step="eager", prefetch=prefetch,
                                                      cpu_share=a.cpu_share,
                                                      threads=a.threads, kv_type=a.kv_type,
                                                      sequences=a.batch))
    step: DecodeStep = engine.model.step
    timed_steps(engine, 4)  # warm up (compiles)
    eager = timed_steps(engine, a.steps)
    host = host_share(engine, a.steps)
    act = torch.profiler.ProfilerActivity
    prof = torch.profiler.profile(activities=[act.CUDA if a.device == "cuda" else act.CPU])
    timed_steps(engine, a.steps, around=prof)
    every = kernel_rows(prof, a.device, a.steps, top=1 << 30)
    gpu_total = sum(r["us"] for r in every)
    step.graphs = a.device == "cuda"
    graphs = timed_steps(engine, a.steps + 2)[2:]  # an eager step, a capture, then replays
    if a.trace:
        prof = torch.profiler.profile(activities=[act.CPU, act.CUDA])
        timed_steps(engine, 8, around=prof)  # an eager step, a capture, replays
        prof.export_chrome_trace(a.trace)
    res = {"budget": a.vram_budget, "pieces": len(step.pieces), "fuse_route": step.fuse_route,
           "eager_ms": 1e3 * statistics.median(eager), "graphs_ms": 1e3 * statistics.median(graphs),
           "gpu_kernels_ms": gpu_total / 1e3, "host": host,
           "kernels": [{"us_per_step": r["us"], "launches_per_step": r["launches"],
                        "name": r["name"]} for r in every[:30]]}
    print(f"budget {a.vram_budget} GiB, {len(step.pieces)} pieces: step {res['eager_ms']:.2f} ms "
          f"eager, {res['graphs_ms']:.2f} ms with graphs; GPU kernels {res['gpu_kernels_ms']:.2f} "
          "ms per step; per step: " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()))
    print_rows(every[:30], "step")
    if a.batch > 1:
        from strata.server import kv_batch

        step.graphs = False
        pool, batch = kv_batch.batched(engine, "graphs" if a.device == "cuda" else "eager")
        prof = torch.profiler.profile(activities=[act.CUDA if a.device == "cuda" else act.CPU])
        timed_steps(engine, a.steps, around=prof, pool=pool)
        paged = kernel_rows(prof, a.device, a.steps, top=1 << 30)
        step.graphs = a.device == "cuda"
        replay = timed_steps(engine, a.steps + 2, pool=pool)[2:]
        res["paged_graphs_ms"] = 1e3 * statistics.median(replay)
        res["paged_gpu_kernels_ms"] = sum(r["us"] for r in paged) / 1e3
        kernels: dict[int, list[dict]] = {}
        res["batched_ms"] = batch_steps(engine, pool, batch, a.steps, kernels)
        res["batched_gpu_kernels_ms"] = {b: sum(r["us"] for r in rows) / 1e3
                                         for b, rows in kernels.items()}
        res["batched_kernels"] = {b: rows[:30] for b, rows in kernels.items()}
        print(f"one sequence over the server's paged pool ({pool.n_slots} x {pool.capacity} "
              f"rows, blocks of {pool.block}): {res['paged_graphs_ms']:.2f} ms with graphs, "
              f"GPU kernels {res['paged_gpu_kernels_ms']:.2f} ms eagerly")
        print_rows(paged[:12], "step")
        print("batched step, graphs: " + ", ".join(
            f"{b} rows {ms:.2f} ms ({b / ms * 1e3:.0f} tok/s; kernels "
            f"{res['batched_gpu_kernels_ms'][b]:.2f} ms)" for b, ms in res["batched_ms"].items()))
        for b in (8, 16, 32):
            if b in kernels:
                print(f"the batched step of {b} rows, replayed:")
                print_rows(kernels[b][:14], "step")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
