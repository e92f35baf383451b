"""The grouped prompt-chunk MoE path (strata.kernels.gpu.moe_grouped: experts dequantized to bf16,
then torch._grouped_mm) against the reference, strata.kernels.gpu.reference.moe_ref.

Every run draws fresh random blocks (the seed is in each failure message). Layers have prime
expert counts (7, 13), experts without a slot, an expert that gets exactly one token and most
getting none, T in (5, 33, 200), mixed (gate, up, down) types. The weight scratch and the by-pair
output start as NaN (`nan_scratch`), and `out` holds random values the call must add to.

Tolerances, as ||added - ref|| / ||ref||:
  EXACT_TOL    the CPU runs in float32 (exact dequantized weights, float32 GEMMs summed in
               another order than the reference's per-pair matvecs): 1.6e-7..4.2e-7 seen.
  GROUPED_TOL  CUDA (and the CPU with compute_dtype forced to bf16): x, the weights, g | u (the
               grouped GEMM's bf16 output), silu(g)·u·w and each pair's output are rounded to
               bf16, 2^-9 relative each (rms 1.1e-3); in quadrature about 4-5e-3, and 4.4e-3..
               5.2e-3 were seen on the CPU in bf16. 1.5e-2 leaves 3x headroom (the fused tl.dot
               MoE path is held to the same bound); an indexing bug gives errors of order 1.
CUDA tests are marked `cuda` (skipped without a GPU). One CPU test runs the Triton slot
dequantize kernel and the whole grouped path under TRITON_INTERPRET=1 in a subprocess.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

from interpreted import fresh_rng, rel_err, run_interpreted  # noqa: E402

from strata.experts.compute import group_pairs, run_records  # noqa: E402
from strata.experts.layout import ExpertLayout  # noqa: E402
from strata.kernels.gpu import FUSED_TYPES  # noqa: E402
from strata.kernels.gpu import moe as moe_mod  # noqa: E402
from strata.kernels.gpu import moe_grouped as mg  # noqa: E402
from strata.kernels.gpu.reference import moe_ref  # noqa: E402
from strata.quant import QType, dequantize, get_quant, random_rows, row_nbytes  # noqa: E402

EXACT_TOL = 2e-5
GROUPED_TOL = 1.5e-2
DEQ_TOL = 2.0**-22  # the tiles' d·(q - c) as one FMA: a rounding of the block scale


def nan_scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def tol_for(device: str) -> float:
    return EXACT_TOL if mg.compute_dtype(torch.device(device)) == torch.float32 else GROUPED_TOL


# (E experts, K per token, D, F, (gate, up, down) types, resident experts)
CASES = {
    "Q4_K/Q4_K/Q6_K": (13, 2, 256, 256, (QType.Q4_K, QType.Q4_K, QType.Q6_K), 9),
    "Q8_0": (7, 3, 96, 64, (QType.Q8_0, QType.Q8_0, QType.Q8_0), 5),
    "IQ2_XS": (7, 2, 256, 256, (QType.IQ2_XS, QType.IQ2_XS, QType.IQ2_XS), 6),
    "mixed Q6_K/IQ2_XS/Q8_0": (13, 4, 256, 64, (QType.Q6_K, QType.IQ2_XS, QType.Q8_0), 11),
}


def route(t: int, e: int, topk: int, resident: np.ndarray,
          rng: np.random.Generator) -> torch.Tensor:
    """ids [T, K]: every token picks K distinct experts among a few 'hot' ones (resident or
    not), except one resident expert outside them that token 0 alone picks: most experts get
    no token, one gets exactly one."""
    lonely = int(rng.choice(resident))
    hot = rng.permutation([i for i in range(e) if i != lonely])[: max(topk, e // 3)]
    ids = np.stack([rng.permutation(hot)[:topk] for _ in range(t)])
    ids[0, -1] = lonely
    return torch.from_numpy(ids)


def make_layer(case: tuple, t: int, rng: np.random.Generator, device: str) -> dict:
    e, topk, d, f, qtypes, n_res = case
    qg, qu, qd = qtypes
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    resident = rng.permutation(e)[:n_res]
    slot_of[torch.from_numpy(resident)] = torch.from_numpy(rng.permutation(n_res)).int()
    n_slots = n_res + 1  # a spare slot nobody maps to

    def slots(q: QType, rows: int, cols: int) -> torch.Tensor:
        w = torch.from_numpy(random_rows(q, n_slots * rows, cols, rng, 0.05))
        return w.view(n_slots, rows, row_nbytes(q, cols)).to(device)

    return dict(x=torch.randn(t, d).to(device), ids=route(t, e, topk, resident, rng).to(device),
                weights=torch.rand(t, topk).to(device), slot_of_expert=slot_of.to(device),
                gate_slots=slots(qg, f, d), up_slots=slots(qu, f, d), down_slots=slots(qd, d, f),
                qtypes=qtypes, d_model=d, d_expert=f)


def check_added(layer: dict, scratch_bytes: int, tol: float, what: str) -> None:
    before = torch.randn(layer["x"].shape[0], layer["d_model"], device=layer["x"].device)
    out = mg.moe_forward_grouped(**layer, out=before.clone(), scratch_bytes=scratch_bytes)
    added = out - before
    assert torch.isfinite(added).all(), f"{what}: non-finite output"
    err = rel_err(added, moe_ref(**layer))
    assert err < tol, f"{what}: rel err {err:.2e}"


# ---- moe_forward_grouped ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("t", [5, 33, 200])
def test_grouped_matches_reference(name: str, t: int, device: str,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    rng, seed = fresh_rng()
    monkeypatch.setattr(mg, "scratch", nan_scratch)
    layer = make_layer(CASES[name], t, rng, device)
    e, _, d, f = CASES[name][:4]
    one = 3 * d * f * mg.compute_dtype(torch.device(device)).itemsize
    # the whole layer at once; batches of 3 experts; one expert per batch (scratch below one)
    for scratch_bytes in (mg.GROUPED_SCRATCH_BYTES, 3 * one, 1):
        check_added(layer, scratch_bytes, tol_for(device),
                    f"{name} T={t} {device} scratch={scratch_bytes} seed={seed}")


@pytest.mark.parametrize("types", [(QType.MXFP4,) * 3, (QType.Q4_K, QType.Q4_K, QType.Q6_K)],
                         ids=["MXFP4", "Q4_K/Q4_K/Q6_K"])
@pytest.mark.parametrize("act", ["swiglu", "swiglu_oai"])
def test_grouped_with_biases(types: tuple, act: str, device: str,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The experts' biases (gpt-oss) and both activations, as torch_ops.expert_mlp computes
    them: the whole layer in one batch, in batches of 3 experts, one expert a batch."""
    rng, seed = fresh_rng()
    monkeypatch.setattr(mg, "scratch", nan_scratch)
    e, d, f = 11, 256, 256
    layer = make_layer((e, 4, d, f, types, 8), 40, rng, device)
    layer["x"] = 3 * layer["x"]
    bias = tuple(3 * torch.randn(e, n).to(device) for n in (f, f, d))  # cuts some at 7
    ref = moe_ref(**layer, bias=bias, act=act)
    one = 3 * d * f * mg.compute_dtype(torch.device(device)).itemsize
    for scratch_bytes in (mg.GROUPED_SCRATCH_BYTES, 3 * one, 1):
        out = mg.moe_forward_grouped(**layer, scratch_bytes=scratch_bytes, bias=bias, act=act)
        err = rel_err(out, ref)
        assert err < tol_for(device), f"{act} scratch={scratch_bytes} seed={seed}: {err:.2e}"


