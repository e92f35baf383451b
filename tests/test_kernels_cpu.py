"""CPU expert backends (strata.kernels.cpu) against the float32 reference (dequantize + matmul).

Every case draws fresh random blocks (the seed is in the failure message, to replay it). The ggml
backend is skipped when ggml-python is not installed (`pip install ggml-python`).

Tolerances are relative, ‖out − ref‖ / ‖ref‖ over the experts' contribution. torch dequantizes
exactly as the reference does, so only summation order differs. ggml rounds the activations of
each matmul (x, then silu(g)·u) to the weight type's dot partner: q8_0 (32 values per scale) for
the legacy types, IQ4_NL and MXFP4; q8_K (256 per scale) for the K- and IQ-types; f16 / bf16 for
f16 / bf16 weights. Measured on these shapes over 40 seeds (max, mean): q8_0 1.3%, 1.1%;
q8_K 2.7%, 1.7% (sd 0.25%); bf16 0.38%; f16 0.04%; f32 < 1e-6. Each bound has room above the max.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch

from strata.kernels.cpu import ExpertJob, make_cpu_experts, reference_run
from strata.quant import SUPPORTED, QType, random_rows, row_nbytes

D, F = 256, 512  # whole 256-value blocks; D != F so that a swapped axis cannot pass
Q8_0_PARTNER = {QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0, QType.IQ4_NL,
                QType.MXFP4}
GGML_TOL = {QType.F32: 1e-4, QType.F16: 2e-3, QType.BF16: 1e-2}  # else by the q8 partner below
TORCH_TOL = 1e-5


def tolerance(backend: str, qtypes: tuple[int, ...]) -> float:
    if backend == "torch":
        return TORCH_TOL
    return max(GGML_TOL.get(QType(q), 2e-2 if q in Q8_0_PARTNER else 4e-2) for q in qtypes)


@pytest.fixture(scope="module", params=["torch", "ggml"])
def backend(request: pytest.FixtureRequest):
    if request.param == "ggml":
        pytest.importorskip("ggml", reason="ggml-python not installed: the ggml backend is skipped")
    experts = make_cpu_experts(request.param)
    yield experts
    experts.close()


def fresh_rng() -> tuple[np.random.Generator, int]:
    seed = int(np.random.SeedSequence().entropy % (1 << 32))
    return np.random.default_rng(seed), seed


def arena(rng: np.random.Generator, qtypes: tuple[int, int, int], n_experts: int):
    """Experts packed as the arena packs them: uint8 [E, stride] records | gate | up | down |,
    returned as per-expert (gate, up, down) torch views."""
    parts = (F * row_nbytes(qtypes[0], D), F * row_nbytes(qtypes[1], D),
             D * row_nbytes(qtypes[2], F))
    stride = (sum(parts) + 255) // 256 * 256
    buf = torch.zeros(n_experts, stride, dtype=torch.uint8)
    views = []
    for e in range(n_experts):
        rows = (random_rows(qtypes[0], F, D, rng, 0.02), random_rows(qtypes[1], F, D, rng, 0.02),
                random_rows(qtypes[2], D, F, rng, 0.02))
        start, mats = 0, []
        for part, r in zip(parts, rows, strict=True):
            buf[e, start:start + part] = torch.from_numpy(r.reshape(-1))
            mats.append(buf[e, start:start + part].view(r.shape))
            start += part
        views.append(tuple(mats))
    return views


def job(mats, qtypes, tokens: list[int], rng: np.random.Generator) -> ExpertJob:
    weights = torch.from_numpy(rng.uniform(0.1, 1.0, len(tokens)).astype(np.float32))
    return ExpertJob(*mats, tuple(int(q) for q in qtypes), torch.tensor(tokens), weights)


def check(experts, h: torch.Tensor, jobs: list[ExpertJob], seed: int) -> None:
    base = torch.from_numpy(np.random.default_rng(seed).normal(size=h.shape).astype(np.float32))
    ref, out = base.clone(), base.clone()  # pre-filled: run must accumulate into out
    reference_run(h, jobs, ref)
    experts.run(h, jobs, out)
    tol = tolerance(experts.name, tuple(q for j in jobs for q in j.qtypes))
    err = ((out - ref).norm() / (ref - base).norm()).item()
    assert err < tol, f"{experts.name}: relative error {err:.2e} >= {tol:.0e} (seed {seed})"


@pytest.mark.parametrize("qtype", SUPPORTED, ids=[t.name for t in SUPPORTED])
def test_every_type(backend, qtype: QType) -> None:
    rng, seed = fresh_rng()
    q = (qtype, qtype, qtype)
    experts = arena(rng, q, 5)
    h = torch.from_numpy(rng.normal(size=(7, D)).astype(np.float32))
    jobs = [job(experts[3], q, [4], rng),  # one token
            job(experts[0], q, [0, 2, 6], rng),  # three, token 0 shared with the next expert
            job(experts[4], q, list(range(7)), rng)]  # every token of an odd count
    check(backend, h, jobs, seed)


@pytest.mark.parametrize("tokens", [1, 3, 7])
def test_mixed_types_separate_buffers(backend, tokens: int) -> None:
    # gate, up, down of different types, two signatures in one call, matrices in separate
    # numpy buffers (not evenly spaced: ggml runs them as one-expert groups)
    rng, seed = fresh_rng()
    mixes = [(QType.Q4_K, QType.IQ3_S, QType.Q8_0), (QType.IQ2_XS, QType.IQ2_XS, QType.Q6_K)]
    h = torch.from_numpy(rng.normal(size=(tokens, D)).astype(np.float32))
    jobs = []
    for i, q in enumerate(mixes * 2):
        mats = (random_rows(q[0], F, D, rng, 0.02), random_rows(q[1], F, D, rng, 0.02),
                random_rows(q[2], D, F, rng, 0.02))
        picked = sorted(rng.choice(tokens, size=1 + i % tokens, replace=False).tolist())
        jobs.append(job(mats, q, picked, rng))
    check(backend, h, jobs, seed)


def test_graph_reuse_with_other_experts(backend) -> None:
    # the same call shape twice with other experts and tokens: a cached graph must re-point
    rng, seed = fresh_rng()
    q = (QType.Q4_K, QType.Q4_K, QType.Q6_K)
    experts = arena(rng, q, 8)
    h = torch.from_numpy(rng.normal(size=(3, D)).astype(np.float32))
    for a, b in ((1, 2), (7, 0), (5, 5)):  # (5, 5): one expert twice
        check(backend, h, [job(experts[a], q, [0, 2], rng), job(experts[b], q, [1], rng)], seed)


def test_ggml_strided_one_token() -> None:
    """The CPU share's lean call: one token through experts picked by slot in arena records
    (each part one strided tensor), for two layers of other types in turn, against the float
    reference and against the general call (the same ggml arithmetic: equal but for order)."""
    pytest.importorskip("ggml", reason="ggml-python not installed: the ggml backend is skipped")
    rng, seed = fresh_rng()
    experts = make_cpu_experts("ggml")
    try:
        layers = [(q, arena(rng, q, 8)) for q in ((QType.Q4_K, QType.IQ3_S, QType.Q6_K),
                                                  (QType.Q8_0, QType.Q8_0, QType.Q5_K))]
        for picks in ([3], [5, 0], [2, 7, 2], [6]):
            for q, recs in layers:
                x = rng.normal(size=D).astype(np.float32)
                w = rng.uniform(0.1, 1.0, len(picks)).astype(np.float32)
                stride = recs[1][0].data_ptr() - recs[0][0].data_ptr()
                got = experts.run_strided(x, tuple(int(t) for t in q), F,
                                          tuple(m.data_ptr() for m in recs[0]), stride, 8,
                                          np.array(picks, np.int32), w)
                h = torch.from_numpy(x)[None]
                jobs = [ExpertJob(*recs[e], tuple(int(t) for t in q), torch.tensor([0]),
                                  torch.tensor([wk])) for e, wk in zip(picks, w, strict=True)]
                ref, out = torch.zeros(1, D), torch.zeros(1, D)
                reference_run(h, jobs, ref)
                experts.run(h, jobs, out)
                err = float(np.linalg.norm(got - ref[0].numpy()) / ref.norm())
                assert err < tolerance("ggml", q), (picks, q, err, seed)
                np.testing.assert_allclose(got, out[0].numpy(), rtol=1e-5, atol=1e-6 * float(
                    out.abs().max()), err_msg=f"seed {seed}")
    finally:
        experts.close()


def test_no_work_leaves_out_alone(backend) -> None:
    rng, _ = fresh_rng()
    q = (QType.Q8_0,) * 3
    out = torch.randn(2, D)
    before = out.clone()
    backend.run(torch.randn(2, D), [], out)
    backend.run(torch.randn(2, D), [job(arena(rng, q, 1)[0], q, [], rng)], out)
    assert torch.equal(out, before)


def test_bad_shapes_are_refused(backend) -> None:
    rng, _ = fresh_rng()
    q = (QType.Q4_K,) * 3
    gate, up, down = arena(rng, q, 1)[0]
    with pytest.raises(ValueError, match="down"):
        backend.run(torch.randn(1, D), [job((gate, up, down[1:]), q, [0], rng)],
                    torch.zeros(1, D))
    with pytest.raises(ValueError, match="out"):
        backend.run(torch.randn(1, D), [job((gate, up, down), q, [0], rng)], torch.zeros(2, D))


def test_ggml_sends_types_it_lacks_to_torch(monkeypatch, caplog) -> None:
    pytest.importorskip("ggml", reason="ggml-python not installed: the ggml backend is skipped")
    from strata.kernels.cpu import ggml_experts

    monkeypatch.setattr(ggml_experts, "supported", lambda q: q != QType.IQ1_M)
    rng, seed = fresh_rng()
    experts = make_cpu_experts("ggml")
    h = torch.from_numpy(rng.normal(size=(3, D)).astype(np.float32))
    lacking = (QType.IQ1_M, QType.IQ1_M, QType.Q4_K)
    q = (QType.Q4_K,) * 3
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        check(experts, h, [job(arena(rng, lacking, 1)[0], lacking, [0, 1], rng),
                           job(arena(rng, q, 1)[0], q, [2], rng)], seed)
    assert "run on torch" in caplog.text
    experts.close()


def test_registry(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="strata.kernels"):
        auto = make_cpu_experts("auto")
    assert f"{auto.name} backend" in caplog.text
    auto.close()
    assert make_cpu_experts("torch").name == "torch"
    with pytest.raises(ValueError, match="unknown CPU expert backend"):
        make_cpu_experts("numba")


@pytest.mark.parametrize("threads", [1, 3])
def test_token_pool_one_token(threads: int) -> None:
    """The CPU share's token pool (ggml's dot kernels on a C pool of spinning threads): the
    float reference within the q8 rounding, for mixed types and 1-3 picks (one expert twice),
    with waits long enough between calls that the workers fall asleep and must be woken; and
    ggml's own strided call to float32 round-off in most calls. The rest may differ by an
    activation that rounds to the other 8-bit value: the pool's silu takes libm's expf, ggml's
    a SIMD polynomial, and a value at a rounding boundary moves every output row a little
    (seed 253997038: 2.3e-3 of the largest output in one call of eight, both 1.8e-2 from the
    reference)."""
    pytest.importorskip("ggml", reason="ggml-python not installed: the ggml backend is skipped")
    from strata.kernels.cpu.token_pool import TokenPool

    if TokenPool.available() is not None:
        pytest.skip(f"the token pool cannot run here: {TokenPool.available()}")
    rng, seed = fresh_rng()
    graph, pool = make_cpu_experts("ggml"), TokenPool(threads, spin_us=200)
    try:
        assert pool.threads == threads
        layers = [(q, arena(rng, q, 8)) for q in ((QType.Q4_K, QType.IQ3_S, QType.Q6_K),
                                                  (QType.Q8_0, QType.Q8_0, QType.Q5_K))]
        calls = exact = 0
        for i, picks in enumerate(([3], [5, 0], [2, 7, 2], [6])):
            for q, recs in layers:
                x = rng.normal(size=D).astype(np.float32)
                w = rng.uniform(0.1, 1.0, len(picks)).astype(np.float32)
                stride = recs[1][0].data_ptr() - recs[0][0].data_ptr()
                args = (x, tuple(int(t) for t in q), F, tuple(m.data_ptr() for m in recs[0]),
                        stride, 8, np.array(picks, np.int32), w)
                if i == 2:
                    time.sleep(0.01)  # > spin_us: the workers sleep on the condition variable
                got, want = pool.run_strided(*args), graph.run_strided(*args)
                jobs = [ExpertJob(*recs[e], tuple(int(t) for t in q), torch.tensor([0]),
                                  torch.tensor([wk])) for e, wk in zip(picks, w, strict=True)]
                ref = torch.zeros(1, D)
                reference_run(torch.from_numpy(x)[None], jobs, ref)
                err = float(np.linalg.norm(got - ref[0].numpy()) / ref.norm())
                assert err < tolerance("ggml", q), (picks, q, err, seed)
                calls += 1
                if np.allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max())):
                    exact += 1
                else:  # a flipped activation: far below either's distance from the reference
                    apart = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                    assert apart < 0.25 * err, (picks, q, apart, err, seed)
        assert exact >= calls - 2, (exact, calls, seed)
        with pytest.raises(ValueError, match="outside the layer's 8 records"):
            pool.run_strided(*args[:6], np.array([8], np.int32), w[:1])
        with pytest.raises(ValueError, match="1 to 16 experts"):
            pool.run_strided(*args[:6], np.zeros(17, np.int32), np.ones(17, np.float32))
    finally:
        pool.close()
        graph.close()


def test_token_pool_says_why_it_cannot_build(tmp_path, monkeypatch) -> None:
    pytest.importorskip("ggml", reason="ggml-python not installed: the ggml backend is skipped")
    from strata.kernels.cpu import token_pool

    monkeypatch.setenv("STRATA_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    token_pool._library.cache_clear()
    try:
        why = token_pool.TokenPool.available()
        assert why is not None and "failed on token_pool.c" in why
        with pytest.raises(RuntimeError, match="the token pool cannot run: false failed"):
            token_pool.TokenPool(2)
        assert not list(tmp_path.rglob("*.so"))  # nothing half-written left behind
    finally:
        token_pool._library.cache_clear()


def test_pool_threads_follow_the_affinity_mask_and_the_load(monkeypatch) -> None:
    """The CPU pool's default thread count counts the cores this process may use (a container's
    cpuset), not the machine's, less those other processes keep busy, less the driving thread."""
    import os

    from strata import config
    from strata.experts import cpu_pool

    monkeypatch.setattr(config, "BUSY_REUSE_S", 0.0)  # (each call samples afresh here)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 9}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert cpu_pool.default_threads() == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (1.2, 0.0, 0.0))  # one core kept busy
    monkeypatch.setattr(config, "busy_now", lambda s: 1.3)  # (and busy now)
    assert cpu_pool.default_threads() == 1
    assert cpu_pool.default_threads(drives_gpu=False) == torch.get_num_threads()  # (CPU)
    # the load average remembers a process that has ended: the cores busy now count
    monkeypatch.setattr(config, "busy_now", lambda s: 0.1)
    assert cpu_pool.default_threads() == 2
    monkeypatch.setattr(config, "busy_now", lambda s: None)  # (no /proc/stat: the average)
    assert cpu_pool.default_threads() == 1
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 0.0, 0.0))
    monkeypatch.setattr(config, "busy_now", lambda s: 9.0)
    assert cpu_pool.default_threads() == 55


