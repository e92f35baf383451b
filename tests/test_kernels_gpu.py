"""The fused GGUF kernels (strata.kernels.gpu) against the reference: strata.quant.dequantize
(bit-exact with gguf-py) followed by a float32 matmul.

Every run draws fresh random blocks (the seed is in each failure message) and odd shapes: rows that
are not a multiple of any tile, K with a partial last step, 1/3/7 tokens, prime expert counts, one
token on an expert and none on most. Outputs and intermediate buffers start as NaN, so anything a
kernel forgets to write shows up.

Tolerances, as ||out - ref|| / ||ref||:
  FMA_TOL  decode kernels: float32 products of the exact weights, summed in another order than
           torch's GEMM (1e-7..8e-7 seen under the interpreter).
  DOT_TOL  tensor cores (the fused tl.dot kernel, 5-63 tokens; dequantize -> cuBLAS from 64):
           weights (and float32 x) are rounded to bf16, 8 significant bits, a relative error
           uniform in +-2^-9 per product (rms 1.1e-3 each); with random signs the sum's relative
           error is of that order, 1.5e-3..3e-3 expected. 1e-2 leaves 3x headroom, and any
           layout or indexing bug gives errors of order 1.
  MOE_DOT_TOL  as DOT_TOL with h = silu(g) * u also stored in bf16 between the two GEMMs
           (3.6e-3 and 4.0e-3 seen under the interpreter).
  DEQ_TOL  dequantize tiles: d * (q - c) is computed as one FMA, 2^b d * f - d (2^b + c) with
           f = 1 + q / 2^b, so results differ from d * (q - c) by a rounding of the block scale:
           |diff| <= 2^-22 * max |row|.
CUDA tests are marked `cuda` (tests/conftest.py skips them without a GPU). One CPU test runs a few
types and tiny shapes under Triton's interpreter in a subprocess (TRITON_INTERPRET=1 has to be set
before triton is imported).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")  # the whole module needs triton; CUDA tests also need a GPU

from interpreted import fresh_rng, rel_err, run_interpreted_side_by_side  # noqa: E402

from strata.kernels.gpu import FUSED_TYPES, dequantize_gpu, moe_forward, quant_matmul  # noqa: E402
from strata.kernels.gpu import moe as moe_mod  # noqa: E402
from strata.kernels.gpu.reference import matmul_ref, moe_ref  # noqa: E402
from strata.quant import QType, dequantize, get_quant, random_rows, row_nbytes  # noqa: E402

FMA_TOL = 2e-5
DOT_TOL = 1e-2
MOE_DOT_TOL = 1.5e-2
DEQ_TOL = 2.0**-22
PRIORITY = [QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.IQ2_XS, QType.IQ3_XXS, QType.Q5_K,
            QType.IQ4_XS]
ALL = list(FUSED_TYPES)


def k_for(qtype: QType, n_blocks: int) -> int:
    return get_quant(qtype).block_size * n_blocks


def cuda_rows(qtype: QType, n: int, k: int, rng: np.random.Generator,
              std: float = 0.05) -> torch.Tensor:
    return torch.from_numpy(random_rows(qtype, n, k, rng, std)).cuda()


# ---- dequantize tiles ---------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_dequantize_tile(qtype: QType) -> None:
    rng, seed = fresh_rng()
    quant = get_quant(qtype)
    # valid random blocks: 37 rows of 3 blocks (a partial last K step for 32-value blocks)
    w = cuda_rows(qtype, 37, k_for(qtype, 3), rng)
    # every bit pattern: 512 one-block rows of random bytes, keeping those that decode finite
    raw = torch.from_numpy(rng.integers(0, 256, (512, quant.type_size), dtype=np.uint8)).cuda()
    finite = torch.isfinite(dequantize(raw, qtype, quant.block_size)).all(1)
    for rows, k in ((w, k_for(qtype, 3)), (raw[finite].contiguous(), quant.block_size)):
        ref = dequantize(rows, qtype, k)
        out = torch.full_like(ref, float("nan"))
        dequantize_gpu(rows, qtype, k, dtype=torch.float32, out=out)
        bound = DEQ_TOL * ref.abs().amax(1, keepdim=True) + 1e-37
        bad = ~((out - ref).abs() <= bound)  # NaN counts as bad
        assert not bad.any(), f"{qtype.name} seed={seed}: {int(bad.sum())} values off"


# ---- quant_matmul -------------------------------------------------------------------------------

# (tokens, x dtype, tolerance): the FMA kernel up to 4 tokens, tensor cores above
MATMUL_CASES = [
    (1, torch.bfloat16, FMA_TOL),  # decode
    (1, torch.float32, FMA_TOL),
    (3, torch.float32, FMA_TOL),  # three accumulators, the fourth masked
    (7, torch.bfloat16, DOT_TOL),  # fewer tokens than the 16-row tl.dot tile; K split
    (16, torch.float32, DOT_TOL),  # a batched step of 16
    (300, torch.float32, DOT_TOL),  # dequantize -> cuBLAS (matmul.DEQUANT_MIN_M)
]


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("m,dtype,tol", MATMUL_CASES, ids=lambda c: str(c).split(".")[-1])
def test_quant_matmul(qtype: QType, m: int, dtype: torch.dtype, tol: float) -> None:
    rng, seed = fresh_rng()
    n = 41  # not a multiple of any row tile
    k = k_for(qtype, 3 if get_quant(qtype).block_size == 256 else 13)  # partial last K step
    w = cuda_rows(qtype, n, k, rng)
    x = torch.randn(m, k, device="cuda").to(dtype)
    out = torch.full((m, n), float("nan"), device="cuda")
    quant_matmul(x, w, qtype, out=out)
    err = rel_err(out, matmul_ref(x, w, qtype))
    assert err < tol, f"{qtype.name} m={m} {dtype} seed={seed}: rel err {err:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("qa,qb", [(QType.Q4_K, QType.Q6_K), (QType.Q5_K, QType.Q8_0),
                                   (QType.IQ3_XXS, QType.Q4_K)], ids=lambda q: q.name)
def test_gemv_pair(qa: QType, qb: QType) -> None:
    """Two matrices of other types, one token, one launch (the q/k pair and a v of another
    type: Qwen3-30B-A3B's 4608 and 512 rows of 2048), each against the reference; the outputs
    start as NaN, so a row the kernel does not write fails."""
    from strata.kernels.gpu.matmul import gemv_pair

    rng, seed = fresh_rng()
    for na, nb, k in ((4608, 512, 2048), (41, 7, k_for(qa, 3))):
        wa, wb = cuda_rows(qa, na, k, rng), cuda_rows(qb, nb, k, rng)
        x = torch.randn(1, k, device="cuda")
        out = (torch.full((1, na), float("nan"), device="cuda"),
               torch.full((1, nb), float("nan"), device="cuda"))
        ya, yb = gemv_pair(x, (wa, qa), (wb, qb), out=out)
        assert ya is out[0] and yb is out[1]
        for y, w, q in ((ya, wa, qa), (yb, wb, qb)):
            err = rel_err(y, matmul_ref(x, w, q))
            assert err < FMA_TOL, f"{q.name} of {qa.name}+{qb.name} seed={seed}: {err:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("fused_max_t", [1 << 30, 0])
def test_qkv_linear_pairs_only_fused_weights(fused_max_t: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k in one matrix and a v of another type: one gemv_pair launch for a token where the
    weights run fused kernels; with --kernels off (fused_max_t 0) none, the weights' own path
    (QuantTensor.matmul_t) for each. The same q, k, v either way, to the reference's bound."""
    from strata.kernels.gpu import matmul
    from strata.model.weights import LayerWeights, QuantTensor, fuse_qkv, qkv_linear

    rng, seed = fresh_rng()
    d = 512
    mats = [QuantTensor(cuda_rows(q, n, d, rng), int(q), d, fused_max_t)
            for q, n in ((QType.Q4_K, 64), (QType.Q4_K, 32), (QType.Q6_K, 32))]
    lw = LayerWeights(torch.ones(d), *mats, torch.zeros(1, 1), None, None, None, None, None,
                      torch.ones(d), torch.zeros(1, d), None)
    fuse_qkv(lw)
    assert lw.qkv is not None and lw.qkv[1] == 2
    calls = []
    pair = matmul.gemv_pair
    monkeypatch.setattr(matmul, "gemv_pair", lambda *a, **k: calls.append(1) or pair(*a, **k))
    x = torch.randn(1, d, device="cuda")
    for y, m in zip(qkv_linear(x, lw), mats, strict=True):
        err = rel_err(y, matmul_ref(x, m.raw, m.qtype))
        assert err < FMA_TOL, f"fused_max_t={fused_max_t} seed={seed}: rel err {err:.2e}"
    assert len(calls) == (fused_max_t > 0)


def test_gemv_pair_compiles_for_sm90() -> None:
    """Without a GPU: the two-matrix GEMV compiles for sm_90 with the tiles a Q4_K q/k pair and
    a Q6_K v take (other rows a program, other K steps: the interpreter runs either branch
    alone and would not see a clash between them)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import matmul
    from strata.kernels.gpu.formats import kernel_format

    fa, fb = kernel_format(QType.Q4_K), kernel_format(QType.Q6_K)
    (bna, bka, sta, _), (bnb, bkb, stb, _) = fa.gemv, fb.gemv
    assert (bna, bka) != (bnb, bkb)
    sig = {"x": "*fp32", "wa": "*u8", "wb": "*u8", "ya": "*fp32", "yb": "*fp32",
           "ta": "*fp32", "ta2": "*fp32", "tb": "*fp32", "tb2": "*fp32", "NA": "i32",
           "NB": "i32", "K": "i32", "rb_a": "i32", "rb_b": "i32", "GA": "i32"}
    consts = dict(QA=int(fa.qtype), SA=fa.group, BNA=bna, BKA=bka, STA=sta, QB=int(fb.qtype),
                  SB=fb.group, BNB=bnb, BKB=bkb, STB=stb, EVEN_A=True, EVEN_B=True)
    sig.update(dict.fromkeys(consts, "constexpr"))
    k = triton.compile(ASTSource(matmul._gemv_pair_kernel, sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32))
    assert k.asm["cubin"]


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", PRIORITY, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 4, 16, 129])
def test_quant_matmul_model_shapes(qtype: QType, m: int) -> None:
    """A real expert shape (F=1536 rows of D=4096), where the tuned tiles apply."""
    rng, seed = fresh_rng()
    w = cuda_rows(qtype, 1536, 4096, rng)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.full((m, 1536), float("nan"), device="cuda")
    quant_matmul(x, w, qtype, out=out)
    tol = FMA_TOL if m <= 4 else DOT_TOL
    err = rel_err(out, matmul_ref(x, w, qtype))
    assert err < tol, f"{qtype.name} m={m} seed={seed}: rel err {err:.2e}"


# ---- moe_forward --------------------------------------------------------------------------------


def nan_scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# (T tokens, E experts, K per token, D, F, (gate, up, down) types, resident experts)
MOE_CASES = {
    "decode": (1, 7, 2, 512, 256, (QType.Q4_K, QType.Q4_K, QType.Q6_K), 5),
    "decode-4tok-mixed": (4, 13, 3, 256, 512, (QType.IQ2_XS, QType.IQ3_XXS, QType.Q8_0), 11),
    "decode-legacy": (2, 5, 2, 160, 96, (QType.Q4_0, QType.Q5_1, QType.IQ4_NL), 5),
    "prompt-7tok": (7, 7, 2, 512, 256, (QType.Q4_K, QType.Q5_K, QType.Q6_K), 6),
    "prompt-prime": (61, 13, 4, 768, 256, (QType.Q6_K, QType.Q2_K, QType.IQ4_XS), 9),
    "prompt-iq1": (33, 11, 3, 256, 256, (QType.IQ1_S, QType.IQ1_M, QType.IQ2_S), 11),
    "prompt-misc": (19, 5, 2, 256, 256, (QType.MXFP4, QType.Q3_K, QType.IQ3_S), 4),
    "none-resident": (5, 7, 2, 256, 256, (QType.Q4_K, QType.Q4_K, QType.Q4_K), 0),
}


def make_layer(case: tuple, rng: np.random.Generator) -> dict:
    t, e, topk, d, f, qtypes, n_res = case
    qg, qu, qd = qtypes
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    resident = rng.permutation(e)[:n_res]
    slot_of[torch.from_numpy(resident)] = torch.from_numpy(rng.permutation(n_res)).int()
    n_slots = max(n_res, 1) + 1  # a spare slot nobody maps to

    def slots(q: QType, rows: int, cols: int) -> torch.Tensor:
        return cuda_rows(q, n_slots * rows, cols, rng).view(n_slots, rows, row_nbytes(q, cols))

    ids = torch.from_numpy(np.stack([rng.permutation(e)[:topk] for _ in range(t)]))
    return dict(x=torch.randn(t, d, device="cuda"), ids=ids.cuda(),
                weights=torch.rand(t, topk, device="cuda"), slot_of_expert=slot_of.cuda(),
                gate_slots=slots(qg, f, d), up_slots=slots(qu, f, d), down_slots=slots(qd, d, f),
                qtypes=qtypes, d_model=d, d_expert=f)


@pytest.mark.cuda
@pytest.mark.parametrize("name", list(MOE_CASES))
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_moe_forward(name: str, xdtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    rng, seed = fresh_rng()
    monkeypatch.setattr(moe_mod, "scratch", nan_scratch)
    layer = make_layer(MOE_CASES[name], rng)
    layer["x"] = layer["x"].to(xdtype)
    before = torch.randn(layer["x"].shape[0], layer["d_model"], device="cuda")
    out = moe_forward(**layer, out=before.clone())  # accumulates into out
    ref = moe_ref(**layer)
    added = out - before
    assert torch.isfinite(added).all(), f"{name} seed={seed}: non-finite output"
    if not ref.abs().any():  # nothing resident: nothing added
        assert not added.any(), f"{name} seed={seed}"
        return
    t = layer["x"].shape[0]
    tol = FMA_TOL if t <= moe_mod.DECODE_MAX_T else MOE_DOT_TOL
    # out = before + moe rounds to float32 once per element, whatever the kernel: half an ulp of
    # |out| (a small routing weight makes ref small beside `before`)
    rounding = float(torch.finfo(torch.float32).eps * out.double().norm() / ref.double().norm())
    err = rel_err(out.double() - before.double(), ref)
    assert err < tol + rounding, (f"{name} {xdtype} seed={seed}: rel err {err:.2e} (the sum's "
                                  f"own rounding {rounding:.1e})")
    if moe_mod.DECODE_MAX_T < t <= moe_mod.PAIRS_MAX_T:  # a batched decode step's call
        err = rel_err(moe_forward(**layer, step=True), ref)
        assert err < FMA_TOL, f"{name} {xdtype} seed={seed}: per pair, rel err {err:.2e}"
    if t <= moe_mod.DECODE_MAX_T:  # each pair's row unsummed: [T, K, D], summing to ref
        rows = moe_forward(**layer, sum_pairs=False)
        assert rows.shape == (t, layer["ids"].shape[1], layer["d_model"]), rows.shape
        assert torch.isfinite(rows).all(), f"{name} seed={seed}: unwritten rows"
        err = rel_err(rows.sum(1), ref)
        assert err < tol, f"{name} {xdtype} seed={seed}: rows rel err {err:.2e}"


@pytest.mark.cuda
def test_moe_one_token_per_expert() -> None:
    """64 experts, 5 tokens with top-1 routing: one expert gets two tokens, three get one, the
    other 60 none (their CTAs exit at once); every expert is resident."""
    rng, seed = fresh_rng()
    layer = make_layer((5, 64, 1, 256, 256, (QType.Q4_K, QType.Q8_0, QType.Q6_K), 64), rng)
    layer["ids"] = torch.tensor([[3], [17], [3], [40], [63]], device="cuda")
    out = moe_forward(**layer)
    err = rel_err(out, moe_ref(**layer))
    assert err < MOE_DOT_TOL, f"seed={seed}: rel err {err:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 4])
def test_misses_gathered_from_mapped_host_records(t: int) -> None:
    """A layer's records in pinned host memory (as the arena), a few of them in VRAM slots:
    gather_misses copies the missed pairs' records over PCIe into rows, inside a CUDA graph,
    and moe_forward with those rows equals the reference with every expert resident."""
    from strata.experts.layout import ExpertLayout
    from strata.kernels.gpu import gather_misses

    rng, seed = fresh_rng()
    e, topk, d, f = 11, 3, 512, 256
    qt = (QType.Q4_K, QType.IQ2_XS, QType.Q6_K)
    lay = ExpertLayout(0, tuple(int(q) for q in qt), d, f)
    records = torch.zeros(e, lay.stride, dtype=torch.uint8).pin_memory()
    for part, (q, n, k) in zip(lay.views(records), ((qt[0], f, d), (qt[1], f, d), (qt[2], d, f)),
                               strict=True):
        part[:] = torch.from_numpy(random_rows(q, e * n, k, rng, 0.05)).view(e, n, -1)
    resident = rng.permutation(e)[:4]
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    slot_of[torch.from_numpy(resident)] = torch.arange(4, dtype=torch.int32)
    slots = records[torch.from_numpy(resident)].cuda()
    slot_of = slot_of.cuda()
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:topk] for _ in range(t)])).cuda()
    x, wts = torch.randn(t, d, device="cuda"), torch.rand(t, topk, device="cuda")
    rows = torch.full((t * topk, lay.stride), 255, dtype=torch.uint8, device="cuda")
    out = torch.zeros(t, d, device="cuda")
    run = lambda: (out.zero_(), gather_misses(ids, slot_of, records, rows, lay.nbytes),  # noqa: E731
                   moe_forward(x, ids, wts, slot_of, *lay.views(slots), qt, d, f, out=out,
                               miss=lay.views(rows)))
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    ids.copy_(torch.from_numpy(np.stack([rng.permutation(e)[:topk] for _ in range(t)])))
    graph.replay()
    full = records.cuda()
    ref = moe_ref(x, ids, wts, torch.arange(e, dtype=torch.int32, device="cuda"),
                  *lay.views(full), qt, d, f)
    err = rel_err(out, ref)
    assert err < FMA_TOL, f"t={t} seed={seed}: rel err {err:.2e}"


# ---- experts with biases and the clamped SwiGLU (gpt-oss) ---------------------------------------

# (gate, up, down) types: gpt-oss's MXFP4 experts, and a mix of other fused types
BIAS_TYPES = {"mxfp4": (QType.MXFP4, QType.MXFP4, QType.MXFP4),
              "q4k-q6k": (QType.Q4_K, QType.Q4_K, QType.Q6_K)}


def expert_biases(e: int, d: int, f: int, device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """gate, up [E, F] and down [E, D] float32 biases, large enough that the clamped SwiGLU's
    limit (7) cuts some g and u."""
    return tuple(3 * torch.randn(e, n, device=device) for n in (f, f, d))


@pytest.mark.cuda
@pytest.mark.parametrize("types", list(BIAS_TYPES))
@pytest.mark.parametrize("act", ["swiglu", "swiglu_oai"])
@pytest.mark.parametrize("t,path", [(1, None), (2, None), (4, None), (9, "pairs"),
                                    (23, "tl.dot"), (96, "grouped")],
                         ids=["1", "2", "4", "pairs-9", "dot-23", "grouped-96"])
def test_moe_forward_with_biases(types: str, act: str, t: int, path: str | None,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path moe_forward picks (decode FMA kernels, the tl.dot grouped kernels, the bf16
    grouped GEMMs) adds the experts' biases and computes their activation as
    torch_ops.expert_mlp does; the unsummed decode rows too."""
    from strata.kernels.gpu import moe_grouped

    rng, seed = fresh_rng()
    monkeypatch.setattr(moe_mod, "scratch", nan_scratch)
    monkeypatch.setattr(moe_grouped, "scratch", nan_scratch)
    e, d, f = 11, 512, 256
    layer = make_layer((t, e, 4, d, f, BIAS_TYPES[types], 8), rng)
    layer["x"] = 3 * layer["x"]
    bias = expert_biases(e, d, f)
    out = moe_forward(**layer, bias=bias, act=act, path=path)
    ref = moe_ref(**layer, bias=bias, act=act)
    tol = FMA_TOL if (path or moe_mod.moe_path(t, 4, e)) == "pairs" else MOE_DOT_TOL
    err = rel_err(out, ref)
    assert err < tol, f"{types} {act} t={t} seed={seed}: rel err {err:.2e}"
    if t <= moe_mod.DECODE_MAX_T:
        rows = moe_forward(**layer, bias=bias, act=act, sum_pairs=False)
        assert torch.isfinite(rows).all(), f"seed={seed}: unwritten rows"
        err = rel_err(rows.sum(1), ref)
        assert err < tol, f"{types} {act} t={t} seed={seed}: rows rel err {err:.2e}"
        # x8 is refused quietly for biased calls: the same float32 result
        err = rel_err(moe_forward(**layer, bias=bias, act=act, x8=True), ref)
        assert err < tol, f"{types} {act} t={t} seed={seed}: x8 rel err {err:.2e}"


@pytest.mark.cuda
@pytest.mark.parametrize("t", [1, 4])
def test_gathered_misses_with_biases(t: int) -> None:
    """The gathered-miss call (miss rows, every pair computed) with gpt-oss's biases and
    activation on MXFP4 records equals the reference with every expert resident."""
    from strata.experts.layout import ExpertLayout
    from strata.kernels.gpu import gather_misses

    rng, seed = fresh_rng()
    e, topk, d, f = 9, 4, 256, 128
    qt = BIAS_TYPES["mxfp4"]
    lay = ExpertLayout(0, tuple(int(q) for q in qt), d, f)
    records = torch.zeros(e, lay.stride, dtype=torch.uint8).pin_memory()
    for part, (q, n, k) in zip(lay.views(records), ((qt[0], f, d), (qt[1], f, d), (qt[2], d, f)),
                               strict=True):
        part[:] = torch.from_numpy(random_rows(q, e * n, k, rng, 0.05)).view(e, n, -1)
    resident = rng.permutation(e)[:3]
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    slot_of[torch.from_numpy(resident)] = torch.arange(3, dtype=torch.int32)
    slots, slot_of = records[torch.from_numpy(resident)].cuda(), slot_of.cuda()
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:topk] for _ in range(t)])).cuda()
    x, wts = 3 * torch.randn(t, d, device="cuda"), torch.rand(t, topk, device="cuda")
    bias = expert_biases(e, d, f)
    rows = torch.full((t * topk, lay.stride), 255, dtype=torch.uint8, device="cuda")
    gather_misses(ids, slot_of, records, rows, lay.nbytes)
    out = moe_forward(x, ids, wts, slot_of, *lay.views(slots), qt, d, f, miss=lay.views(rows),
                      bias=bias, act="swiglu_oai")
    ref = moe_ref(x, ids, wts, torch.arange(e, dtype=torch.int32, device="cuda"),
                  *lay.views(records.cuda()), qt, d, f, bias=bias, act="swiglu_oai")
    err = rel_err(out, ref)
    assert err < FMA_TOL, f"t={t} seed={seed}: rel err {err:.2e}"


