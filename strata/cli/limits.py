"""Checks of what a command is asked to do before the engine allocates for it: sampling flags,
and the KV cache a prompt plus -n tokens needs against the memory there is."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from strata.config import kv_bytes
from strata.errors import StrataError
from strata.units import fmt_bytes

MAX_SEED = (1 << 64) - 1  # torch.Generator.manual_seed's range
SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k",
                  "min_p": "--min-p", "max_tokens": "-n"}  # SamplingParams' fields


def check_sampling(args: argparse.Namespace) -> None:
    """What SamplingParams does not check of generate's flags: finite numbers and the seed's
    range, each error naming its flag (SamplingParams checks the ranges)."""
    for flag, v in (("--temperature", args.temperature), ("--top-p", args.top_p),
                    ("--min-p", args.min_p)):
        if not math.isfinite(v):
            raise StrataError(f"{flag} {v}: give a finite number")
    if args.seed is not None:
        check_seed(args.seed)


def check_seed(seed: int, flag: str = "--seed") -> None:
    """A seed torch's and numpy's generators take: 0 .. 2**64 - 1."""
    if not 0 <= seed <= MAX_SEED:
        raise StrataError(f"{flag} {seed}: give a number from 0 to 2**64 - 1")


def check_ctx(ctx: int | None, tokens: int, what: str) -> None:
    """Work that needs `tokens` rows of KV cache against --ctx, on every device (on CUDA the
    memory plan holds no more; on the CPU the cache would grow past it unasked)."""
    if ctx is not None and tokens > ctx:
        raise StrataError(f"--ctx {ctx}: {what} need {tokens} tokens of KV cache; give --ctx "
                          f"{tokens} or more")


def available_memory(device: str) -> int | None:
    """Bytes free for new allocations on `device`: MemAvailable on the host, free VRAM on a
    GPU; None where it cannot be told."""
    if device.startswith("cuda"):
        import torch

        try:
            return int(torch.cuda.mem_get_info()[0])
        except Exception:  # no driver: the engine's own load has failed before this
            return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_kv_memory(engine: object, tokens: int, flag: str = "-n") -> None:
    """Refuse a KV cache for `tokens` positions that would not fit in the memory there is."""
    cfg, ec = engine.config, engine.engine_config  # type: ignore[attr-defined]
    need = kv_bytes(cfg, tokens, ec.kv_type)
    device = str(engine.model.device)  # type: ignore[attr-defined]
    free = available_memory(device)
    if free is not None and need > free:
        raise StrataError(f"{flag}: a KV cache for {tokens:,} tokens needs {fmt_bytes(need)} "
                          f"but {device} has {fmt_bytes(free)} available; lower {flag} "
                          "(or --kv-type f16 halves it)")
