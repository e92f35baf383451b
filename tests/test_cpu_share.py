"""--cpu-share: the CPU pool computes a gathered layer's last missed pairs while the GPU gathers
the rest, through a mailbox in host memory (strata/kernels/gpu/mailbox.py,
strata/experts/cpu_share.py). On the CPU: the worker against posts written by the test, its
bounded waits, and the mailbox kernels under Triton's interpreter with a thread answering; on
CUDA: decode steps with the share give the reference logits and count the CPU's pairs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from test_decode_step import PROMPT, decoded_logits
from test_offload import TOKENS, assert_same, offload

from strata.cli.logits import compute_logits
from strata.cli.main import main
from strata.engine.generator import Engine
from strata.errors import StrataError
from strata.experts.compute import Group
from strata.experts.cpu_share import CpuShare
from strata.runtime.waits import StallError

triton = pytest.importorskip("triton")

from interpreted import fresh_seed, run_interpreted  # noqa: E402


@pytest.fixture(scope="module")
def engine(synth):
    """The synthetic qwen3moe (3 layers x 8 experts), no expert cached, on the CPU."""
    return offload(synth("qwen3moe", "Q4_K_M"), "cpu", expert_cache="0", decode_step="off")


def post(share: CpuShare, step: int, layer: int, ids, slots, wts, h) -> None:  # noqa: ANN001
    """What the GPU's post kernel writes, written by the test."""
    box = share._np
    box["ids"][layer], box["slots"][layer], box["wts"][layer] = ids, slots, wts
    box["h"][layer] = h
    box["req"][layer] = step


@pytest.fixture(scope="module")
def ggml_engine(synth):
    """The same with ggml's CPU kernels, whose layers the share computes straight from the
    arena's records (run_strided)."""
    pytest.importorskip("ggml", reason="ggml-python not installed")
    return offload(synth("qwen3moe", "Q4_K_M"), "cpu", expert_cache="0", decode_step="off",
                   cpu_kernels="ggml")


@pytest.mark.parametrize("pool", ["torch", "graph", "token"])
def test_the_worker_computes_its_pairs_and_answers(request, pool, monkeypatch) -> None:
    """With torch's kernels, and with ggml's on either pool (STRATA_CPU_SHARE_POOL): the
    token pool runs ggml's dot kernels on its own threads, so it equals the general ggml call
    but for summation order and its silu's libm expf (an activation at an 8-bit rounding
    boundary could round the other way: test_token_pool_one_token; not with these inputs)."""
    engine = request.getfixturevalue("engine" if pool == "torch" else "ggml_engine")
    ex = engine.model.experts
    cfg = engine.config
    k, d = cfg.n_experts_used, cfg.d_model
    if pool == "token":
        from strata.kernels.cpu.token_pool import TokenPool

        if TokenPool.available() is not None:
            pytest.skip(f"the token pool cannot run: {TokenPool.available()}")
    exact = pool == "torch"  # the same torch call as the test's; ggml's differ in order
    monkeypatch.setenv("STRATA_CPU_SHARE_POOL", "token" if pool == "token" else "graph")
    share = CpuShare(ex, [0, 2], 1, k, d, torch.device("cpu"), timeout_s=5)
    try:
        rng = np.random.default_rng(0)
        for _ in range(2):  # two steps: the stamps move on
            step = share.begin()
            want = {}
            for layer in (0, 2):
                ids = rng.permutation(cfg.n_experts)[:k].astype(np.int32)
                slots = np.full(k, -1, np.int32)
                if layer == 2:
                    slots[-1] = 0  # the CPU's pair hits: the GPU computes it, the CPU nothing
                wts = rng.random(k).astype(np.float32)
                h = rng.standard_normal(d).astype(np.float32)
                post(share, step, layer, ids, slots, wts, h)
                out = torch.zeros(1, d)
                if slots[-1] < 0:
                    g = Group(int(ids[-1]), torch.zeros(1, dtype=torch.int64),
                              torch.tensor([wts[-1]]))
                    ex.pool.run(layer, ex.arena, [g], torch.from_numpy(h)[None], out)
                want[layer] = (out[0].numpy(), [int(ids[-1])] if slots[-1] < 0 else [])
            share.end(None)
            assert (share._token is not None) == (pool == "token")
            for layer, (row, experts) in want.items():
                if exact:
                    np.testing.assert_array_equal(share._np["rows"][layer], row)
                else:
                    np.testing.assert_allclose(share._np["rows"][layer], row, rtol=1e-5,
                                               atol=1e-6 * float(np.abs(row).max()))
                assert share._np["done"][layer] == step
                assert share.taken[step].get(layer, []) == experts
            assert share.taken[step][0] and 2 not in share.taken[step]
        tm = share.timing  # two steps of two layers timed; the pool ran on layer 0's posts only
        assert tm["layers"] == 4 and 0 < tm["pool_s"] <= tm["answer_s"]
    finally:
        share.close()