def _compile_sm90(fn, sig: dict, consts: dict, warps: int, stages: int | None = None):  # noqa: ANN001, ANN202
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(sig, **dict.fromkeys(consts, "constexpr"))
    opts = {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}
    return triton.compile(ASTSource(fn, sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32), options=opts)


@pytest.mark.parametrize("types", list(BIAS_TYPES))
def test_biased_moe_kernels_compile_for_sm90(types: str) -> None:
    """Without a GPU: the four MoE kernels with biases and the clamped SwiGLU compile for
    sm_90 (Triton's bundled ptxas) with the tiles moe_forward gives them (MXFP4's group kernels
    through mxfp4_dot_span), within the H100's / H200's 227 KiB of shared memory per block."""
    from strata.kernels.gpu.formats import kernel_format
    from strata.kernels.tuning import DOWN_TILE, GATE_UP_TILE

    fg, fu, fd = (kernel_format(q) for q in BIAS_TYPES[types])
    d, f = 2880, 2880  # gpt-oss's d_model and d_expert: no tile divides them evenly
    ptr = {"x": "*fp32", "ids": "*i32", "wts": "*fp32", "slot_of": "*i32"}
    u8, f32, i32 = "*u8", "*fp32", "i32"
    kernels = []
    bn, bk, st, w = moe_mod.decode_tile(GATE_UP_TILE, (fg, fu), d)
    sig = dict(ptr, gate=u8, up=u8, h=f32, tg=f32, tg2=f32, tu=f32, tu2=f32, mg=u8, mu=u8,
               bg=f32, bu=f32, D=i32, F=i32, stride_x=i32, stride_gs=i32, stride_us=i32,
               stride_ms=i32, rb_g=i32, rb_u=i32)
    for miss in (False, True):
        kernels.append(_compile_sm90(moe_mod._gate_up_pairs_kernel, sig, dict(
            TOPK=4, QG=int(fg.qtype), SG=fg.group, QU=int(fu.qtype), SU=fu.group, BN=bn, BK=bk,
            EVEN_D=d % bk == 0, STAGES=st, MISS=miss, HOST_FROM=4, BIAS=True, OAI=True), w))
    bn, bk, st, w = moe_mod.decode_tile(DOWN_TILE, (fd,), f)
    sig = dict(h=f32, ids="*i32", slot_of="*i32", down=u8, part=f32, td=f32, td2=f32, md=u8,
               wts=f32, bd=f32, D=i32, F=i32, stride_ds=i32, stride_ms=i32, rb_d=i32)
    kernels.append(_compile_sm90(moe_mod._down_pairs_kernel, sig, dict(
        QD=int(fd.qtype), SD=fd.group, BN=bn, BK=bk, EVEN_F=f % bk == 0, STAGES=st, MISS=True,
        TOPK=4, HOST_FROM=4, BIAS=True), w))
    # the tl.dot group kernels: the smallest and largest BM (16, 128); MXFP4 rows as
    # moe_forward passes them (mxfp4_dot_span where tuning.MXFP4_DOT_SPAN, else the shared tile)
    mx = types == "mxfp4" and moe_mod.MXFP4_DOT_SPAN
    for t in (23, 1024):
        bm, bn, bk, w = moe_mod.group_config(t, 4, 32)
        sig = dict(x="*bf16", counts="*i32", starts="*i32", order="*i32", slot_of="*i32",
                   gate=u8, up=u8, h="*bf16", tg=f32, tg2=f32, tu=f32, tu2=f32, bg=f32, bu=f32,
                   D=i32, F=i32, NC=i32, stride_x=i32, stride_gs=i32, stride_us=i32, rb_g=i32,
                   rb_u=i32)
        kernels.append(_compile_sm90(moe_mod._gate_up_groups_kernel, sig, dict(
            TOPK=4, QG=int(fg.qtype), SG=fg.group, QU=int(fu.qtype), SU=fu.group, BM=bm, BN=bn,
            BK=bk, EVEN_D=d % bk == 0, DOT=triton.language.bfloat16, BIAS=True, OAI=True,
            MX=mx), w, 3))
        sig = dict(h="*bf16", counts="*i32", starts="*i32", order="*i32", wts=f32,
                   slot_of="*i32", down=u8, y=f32, td=f32, td2=f32, bd=f32, D=i32, F=i32,
                   NC=i32, stride_ds=i32, rb_d=i32)
        kernels.append(_compile_sm90(moe_mod._down_groups_kernel, sig, dict(
            QD=int(fd.qtype), SD=fd.group, BM=bm, BN=bn, BK=bk, EVEN_F=f % bk == 0,
            DOT=triton.language.bfloat16, BIAS=True, MX=mx), w, 3))
    for k in kernels:
        assert k.asm["cubin"]
        assert k.metadata.shared <= 232448, (k.name, k.metadata.shared)


