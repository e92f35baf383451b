"""--prefetch N: while a gathered decode layer computes, the next one's likely experts are copied
ahead into VRAM rows, and its gather takes them from there (strata/engine/decode_prefetch.py).
On the CPU: gather_misses' prefetched source under Triton's interpreter, and the refusals; on
CUDA: decode steps with prefetch give the reference logits, capture as graphs and count what
was copied ahead."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from test_decode_step import PROMPT, decoded_logits
from test_offload import TOKENS, assert_same, offload

from strata.cli.logits import compute_logits
from strata.cli.main import main
from strata.config import AUTO_PREFETCH
from strata.engine.generator import Engine

triton = pytest.importorskip("triton")

from interpreted import fresh_seed, run_interpreted  # noqa: E402

_GATHER = """
    import torch
    from strata.kernels.gpu import gather_misses

    rng = np.random.default_rng(seed)
    e, stride, nbytes = 13, 96, 90  # records padded to whole words; 90 bytes copied (23 words)
    records = torch.from_numpy(rng.integers(0, 256, (e, stride), dtype=np.uint8))
    slot_of = torch.full((e,), -1, dtype=torch.int32)
    slot_of[[2, 7]] = torch.tensor([0, 1], dtype=torch.int32)  # two resident experts
    # two rows copied ahead: expert 4 in row 1, expert 9 in row 0, with other bytes than the
    # arena's, so that the test sees where each row came from
    pre = torch.from_numpy(rng.integers(0, 256, (2, stride), dtype=np.uint8))
    pre_of = torch.full((e,), -1, dtype=torch.int32)
    pre_of[4], pre_of[9] = 1, 0
    pre_of[7] = 0  # a resident expert with a prefetch row: its slot wins, nothing is copied
    ids = torch.tensor([[4, 2, 11, 9, 7, 0, -1]])  # -1: no expert (a prefetch's spare row)
    rows = torch.full((7, stride), 255, dtype=torch.uint8)
    gather_misses(ids, slot_of, records, rows, nbytes, prefetched=(pre_of, pre))
    words = 4 * ((nbytes + 3) // 4)
    for p, ex in enumerate(ids[0].tolist()):
        if ex < 0 or slot_of[ex] >= 0:
            assert (rows[p] == 255).all(), (p, ex)  # a hit: left as it was
        else:
            src = pre[pre_of[ex]] if pre_of[ex] >= 0 else records[ex]
            assert torch.equal(rows[p, :words], src[:words]), (p, ex)
            assert (rows[p, words:] == 255).all(), (p, ex)
    ids = ids[:, :6]
    # without prefetched rows every miss comes from the arena (and host_from still holds)
    rows2 = torch.full((6, stride), 255, dtype=torch.uint8)
    gather_misses(ids, slot_of, records, rows2, nbytes, host_from=4)
    for p, ex in enumerate(ids[0].tolist()):
        want = records[ex][:words] if slot_of[ex] < 0 and p < 4 else torch.full((words,), 255,
                                                                                 dtype=torch.uint8)
        assert torch.equal(rows2[p, :words], want), (p, ex)
    # records of several blocks (GATHER_BLOCK words each) gathered by few programs, each looping
    # over its share (as the prefetch's copy runs): the same rows as a program per block
    from strata.kernels.gpu.moe import GATHER_BLOCK

    big = 4 * GATHER_BLOCK * 2 + 4 * 9  # bytes: two whole blocks and part of a third
    records = torch.from_numpy(rng.integers(0, 256, (e, big + 8), dtype=np.uint8))
    pre = torch.from_numpy(rng.integers(0, 256, (2, big + 8), dtype=np.uint8))
    want = torch.full((6, big + 8), 255, dtype=torch.uint8)
    gather_misses(ids, slot_of, records, want, big - 2, prefetched=(pre_of, pre))
    for p, ex in enumerate(ids[0].tolist()):
        src = None if slot_of[ex] >= 0 else pre[pre_of[ex]] if pre_of[ex] >= 0 else records[ex]
        assert torch.equal(want[p, :big], src[:big] if src is not None else want[p, :big])
        assert (want[p, big:] == 255).all() and (src is not None or (want[p] == 255).all())
    for programs in (1, 2, 5):
        got = torch.full_like(want, 255)
        gather_misses(ids, slot_of, records, got, big - 2, prefetched=(pre_of, pre),
                      programs=programs)
        assert torch.equal(got, want), programs
    # the prefetch's own copy: its guesses, -1 where it has none, from the arena by looping
    # programs (no prefetched source)
    guesses = torch.tensor([[11, -1, 4]])
    ahead = torch.full((3, big + 8), 255, dtype=torch.uint8)
    gather_misses(guesses, slot_of, records, ahead, big - 2, programs=2)
    assert torch.equal(ahead[0, :big], records[11, :big])
    assert torch.equal(ahead[2, :big], records[4, :big])
    assert (ahead[1] == 255).all() and (ahead[:, big:] == 255).all()
    try:
        gather_misses(ids, slot_of, records, got, big - 2, programs=0)
    except ValueError as err:
        assert "programs=0" in str(err)
    else:
        raise AssertionError("programs=0 accepted")
    # rows too short for the record are refused
    try:
        gather_misses(ids, slot_of, records, rows, nbytes, prefetched=(pre_of, pre[:, :64]))
    except ValueError as err:
        assert "prefetched rows" in str(err)
    else:
        raise AssertionError("short prefetched rows accepted")
    print("ok")
"""


def test_gather_takes_prefetched_rows_under_the_interpreter() -> None:
    run_interpreted(_GATHER, fresh_seed(), timeout=300)


@pytest.mark.parametrize("flags, message", [
    (["--prefetch", "3"], "--prefetch 3: give auto, or 0 (off) to 2"),
    (["--prefetch", "-1"], "--prefetch -1: give auto, or 0 (off) to 2"),
    (["--prefetch", "two"], "--prefetch two: give auto or a count of experts (0: off)"),
])
def test_prefetch_out_of_range_is_refused(synth, capsys, flags, message) -> None:
    path = synth("qwen3moe", "Q4_K_M")
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "1",
                 "--offload", "on", *flags]) == 2
    err = capsys.readouterr().err
    # one error line, nothing else but the device line every model command starts with
    lines = [ln for ln in err.strip().splitlines()
             if not ln.startswith(("strata: device: ", "strata: loading: "))]
    assert message in err and len(lines) == 1, err


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["0", "5"])
@pytest.mark.parametrize("ahead", [1, 2])
def test_decode_steps_with_prefetch_give_reference_logits(synth, cache, ahead):
    """Every layer gathers its misses; the next layer's guessed experts are copied ahead on a
    side stream inside the graph: the same logits, every step replayed after the capture, and
    every guess counted as used or not (the tiny model routes 2 of 8: some guesses land)."""
    path = synth("qwen3moe", "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)[PROMPT:]
    engine = offload(path, "cuda", expert_cache=cache, miss="dma", prefetch=ahead)
    step = engine.model.step
    cfg = engine.config
    assert len(step.gathered_layers) == cfg.n_layers and step.prefetch is not None
    assert step.prefetch.next == {i: i + 1 for i in range(cfg.n_layers - 1)}
    assert_same(decoded_logits(engine, TOKENS), ref)
    assert not step._failed and step.steps["replayed"] == len(TOKENS) - PROMPT - 1
    st = engine.model.experts.stats
    st.settle()
    steps = len(TOKENS) - PROMPT
    guesses = st.ahead_used + st.ahead_unused
    assert guesses[0] == 0  # nothing is guessed for the first layer
    # each later layer: up to `ahead` guesses a step, those of the router's `ahead` best
    # without a slot; with no slots always `ahead`
    if cache == "0":
        assert (guesses[1:] == steps * ahead).all(), guesses
    else:
        assert (guesses[1:] <= steps * ahead).all() and guesses[1:].sum() > 0, guesses
    assert st.ahead_used.sum() > 0
    pairs_all = st.hits.sum() + st.cpu.sum() + st.streamed.sum()
    assert pairs_all == len(TOKENS) * cfg.n_layers * cfg.n_experts_used
    check_rows(engine)


def check_rows(engine) -> None:  # noqa: ANN001
    """After the last step: the last layer's guessed records sit in the prefetch rows that
    pre_of names, byte for byte as in the arena."""
    pf, ex = engine.model.step.prefetch, engine.model.experts
    last = engine.config.n_layers - 1
    table = ex.cache.layers[last].table.cpu()  # (the device table the step read)
    pre_of, nbytes = pf.pre_of[last].cpu(), ex.arena.layouts[last].nbytes
    for j, e in enumerate(pf.pred[last].tolist()):  # (-1: no guess, every pick had a slot)
        if e >= 0 and table[e] < 0:
            assert pre_of[e] == j
            assert torch.equal(pf.rows[j, :nbytes].cpu(), ex.arena.layers[last][e, :nbytes])


@pytest.mark.cuda
def test_guesses_are_routed_experts_without_a_slot(synth):
    """The guesses are the N experts the next layer's router ranks best for the residual, best
    first, with -1 in place of those that have a slot. Checked against the router written out
    in torch, for residuals where 0, 1 or 2 of those have a slot."""
    path = synth("qwen3moe", "Q4_K_M")
    engine = offload(path, "cuda", expert_cache="12", miss="dma", prefetch=2)
    pf, cfg = engine.model.step.prefetch, engine.config
    lw = engine.model.w.layers[1]
    table = engine.model.experts.cache.layers[1].table
    assert 0 < int((table >= 0).sum()) < cfg.n_experts
    gen = torch.Generator(device="cuda").manual_seed(int(np.random.default_rng().integers(1 << 30)))
    seen = set()
    for _ in range(64):
        x = torch.randn(1, cfg.d_model, device="cuda", generator=gen) * 3
        pf.guess(0, x)
        torch.cuda.synchronize()
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * lw.ffn_norm
        picks = torch.topk((h @ lw.router.T)[0], pf.n).indices.tolist()
        want = [e if table[e] < 0 else -1 for e in picks]
        seen.add(sum(e >= 0 for e in want))
        assert pf.pred[1].tolist() == want, (picks, want)
    assert seen == {0, 1, 2}, seen


@pytest.mark.cuda
def test_prefetch_in_eager_decode_steps(synth):
    """The same without graphs (--decode-step eager): real side streams, the same logits."""
    path = synth("qwen3moe", "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)[PROMPT:]
    engine = offload(path, "cuda", expert_cache="0", miss="dma", prefetch=2,
                     decode_step="eager")
    assert_same(decoded_logits(engine, TOKENS), ref)
    assert engine.model.step.steps["replayed"] == 0
    check_rows(engine)


@pytest.mark.cuda
def test_the_gather_reads_the_prefetched_rows(synth, monkeypatch):
    """Rows copied ahead and then zeroed on the side stream: the logits move. A gather that
    ignored the prefetch (or read it before the copy) would still give the reference."""
    from strata.engine.decode_prefetch import DecodePrefetch

    copy = DecodePrefetch.copy

    def spoiled(self, layer):  # noqa: ANN001 (on the copy stream, before its event)
        copy(self, layer)
        self.rows.zero_()

    monkeypatch.setattr(DecodePrefetch, "copy", spoiled)
    path = synth("qwen3moe", "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)[PROMPT:]
    engine = offload(path, "cuda", expert_cache="0", miss="dma", prefetch=2)
    got = decoded_logits(engine, TOKENS)
    engine.model.experts.stats.settle()
    assert engine.model.experts.stats.ahead_used.sum() > 0
    assert max(float(np.abs(g - r).max()) for g, r in zip(got, ref, strict=True)) > 1e-3


@pytest.mark.parametrize("one_chunk", [False, True])
@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("pre", [False, True])
def test_gather_kernel_compiles_for_sm90(pre: bool, loop: bool, one_chunk: bool) -> None:
    """Without a GPU: Triton compiles the gather for sm_90 (its bundled ptxas), with and without
    the prefetched source, a program per block or a few looping (the interpreter runs neither
    Triton's front end nor its types)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import moe

    sig = {"ids": "*i64", "slot_of": "*i32", "src": "*i32", "dst": "*i32", "nwords": "i32",
           "stride_src": "i32", "stride_dst": "i32", "pre_of": "*i32", "pre": "*i32",
           "stride_pre": "i32", "n_items": "i32", "n_chunks": "i32", "BLOCK": "constexpr",
           "TOPK": "constexpr", "HOST_FROM": "constexpr", "PRE": "constexpr",
           "LOOP": "constexpr"}
    consts = {"BLOCK": moe.GATHER_BLOCK, "TOPK": 8, "HOST_FROM": 8, "PRE": pre, "LOOP": loop}
    if one_chunk:  # records of one block: Triton makes the argument 1 a constant
        sig["n_chunks"] = "constexpr"
        consts["n_chunks"] = 1
    k = triton.compile(ASTSource(moe._gather_kernel, sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32))
    assert k.asm["cubin"]
    assert ("scf.for" in k.asm["ttir"]) == loop
    # ids, slot_of, the arena; with the prefetched source also pre_of and the rows in VRAM
    assert k.asm["ttir"].count("tt.load") == (5 if pre else 3)


def test_the_plan_counts_the_prefetch_rows(synth) -> None:
    """The staging rows the memory plan counts: K for a token's misses, N more with --prefetch
    on CUDA decode steps; none more on the CPU or without decode steps. --prefetch auto counts
    AUTO_PREFETCH where the cache holds fewer slots a layer than a token's K experts, and none
    where it holds more (its rows then go to the cache)."""
    from strata.config import EngineConfig, ModelConfig
    from strata.engine.memory_plan import make_plan
    from strata.experts.layout import expert_layouts
    from strata.gguf import open_model

    mf = open_model(synth("qwen3moe", "Q4_K_M"))
    cfg = ModelConfig.from_model(mf)
    layouts = expert_layouts(mf, cfg)
    stride = max(lay.stride for lay in layouts)
    k = cfg.n_experts_used
    auto = min(AUTO_PREFETCH, k)  # auto copies at most a token's K experts ahead
    # (device, decode step, --prefetch (None: auto), --expert-cache, staging rows)
    for device, decode_step, prefetch, cache, rows in (
            ("cuda", "graphs", 2, "auto", 4), ("cuda", "eager", 1, "auto", 3),
            ("cuda", "off", 2, "auto", 2), ("cpu", "eager", 2, "auto", 2),
            ("cuda", "graphs", 0, "auto", 2),
            ("cuda", "graphs", None, "0", k + auto),  # no slots: on
            ("cuda", "graphs", None, "3", k + auto),  # 1 slot a layer < K: on
            ("cuda", "graphs", None, "6", k),  # 2 slots a layer = K: off
            ("cuda", "graphs", None, "auto", k),  # every expert fits: off
            ("cuda", "off", None, "0", k), ("cpu", "eager", None, "0", k)):
        plan = make_plan(mf, cfg, EngineConfig(device=device, vram_budget_gib=2, ctx=256,
                                               decode_step=decode_step, prefetch=prefetch,
                                               expert_cache=cache), layouts)
        assert (plan.staging_slots, plan.staging) == (rows, rows * stride), (device, prefetch,
                                                                              cache)
        assert plan.prefetch == rows - k, (device, prefetch, cache)
    # auto, when it turns off, keeps no rows: the plan is --prefetch 0's
    auto, off = (make_plan(mf, cfg, EngineConfig(device="cuda", vram_budget_gib=2, ctx=256,
                                                 prefetch=p), layouts) for p in (None, 0))
    assert replace(auto, host_available=0) == replace(off, host_available=0)  # (RAM moves)


def test_guesses_are_counted_used_or_not(synth) -> None:
    """after_gathered's count of a step with guesses: a guess the layer routed to and gathered
    is used; one it did not route to, or one the CPU share computed, crossed PCIe for nothing;
    a guess with a slot (or none, -1) is not a copy at all."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cpu", expert_cache="0", decode_step="off")
    ex = engine.model.experts
    e, nbytes = engine.config.n_experts, ex.arena.layouts[1].nbytes
    slot_of = np.full(e, -1, np.int32)
    slot_of[5] = 0  # expert 5 has a slot: a hit, and no copy when guessed
    counts = np.zeros(e, np.int32)
    counts[[1, 3, 5, 6]] = 1  # the token's routing (4 pairs here)
    assert ex.cache.layers[1].capacity == 0
    before = (ex.stats.bytes_h2d, ex.stats.streamed[1], ex.stats.cpu[1], ex.stats.hits[1])
    ex.after_gathered(1, counts, slot_of, on_cpu=[6], ahead=np.array([3, 6, 7, 5, -1]))
    st = ex.stats
    assert (st.ahead_used[1], st.ahead_unused[1]) == (1, 2)  # 3 used; 6 (the CPU's), 7 not
    assert st.hits[1] - before[3] == 1 and st.cpu[1] - before[2] == 1
    assert st.streamed[1] - before[1] == 2  # 1 and 3: computed from copied records
    # over PCIe: 1 (gathered), 3 (copied ahead), 6 and 7 (copied ahead for nothing); no cache
    # slots, so no admission adds a copy
    assert st.bytes_h2d - before[0] == 4 * nbytes and st.admissions == 0
    text = "\n".join(st.lines())  # --stats: the run's line and layer 1's
    assert "prefetch: 1 of 3 experts copied ahead" in text and "ahead 1/3 used" in text


@pytest.mark.cuda
def test_prefetch_with_a_cpu_share(synth):
    """Both at once: the CPU takes each token's last missed pair, the side stream copies one
    guess ahead: the reference logits, and the share's pairs are not counted as used guesses."""
    path = synth("qwen3moe", "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)[PROMPT:]
    engine = offload(path, "cuda", expert_cache="0", miss="dma", prefetch=1, cpu_share=1)
    step = engine.model.step
    assert step.prefetch is not None and step.share is not None
    assert_same(decoded_logits(engine, TOKENS), ref)
    st = engine.model.experts.stats
    st.settle()
    assert st.cpu.sum() > 0 and (st.ahead_used <= st.streamed).all()
    step.share.close()


def test_prefetch_on_the_cpu_says_it_is_off(synth, caplog) -> None:
    """--prefetch and --cpu-share serve CUDA decode steps: on the CPU each says it is off; the
    default, --prefetch auto, is off there without a warning."""
    path = synth("qwen3moe", "Q4_K_M")
    with caplog.at_level("WARNING", logger="strata"):
        engine = offload(path, "cpu", prefetch=2, cpu_share=1)
    assert engine.model.experts.prefetch == 0
    assert engine.model.step is None or engine.model.step.prefetch is None
    for flag in ("--prefetch 2: off", "--cpu-share 1: off"):
        assert any(flag in r.getMessage() and "on the CPU" in r.getMessage()
                   for r in caplog.records), flag
    caplog.clear()
    with caplog.at_level("WARNING", logger="strata"):
        engine = offload(path, "cpu")
    assert engine.model.experts.prefetch == 0 and engine.model.experts.prefetch_auto
    assert not [r for r in caplog.records if "prefetch" in r.getMessage()], caplog.records


@pytest.mark.cuda
def test_prefetch_auto_on_cuda(synth, caplog) -> None:
    """--prefetch auto: AUTO_PREFETCH experts ahead (at most a token's K) where layers gather
    their misses and the cache holds fewer slots a layer than a token's experts; off with a
    plan line, not a warning, where it holds more or every expert has a slot."""
    path = synth("qwen3moe", "Q4_K_M")
    engine = offload(path, "cuda", expert_cache="0", miss="dma")
    assert engine.model.step.prefetch is not None
    assert engine.model.step.prefetch.n == min(AUTO_PREFETCH, engine.config.n_experts_used)
    for cache, why in (("24", "every expert has a cache slot"),
                       ("12", "the cache holds 4.0 slots a layer, a token routes to 2")):
        caplog.clear()
        with caplog.at_level("INFO", logger="strata"):
            engine = offload(path, "cuda", expert_cache=cache, miss="dma")
        assert engine.model.step.prefetch is None, cache
        said = [r for r in caplog.records if "--prefetch auto: off" in r.getMessage()]
        assert said and all(r.levelname == "INFO" and why in r.getMessage() for r in said), \
            caplog.records


def test_prefetch_pays_where_most_routed_experts_miss() -> None:
    """--prefetch auto's rule: on while the layers with experts outside VRAM average fewer
    slots than a token's K experts (the 2 GiB plan: 1 slot a layer, K = 8), off from K on
    (10 GiB: 43) and with no such layer."""
    from strata.config import prefetch_pays

    assert prefetch_pays([1] * 48, 8) and prefetch_pays([0, 0, 15], 8)
    assert not prefetch_pays([43] * 48, 8) and not prefetch_pays([8, 8], 8)
    assert not prefetch_pays([], 8)