def test_other_load_samples_once_at_start_up(monkeypatch) -> None:  # noqa: ANN001
    """The thread pools and the CPU pool both ask at start-up: one 0.1 s sample serves both,
    and a call after BUSY_REUSE_S samples again."""
    import os

    from strata import config

    samples = []
    monkeypatch.setattr(os, "getloadavg", lambda: (3.0, 0.0, 0.0))
    monkeypatch.setattr(config, "busy_now", lambda s: samples.append(s) or 2.0)
    monkeypatch.setattr(config, "_busy_read", [])
    clock = [100.0]
    monkeypatch.setattr(config.time, "monotonic", lambda: clock[0])
    assert config.other_load() == 2.0 and config.other_load() == 2.0
    assert len(samples) == 1
    clock[0] += config.BUSY_REUSE_S + 0.1
    assert config.other_load() == 2.0 and len(samples) == 2


def test_busy_now_counts_a_busy_process() -> None:
    """busy_now reads /proc/stat twice: a thread spinning in another process shows as about one
    busy core (at most the usable cores); nothing else checked, the machine is shared."""
    import subprocess
    import sys

    from strata.config import busy_now, usable_cores

    if busy_now(0.01) is None:
        pytest.skip("no /proc/stat")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        busy = busy_now(0.3)
    finally:
        spin.kill()
        spin.wait()
    assert 0.7 <= busy <= usable_cores() + 0.01