# ---- launcher checks and fallbacks (no GPU needed) ----------------------------------------------


def test_launcher_rejects_bad_shapes() -> None:
    w = torch.zeros(8, row_nbytes(QType.Q4_K, 256), dtype=torch.uint8)
    with pytest.raises(ValueError, match="x must be"):
        quant_matmul(torch.zeros(2, 1, 256), w, QType.Q4_K)
    with pytest.raises(ValueError, match="multiple of 256"):
        quant_matmul(torch.zeros(2, 255), w, QType.Q4_K)
    with pytest.raises(ValueError, match="rows of 512 values"):
        quant_matmul(torch.zeros(2, 512), w, QType.Q4_K)
    with pytest.raises(TypeError, match="bfloat16 or float32"):
        quant_matmul(torch.zeros(2, 256, dtype=torch.float16), w, QType.Q4_K)
    with pytest.raises(TypeError, match="uint8"):
        quant_matmul(torch.zeros(2, 256), w.float(), QType.Q4_K)


def test_unfused_type_falls_back_with_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    rng, _ = fresh_rng()
    w = torch.from_numpy(random_rows(QType.F16, 5, 64, rng, 0.1))
    x = torch.randn(3, 64)
    with caplog.at_level(logging.INFO, logger="strata.kernels"):
        out = quant_matmul(x, w, QType.F16)
    assert "no fused kernel for F16" in caplog.text
    torch.testing.assert_close(out, matmul_ref(x, w, QType.F16))


