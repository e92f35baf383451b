"""What a torch dequantize holds at its peak, per byte of its float32 output: every supported type
within strata.quant.DEQUANT_PEAK, the factor the memory plan and the dequantizing paths size
their pieces by (a type over it would let the float32 paths overrun --vram-budget)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from strata.quant import DEQUANT_PEAK, SUPPORTED, QType

# the measuring scripts' helpers: a /proc/self/status field in KiB; the peak resident size reset
_PROC = textwrap.dedent("""
    def kib(field):
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":"))
    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
""")
# in its own process, for each type named: random blocks, the peak resident size reset (Linux:
# clear_refs 5), one dequantize, then how far the peak rose above the size before it, over the
# output's bytes (VmHWM, not getrusage's ru_maxrss, which a child keeps from the parent it
# forked from); a small dequantize of the type first, so that what its first call builds once
# (tables, torch's first-use state) is not the next type's (nor, as in a process of its own, in
# its peak either way: a few KiB against the 32 MiB output)
_MEASURE = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    from strata.quant import QType, dequantize, row_nbytes
    torch.set_num_threads(1)
    n, k = 2048, 4096
    for name in sys.argv[1:]:
        q = QType[name]
        dequantize(torch.zeros(1, row_nbytes(q, k), dtype=torch.uint8), q, k)
        raw = torch.from_numpy(np.random.default_rng(0).integers(
            0, 256, (n, row_nbytes(q, k)), dtype=np.uint8))
        reset_peak()
        before = kib("VmRSS")
        out = dequantize(raw, q, k)
        print(name, (kib("VmHWM") - before) * 1024 / (out.numel() * 4), flush=True)
        del raw, out
""")


# glibc keeps freed blocks under its (growing) mmap threshold resident; from 128 KiB up every
# block is mapped and unmapped on its own, so the peak resident size counts live tensors only
# (as the GPU's allocated-bytes peak does)
_LIVE_ONLY = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072")


def _peaks(types: list[QType]) -> dict[QType, float]:
    """Each type's dequantize peak over its output's bytes, measured in one process."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _PROC + _MEASURE, *(q.name for q in types)],
                          capture_output=True, text=True, timeout=300, cwd=root, env=_LIVE_ONLY)
    assert done.returncode == 0, done.stderr[-2000:]
    peaks = {QType[name]: float(v) for name, v in (ln.split() for ln in done.stdout.split("\n")
                                                     if ln)}
    assert list(peaks) == types, done.stdout
    return peaks


def test_dequantize_peak_within_dequant_peak() -> None:
    types = [q for q in SUPPORTED if q not in (QType.F32, QType.F16, QType.BF16)]
    with ThreadPoolExecutor(2) as pool:  # two processes, every other type each
        peaks = {q: p for part in pool.map(_peaks, (types[0::2], types[1::2]))
                 for q, p in part.items()}
    over = {q.name: round(p, 2) for q, p in peaks.items() if p > DEQUANT_PEAK}
    assert not over, f"dequantize peaks over DEQUANT_PEAK = {DEQUANT_PEAK}: {over}"
    # the measurement sees the output itself (a probe that saw nothing would pass anything)
    low = {q.name: round(p, 2) for q, p in peaks.items() if p < 1}
    assert not low, f"peaks below the output's own size: {low}"


_RUN_RECORDS = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    from strata.experts.compute import group_pairs, run_records
    from strata.experts.layout import ExpertLayout
    from strata.quant import DEQUANT_CHUNK_BYTES, DEQUANT_PEAK, QType, dequant_rows, random_rows
    torch.set_num_threads(1)
    q, f, e, d, t, k = QType[sys.argv[1]], int(sys.argv[2]), 12, 2048, 24, 2
    rng = np.random.default_rng(0)
    lay = ExpertLayout(0, (int(q),) * 3, d, f)
    records = torch.empty(e, lay.stride, dtype=torch.uint8)
    for part, (n, c) in zip(lay.views(records), ((f, d), (f, d), (d, f))):
        part[:] = torch.from_numpy(random_rows(q, e * n, c, rng, 0.02)).view(e, n, -1)
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:k] for _ in range(t)]))
    groups = group_pairs(ids, torch.full((t, k), 0.5))
    h, out = torch.randn(t, d), torch.zeros(t, d)
    if f == 1024:  # two experts at once, a matrix dequantized whole
        workspace = 2 * (3 + DEQUANT_PEAK) * d * f * 4
        assert dequant_rows(d, workspace - 2 * 3 * d * f * 4) >= 2 * f
    else:  # one expert, and too little beside it for a whole matrix: pieces
        workspace = 3 * d * f * 4 + DEQUANT_CHUNK_BYTES
        assert dequant_rows(d, workspace - 3 * d * f * 4) < f
    mine = records[[g.expert for g in groups]]
    reset_peak()
    before = kib("VmRSS")
    run_records(lay, mine, groups, h, out, workspace)
    print((kib("VmHWM") - before) * 1024 / workspace)
""")


def test_run_records_within_its_workspace() -> None:
    """The float32 expert path (compute.run_records: dequantize, then batched matmuls) holds
    no more than the workspace it is given, for the type whose dequantize peaks highest and
    for Q4_K: 12 experts of 2048 x 1024, two at a time, each matrix dequantized whole; and of
    2048 x 2048, one at a time, each matrix in pieces (a whole one would not fit)."""
    root = Path(__file__).resolve().parents[1]

    def share(case: tuple[str, int]) -> float:  # (each in its own process: its own peak)
        done = subprocess.run([sys.executable, "-c", _PROC + _RUN_RECORDS, case[0],
                               str(case[1])], capture_output=True, text=True, timeout=300,
                              cwd=root, env=_LIVE_ONLY)
        assert done.returncode == 0, done.stderr[-2000:]
        return float(done.stdout.split()[-1])

    cases = (("IQ3_XXS", 1024), ("Q4_K", 1024), ("IQ3_XXS", 2048))
    with ThreadPoolExecutor(2) as pool:
        shares = list(pool.map(share, cases))
    for (q, f), s in zip(cases, shares, strict=True):
        # (a few MiB of activations and allocator slack on top; the old sizing took ~2.5x)
        assert 0.3 < s < 1.1, (q, f, s)