def test_an_unknown_share_pool_is_refused(engine, monkeypatch) -> None:
    monkeypatch.setenv("STRATA_CPU_SHARE_POOL", "fast")
    cfg = engine.config
    with pytest.raises(StrataError, match="STRATA_CPU_SHARE_POOL=fast: give graph"):
        CpuShare(engine.model.experts, [0], 1, cfg.n_experts_used, cfg.d_model,
                 torch.device("cpu"), timeout_s=5)


def test_the_worker_waits_for_a_post_with_a_deadline(engine) -> None:
    ex = engine.model.experts
    share = CpuShare(ex, [1], 1, engine.config.n_experts_used, engine.config.d_model,
                     torch.device("cpu"), timeout_s=0.2)
    try:
        share.begin()  # nothing is ever posted
        t0 = time.monotonic()
        with pytest.raises(StallError, match="layer 1 of decode step 1 to be posted"):
            share.end(None)
        assert time.monotonic() - t0 < 3
    finally:
        share.close()


def test_a_wait_that_ran_out_in_the_graph_is_reported(engine) -> None:
    share = CpuShare(engine.model.experts, [0], 1, engine.config.n_experts_used,
                     engine.config.d_model, torch.device("cpu"), timeout_s=1)
    try:
        share._np["err"][0] = 3  # the take kernel of layer 2 gave up
        with pytest.raises(StallError, match="CPU's experts of layer 2"):
            share.begin()
        share.check()  # reported once
    finally:
        share.close()


def test_cpu_share_out_of_range_is_refused(synth, capsys) -> None:
    path = str(synth("qwen3moe", "Q4_K_M"))
    k = Engine.load(path).config.n_experts_used
    code = main(["generate", path, "--offload", "on", "--cpu-share", str(k), "-n", "1",
                 "--prompt", "hi"])
    assert code == 2
    assert f"--cpu-share {k}: give 0 (off) to {k - 1}" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--cpu-share 0"):
        CpuShare(None, [0], 0, k, 8, torch.device("cpu"))


_MAILBOX = """
    import threading, time
    import torch
    from strata.kernels.gpu.mailbox import post, take

    L, K, D = 3, 4, 40
    i32 = torch.int32
    box = {"req": torch.zeros(L, dtype=i32), "done": torch.zeros(L, dtype=i32),
           "ids": torch.zeros(L, K, dtype=i32), "slots": torch.zeros(L, K, dtype=i32),
           "wts": torch.zeros(L, K), "h": torch.zeros(L, D), "rows": torch.zeros(L, D),
           "err": torch.zeros(1, dtype=torch.int32)}
    gen = torch.Generator().manual_seed(seed)
    seq = torch.tensor([7], dtype=torch.int32)
    ids = torch.tensor([[5, 1, 6, 2]])
    slot_of = torch.tensor([0, -1, 3, -1, -1, 2, -1, 1], dtype=torch.int32)
    wts, h = torch.rand(1, K, generator=gen), torch.randn(1, D, generator=gen)
    post(box, seq, 1, ids, wts, h, slot_of)
    assert box["req"].tolist() == [0, 7, 0]
    assert box["ids"][1].tolist() == [5, 1, 6, 2] and box["slots"][1].tolist() == [2, -1, -1, 3]
    assert torch.equal(box["wts"][1], wts[0]) and torch.equal(box["h"][1], h[0])
    assert not box["h"][0].any() and not box["h"][2].any()

    answer = torch.randn(D, generator=gen)
    def host():  # the worker: sees the post, answers a little later
        while int(box["req"][1]) != 7:
            time.sleep(0.001)
        time.sleep(0.05)
        box["rows"][1] = answer
        box["done"][1] = 7
    t = threading.Thread(target=host)
    t.start()
    out = torch.randn(D, generator=gen)
    before = out.clone()
    take(box, seq, 1, out)
    t.join()
    assert torch.equal(out, before + answer) and int(box["err"][0]) == 0

    out = before.clone()  # nobody answers layer 2: the take gives up, says so, adds nothing
    take(box, seq, 2, out, limit=50)
    assert torch.equal(out, before) and int(box["err"][0]) == 3
    print("ok")
"""