# ---- the same kernels on the CPU, under Triton's interpreter ------------------------------------

_INTERPRETED_HEAD = """
    import torch
    from strata.kernels.gpu import dequantize_gpu, moe_forward, quant_matmul
    from strata.kernels.gpu.reference import matmul_ref, moe_ref
    from strata.quant import QType, dequantize, random_rows, row_nbytes

    rng = np.random.default_rng(seed)
    def rel(a, b):
        return float((a - b).norm() / b.norm())
    def rows(q, n, k):
        return torch.from_numpy(random_rows(q, n, k, rng, 0.05))
"""
_INTERPRETED_MATMUL = """
    for q in (QType.Q4_K, QType.Q6_K, QType.IQ2_XS, QType.Q8_0):
        k = 512 if q != QType.Q8_0 else 96
        w = rows(q, 5, k)
        ref = dequantize(w, q, k)
        diff = (dequantize_gpu(w, q, k, torch.float32) - ref).abs().max()
        assert diff <= 2**-22 * ref.abs().max(), q
        for m in (1, 3, 9):  # FMA, FMA with three tokens, tl.dot (float32 operands here)
            x = torch.randn(m, k)
            y = quant_matmul(x, w, q)
            assert rel(y, matmul_ref(x, w, q)) < 2e-5, (q, m)
            # a bias: added as one token's GEMV stores (the rows kernel's too), after otherwise;
            # bit for bit the product's then the add
            b = torch.randn(5)
            assert torch.equal(quant_matmul(x, w, q, bias=b), y + b), (q, m, "bias")
            if m == 1:
                tile = (2, 32 if q == QType.Q8_0 else 256, 1, 1)
                yr = quant_matmul(x, w, q, rows_tile=tile)
                assert torch.equal(quant_matmul(x, w, q, rows_tile=tile, bias=b), yr + b), \
                    (q, "rows kernel bias")
    # two matrices of other types in one launch (a q/k pair and its v)
    from strata.kernels.gpu.matmul import gemv_pair
    for qa, qb, na, nb in ((QType.Q4_K, QType.Q6_K, 7, 3), (QType.IQ2_XS, QType.Q5_K, 2, 5)):
        wa, wb, x = rows(qa, na, 512), rows(qb, nb, 512), torch.randn(1, 512)
        out = (torch.full((1, na), float("nan")), torch.full((1, nb), float("nan")))
        ya, yb = gemv_pair(x, (wa, qa), (wb, qb), out=out)
        assert ya is out[0] and yb is out[1], (qa, qb)
        assert rel(ya, matmul_ref(x, wa, qa)) < 2e-5 and rel(yb, matmul_ref(x, wb, qb)) < 2e-5
    print("ok")
"""
_INTERPRETED_MOE = """
    e, d, f = 3, 256, 64
    qt = (QType.Q4_K, QType.IQ2_XS, QType.Q8_0)
    slot_of = torch.tensor([1, -1, 0], dtype=torch.int32)
    layer = dict(slot_of_expert=slot_of, gate_slots=rows(qt[0], 2 * f, d).view(2, f, -1),
                 up_slots=rows(qt[1], 2 * f, d).view(2, f, -1),
                 down_slots=rows(qt[2], 2 * d, f).view(2, d, -1), qtypes=qt, d_model=d,
                 d_expert=f)
    # decode and a batch of 6 (per pair), a prompt chunk (tl.dot; h in bf16)
    for t, path, tol in ((1, None, 2e-5), (6, "pairs", 2e-5), (6, None, 1.5e-2)):
        ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(t)]))
        x, wts = torch.randn(t, d), torch.rand(t, 2)
        out = moe_forward(x, ids, wts, **layer, path=path)
        assert rel(out, moe_ref(x, ids, wts, **layer)) < tol, t
        if t == 1:  # the pairs' rows unsummed (non-resident pairs' rows zero)
            parts = moe_forward(x, ids, wts, **layer, sum_pairs=False)
            assert parts.shape == (1, 2, d) and torch.isfinite(parts).all()
            assert rel(parts.sum(1), moe_ref(x, ids, wts, **layer)) < tol
    # misses gathered from the records into rows, then every pair computed
    from strata.experts.layout import ExpertLayout
    from strata.kernels.gpu import gather_misses
    lay = ExpertLayout(0, tuple(int(q) for q in qt), d, f)
    records = torch.zeros(e, lay.stride, dtype=torch.uint8)
    for part, src, (q, n, k) in zip(lay.views(records), (layer["gate_slots"], layer["up_slots"],
                                    layer["down_slots"]), ((qt[0], f, d), (qt[1], f, d),
                                                           (qt[2], d, f))):
        # expert 0 in slot 1, expert 2 in slot 0 (as slot_of says), expert 1 only here
        part[:] = torch.stack([src[1], rows(q, n, k), src[0]])
    slots = records[[2, 0]]
    full = dict(layer, slot_of_expert=torch.arange(e, dtype=torch.int32),
                **dict(zip(("gate_slots", "up_slots", "down_slots"), lay.views(records))))
    for t in (1, 3):
        ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(t)]))
        x, wts = torch.randn(t, d), torch.rand(t, 2)
        rows_ = torch.full((2 * t + 1, lay.stride), 255, dtype=torch.uint8)
        gather_misses(ids, slot_of, records, rows_, lay.nbytes)
        for p_, ex in enumerate(ids.reshape(-1).tolist()):
            want = records[ex] if slot_of[ex] < 0 else torch.full_like(records[ex], 255)
            assert torch.equal(rows_[p_, :lay.nbytes], want[:lay.nbytes]), (t, p_)
        out = moe_forward(x, ids, wts, slot_of, *lay.views(slots), qt, d, f,
                          miss=lay.views(rows_))
        assert rel(out, moe_ref(x, ids, wts, **full)) < 2e-5, ("miss rows", t)
    print("ok")
"""


