"""Instructions per weight in the K loop of the one-token Q4_K and Q6_K GEMV kernels, counted
in their sm_90 SASS without a GPU: Triton compiles each for sm_90 with its bundled ptxas,
nvdisasm lists the cubin, and the longest loop (a label and the backward branch to it) is one
thread's K step. Pointers and row bytes get the 16-byte divisibility they have at launch (so
loads vectorize as they do there). An instruction count, not a time: the kernel benchmark
times them.

    python scripts/sass_count.py
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.kernels.gpu import gemv_q8  # noqa: E402
from strata.kernels.gpu import matmul as mm  # noqa: E402
from strata.kernels.gpu.formats import kernel_format  # noqa: E402
from strata.quant import QType  # noqa: E402

ALIGNED = [["tt.divisibility", 16]]


def loop_length(fn, signature: dict, constexprs: dict, aligned: tuple[int, ...],  # noqa: ANN001
                warps: int) -> int:
    k = triton.compile(ASTSource(fn, signature, constexprs=constexprs,
                                 attrs={(i,): ALIGNED for i in aligned}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    try:
        sass = subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout.splitlines()
    finally:
        os.unlink(f.name)
    labels: dict[str, int] = {}
    best = 0
    for i, line in enumerate(sass):
        if m := re.match(r"^(\.L_x_\d+):", line):
            labels[m.group(1)] = i
        if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i:
            body = sass[labels[m.group(1)]:i + 1]
            best = max(best, sum(bool(re.search(r"/\*[0-9a-f]{4}\*/", x)) for x in body))
    return best


def main() -> None:
    fma_sig = {"x": "*fp32", "w": "*u8", "y": "*fp32", "tab": "*fp32", "tab2": "*fp32",
               "M": "i32", "N": "i32", "K": "i32", "row_bytes": "i32", "stride_xm": "i32",
               "stride_ym": "i32", "QT": "constexpr", "S": "constexpr", "BM": "constexpr",
               "BN": "constexpr", "BK": "constexpr", "EVEN_K": "constexpr",
               "STAGES": "constexpr"}
    for q in (QType.Q4_K, QType.Q6_K):
        fmt = kernel_format(q)
        bn, bk, stages, warps = fmt.gemv  # the type's tuned tile
        n = loop_length(mm._gemv_kernel, fma_sig, {"QT": int(q), "S": fmt.group, "BM": 1,
                                                   "BN": bn, "BK": bk, "EVEN_K": True,
                                                   "STAGES": stages}, (0, 1, 2, 3, 4, 8), warps)
        per = bn * bk / (32 * warps)
        print(f"FMA GEMV (matmul.py) {q.name} BN {bn} BK {bk} warps {warps}: {n} instructions "
              f"per thread step, {per:.0f} weights: {n / per:.2f} per weight")
    q8_sig = {"xq": "*i8", "dx": "*fp32", "sx": "*fp32", "w": "*u8", "y": "*fp32", "N": "i32",
              "K": "i32", "row_bytes": "i32", "BN": "constexpr", "STAGES": "constexpr"}
    q6_sig = {"xq": "*i8", "dx": "*fp32", "sx16": "*fp32",
              **{a: t for a, t in q8_sig.items() if a not in ("xq", "dx", "sx")}}
    for name, fn, sig in (("Q4_K", gemv_q8._gemv_q4k_kernel, q8_sig),
                          ("Q6_K", gemv_q8._gemv_q6k_kernel, q6_sig)):
        for bn, warps in ((4, 2), (8, 1), (16, 1), (16, 2), (32, 2), (32, 4)):
            n = loop_length(fn, sig, {"BN": bn, "STAGES": 1}, (0, 1, 2, 3, 4, 7), warps)
            per = bn * 256 / (32 * warps)
            print(f"dp4a GEMV (gemv_q8.py) {name} BN {bn} warps {warps}: {n} instructions per "
                  f"thread step, {per:.0f} weights: {n / per:.2f} per weight")


if __name__ == "__main__":
    main()
