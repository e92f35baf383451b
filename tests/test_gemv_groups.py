"""quant_matmul for a batched decode step's B rows, under Triton's interpreter against the
reference (strata.quant.dequantize then a float32 matmul): the FMA GEMV past four tokens
(gemv_max_m: programs of four tokens, a row tile's groups side by side) and the tensor-core
kernel with K split across programs (split_k: partial sums added after). The CUDA side is
tests/test_kernels_gpu.py's test_quant_matmul.

Every run draws fresh random blocks and x (the seed is in each failure message); y starts as
NaN, so a token or row the kernel does not write shows up. Token counts: 5 (a group of one
after a full one), 13, 16 (four groups); N not a multiple of the row tile; K with a partial
last step. FMA_TOL as in tests/test_kernels_gpu.py (exact weights, float32 sums in another
order; the interpreter's tl.dot multiplies float32). The launches are counted: one FMA GEMV
launch a product, no tensor-core one, and the reverse with split_k, at 13 tokens: splits of 3
(K not a multiple of the splits' span: the last split shorter) and more splits than K's steps
(empty splits that write zeros); one split is every other prompt-sized call's.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from interpreted import fresh_seed, run_interpreted  # noqa: E402

_BODY = """
    import torch
    import strata.kernels.gpu.matmul as mm
    from strata.kernels.gpu import quant_matmul
    from strata.kernels.gpu.reference import matmul_ref
    from strata.quant import QType, random_rows

    launches = []
    class Spy:  # records each launch of a kernel, then runs it
        def __init__(self, name, kernel):
            self.name, self.kernel = name, kernel
        def __getitem__(self, grid):
            launches.append(self.name)
            return self.kernel[grid]
    mm._gemv_kernel = Spy("fma", mm._gemv_kernel)
    mm._gemm_kernel = Spy("dot", mm._gemm_kernel)
    rng = np.random.default_rng(seed)
    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())
    for qtype, n, k in (("Q4_K", 13, 768), ("Q6_K", 7, 512), ("Q8_0", 5, 416)):
        qt = QType[qtype]
        w = torch.from_numpy(random_rows(qt, n, k, rng, 0.05))
        for m in (5, 13, 16):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32) * 3)
            y = torch.full((m, n), float("nan"))
            launches.clear()
            ref = matmul_ref(x, w, qt)
            quant_matmul(x, w, qt, out=y, gemv_max_m=16)
            assert launches == ["fma"], (qtype, m, launches)
            assert torch.isfinite(y).all(), (qtype, m, "not every token and row written")
            err = rel(y, ref)
            assert err < 2e-5, (qtype, m, err)
            for split in (3, 64) if m == 13 else ():
                launches.clear()
                y = torch.full((m, n), float("nan"))
                quant_matmul(x, w, qt, out=y, gemv_max_m=0, split_k=split)
                assert launches == ["dot"], (qtype, m, split, launches)
                err = rel(y, ref)
                assert err < 2e-5, (qtype, m, split, err)
    print("ok")
"""


def test_batched_rows_matmuls_under_the_interpreter() -> None:
    run_interpreted(_BODY, fresh_seed() % 2**31, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ2_XS"])
def test_split_gemm_kernel_fits_sm90(qtype: str) -> None:
    """Without a GPU: the tensor-core kernel with its K span bounds read at run time (the split
    of K) builds for sm_90 as a batched step of 8 rows over the 30B-A3B's q launches it, within
    its shared memory and registers, with no spills."""
    from test_decode_ops import SM90_REGS, SM90_SHARED, sm90_resources

    from strata.kernels.gpu import matmul as mm
    from strata.kernels.gpu.formats import kernel_format
    from strata.quant import QType, row_nbytes

    qt = QType[qtype]
    fmt = kernel_format(qt)
    m, n, k = 8, 4096, 2048
    bm, bn, bk, warps, _ = mm.gemm_config(m, n)
    pointers = {"x": "*fp32", "w": "*u8", "y": "*fp32", "tab": "*fp32", "tab2": "*fp32"}
    ints = dict(M=m, N=n, K=k, KS=k // 4, row_bytes=row_nbytes(qt, k), stride_xm=k,
                stride_ym=n, stride_ys=m * n)
    const = dict(QT=int(qt), S=fmt.group, BM=bm, BN=bn, BK=bk, GROUP_M=8, EVEN_K=True,
                 DOT=mm.tl.bfloat16)
    got = sm90_resources(mm._gemm_kernel, pointers, {}, ints, const, warps)
    assert got["shared"] <= SM90_SHARED and got["regs"] <= SM90_REGS, got
    assert got["spills"] == 0 and got["stack"] == 0 and got["local"] == 0, got
