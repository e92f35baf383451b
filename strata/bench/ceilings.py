"""Measure the machine's bandwidth ceilings: GPU memory copy, pinned host->GPU copy, host RAM read.

Every speed figure Strata reports is compared with these, measured in the same run.
"""

from __future__ import annotations

import time

import torch

GB = 1e9


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def host_read_gbs(nbytes: int = 1 << 30, repeats: int = 5, threads: int | None = None) -> float:
    """Host RAM read bandwidth: a sum over a buffer larger than the caches (torch's CPU threads)."""
    if threads:
        torch.set_num_threads(threads)
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / _median(times) / GB


def hbm_copy_gbs(nbytes: int = 2 << 30, repeats: int = 20) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return 2 * nbytes / cuda_seconds(lambda: dst.copy_(src), repeats) / GB


def pcie_h2d_gbs(nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Pinned host memory to the GPU."""
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    src.random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / cuda_seconds(lambda: dst.copy_(src, non_blocking=True), repeats) / GB


def cuda_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    """Median seconds of fn() on the current stream between two CUDA events, after a warm-up
    call (eager: launch costs included)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return _median(times)


def measure(device_bytes: int | None = None) -> dict[str, float]:
    """The ceilings; device_bytes: the most VRAM the GPU's test buffers may take at once (a
    quarter of the smallest --vram-budget: the run's VRAM peak stays inside it; 4 GiB
    without). The HBM copy's buffers stay far above the 60 MB L2 of an H200 even at 2 GiB."""
    out = {"host_read_GBs": host_read_gbs(), "cpu_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        most = device_bytes or 4 << 30
        out |= {"hbm_copy_GBs": hbm_copy_gbs(min(2 << 30, most // 2)),
                "pcie_h2d_pinned_GBs": pcie_h2d_gbs(min(1 << 30, most)),
                "gpu": torch.cuda.get_device_name()}
        # the test buffers back to the driver: kept in torch's cache they were counted
        # in every nvidia-smi peak of the run (4.6 GiB before the model loaded, on an H200)
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=1))