def test_mailbox_kernels_under_the_interpreter() -> None:
    run_interpreted(_MAILBOX, fresh_seed(), timeout=300)


def test_mailbox_kernels_compile_for_sm90() -> None:
    """The PTX path, without a GPU: Triton compiles both kernels for sm_90 (its bundled
    ptxas), with the system-scope release store and fence, the acquire polls in a loop and
    volatile reads of the host's rows."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import mailbox as mb

    target = GPUTarget("cuda", 90, 32)
    ptrs = {"seq": "*i32", "req": "*i32", "b_ids": "*i32", "b_slots": "*i32",
            "b_wts": "*fp32", "b_h": "*fp32", "ids": "*i64", "wts": "*fp32", "h": "*fp32",
            "slot_of": "*i32", "layer": "i32", "D": "i32", "K": "constexpr", "KB": "constexpr",
            "BLOCK": "constexpr"}
    post_k = triton.compile(ASTSource(mb._post_kernel, ptrs,
                                      constexprs={"K": 8, "KB": 8, "BLOCK": 2048}), target=target)
    ptx = post_k.asm["ptx"]
    assert "fence.acq_rel.sys" in ptx and "st.release.sys.global.b32" in ptx
    assert post_k.asm["cubin"]
    sig = {"seq": "*i32", "done": "*i32", "b_rows": "*fp32", "err": "*i32", "out": "*fp32",
           "layer": "i32", "D": "i32", "LIMIT": "i32", "BLOCK": "constexpr"}
    take_k = triton.compile(ASTSource(mb._take_kernel, sig, constexprs={"BLOCK": 2048}),
                            target=target)
    ptx = take_k.asm["ptx"]
    assert ptx.count("ld.acquire.sys.global.b32") >= 2 and "ld.volatile.global" in ptx
    assert take_k.asm["cubin"]
    # at launch Triton turns an int argument equal to 1 into a constant unless told not to: the
    # layer number (and the poll limit) must stay i32 values for `.to` and the graph's replays
    for kern, names in ((mb._post_kernel, {"layer"}), (mb._take_kernel, {"layer", "LIMIT"})):
        assert names <= {p.name for p in kern.params if p.do_not_specialize}, kern


_HOST_FROM = """
    import numpy as np
    import torch
    from strata.kernels.gpu import gather_misses, moe_forward
    from strata.kernels.gpu.reference import moe_ref
    from strata.experts.layout import ExpertLayout
    from strata.quant import QType, random_rows

    rng = np.random.default_rng(seed)
    # large row tiles: few programs (the interpreter's time goes by program)
    tiles = {"gate_up": (32, 256, 1, 4), "down_pairs": (32, 256, 1, 4)}
    e, d, f, k = 6, 256, 256, 4
    qt = (QType.Q4_K, QType.Q8_0, QType.Q6_K)
    lay = ExpertLayout(0, tuple(int(q) for q in qt), d, f)
    records = torch.zeros(e, lay.stride, dtype=torch.uint8)
    for part, q, rows_, cols in zip(lay.views(records), qt, (f, f, d), (d, d, f)):
        part.copy_(torch.from_numpy(random_rows(q, e * rows_, cols, rng, 0.05)).view(part.shape))
    slot_of = torch.tensor([-1, 0, -1, -1, 1, -1], dtype=torch.int32)
    slots = records[[1, 4]].clone()
    ids = torch.tensor([[0, 4, 2, 3]])  # pairs 0, 2, 3 miss; pair 1 hits
    x, wts = torch.randn(1, d), torch.rand(1, k)
    for host_from in (4, 2):
        rows = torch.full((k, lay.stride), 255, dtype=torch.uint8)
        gather_misses(ids, slot_of, records, rows, lay.nbytes, host_from)
        for p in range(k):  # gathered: the misses before host_from; the rest untouched
            e_p = int(ids[0, p])
            if slot_of[e_p] < 0 and p < host_from:
                assert torch.equal(rows[p, : lay.nbytes], records[e_p, : lay.nbytes]), p
            else:
                assert (rows[p] == 255).all(), p
        parts = moe_forward(x, ids, wts, slot_of, *lay.views(slots), qt, d, f,
                            miss=lay.views(rows), sum_pairs=False, host_from=host_from,
                            tiles=tiles)
        assert parts.shape == (1, k, d)
        full = torch.arange(e, dtype=torch.int32)
        for p in range(k):
            e_p = int(ids[0, p])
            if slot_of[e_p] < 0 and p >= host_from:  # the host's pair: a zero row
                assert not parts[0, p].any(), (host_from, p)
                continue
            one = moe_ref(x, ids[:, p:p + 1], wts[:, p:p + 1], full, *lay.views(records), qt,
                          d, f)
            err = float((parts[0, p] - one[0]).abs().max() / one.abs().max())
            assert err < 2e-5, (host_from, p, err)
    print("ok")