_INTERPRETED_BIAS = """
    from strata.experts.layout import ExpertLayout
    from strata.kernels.gpu import gather_misses
    e, d, f = 3, 32, 32
    qt = (QType.{GU}, QType.{GU}, QType.{DN})
    lay = ExpertLayout(0, tuple(int(q) for q in qt), d, f)
    records = torch.zeros(e, lay.stride, dtype=torch.uint8)
    for part, (q, n, k) in zip(lay.views(records), ((qt[0], f, d), (qt[1], f, d), (qt[2], d, f))):
        part[:] = rows(q, e * n, k).view(e, n, -1)
    slot_of = torch.tensor([1, -1, 0], dtype=torch.int32)  # expert 1 only in the records
    slots = records[[2, 0]]
    full = (torch.arange(e, dtype=torch.int32), *lay.views(records), qt, d, f)
    bias = tuple(3 * torch.randn(e, n) for n in (f, f, d))
    for act, t in {CALLS}:
        ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(t)]))
        x, wts = 3 * torch.randn(t, d), torch.rand(t, 2)
        if t == 1:  # the resident pairs only
            out = moe_forward(x, ids, wts, slot_of, *lay.views(slots), qt, d, f, bias=bias,
                              act=act)
            ref = moe_ref(x, ids, wts, slot_of, *lay.views(slots), qt, d, f, bias=bias, act=act)
            assert rel(out, ref) < 2e-5, ("resident", act, t)
        miss = torch.full((2 * t, lay.stride), 255, dtype=torch.uint8)
        gather_misses(ids, slot_of, records, miss, lay.nbytes)
        out = moe_forward(x, ids, wts, slot_of, *lay.views(slots), qt, d, f,
                          miss=lay.views(miss), bias=bias, act=act)
        ref = moe_ref(x, ids, wts, *full, bias=bias, act=act)
        assert rel(out, ref) < 2e-5, ("miss rows", act, t)
        # steps whose BK does not divide the rows (the last one masked, as gpt-oss's 2880 takes
        # k_step's 512): gate/up over d = 32 in steps of 64, the down over f in steps of 64
        out = moe_forward(x, ids, wts, slot_of, *lay.views(slots), qt, d, f,
                          miss=lay.views(miss), bias=bias, act=act,
                          tiles={"gate_up": (1, 64, 1, 2), "down_pairs": (4, 64, 1, 4)})
        assert rel(out, ref) < 2e-5, ("masked steps", act, t)
    # a prompt chunk on the tl.dot kernels (float32 operands here) and the grouped GEMMs
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(6)]))
    x, wts = 3 * torch.randn(6, d), torch.rand(6, 2)
    ref = moe_ref(x, ids, wts, *full, bias=bias, act="swiglu_oai")
    for path, tol in (("tl.dot", 1.5e-2), ("grouped", 2e-5)):  # (tl.dot: h in bf16)
        out = moe_forward(x, ids, wts, *full, bias=bias, act="swiglu_oai", path=path)
        assert rel(out, ref) < tol, ("prompt", path)
    if {HITS}:  # FusedHits (on for this check) passes a biased layer's biases: as run_records
        import strata.experts.gpu_hits as gpu_hits
        from strata.experts.compute import group_pairs, run_records
        from strata.model.weights import ExpertBias
        gpu_hits.fused_kernels_available = lambda device: True
        blay = ExpertLayout(0, lay.qtypes, d, f, ExpertBias(*bias, "swiglu_oai"))
        hits = gpu_hits.FusedHits([blay], torch.device("cpu"), max_t=4)
        assert hits.covers(0, 1) and list(hits.biases) == [0]
        ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(2)]))
        x, wts = 3 * torch.randn(2, d), torch.rand(2, 2)
        out = hits.run(blay, records, torch.arange(e, dtype=torch.int32), x, ids, wts, None)
        groups = group_pairs(ids, wts)
        ref = torch.zeros(2, d)
        run_records(blay, records[[g.expert for g in groups]], groups, x, ref, 1 << 24)
        assert rel(out, ref) < 2e-5, "FusedHits"
    print("ok")
"""


