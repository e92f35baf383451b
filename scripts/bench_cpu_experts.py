"""GB/s of expert weights the CPU backends process, against host RAM read bandwidth.

One call = one layer's missed experts: --experts experts (Qwen3-30B-A3B shapes by default,
D=2048, F=768), each with n tokens, for n in --tokens. Calls rotate through an arena of
--arena experts packed as strata.experts.layout packs them (64 by default: about 200 MB, which a
large L3 partly holds; 1024 for figures read from RAM, the default of --share). GB/s = weight
bytes of one call / median call time. Also measured: host RAM read
(strata.bench.ceilings.host_read_gbs) at each thread count, and the per-call overhead (one tiny
expert, one token). "best" is the fastest call: on a shared machine the median carries
other processes' load, most of all at thread counts near the core count.

    .venv/bin/python scripts/bench_cpu_experts.py --json /tmp/cpu_experts.json

--share times, instead, the call of a decode step's CPU share (run_strided: one token through 1
or 2 experts picked by slot in a layer's records; on the ggml graph, GgmlExperts, and on the C
pool with ggml's dot kernels, TokenPool, where it builds), back to back and with a
--gap-us pause between calls (busy-waited), as the share makes them once a layer: a pool whose
threads fall asleep between calls pays their wake-up in every call. --pcie-load times each case
also while a thread copies page-locked host memory to the GPU without pause, as a decode step's
gathers read the arena while the share computes (both read host RAM).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import threading
import time

import numpy as np
import torch

from strata.bench.ceilings import host_read_gbs
from strata.kernels.cpu import ExpertJob, ggml_available, make_cpu_experts
from strata.quant import QType, random_rows, row_nbytes


def make_arena(qtypes: tuple[QType, QType, QType], d: int, f: int, n: int,
               rng: np.random.Generator):
    """n experts as packed records (8 distinct ones, tiled): (per expert (gate, up, down) views,
    an expert's weight bytes, the records uint8 [n, stride], the parts' offsets in a record)."""
    parts = (f * row_nbytes(qtypes[0], d), f * row_nbytes(qtypes[1], d),
             d * row_nbytes(qtypes[2], f))
    stride = (sum(parts) + 255) // 256 * 256
    buf = torch.zeros(n, stride, dtype=torch.uint8)
    for e in range(min(n, 8)):
        rows = [random_rows(qtypes[0], f, d, rng, 0.02), random_rows(qtypes[1], f, d, rng, 0.02),
                random_rows(qtypes[2], d, f, rng, 0.02)]
        buf[e, :sum(parts)] = torch.from_numpy(np.concatenate([r.reshape(-1) for r in rows]))
    for e in range(8, n):
        buf[e] = buf[e % 8]
    offs = np.cumsum((0,) + parts)
    shapes = ((f, parts[0] // f), (f, parts[1] // f), (d, parts[2] // d))
    views = [tuple(buf[e, offs[i]:offs[i + 1]].view(shapes[i]) for i in range(3))
             for e in range(n)]
    return views, sum(parts), buf, offs[:3]


def time_calls(experts, h, calls: list[list[ExpertJob]], repeats: int) -> tuple[float, float]:
    """(median, fastest) seconds per call."""
    out = torch.zeros_like(h)
    for jobs in calls[:2]:
        experts.run(h, jobs, out)  # warm up: graphs, pages
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        experts.run(h, calls[i % len(calls)], out)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def bench(args: argparse.Namespace) -> dict:
    cores = len(os.sched_getaffinity(0))
    thread_counts = sorted({1, cores}) if args.threads == "1,all" else \
        [int(t) for t in args.threads.split(",")]
    backends = [b for b in args.backends.split(",") if b != "ggml" or ggml_available()]
    result = {"machine": {"cores": cores, "cpu": platform.processor() or platform.machine()},
              "shape": {"d_model": args.d_model, "d_expert": args.d_expert,
                        "experts_per_call": args.experts},
              "host_read_GBs": {}, "rows": [], "overhead_us": {}}
    if "ggml" in backends:
        from strata.kernels.cpu.ggml_lib import uses_openmp

        result["machine"]["ggml_openmp"] = uses_openmp()
    for t in thread_counts:
        result["host_read_GBs"][t] = host_read_gbs(threads=t)
    rng = np.random.default_rng(0)
    for name in args.types.split(","):
        qtype = QType[name]
        arena, expert_bytes, _, _ = make_arena((qtype,) * 3, args.d_model, args.d_expert,
                                               args.arena, rng)
        for backend in backends:
            for t in thread_counts:
                torch.set_num_threads(t)  # torch ops in both backends share these threads
                experts = make_cpu_experts(backend, threads=t)
                for n in [int(x) for x in args.tokens.split(",")]:
                    h = torch.randn(n, args.d_model)
                    calls = [[ExpertJob(*arena[(c * args.experts + j) % args.arena],
                                        (qtype,) * 3, torch.arange(n), torch.full((n,), 0.125))
                              for j in range(args.experts)] for c in range(args.arena)]
                    reps = args.repeats if backend == "ggml" else max(3, args.repeats // 10)
                    sec, best = time_calls(experts, h, calls, reps)
                    gbs = expert_bytes * args.experts / sec / 1e9
                    row = {"type": name, "backend": backend, "threads": t, "tokens": n,
                           "ms_per_call": sec * 1e3, "GBs": gbs,
                           "best_GBs": expert_bytes * args.experts / best / 1e9,
                           "of_host_read": gbs / result["host_read_GBs"][t]}
                    result["rows"].append(row)
                    print(f"{name:8s} {backend:5s} {t:3d} thr {n:3d} tok  {sec * 1e3:8.2f} ms  "
                          f"{gbs:6.2f} GB/s (best {row['best_GBs']:5.2f})  "
                          f"{row['of_host_read']:6.1%} of host read", flush=True)
                experts.close()
    tiny = make_arena((QType.Q4_K,) * 3, 256, 256, 1, rng)[0]
    for backend in backends:
        for t in thread_counts:
            torch.set_num_threads(t)
            experts = make_cpu_experts(backend, threads=t)
            jobs = [ExpertJob(*tiny[0], (QType.Q4_K,) * 3, torch.zeros(1, dtype=torch.long),
                              torch.ones(1))]
            sec, _ = time_calls(experts, torch.randn(1, 256), [jobs], 200)
            result["overhead_us"][f"{backend}/{t}"] = sec * 1e6
            experts.close()
    return result


class PcieLoad:
    """A thread copying 256 MiB of page-locked host memory to the GPU over and over, while on;
    `gbs()` is what it moved per second of being on."""

    def __init__(self) -> None:
        self.src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
        self.dst = torch.empty_like(self.src, device="cuda")
        self.stream = torch.cuda.Stream()
        self.on, self.quit = threading.Event(), False
        self.moved, self.busy_s = 0, 0.0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.quit:
            if not self.on.wait(timeout=0.1):
                continue
            t0 = time.perf_counter()
            with torch.cuda.stream(self.stream):
                self.dst.copy_(self.src, non_blocking=True)
            self.stream.synchronize()
            self.moved += self.src.numel()
            self.busy_s += time.perf_counter() - t0

    def gbs(self) -> float:
        return self.moved / max(self.busy_s, 1e-9) / 1e9

    def close(self) -> None:
        self.quit = True
        self.on.clear()
        self.thread.join()


def bench_share(args: argparse.Namespace) -> dict:
    cores = len(os.sched_getaffinity(0))
    thread_counts = [int(t) for t in args.threads.replace("all", str(cores)).split(",")]
    result = {"machine": {"cores": cores, "cpu": platform.processor() or platform.machine(),
                          "env": {k: v for k, v in os.environ.items()
                                  if k.startswith(("OMP_", "GOMP_"))}},
              "shape": {"d_model": args.d_model, "d_expert": args.d_expert}, "share": []}
    from strata.kernels.cpu.ggml_lib import cpu_features, uses_openmp

    result["machine"]["ggml_openmp"] = uses_openmp()
    result["machine"]["ggml_cpu_features"] = cpu_features()
    print(f"share call: ggml built with {', '.join(cpu_features())}; OpenMP {uses_openmp()}")
    rng = np.random.default_rng(0)
    q = (QType.Q4_K, QType.Q4_K, QType.Q6_K)  # Q4_K_M's usual expert mix
    _, expert_bytes, buf, offs = make_arena(q, args.d_model, args.d_expert, args.arena, rng)
    bases = tuple(buf.data_ptr() + int(o) for o in offs)
    stride = buf.stride(0)
    x = rng.standard_normal(args.d_model).astype(np.float32)
    load = PcieLoad() if args.pcie_load else None
    cases = [(gap, loaded) for loaded in ((False, True) if load else (False,))
             for gap in (0.0, args.gap_us * 1e-6)]
    from strata.kernels.cpu.token_pool import TokenPool

    pools = ["graph"] + (["token"] if TokenPool.available() is None else [])
    if len(pools) == 1:
        print(f"share call: the token pool is skipped: {TokenPool.available()}")
    for t, pool in ((t, pool) for t in thread_counts for pool in pools):
        experts = make_cpu_experts("ggml", threads=t) if pool == "graph" else TokenPool(t)
        for n in (1, 2):
            w = np.full(n, 0.5, np.float32)
            for gap, loaded in cases:
                if loaded:
                    load.moved, load.busy_s = 0, 0.0
                    load.on.set()
                    time.sleep(0.05)
                times = []
                for i in range(args.repeats * 10 + 5):
                    slots = np.array([(i * 7 + j * 13) % args.arena for j in range(n)],
                                     np.int32)
                    t0 = time.perf_counter()
                    experts.run_strided(x, tuple(int(v) for v in q), args.d_expert, bases,
                                        stride, args.arena, slots, w)
                    t1 = time.perf_counter()
                    if i >= 5:
                        times.append(t1 - t0)
                    while time.perf_counter() - t1 < gap:
                        pass
                us = statistics.median(times) * 1e6
                row = {"pool": pool, "threads": t, "experts": n, "gap_us": gap * 1e6,
                       "us_per_call": us,
                       "best_us": min(times) * 1e6, "GBs": expert_bytes * n / us / 1e3}
                note = ""
                if loaded:
                    load.on.clear()
                    row["pcie_load_GBs"] = load.gbs()
                    note = f"  while host->GPU copies ran at {row['pcie_load_GBs']:.1f} GB/s"
                result["share"].append(row)
                print(f"share call: {pool:5s} {t:3d} thr {n} expert(s) gap {gap * 1e6:4.0f} us  "
                      f"{us:7.1f} us (best {row['best_us']:6.1f})  {row['GBs']:5.1f} GB/s{note}",
                      flush=True)
        experts.close()
    if load is not None:
        load.close()
    return result


def print_table(r: dict) -> None:
    reads = ", ".join(f"{t} thr {g:.1f} GB/s" for t, g in r["host_read_GBs"].items())
    print(f"\nhost RAM read: {reads}; ggml OpenMP: {r['machine'].get('ggml_openmp')}")
    print("| type | backend | threads | tok/expert | ms/call | GB/s | best GB/s | of host read |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in r["rows"]:
        print(f"| {row['type']} | {row['backend']} | {row['threads']} | {row['tokens']} | "
              f"{row['ms_per_call']:.2f} | {row['GBs']:.2f} | {row['best_GBs']:.2f} | "
              f"{row['of_host_read']:.0%} |")
    print("per-call overhead (one 256x256 Q4_K expert, 1 token): " + ", ".join(
        f"{k} thr {v:.0f} us" for k, v in r["overhead_us"].items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--types", default="Q4_K,Q6_K,Q8_0,IQ2_XS,IQ3_XXS")
    p.add_argument("--backends", default="ggml,torch")
    p.add_argument("--threads", default="1,all", help='"1,all" or a list like 1,4,16')
    p.add_argument("--tokens", default="1,4,16", help="tokens per expert")
    p.add_argument("--experts", type=int, default=8, help="missed experts per call")
    p.add_argument("--arena", type=int, default=None,
                   help="experts the calls rotate through (64; 1024 with --share)")
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--d-expert", type=int, default=768)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--share", action="store_true",
                   help="time the CPU share's one-token call instead (ggml graph and token "
                   "pool; --threads)")
    p.add_argument("--gap-us", type=float, default=400.0,
                   help="--share: pause between calls, as between a decode step's layers")
    p.add_argument("--pcie-load", action="store_true",
                   help="--share: time each case also while host->GPU copies run (CUDA)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.arena is None:
        args.arena = 1024 if args.share else 64
    if args.share:
        result = bench_share(args)
    else:
        result = bench(args)
        print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