def test_biased_experts(backend) -> None:
    # gpt-oss's experts: biases on gate, up and down and the clamped SwiGLU, in arena records
    # (one group) and one job alone; activations large enough that the clamps bite
    rng, seed = fresh_rng()
    q = (QType.MXFP4, QType.MXFP4, QType.MXFP4)
    experts = arena(rng, q, 4)
    h = torch.from_numpy(rng.normal(scale=30.0, size=(5, D)).astype(np.float32))

    def biased(mats, tokens: list[int]) -> ExpertJob:
        j = job(mats, q, tokens, rng)
        b = tuple(torch.from_numpy(rng.normal(size=n).astype(np.float32)) for n in (F, F, D))
        return ExpertJob(j.gate, j.up, j.down, j.qtypes, j.tokens, j.weights, b, "swiglu_oai")

    check(backend, h, [biased(experts[2], [1]), biased(experts[0], [0, 1, 4]),
                       biased(experts[3], list(range(5)))], seed)
    check(backend, h, [biased(experts[1], [2, 3])], seed)


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q6_K, QType.Q8_0, QType.IQ2_XS,
                                   QType.BF16, QType.F32], ids=lambda q: q.name)
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_ggml_dense_matmul(qtype: QType, tokens: int) -> None:
    """A dense matrix in its GGUF blocks multiplied on ggml's kernels (the offload runtime's
    dense matrices on the CPU under --kernels fused) against dequantize + matmul, within ggml's
    rounding of x to its 8-bit (or half) dot partner; each call's output is a new tensor, and a
    graph kept for a token count gives the same result again."""
    pytest.importorskip("ggml", reason="ggml-python not installed")
    from strata.kernels.cpu.ggml_dense import GgmlMatmul
    from strata.quant import dequantize

    rng, seed = fresh_rng()
    n, k = 384, 512
    raw = torch.from_numpy(random_rows(qtype, n, k, rng, 0.02))
    x = torch.from_numpy(rng.normal(size=(tokens, k)).astype(np.float32))
    ref = x @ dequantize(raw, qtype, k).T
    mm = GgmlMatmul(raw, qtype, k)
    out = mm(x)
    err = ((out - ref).norm() / ref.norm()).item()
    tol = tolerance("ggml", (qtype,))
    assert out.shape == (tokens, n) and err < tol, f"{qtype.name}: {err:.2e} (seed {seed})"
    again = mm(x[::1].clone())
    assert again.data_ptr() != out.data_ptr() and torch.equal(again, out)