def test_biased_moe_kernels_under_the_interpreter() -> None:
    """gpt-oss's experts on the CPU under Triton's interpreter, tiny sizes: the decode kernels
    with biases (every pair through miss rows; at 1 token the resident pairs alone too): the
    clamped SwiGLU at 1, 2 and 4 tokens for MXFP4; silu at 1 token and the clamped SwiGLU at 3
    for Q8_0 gate/up with a Q4_0 down; a prompt chunk on both prompt paths; FusedHits.run of
    a biased layer against run_records (the torch path)."""
    _, seed = fresh_rng()
    oai = [("swiglu_oai", t) for t in (1, 2, 4)]
    bodies = [_INTERPRETED_HEAD + _INTERPRETED_BIAS.replace("{GU}", gu).replace(
        "{DN}", dn).replace("{CALLS}", repr(calls)).replace("{HITS}", hits)
        for gu, dn, calls, hits in (("MXFP4", "MXFP4", oai, "False"),
                                    ("Q8_0", "Q4_0", [("swiglu", 1), ("swiglu_oai", 3)], "True"))]
    run_interpreted_side_by_side(bodies, seed, timeout=300)


def test_rows_tiles_of_the_tuning_table_under_the_interpreter() -> None:
    """Each one-token shape tuning.GEMV_ROWS_TUNE sends to the rows kernel (gpt-oss's 2880-wide
    Q8_0: BK not dividing the row, the last step masked), on 9 rows of its type and width with
    its tile: the reference product."""
    _, seed = fresh_rng()
    run_interpreted_side_by_side([_INTERPRETED_HEAD + """
    from strata.kernels.tuning import GEMV_ROWS_TUNE
    assert GEMV_ROWS_TUNE
    for (q, n, k), tile in GEMV_ROWS_TUNE.items():
        w, x = rows(QType(q), 9, k), torch.randn(1, k)
        y = quant_matmul(x, w, QType(q), rows_tile=tile)
        assert rel(y, matmul_ref(x, w, QType(q))) < 2e-5, (q, n, k, tile)
    print("ok")
    """], seed, timeout=300)