@pytest.mark.parametrize("t", [5, 200])
def test_grouped_in_bf16_on_the_cpu(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA arithmetic (bf16 operands, torch._grouped_mm in bf16) on the CPU."""
    rng, seed = fresh_rng()
    monkeypatch.setattr(mg, "scratch", nan_scratch)
    monkeypatch.setattr(mg, "compute_dtype", lambda device: torch.bfloat16)
    layer = make_layer(CASES["mixed Q6_K/IQ2_XS/Q8_0"], t, rng, "cpu")
    for scratch_bytes in (mg.GROUPED_SCRATCH_BYTES, 1):
        check_added(layer, scratch_bytes, GROUPED_TOL, f"bf16 T={t} seed={seed}")


def test_nothing_resident_adds_nothing(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rng, seed = fresh_rng()
    monkeypatch.setattr(mg, "scratch", nan_scratch)
    layer = make_layer(CASES["Q4_K/Q4_K/Q6_K"], 33, rng, device)
    layer["slot_of_expert"] = torch.full_like(layer["slot_of_expert"], -1)
    for scratch_bytes in (mg.GROUPED_SCRATCH_BYTES, 1):
        before = torch.randn(33, layer["d_model"], device=device)
        out = mg.moe_forward_grouped(**layer, out=before.clone(), scratch_bytes=scratch_bytes)
        assert torch.equal(out, before), f"seed={seed} scratch={scratch_bytes}"


def test_torch_mm_loop_when_grouped_mm_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    rng, seed = fresh_rng()
    layer = make_layer(CASES["Q8_0"], 33, rng, "cpu")

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise NotImplementedError("no grouped mm here")

    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    check_added(layer, mg.GROUPED_SCRATCH_BYTES, EXACT_TOL, f"seed={seed}")
    a = torch.randn(9, 32)
    b = torch.randn(3, 16, 32)
    offs = torch.tensor([4, 4, 9], dtype=torch.int32)  # an empty group in the middle
    y = mg.grouped_mm(a, b.transpose(1, 2), offs)
    torch.testing.assert_close(y, torch.cat([a[:4] @ b[0].T, a[4:9] @ b[2].T]))


def test_the_grouped_threshold_follows_the_expert_types() -> None:
    """MMQ-able layers (Q4_K gate/up, Q6_K down, under x8) take the grouped path from 32
    tokens per expert, i-quants from 8, the rest from 16; biased layers never take MMQ; the
    layouts' least threshold is what the graphs' scratch is counted from."""
    from strata.experts.layout import ExpertLayout
    from strata.kernels.tuning import (
        GROUPED_MIN_TOKENS,
        IQ_GROUPED_MIN_TOKENS,
        MMQ_GROUPED_MIN_TOKENS,
    )

    q4 = (int(QType.Q4_K), int(QType.Q4_K), int(QType.Q6_K))
    iq = (int(QType.IQ2_XS), int(QType.IQ2_XS), int(QType.IQ3_XXS))
    q8 = (int(QType.Q8_0),) * 3
    assert moe_mod.grouped_min_tokens(q4, 2048, 768, True) == MMQ_GROUPED_MIN_TOKENS == 32
    assert moe_mod.grouped_min_tokens(q4, 2048, 768, False) == GROUPED_MIN_TOKENS == 16
    assert moe_mod.grouped_min_tokens(q4, 2048, 768, True, bias=object()) == GROUPED_MIN_TOKENS
    assert moe_mod.grouped_min_tokens(iq, 2048, 768, True) == IQ_GROUPED_MIN_TOKENS == 8
    assert moe_mod.grouped_min_tokens(q8, 2048, 768, True) == GROUPED_MIN_TOKENS
    # Qwen3.6-35B-A3B's 512-token chunk (256 experts, top 8: 16 a expert) now runs MMQ
    assert moe_mod.moe_path(512, 8, 256, min_tokens=32) == "tl.dot"
    assert moe_mod.moe_path(1024, 8, 256, min_tokens=32) == "grouped"
    assert moe_mod.moe_path(128, 8, 128, min_tokens=8) == "grouped"  # IQ2_XS pp128 on 30B
    lays = [ExpertLayout(0, q4, 2048, 768), ExpertLayout(1, iq, 2048, 768)]
    assert moe_mod.layouts_min_tokens(lays) == 8
    assert moe_mod.layouts_min_tokens(lays[:1]) == 32


def test_moe_forward_dispatches_by_tokens_per_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not moe_mod.use_grouped(moe_mod.DECODE_MAX_T, 8, 1)  # decode stays per pair
    assert moe_mod.moe_path(moe_mod.PAIRS_MAX_T, 8, 1, step=True) == "pairs"  # a batched step
    assert moe_mod.moe_path(moe_mod.PAIRS_MAX_T, 8, 128, step=True, miss=True) == "tl.dot"
    assert moe_mod.moe_path(moe_mod.PAIRS_MAX_T, 8, 128) == "tl.dot"  # a prompt chunk
    assert moe_mod.moe_path(moe_mod.PAIRS_MAX_T + 1, 8, 128, step=True) == "tl.dot"
    assert not moe_mod.use_grouped(255, 8, 128)  # 15.9 tokens per expert: tl.dot kernels
    assert moe_mod.use_grouped(256, 8, 128)  # 16: grouped (Qwen3-30B-A3B from 256 tokens)
    rng, seed = fresh_rng()
    layer = make_layer(CASES["Q8_0"], 200, rng, "cpu")  # 200·3/7 = 86 tokens per expert
    calls = []
    real = mg.moe_forward_grouped
    monkeypatch.setattr(mg, "moe_forward_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = moe_mod.moe_forward(**layer)
    assert calls == [1]
    err = rel_err(out, moe_ref(**layer))
    assert err < EXACT_TOL, f"seed={seed}: rel err {err:.2e}"


def test_scratch_is_bounded() -> None:
    d, f = 2048, 768
    per_expert = 3 * d * f * 2
    assert mg.experts_per_batch(128, d, f) == 128  # Qwen3-30B-A3B: one batch by default
    assert mg.experts_per_batch(128, d, f, 64 * per_expert) == 64
    assert mg.experts_per_batch(128, d, f, 100 * per_expert) == 64  # two even batches
    assert mg.experts_per_batch(128, d, f, 1) == 1  # never below one expert
    assert mg.experts_per_batch(5000, 64, 64, 1 << 40) == 1000  # < 1024 groups, evened
    for scratch_bytes in (1, 10 * per_expert, mg.GROUPED_SCRATCH_BYTES):
        total = mg.grouped_scratch_bytes((d, f), 128, 4096, 8, scratch_bytes)
        weights = mg.experts_per_batch(128, d, f, scratch_bytes) * per_expert
        assert weights <= max(scratch_bytes, per_expert)
        assert total == weights + mg.grouped_scratch_bytes((d, f), 128, 4096, 8, 1) - per_expert
    lay = ExpertLayout(0, (QType.Q4_K, QType.Q4_K, QType.Q6_K), d, f)
    assert mg.grouped_scratch_bytes(lay, 128, 512, 8) == mg.grouped_scratch_bytes((d, f), 128,
                                                                                  512, 8)


# ---- dequantize_slots ---------------------------------------------------------------------------


def check_slots(qtype: QType, device: str, rng: np.random.Generator, seed: int) -> None:
    k = get_quant(qtype).block_size * (3 if get_quant(qtype).block_size == 256 else 7)
    n_slots, rows = 5, 37  # rows: no multiple of the 16-row tile
    w = torch.from_numpy(random_rows(qtype, n_slots * rows, k, rng, 0.05)).to(device)
    stride = row_nbytes(qtype, k) * rows + 256  # records with a gap, as slot views have
    rec = torch.zeros(n_slots, stride, dtype=torch.uint8, device=device)
    rec[:, : rows * row_nbytes(qtype, k)] = w.view(n_slots, -1)
    view = rec[:, : rows * row_nbytes(qtype, k)].view(n_slots, rows, row_nbytes(qtype, k))
    slots = torch.tensor([3, -1, 0, 4], dtype=torch.int32, device=device)
    wide = torch.full((4, 2 * rows, k), float("nan"), device=device)  # out: a strided half
    mg.dequantize_slots(view, slots, qtype, k, wide[:, rows:])
    ref = dequantize(view, qtype, k)
    for j, s in enumerate(slots.tolist()):
        got = wide[j, rows:]
        if s < 0:
            assert got.isnan().all(), f"{qtype.name} seed={seed}: wrote a slot -1 expert"
            continue
        bound = DEQ_TOL * ref[s].abs().amax(1, keepdim=True) + 1e-37
        assert ((got - ref[s]).abs() <= bound).all(), f"{qtype.name} slot {s} seed={seed}"
    assert wide[:, :rows].isnan().all(), f"{qtype.name} seed={seed}: wrote outside out"


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.IQ2_XS, QType.F16], ids=lambda q: q.name)
def test_dequantize_slots_cpu(qtype: QType) -> None:
    rng, seed = fresh_rng()
    check_slots(qtype, "cpu", rng, seed)


@pytest.mark.cuda
@pytest.mark.parametrize("qtype", list(FUSED_TYPES), ids=lambda q: q.name)
def test_dequantize_slots_kernel(qtype: QType) -> None:
    rng, seed = fresh_rng()
    check_slots(qtype, "cuda", rng, seed)


# ---- experts_forward_grouped and the ring -------------------------------------------------------


def make_records(lay: ExpertLayout, n: int, rng: np.random.Generator) -> torch.Tensor:
    """uint8 [n, stride]: n experts packed as ExpertLayout records."""
    rec = torch.zeros(n, lay.stride, dtype=torch.uint8)
    (qg, qu, qd), d, f = lay.qtypes, lay.d_model, lay.d_expert
    for part, q, rows, cols in zip(lay.views(rec), (qg, qu, qd), (f, f, d), (d, d, f),
                                   strict=True):
        part.copy_(torch.from_numpy(random_rows(q, n * rows, cols, rng, 0.05)).view(part.shape))
    return rec


@pytest.mark.parametrize("scratch_bytes", [mg.GROUPED_SCRATCH_BYTES, 1])
def test_experts_forward_grouped_matches_run_records(scratch_bytes: int, device: str) -> None:
    rng, seed = fresh_rng()
    lay = ExpertLayout(0, (QType.Q4_K, QType.IQ2_XS, QType.Q8_0), 256, 64)
    e, t = 7, 41
    rec = make_records(lay, e, rng)
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(t)]))
    groups = group_pairs(ids, torch.rand(t, 2))
    x = torch.randn(t, lay.d_model)
    ref = torch.zeros(t, lay.d_model)
    run_records(lay, rec[[g.expert for g in groups]], groups, x, ref, 1 << 30)
    recd = rec.to(device)
    out = torch.zeros(t, lay.d_model, device=device)
    slots = torch.tensor([g.expert for g in groups], dtype=torch.int32, device=device)
    mg.experts_forward_grouped(x.to(device), torch.cat([g.tokens for g in groups]).to(device),
                               torch.cat([g.weights for g in groups]).to(device),
                               [len(g.tokens) for g in groups], slots, *lay.views(recd),
                               lay.qtypes, lay.d_model, lay.d_expert, out, scratch_bytes)
    err = rel_err(out.cpu(), ref)
    assert err < tol_for(device), f"{device} seed={seed}: rel err {err:.2e}"


@pytest.mark.cuda
def test_accumulating_index_put_adds_as_one_index_add_per_expert() -> None:
    """experts_forward_grouped adds a call's rows (grouped by expert, each token at most once per
    expert) with one accumulating index_put_: on CUDA it must give the per-expert index_add_
    loop's sums bit for bit (each token's rows added in row order), at a bank's shape."""
    rng, seed = fresh_rng()
    t, d, e = 300, 2048, 40
    counts = [int(c) for c in rng.integers(0, 60, e)]
    tokens = torch.cat([torch.from_numpy(rng.permutation(t)[:c]) for c in counts]).cuda()
    y = torch.randn(tokens.shape[0], d, device="cuda")
    base = torch.randn(t, d, device="cuda")
    loop, once = base.clone(), base.clone()
    r = 0
    for c in counts:
        loop.index_add_(0, tokens[r:r + c], y[r:r + c])
        r += c
    once.index_put_((tokens,), y, accumulate=True)
    assert torch.equal(once, loop), f"seed={seed}: {(once - loop).abs().max().item():.3e}"


