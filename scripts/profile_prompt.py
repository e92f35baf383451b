"""How busy the copy engine and the compute stream are while a prompt streams experts.

    python scripts/profile_prompt.py MODEL --vram-budget 6 --expert-cache 0 --prompt-len 8192 \
        [--host-routing] [--trace trace.json] [--json F]

Runs the prompt once to warm up, then once under torch.profiler, and prints the wall time, the
time host-to-device copies were in flight (the union of their intervals: copies on the ring's
copy stream and any other), the time kernels ran, and their overlap, with the bytes copied and
the rate over the wall time and over the copies' own time; then the --top ops by device time.
A short prompt with every expert resident (--vram-budget 40 --prompt-len 128) shows where its
time goes: kernels busy for most of the wall time, or the host between them. --trace writes
the Chrome trace (chrome://tracing, ui.perfetto.dev) for a look at one layer's banks.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from strata.bench.profiling import kernel_rows, print_rows
from strata.config import EngineConfig
from strata.engine.generator import Engine


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merge [start, end) intervals."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def overlap(x: list[tuple[float, float]], y: list[tuple[float, float]]) -> float:
    """Length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        total += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return total


def busy(events, device: str) -> tuple[list, list]:  # noqa: ANN001 (profiler events)
    """(host-to-device copy intervals, kernel intervals), merged, in microseconds."""
    copies, kernels = [], []
    for ev in events:
        name = ev.name
        start = ev.time_range.start
        end = ev.time_range.end
        if device == "cuda" and getattr(ev, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        if name.startswith("Memcpy HtoD"):
            copies.append((start, end))
        elif not name.startswith("Memcpy") and not name.startswith("Memset"):
            kernels.append((start, end))
    return union(copies), union(kernels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--vram-budget", type=float, default=None)
    p.add_argument("--expert-cache", default="auto")
    p.add_argument("--prompt-len", type=int, default=8192)
    p.add_argument("--ring-bytes", type=int, default=None)
    p.add_argument("--host-routing", action="store_true",
                   help="read every chunk's routing on the host (OffloadExperts._streams_routed "
                   "off), to compare with the device-routed streaming")
    p.add_argument("--top", type=int, default=15, help="the longest ops by device time listed")
    p.add_argument("--trace", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--kv-type", default="f16", help="KV cache elements (strata's CUDA default)")
    a = p.parse_args()
    ec = EngineConfig(device=a.device, offload="on", vram_budget_gib=a.vram_budget,
                      expert_cache=a.expert_cache, ring_bytes=a.ring_bytes, ctx=a.prompt_len,
                      kv_type=a.kv_type)
    engine = Engine.load(a.model, config=ec)
    if a.host_routing:
        from strata.experts.offload import OffloadExperts

        OffloadExperts._streams_routed = lambda *args: False
    prompt = np.random.default_rng(0).integers(0, engine.config.n_vocab, a.prompt_len).tolist()
    ring = engine.model.experts.ring  # None when every expert has a cache slot

    def streamed_bytes() -> int:
        return ring.streamed_bytes if ring is not None else 0

    def run() -> tuple[float, int]:
        kv = engine.model.new_cache(a.prompt_len)
        streamed0 = streamed_bytes()
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.run_prompt(prompt, kv)
        if a.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0, streamed_bytes() - streamed0

    run()  # warm-up
    act = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[act.CUDA if a.device == "cuda" else act.CPU]) as prof:
        wall, streamed = run()
    copies, kernels = busy(prof.events(), a.device)
    c_us, k_us, both = length(copies), length(kernels), overlap(copies, kernels)
    res = {"prompt_len": a.prompt_len, "wall_s": wall, "tok_s": a.prompt_len / wall,
           "streamed_gb": streamed / 1e9, "copy_busy_s": c_us / 1e6, "kernel_busy_s": k_us / 1e6,
           "overlap_s": both / 1e6, "gbs_over_wall": streamed / wall / 1e9,
           "gbs_while_copying": streamed / (c_us / 1e6) / 1e9 if c_us else 0.0,
           "kernels": kernel_rows(prof, a.device, top=a.top)}
    print(f"prompt {a.prompt_len} tokens: {wall:.3f} s ({res['tok_s']:.0f} tok/s); streamed "
          f"{res['streamed_gb']:.2f} GB: {res['gbs_over_wall']:.1f} GB/s over the wall time, "
          f"{res['gbs_while_copying']:.1f} GB/s while copying; copies in flight "
          f"{res['copy_busy_s']:.3f} s, kernels {res['kernel_busy_s']:.3f} s, both at once "
          f"{res['overlap_s']:.3f} s")
    print_rows(res["kernels"], "prompt")
    chunks = getattr(engine.model, "chunks", None)
    if chunks is not None:  # (whether the timed prompt replayed the prompt graphs, and if not why)
        res["prompt_graphs"] = chunks.line()
        print(res["prompt_graphs"])
    if a.trace:
        prof.export_chrome_trace(a.trace)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