def test_shared_expert_as_one_expert_under_the_interpreter() -> None:
    """A decode token's shared expert through the MoE decode kernels (SharedExpert._as_expert:
    expert 0 of a one-expert layer, its sigmoid gate as the routing weight) against the torch
    form of the same weights: gated (qwen35moe) and not (glm4moe), gate, up and down of three
    types; matrices not all in fused types are left to the torch form; with tuning.SHARED_X8,
    Q4_K matrices on the 8-bit-activation kernels (within their rounding, and not the float32
    path's result: the switch takes)."""
    _, seed = fresh_rng()
    run_interpreted_side_by_side([_INTERPRETED_HEAD + """
    from types import SimpleNamespace
    from strata.model.parts.ffn import SharedExpert
    from strata.model.weights import QuantTensor
    d, s = 256, 256
    w1, w3, w2 = rows(QType.Q4_K, s, d), rows(QType.Q8_0, s, d), rows(QType.Q6_K, d, s)
    g1, g3, g2 = dequantize(w1, QType.Q4_K, d), dequantize(w3, QType.Q8_0, d), \
        dequantize(w2, QType.Q6_K, s)
    for gate in (0.1 * torch.randn(d), None):
        lw = SimpleNamespace(shared_w1=QuantTensor(w1, QType.Q4_K, d),
                             shared_w3=QuantTensor(w3, QType.Q8_0, d),
                             shared_w2=QuantTensor(w2, QType.Q6_K, s), shared_gate=gate)
        se = SharedExpert(lw)
        assert se._one_token(torch.device("cpu")) is not None
        h = torch.randn(1, d)
        ref = (torch.nn.functional.silu(h @ g1.T) * (h @ g3.T)) @ g2.T
        if gate is not None:
            ref = torch.sigmoid(h @ gate[:, None]) * ref
        out = se._as_expert(h)
        assert out.shape == (1, d) and rel(out, ref) < 2e-5, rel(out, ref)
    lw.shared_w3 = g3  # a float matrix: the torch form
    assert SharedExpert(lw)._one_token(torch.device("cpu")) is None
    # tuning.SHARED_X8 with weights loaded for the 8-bit kernels: x and h rounded to 8 bits
    from strata.kernels import tuning
    tuning.SHARED_X8 = True
    u1, u3, u2 = rows(QType.Q4_K, s, d), rows(QType.Q4_K, s, d), rows(QType.Q4_K, d, s)
    gu1, gu3, gu2 = (dequantize(w, QType.Q4_K, d) for w in (u1, u3, u2))
    lw = SimpleNamespace(shared_w1=QuantTensor(u1, QType.Q4_K, d, x8=True),
                         shared_w3=QuantTensor(u3, QType.Q4_K, d, x8=True),
                         shared_w2=QuantTensor(u2, QType.Q4_K, s, x8=True),
                         shared_gate=0.1 * torch.randn(d))
    h = torch.randn(1, d)
    ref = torch.sigmoid(h @ lw.shared_gate[:, None]) * (
        (torch.nn.functional.silu(h @ gu1.T) * (h @ gu3.T)) @ gu2.T)
    se = SharedExpert(lw)
    assert se._one_token(torch.device("cpu")) is not None
    x8 = se._as_expert(h)
    tuning.SHARED_X8 = False
    exact = se._as_expert(h)
    # 8-bit x and h: llama.cpp's bound on its CUDA path; float32 activations: the product's
    assert 1e-6 < rel(x8, ref) < 3e-2 and rel(exact, ref) < 2e-5, (rel(x8, ref), rel(exact, ref))
    print("ok")
    """], seed, timeout=300)