def test_offload_on_the_cpu_multiplies_dense_matrices_on_ggml(synth) -> None:
    """--offload on on the CPU under --kernels fused: the dense matrices (attention, the output
    head) stay in their GGUF blocks on ggml's kernels, logits within the 8-bit activations' reach
    of the reference's; --kernels exact keeps float32."""
    pytest.importorskip("ggml", reason="ggml-python not installed")
    from strata.cli.logits import compute_logits
    from strata.config import EngineConfig
    from strata.engine.generator import Engine
    from strata.model.weights import QuantTensor

    from hf_reference import kl_per_position

    path = synth("qwen3moe", "Q4_K_M")
    tokens = [5, 311, 17, 902, 64, 64, 1000, 3, 250, 777, 41, 8]
    ref = compute_logits(Engine.load(path), tokens)
    eng = Engine.load(path, config=EngineConfig(offload="on"))
    w = eng.model.w
    assert isinstance(w.output, QuantTensor) and w.output.cpu_matmul is not None
    assert isinstance(w.layers[0].wq, QuantTensor) and w.layers[0].wq.cpu_matmul is not None
    kl = kl_per_position(ref, compute_logits(eng, tokens))
    assert kl.max() < 5e-2 and kl.mean() < 1e-2, kl
    exact = Engine.load(path, config=EngineConfig(offload="on", kernels="exact"))
    assert isinstance(exact.model.w.output, torch.Tensor)