"""


def test_host_pairs_are_left_out_under_the_interpreter() -> None:
    run_interpreted(_HOST_FROM, fresh_seed(), timeout=600)


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["0", "5"])
def test_decode_steps_with_a_cpu_share_give_reference_logits(synth, cache):
    """Every layer gathers its misses; the CPU takes each token's last `pairs` missed pairs
    inside the graph's wait: the same logits, the CPU's pairs counted as CPU pairs and not as
    copied bytes."""
    path = synth("qwen3moe", "Q4_K_M")
    pairs = 1  # of the tiny model's 2 (more pairs on the host: the interpreter test above)
    ref = compute_logits(Engine.load(path), TOKENS)[PROMPT:]
    engine = offload(path, "cuda", expert_cache=cache, miss="dma", cpu_share=pairs)
    step = engine.model.step
    assert len(step.gathered_layers) == engine.config.n_layers and step.share is not None
    assert step.share.host_from == engine.config.n_experts_used - pairs
    assert_same(decoded_logits(engine, TOKENS), ref)
    assert not step._failed and step.steps["replayed"] == len(TOKENS) - PROMPT - 1
    st = engine.model.experts.stats
    st.settle()
    assert st.cpu.sum() > 0 and st.streamed.sum() > 0
    pairs_all = st.hits.sum() + st.cpu.sum() + st.streamed.sum()
    assert pairs_all == len(TOKENS) * engine.config.n_layers * engine.config.n_experts_used
    step.share.close()


@pytest.mark.cuda
def test_a_cpu_share_that_never_answers_stops_the_step(synth, monkeypatch):
    """The worker dies: the step raises a StallError naming the wait instead of hanging (the
    graph's own wait gives up after its polls)."""
    from strata.experts import cpu_share

    monkeypatch.setattr(cpu_share.CpuShare, "_layer",
                        lambda self, step, layer: (_ for _ in ()).throw(
                            StallError(f"injected: layer {layer}")))
    monkeypatch.setattr("strata.kernels.gpu.mailbox.TAKE_LIMIT", 1000)
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cuda", expert_cache="0", miss="dma",
                     cpu_share=1)
    kv = engine.model.new_cache(len(TOKENS))
    engine.run_prompt(TOKENS[:PROMPT], kv)
    with pytest.raises(StallError, match="injected: layer 0"):
        engine.model.decode(TOKENS[PROMPT], kv)
    assert threading.active_count() >= 1
