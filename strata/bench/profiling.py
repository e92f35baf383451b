"""Kernel tables from a torch.profiler run, for the profiling scripts (scripts/profile_decode.py,
scripts/profile_prompt.py)."""

from __future__ import annotations

import torch


def kernel_rows(prof: torch.profiler.profile, device: str, per: int = 1,
                top: int = 30) -> list[dict]:
    """The `top` ops by device time (CUDA; CPU self time on the CPU), each divided by `per` (the
    steps or runs profiled): [{"us": time, "launches": count, "name": key}], longest first."""
    rows = []
    for ev in prof.key_averages():
        us = (getattr(ev, "device_time_total", 0.0) if device == "cuda"
              else ev.self_cpu_time_total)
        if us > 0:
            rows.append((us / per, ev.count / per, ev.key))
    rows.sort(reverse=True)
    return [{"us": round(u, 1), "launches": c, "name": k[:120]} for u, c, k in rows[:top]]


def print_rows(rows: list[dict], unit: str) -> None:
    """One line a row: time, launches (each per `unit`), name."""
    for r in rows:
        print(f"  {r['us']:9.1f} us  {r['launches']:6.1f}x  {r['name']}  (per {unit})")