class _Arena:
    """What Ring.stream reads of an Arena: the layouts and one record per expert."""

    def __init__(self, lay: ExpertLayout, records: torch.Tensor):
        self.layouts, self.records = [lay], records

    def record(self, layer: int, expert: int) -> torch.Tensor:
        return self.records[expert]


@pytest.mark.cuda
@pytest.mark.parametrize("n_buffers", [1, 2, 3, 16])  # alternate; banks of 1; odd; banks of 8
def test_ring_computes_banks_grouped(n_buffers: int) -> None:
    from strata.experts.ring import Ring

    rng, seed = fresh_rng()
    lay = ExpertLayout(0, (QType.Q4_K, QType.Q4_K, QType.Q6_K), 256, 256)
    e, t = 13, 57
    rec = make_records(lay, e, rng)
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:3] for _ in range(t)]))
    w = torch.rand(t, 3)
    groups = group_pairs(ids, w)
    x = torch.randn(t, lay.d_model)
    ref = moe_ref(x, ids, w, torch.arange(e, dtype=torch.int32), *lay.views(rec), lay.qtypes,
                  lay.d_model, lay.d_expert)
    ring = Ring(n_buffers * lay.stride + 100, torch.device("cuda"), grouped=True)
    assert ring.grouped
    out = torch.zeros(t, lay.d_model, device="cuda")
    ring.stream(_Arena(lay, rec.pin_memory()), 0, groups, x.cuda(), out, 1 << 30)
    torch.cuda.synchronize()
    assert ring.streamed_bytes == len(groups) * lay.nbytes
    err = rel_err(out.cpu(), ref)
    assert err < GROUPED_TOL, f"{n_buffers} buffers seed={seed}: rel err {err:.2e}"


