"""Does a gather of missed experts from the mapped arena (PCIe) slow compute running beside it?

A decode prefetch copies the next layer's likely experts on a side stream while the main stream
computes. The gather kernel's loads wait on PCIe; this times, with CUDA events:
  - compute alone: a chain of float32 GEMVs (4096 x 4096, about 17 us each) on the main stream;
  - gather alone: N experts' records (30B-A3B Q4_K_M size) from page-locked host memory mapped
    for the device, for a grid of one program per block and for a few programs looping;
  - both at once, and how much longer each took than alone.

    python scripts/bench_gather_overlap.py [--experts 2] [--programs 8,16,32,64] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from strata.bench.ceilings import cuda_seconds
from strata.kernels.gpu import gather_misses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=2)
    p.add_argument("--record-bytes", type=int, default=2_777_088)  # 30B-A3B Q4_K/Q4_K/Q6_K
    p.add_argument("--programs", default="8,16,32,64")
    p.add_argument("--gemvs", type=int, default=16)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    n_rec = 64
    # host records registered with CUDA and read by the kernel over PCIe, as the arena's are
    records = torch.randint(0, 256, (n_rec, a.record_bytes), dtype=torch.uint8)
    err = torch.cuda.cudart().cudaHostRegister(records.data_ptr(), records.numel(), 0)
    if int(err) != 0:
        raise SystemExit(f"cudaHostRegister failed: {err}")
    rows = torch.empty(a.experts, a.record_bytes, dtype=torch.uint8, device=dev)
    slot_of = torch.full((n_rec,), -1, dtype=torch.int32, device=dev)
    w = torch.randn(4096, 4096, device=dev)
    x = torch.randn(4096, device=dev)
    side = torch.cuda.Stream()
    step = [0]

    def ids() -> torch.Tensor:
        step[0] += 1  # other records each time: nothing comes from a cache
        return (torch.arange(a.experts, device=dev) * 7 + step[0] * 13) % n_rec

    def compute() -> None:
        y = x
        for _ in range(a.gemvs):
            y = torch.mv(w, x) + y

    def gather(programs: int | None) -> None:
        gather_misses(ids()[None], slot_of, records, rows, a.record_bytes, programs=programs)

    compute_us = cuda_seconds(compute, a.repeats) * 1e6
    res = {"experts": a.experts, "record_bytes": a.record_bytes,
           "compute_alone_us": compute_us, "cases": []}
    print(f"compute alone: {compute_us:.1f} us ({a.gemvs} GEMVs 4096 x 4096 f32)")
    nbytes = a.experts * a.record_bytes
    for programs in [None] + [int(v) for v in a.programs.split(",")]:
        alone = cuda_seconds(lambda pr=programs: gather(pr), a.repeats) * 1e6
        both_c, both_g = [], []
        for _ in range(a.repeats):
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            torch.cuda.synchronize()
            ev[0].record()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                ev[2].record(side)
                gather(programs)
                ev[3].record(side)
            compute()
            ev[1].record()
            torch.cuda.synchronize()
            both_c.append(ev[0].elapsed_time(ev[1]) * 1e3)
            both_g.append(ev[2].elapsed_time(ev[3]) * 1e3)
        row = {"programs": programs, "gather_alone_us": alone,
               "gather_alone_GBs": nbytes / alone / 1e3,
               "compute_beside_us": statistics.median(both_c),
               "gather_beside_us": statistics.median(both_g)}
        res["cases"].append(row)
        print(f"gather {a.experts} experts, programs {programs or 'one per block'}: alone "
              f"{alone:.1f} us ({row['gather_alone_GBs']:.1f} GB/s); together: compute "
              f"{row['compute_beside_us']:.1f} us (alone {compute_us:.1f}), gather "
              f"{row['gather_beside_us']:.1f} us", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
