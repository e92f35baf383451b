"""One call of each IQ2_XS / IQ3_XXS form (old gemv_iq_spread, iqc's) on 14336 x 4096 at tile
(R 4, BB 8), for Nsight Compute (kernels named _gemv_iq_spread_kernel, _gemv_iqc_kernel):

    ncu --clock-control none -k regex:gemv --metrics l1tex__data_pipe_lsu_wavefronts_mem_lg.sum,\
l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,sm__inst_executed.sum,gpu__time_duration.sum \
        python3 bench/2026-12-01-h200/prototypes-iqc/once_iqc.py
"""
from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[2])]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from iqc import gemv_iqc  # noqa: E402

from strata.kernels.gpu.gemv_q8 import gemv_iq_spread, quantize_x  # noqa: E402
from strata.quant import QType, random_rows  # noqa: E402


def main() -> None:
    dev, n, k, r, bb = torch.device("cuda"), 14336, 4096, 4, 8
    rng = np.random.default_rng(0)
    xq, dx, _ = quantize_x(torch.randn(k, device=dev))
    for q, forms in ((QType.IQ2_XS, ("iq2xs", "iq2xs_ssel")), (QType.IQ3_XXS, ("iq3xxs",))):
        w = torch.from_numpy(random_rows(q, n, k, rng, 0.02)).to(dev)
        print(f"{q.name}: old, then {', '.join(forms)}", flush=True)
        gemv_iq_spread(xq, dx, w, n, k, q, bb=bb, rows=r)
        for f in forms:
            gemv_iqc(xq, dx, w, n, k, f, bb=bb, rows=r)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