# ---- CUDA: torch._grouped_mm's constraints, model shape, no host sync ---------------------------


@pytest.mark.cuda
def test_grouped_mm_layouts_on_cuda() -> None:
    """The operand layouts moe_grouped passes (W^T views of [n, N, K] buffers, empty groups,
    rows past offs[-1]) run on torch._grouped_mm itself and match per-group matmuls."""
    _, seed = fresh_rng()
    torch.manual_seed(seed)
    a = torch.randn(300, 256, device="cuda").bfloat16()
    w = torch.randn(5, 96, 256, device="cuda").bfloat16()
    offs = torch.tensor([0, 120, 120, 121, 290], dtype=torch.int32, device="cuda")
    y = torch._grouped_mm(a, w.transpose(1, 2), offs=offs)
    ref = torch.cat([a[0:120] @ w[1].T, a[120:121] @ w[3].T, a[121:290] @ w[4].T])
    torch.testing.assert_close(y[:290].float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
def test_moe_forward_grouped_and_tl_dot_dispatch_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """moe_forward: 33 tokens of 13 experts (K=2: 5 per expert) run the tl.dot kernels, 200
    (31 per expert) the grouped path; both within the bf16 bound."""
    rng, seed = fresh_rng()
    calls = []
    real = mg.moe_forward_grouped
    monkeypatch.setattr(mg, "moe_forward_grouped", lambda *a, **k: calls.append(1) or real(*a, **k))
    for t, grouped in ((33, False), (200, True)):
        layer = make_layer(CASES["Q4_K/Q4_K/Q6_K"], t, rng, "cuda")
        calls.clear()
        err = rel_err(moe_mod.moe_forward(**layer), moe_ref(**layer))
        assert bool(calls) == grouped, f"T={t}"
        assert err < GROUPED_TOL, f"T={t} seed={seed}: rel err {err:.2e}"


@pytest.mark.cuda
def test_qwen3_30b_a3b_layer() -> None:
    """E=128, K=8, D=2048, F=768, 4096 tokens, Q4_K gate/up, Q6_K down, every expert resident;
    moe_ref on 48 random tokens (it runs pair by pair), every output finite; and the call
    makes no host sync (torch.cuda.set_sync_debug_mode('error'), after a warm-up call)."""
    rng, seed = fresh_rng()
    e, topk, d, f, t = 128, 8, 2048, 768, 4096
    qt = (QType.Q4_K, QType.Q4_K, QType.Q6_K)

    def slots(q: QType, rows: int, cols: int) -> torch.Tensor:
        w = torch.from_numpy(random_rows(q, e * rows, cols, rng, 0.02))
        return w.view(e, rows, row_nbytes(q, cols)).cuda()

    slot_of = torch.from_numpy(rng.permutation(e)).int().cuda()
    ids = torch.from_numpy(np.argsort(rng.random((t, e)), axis=1)[:, :topk]).cuda()
    layer = dict(slot_of_expert=slot_of, gate_slots=slots(qt[0], f, d),
                 up_slots=slots(qt[1], f, d), down_slots=slots(qt[2], d, f), qtypes=qt,
                 d_model=d, d_expert=f)
    x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
    w = torch.softmax(torch.randn(t, topk, device="cuda"), -1)
    assert moe_mod.use_grouped(t, topk, e)
    out = moe_mod.moe_forward(x, ids, w, **layer)
    assert torch.isfinite(out).all(), f"seed={seed}"
    sub = torch.from_numpy(rng.permutation(t)[:48]).cuda()
    err = rel_err(out[sub], moe_ref(x[sub], ids[sub], w[sub], **layer))
    assert err < GROUPED_TOL, f"seed={seed}: rel err {err:.2e}"
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = mg.moe_forward_grouped(x, ids, w, **layer)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(again, out), f"seed={seed}: not deterministic"


# ---- the slot kernel and the grouped path under Triton's interpreter ----------------------------

_INTERPRETED = """
    import torch
    from strata.kernels.gpu import moe_grouped as mg
    from strata.kernels.gpu.reference import moe_ref
    from strata.quant import QType, dequantize, random_rows

    rng = np.random.default_rng(seed)
    def rows(q, n, k):
        return torch.from_numpy(random_rows(q, n, k, rng, 0.05))
    launches = {}
    class Spy:  # counts a kernel's launches: the interpreter, not the torch path, ran
        def __init__(self, name):
            self.name, self.kernel = name, getattr(mg, name)
            launches[name] = []
        def __getitem__(self, grid):
            launches[self.name].append(grid)
            return self.kernel[grid]
    for name in ("_dequant_slots_kernel", "_dequant_mxfp4_slots_kernel", "_glu_rows_kernel",
                 "_combine_kernel"):
        setattr(mg, name, Spy(name))
    calls = launches["_dequant_slots_kernel"]
    # (MXFP4 twice: its own kernel, then the tile kernel every type shares)
    for q, k, mx in ((QType.Q4_K, 512, 64), (QType.Q6_K, 256, 64), (QType.IQ2_XS, 256, 64),
                     (QType.Q8_0, 96, 64), (QType.MXFP4, 160, 64), (QType.MXFP4, 160, None)):
        mg.MXFP4_DEQUANT_BLOCKS = mx
        w = rows(q, 3 * 5, k).view(3, 5, -1)
        out = torch.full((3, 5, k), float("nan"))
        mg.dequantize_slots(w, torch.tensor([2, -1, 0], dtype=torch.int32), q, k, out)
        ref = dequantize(w, q, k)
        for j, s in ((0, 2), (2, 0)):
            assert (out[j] - ref[s]).abs().max() <= 2**-22 * ref[s].abs().max(), (q, mx)
        assert out[1].isnan().all(), (q, mx)
    assert len(launches["_dequant_mxfp4_slots_kernel"]) == 1
    mg.MXFP4_DEQUANT_BLOCKS = 64
    e, d, f = 5, 256, 64
    qt = (QType.Q4_K, QType.IQ2_XS, QType.Q8_0)
    layer = dict(slot_of_expert=torch.tensor([1, -1, 0, 2, -1], dtype=torch.int32),
                 gate_slots=rows(qt[0], 3 * f, d).view(3, f, -1),
                 up_slots=rows(qt[1], 3 * f, d).view(3, f, -1),
                 down_slots=rows(qt[2], 3 * d, f).view(3, d, -1), qtypes=qt, d_model=d,
                 d_expert=f)
    for t in (6, 40):
        ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(t)]))
        x, wts = torch.randn(t, d), torch.rand(t, 2)
        ref = moe_ref(x, ids, wts, **layer)
        for scratch_bytes in (mg.GROUPED_SCRATCH_BYTES, 1):
            out = mg.moe_forward_grouped(x, ids, wts, **layer, scratch_bytes=scratch_bytes)
            err = float((out - ref).norm() / ref.norm())
            assert err < 2e-5, (t, scratch_bytes, err)
    assert len(calls) == 5 + 2 * 3 * (1 + 5), len(calls)
    # the whole layer in one batch (glu rows, then the sum straight from the sorted rows) and
    # one expert a batch (glu rows per batch, the torch scatter): both equal the reference
    assert len(launches["_glu_rows_kernel"]) == 2 * (1 + 5), launches["_glu_rows_kernel"]
    assert len(launches["_combine_kernel"]) == 2, launches["_combine_kernel"]
    # gpt-oss's experts: MXFP4 (its values computed in the tile), biases, the clamped SwiGLU;
    # F 96 (the tl.dot kernels' down: a last K step of half a step)
    qt, f = (QType.MXFP4,) * 3, 96
    layer.update(gate_slots=rows(qt[0], 3 * f, d).view(3, f, -1),
                 up_slots=rows(qt[1], 3 * f, d).view(3, f, -1),
                 down_slots=rows(qt[2], 3 * d, f).view(3, d, -1), qtypes=qt, d_expert=f)
    bias = tuple(3 * torch.randn(e, n) for n in (f, f, d))  # (cuts some at the limit 7)
    ids = torch.from_numpy(np.stack([rng.permutation(e)[:2] for _ in range(24)]))
    x, wts = 3 * torch.randn(24, d), torch.rand(24, 2)
    ref = moe_ref(x, ids, wts, **layer, bias=bias, act="swiglu_oai")
    for scratch_bytes in (mg.GROUPED_SCRATCH_BYTES, 1):
        out = mg.moe_forward_grouped(x, ids, wts, **layer, scratch_bytes=scratch_bytes,
                                     bias=bias, act="swiglu_oai")
        err = float((out - ref).norm() / ref.norm())
        assert err < 2e-5, ("MXFP4 biased", scratch_bytes, err)
    assert len(launches["_combine_kernel"]) == 3, launches["_combine_kernel"]
    # (its experts on their own kernel: 3 parts in one batch, then 5 batches of one expert)
    assert len(launches["_dequant_mxfp4_slots_kernel"]) == 1 + 3 * (1 + 5)
    # the tl.dot group kernels on the same layer: MXFP4 rows through mxfp4_dot_span (a step's
    # blocks read once, x in the joined nibbles' column order) and through the shared tile;
    # h rounded to bf16 between the two kernels on both
    import strata.kernels.gpu.moe as moe
    dot = {}
    for mx in (True, False):
        moe.MXFP4_DOT_SPAN = mx
        dot[mx] = moe.moe_forward(x, ids, wts, **layer, bias=bias, act="swiglu_oai",
                                  path="tl.dot")
        err = float((dot[mx] - ref).norm() / ref.norm())
        assert err < 1.5e-2, ("tl.dot", mx, err)
    err = float((dot[True] - dot[False]).norm() / dot[False].norm())
    assert err < 5e-3, ("the dot span against the tile", err)
    print("ok")
"""


def test_slot_kernel_under_the_interpreter() -> None:
    """_dequant_slots_kernel (Q4_K, Q6_K, IQ2_XS, Q8_0, MXFP4) and MXFP4's own kernel (a slot -1
    left unwritten; 160 columns: five blocks a row, rows split across programs) and the whole
    grouped path on them with its row-wise kernels (glu rows, the sum from the sorted
    rows; MXFP4 with biases and the clamped SwiGLU too), in float32, under TRITON_INTERPRET=1;
    the tl.dot group kernels on the MXFP4 layer with and without mxfp4_dot_span."""
    _, seed = fresh_rng()
    run_interpreted(_INTERPRETED, seed, timeout=600)


def test_token_rounds_cover_every_row_once_with_distinct_tokens() -> None:
    rng, seed = fresh_rng()
    tok = rng.integers(0, 9, 60)
    rounds = mg.token_rounds(tok)
    rows = np.concatenate(rounds)
    assert sorted(rows.tolist()) == list(range(60)), seed
    assert all(len(np.unique(tok[r])) == len(r) for r in rounds), seed
    assert len(rounds) == np.bincount(tok).max(), seed
    assert mg.token_rounds(np.zeros(0, dtype=np.int64)) == []


@pytest.mark.parametrize("kernel", ["glu_rows", "combine", "dequant_mxfp4"])
def test_grouped_kernels_build_for_sm90(kernel: str) -> None:
    """Without a GPU: the grouped path's row kernels (biases and the clamped SwiGLU) and MXFP4's
    dequantize kernel build for sm_90 as launched at gpt-oss-20b's shape, no spills."""
    from test_decode_ops import sm90_resources

    f32, i64 = "*fp32", "*i64"
    if kernel == "glu_rows":
        got = sm90_resources(mg._glu_rows_kernel, dict(h="*bf16", w=f32, eid=i64, bg=f32,
                                                       bu=f32, out="*bf16"), {},
                             dict(F=2880, R=2048), dict(BIAS=True, OAI=True, BR=4, BF=256), 4)
    elif kernel == "combine":
        got = sm90_resources(mg._combine_kernel, dict(y="*bf16", inv=i64, end="*i32", w=f32,
                                                      eid=i64, bd=f32, out=f32), {},
                             dict(D=2880), dict(TOPK=4, BIAS=True, BD=1024), 4)
    else:
        got = sm90_resources(mg._dequant_mxfp4_slots_kernel, dict(w="*u8", slots="*i32",
                                                                  out="*bf16"), {},
                             dict(N=2880, NB=90, row_bytes=1530, stride_ws=2880 * 1530,
                                  stride_oe=5760 * 2880, stride_on=2880),
                             dict(BR=mg.MXFP4_DEQUANT_BLOCKS or 64), 4)
    assert got["spills"] == 0 and got["local"] == 0 and got["regs"] <= 255, got
