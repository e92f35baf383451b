import sys, os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__))); sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), '../../..'))
import numpy as np, torch, triton
from strata.kernels.gpu.gemv_q8 import gemv_iq_spread, gemv_q4k_spread, quantize_x, iq_tables
from strata.quant import QType, random_rows
import iqv2, iqv3
dev = torch.device("cuda")
rng = np.random.default_rng(0)
n, k = 14336, 4096
x = torch.randn(k, device=dev)
xq, dx, xs4 = quantize_x(x)
out = torch.empty(n, device=dev)
w = torch.from_numpy(random_rows(QType.Q4_K, n, k, rng, 0.02)).to(dev)
gemv_q4k_spread(xq, xs4, w, n, k, out=out, bb=8, warps=1, rows=4)
q = QType.IQ2_XS
w = torch.from_numpy(random_rows(q, n, k, rng, 0.02)).to(dev)
gemv_iq_spread(xq, dx, w, n, k, q, out=out, bb=4, warps=1, rows=4)
g3 = iq_tables(q, dev)
iqv3.gemv_ahead_kernel[(triton.cdiv(n, 8),)](xq, dx, w, out, *g3, n, k, w.stride(0), IQ3=False, R=8, BB=4, num_warps=1)
t2 = [torch.from_numpy(a).to(dev) for a in iqv2.tables(False)]
iqv2.gemv_v2_kernel[(triton.cdiv(n, 2),)](xq, dx, w, out, *t2, n, k, w.stride(0), IQ3=False, R=2, BB=16, num_warps=2)
torch.cuda.synchronize()
print("launched")
