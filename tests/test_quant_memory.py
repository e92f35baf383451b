"""What a torch dequantize holds at its peak, per byte of its float32 output: every supported type
within strata.quant.DEQUANT_PEAK, the factor the memory plan and the dequantizing paths size
their pieces by (a type over it would let the float32 paths overrun --vram-budget)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from strata.quant import DEQUANT_PEAK, SUPPORTED, QType

# in its own process: random blocks, the peak resident size reset (Linux: clear_refs 5), one
# dequantize, then how far the peak rose above the size before it, over the output's bytes
# (VmHWM, not getrusage's ru_maxrss, which a child keeps from the parent it forked from)
_MEASURE = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    from strata.quant import QType, dequantize, row_nbytes
    def kib(field):
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith(field + ":"))
    torch.set_num_threads(1)
    q, n, k = QType[sys.argv[1]], 2048, 4096
    raw = torch.from_numpy(np.random.default_rng(0).integers(
        0, 256, (n, row_nbytes(q, k)), dtype=np.uint8))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = kib("VmRSS")
    out = dequantize(raw, q, k)
    print((kib("VmHWM") - before) * 1024 / (out.numel() * 4))
""")


def _peak(q: QType) -> float:
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _MEASURE, q.name], capture_output=True,
                          text=True, timeout=120, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout.split()[-1])


def test_dequantize_peak_within_dequant_peak() -> None:
    types = [q for q in SUPPORTED if q not in (QType.F32, QType.F16, QType.BF16)]
    with ThreadPoolExecutor(2) as pool:
        peaks = dict(zip(types, pool.map(_peak, types), strict=True))
    over = {q.name: round(p, 2) for q, p in peaks.items() if p > DEQUANT_PEAK}
    assert not over, f"dequantize peaks over DEQUANT_PEAK = {DEQUANT_PEAK}: {over}"
    # the measurement sees the output itself (a probe that saw nothing would pass anything)
    low = {q.name: round(p, 2) for q, p in peaks.items() if p < 1}
    assert not low, f"peaks below the output's own size: {low}"