def test_kernels_under_the_interpreter() -> None:
    """Q4_K, Q6_K, IQ2_XS, Q8_0 tiles, both matmul skeletons, the two-matrix GEMV and both MoE
    paths on the CPU (the matmuls beside the MoE paths, each in a process of its own)."""
    _, seed = fresh_rng()
    run_interpreted_side_by_side([_INTERPRETED_HEAD + _INTERPRETED_MATMUL,
                                  _INTERPRETED_HEAD + _INTERPRETED_MOE], seed, timeout=600)


def test_k_step_masks_a_short_tail_rather_than_taking_many_small_steps() -> None:
    """BK stays large where the masked tail of the last step is at most an eighth of the row
    (gpt-oss's 2880: 6 steps of 512, not 90 of 32), halves to a divisor otherwise, and never
    goes below the type's group."""
    from strata.kernels.gpu.matmul import k_step

    assert k_step(512, 2880, 16) == 512  # 192 of 3072 masked
    assert k_step(256, 2880, 16) == 256
    assert k_step(512, 2048, 32) == 512  # divides
    assert k_step(512, 96, 16) == 32  # a tail of 416, then 160, 32, 32: halved to 32
    assert k_step(512, 720, 16) == 256  # 304 masked of 1024 is too many; 48 of 768 is not
    assert k_step(32, 48, 32) == 32  # the group is the floor
    assert k_step(512, 0, 16) == 512  # row length unknown
