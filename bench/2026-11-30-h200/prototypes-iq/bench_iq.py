import sys, os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../..'))
import numpy as np, torch, triton
from strata.bench.ceilings import hbm_copy_gbs
from strata.bench.graph_timing import graph_seconds
from strata.kernels.gpu.gemv_q8 import gemv_iq_spread, quantize_x
from strata.quant import QType, random_rows
import iq2s, iqv2, iqv3
from strata.kernels.gpu.gemv_q8 import iq_tables
dev = torch.device("cuda")
rng = np.random.default_rng(0)
hbm = hbm_copy_gbs()
print(f"hbm copy {hbm:.0f} GB/s")
n, k = 14336, 4096
x = torch.randn(k, device=dev)
xq, dx, _ = quantize_x(x)
for q in (QType.IQ2_XS, QType.IQ3_XXS):
    one = torch.from_numpy(random_rows(q, n, k, rng, 0.02)).to(dev)
    copies = [one] + [one.clone() for _ in range(1 + (256 << 20) // one.numel())][:15]
    nbytes = one.numel()
    ref = gemv_iq_spread(xq, dx, one, n, k, q, bb=4, rows=4)
    out = torch.empty(n, device=dev)
    def report(name, call):
        out.fill_(float('nan'))
        call(0)
        torch.cuda.synchronize()
        err = (out - ref).abs().max().item()
        t = graph_seconds(call, 16)
        print(f"{q.name} {name}: {t*1e6:.1f} us, {nbytes/t/1e9:.0f} GB/s ({nbytes/t/1e9/hbm*100:.0f}% of HBM copy), max diff {err:.2e}", flush=True)
    for r, bb in ((4, 4), (2, 8)):
        report(f"spread R{r} BB{bb} w1", lambda i, r=r, bb=bb: gemv_iq_spread(xq, dx, copies[i % len(copies)], n, k, q, out=out, bb=bb, warps=1, rows=r))
    iq3 = q == QType.IQ3_XXS
    g3 = iq_tables(q, dev)
    for r, bb, wp in ((8, 4, 1),):
        try:
            report(f"ahead R{r} BB{bb} w{wp}", lambda i, r=r, bb=bb, wp=wp: iqv3.gemv_ahead_kernel[(triton.cdiv(n, r),)](xq, dx, copies[i % len(copies)], out, *g3, n, k, one.stride(0), IQ3=iq3, R=r, BB=bb, num_warps=wp))
        except Exception as e:
            print("ahead failed", r, bb, wp, repr(e)[:200])
    if not iq3:
        t1 = [torch.from_numpy(a).to(dev) for a in iq2s.tables()]
        for r, bb, wp in ((4, 4, 1), (2, 8, 1), (8, 4, 1), (4, 8, 1), (2, 4, 1)):
            report(f"prmt L1 R{r} BB{bb} w{wp}", lambda i, r=r, bb=bb, wp=wp: iqv3.gemv_prmt_kernel[(triton.cdiv(n, r),)](xq, dx, copies[i % len(copies)], out, *t1, n, k, one.stride(0), R=r, BB=bb, num_warps=wp))
