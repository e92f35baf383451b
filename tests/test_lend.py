"""Lent slots: between prompt chunks the expert cache holds more experts in the VRAM that only the
prompt workspace uses during chunks (memory_plan.lend_slots, ExpertCache.lend). Results stay the
reference's; growing and shrinking keep the experts the policy ranks best, each slot holding its
expert's record; a decode step captures its graphs again over the new slot tensors."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_offload import TOKENS, assert_same, offload

from strata.cli.logits import compute_logits
from strata.config import EngineConfig, ModelConfig
from strata.engine.generator import Engine
from strata.engine.memory_plan import GIB, MARGIN, lend_slots, make_plan
from strata.experts.arena import Arena
from strata.experts.cache import FILLING, FREE, ExpertCache
from strata.experts.layout import ExpertLayout, expert_layouts
from strata.experts.policy import make_policy
from strata.gguf import open_model

from hf_reference import kl_per_position

CUDA = dict(device="cuda", kernels="fused", ctx=256)


def model(path):  # noqa: ANN001, ANN201
    mf = open_model(path)
    cfg = ModelConfig.from_model(mf)
    return mf, cfg, expert_layouts(mf, cfg)


def budget_for(mf, cfg, layouts, base: int, **kw) -> float:  # noqa: ANN001
    """A --vram-budget (GiB) whose auto cache gets `base` slots a layer on CUDA (kw: more of
    the engine's config)."""
    b = 2.0  # (the workspace and ring take shares of the room the budget leaves: iterated to
    for _ in range(8):  # the budget whose fixed parts and `base` slots fill it)
        none = make_plan(mf, cfg, EngineConfig(**{**CUDA, **kw, "expert_cache": "0",
                                                   "vram_budget_gib": b}), layouts)
        fixed = none.budget - none.left + MARGIN
        b = (fixed + base * sum(lay.stride for lay in layouts)) / GIB
    return b


def test_plan_lends_the_workspace_to_decode_slots(synth):
    mf, cfg, layouts = model(synth("qwen3moe", "Q4_K_M"))
    E = cfg.n_experts
    b = budget_for(mf, cfg, layouts, 2)
    plan = make_plan(mf, cfg, EngineConfig(vram_budget_gib=b, **CUDA), layouts)
    assert plan.slots_per_layer == [2] * cfg.n_layers
    # the tiny model's workspace holds every expert: each layer stays one short of all of them
    assert plan.lent_per_layer == (E - 3,) * cfg.n_layers
    assert plan.lent == sum(n * lay.stride for n, lay in zip(plan.lent_per_layer, layouts,
                                                                 strict=True))
    assert 0 < plan.lent <= plan.workspace + plan.ring and plan.lent_ring  # one sequence
    assert f"+ {(E - 3) * cfg.n_layers} in the workspace and the ring while decoding" in \
        "\n".join(plan.lines())
    # --stream-min 1 (even a one-token pass streams): the workspace alone
    alone = make_plan(mf, cfg, EngineConfig(
        vram_budget_gib=budget_for(mf, cfg, layouts, 2, stream_min=1), **CUDA, stream_min=1),
        layouts)
    assert not alone.lent_ring and sum(alone.lent_per_layer) > 0
    assert "in the workspace while decoding" in "\n".join(alone.lines())
    # several sequences decoding together (a server's passes mix prompt chunks and decode
    # steps: lending would shrink and grow the slots at each change) lend nothing, as do
    # fixed caches, the eager decode and the exact kernels
    for kw in (dict(sequences=2), dict(expert_cache="2"), dict(decode_step="off"),
               dict(kernels="exact")):
        bk = budget_for(mf, cfg, layouts, 2, **kw)  # (each plans its own chunk and workspace)
        other = make_plan(mf, cfg, EngineConfig(vram_budget_gib=bk, **{**CUDA, **kw}), layouts)
        assert other.lent_per_layer == () and not other.lent_ring
        assert "while decoding" not in "\n".join(other.lines())
    cpu = make_plan(mf, cfg, EngineConfig(device="cpu", vram_budget_gib=b), layouts)
    assert cpu.lent_per_layer == ()
    full = make_plan(mf, cfg, EngineConfig(vram_budget_gib=2, **CUDA), layouts)
    assert full.slots_per_layer == [E] * cfg.n_layers and full.lent_per_layer == ()
    # every expert in a slot: nothing ever streams, so no ring (unless asked for)
    assert full.ring == 0 and full.ring_borrow == 0
    assert "every expert has a cache slot, so nothing streams" in "\n".join(full.lines())
    asked = make_plan(mf, cfg, EngineConfig(vram_budget_gib=2, stream_min=1, **CUDA), layouts)
    assert asked.slots_per_layer == [E] * cfg.n_layers and asked.ring > 0
    assert b < 2 and plan.ring > 0  # (a cache short of every expert keeps its ring)


def test_lent_slots_fill_the_workspace_at_30b_shapes():
    """Qwen3-30B-A3B (48 layers, 128 experts, Q4_K gate/up, Q6_K down) with the 2 GiB plan's
    402 MiB workspace: as many slots as it holds, spread evenly, none past it."""
    lay = ExpertLayout(0, (12, 12, 14), 2048, 768)
    cfg = SimpleNamespace(n_experts=128, n_layers=48, n_experts_used=8)
    workspace = 402 << 20
    lent = lend_slots(cfg, [lay] * 48, [1] * 48, workspace)
    used = sum(lent) * lay.stride
    assert used <= workspace < used + lay.stride
    assert max(lent) - min(lent) <= 1 and sum(lent) == workspace // lay.stride
    assert lend_slots(cfg, [lay] * 48, [128] * 48, workspace) == ()  # all resident: nothing
    near = lend_slots(cfg, [lay] * 48, [1] * 48, workspace * 100)
    assert near == (126,) * 48  # never all 128: the decode step is cut for the base slots
    # less than half the cache again: not worth a refill and a capture per request
    assert lend_slots(cfg, [lay] * 48, [43] * 48, workspace) == ()
    assert sum(lend_slots(cfg, [lay] * 48, [4] * 48, workspace)) == sum(lent)


@pytest.fixture()
def tiny(synth):
    path = synth("qwen3moe", "Q4_K_M")
    mf, cfg, layouts = model(path)
    arena = Arena(layouts, cfg.n_experts, pin=False)
    arena.fill(mf)
    return cfg, layouts, arena


def records_match(cache: ExpertCache, arena: Arena) -> None:
    cache.check_integrity()
    for i, ls in enumerate(cache.layers):
        n = ls.layout.nbytes  # (past it: padding, which device copies leave alone)
        for s, e in enumerate(ls.expert_in):
            if e >= 0:
                assert torch.equal(ls.slots[s, :n].cpu(), arena.layers[i][e, :n].cpu()), (i, s, e)


def test_cache_grows_and_shrinks_keeping_what_the_policy_ranks_best(tiny):
    cfg, layouts, arena = tiny
    policies = [make_policy("lru", cfg.n_experts, None) for _ in layouts]
    cache = ExpertCache(layouts, [2] * cfg.n_layers, cfg.n_experts, policies,
                        torch.device("cpu"), lent=[3] * cfg.n_layers)
    cache.warm(arena.layers)
    assert [ls.resident() for ls in cache.layers] == [[0, 1]] * cfg.n_layers
    for ls in cache.layers:  # LRU: 6 the most recent, then 3, 5, 1; then 0 (the initial order)
        for e in (1, 5, 3, 6):
            ls.policy.touch([e], [1])
    n, nbytes = cache.lend(True)
    assert cache.lending and cache.generation == 1
    assert n == 3 * cfg.n_layers and nbytes == 3 * sum(lay.nbytes for lay in layouts)
    for ls in cache.layers:  # the three most recent not resident join 0 and 1
        assert ls.capacity == 5 and sorted(ls.resident()) == [0, 1, 3, 5, 6]
    records_match(cache, arena)
    assert cache.lend(True) == (0, 0) and cache.generation == 1  # no change
    for ls in cache.layers:
        ls.policy.touch([5], [1])  # 5 then 6 are the most recent; both sit in lent slots
        assert ls.slot_of[5] >= 2 and ls.slot_of[6] >= 2
    with torch.inference_mode():  # as in a forward pass
        assert cache.lend(False) == (0, 0)
    assert not cache.lending and cache.generation == 2
    for ls in cache.layers:
        assert ls.capacity == 2 and sorted(ls.resident()) == [5, 6]
        assert (ls.slot_of >= 0).sum() == 2
    records_match(cache, arena)
    assert cache.line() == (f"expert cache: {2 * cfg.n_layers} slots now (without the "
                            f"{3 * cfg.n_layers} lent while decoding); lent 1 time(s), given "
                            "back 1")
    with torch.inference_mode():
        cache.lend(True)  # again: the three most recent others fill the lent slots
    for ls in cache.layers:
        assert sorted(ls.resident()) == [0, 1, 3, 5, 6]
    records_match(cache, arena)
    for i, ls in enumerate(cache.layers):  # outside inference mode, as the stats' settle does
        ls.policy.touch([2], [1])
        assert cache.admit(i, 2, arena.layers[i][2], keep=set()) is not None
    records_match(cache, arena)


def test_a_refill_enters_the_maps_once_its_copies_landed(tiny, monkeypatch):
    """The lent slots' refill runs on the copy stream; decode steps meanwhile see only the slots
    already resident: the maps take each refilled slot once the copies' event has passed, and
    an expert admitted elsewhere meanwhile frees its refill's slot."""
    cfg, layouts, arena = tiny
    policies = [make_policy("lru", cfg.n_experts, None) for _ in layouts]
    cache = ExpertCache(layouts, [2] * cfg.n_layers, cfg.n_experts, policies,
                        torch.device("cpu"), lent=[3] * cfg.n_layers)
    cache.warm(arena.layers)

    class Copies:  # the copy stream's event, as the refill records it
        done = False

        def query(self) -> bool:
            return self.done

    copies = Copies()
    monkeypatch.setattr(cache, "_event", lambda: copies)
    assert cache.lend(True)[0] == 3 * cfg.n_layers
    for ls in cache.layers:
        assert ls.capacity == 5 and sorted(ls.resident()) == [0, 1]
        assert (ls.expert_in == FILLING).sum() == 3
    cache.check_integrity()
    filling = [e for i, _, e in cache._filling[1] if i == 0]
    taken = filling[0]  # a host admission meanwhile: it evicts a resident, not a filling slot
    victim = cache.layers[0].policy.victim([0, 1], set())
    assert cache.admit(0, taken, arena.layers[0][taken], keep=set()) is not None
    cache.flush()  # the copies have not landed: nothing enters
    assert (cache.layers[1].expert_in == FILLING).sum() == 3
    copies.done = True
    cache.flush()
    assert sorted(cache.layers[0].resident()) == sorted([1 - victim, *filling])
    assert (cache.layers[0].expert_in == FREE).sum() == 1  # the copy that lost its expert
    for ls in cache.layers[1:]:
        assert len(ls.resident()) == 5
    cache.check_integrity()
    records_match(cache, arena)


def test_a_cache_without_lent_slots_never_changes(tiny):
    cfg, layouts, arena = tiny
    policies = [make_policy("lfu", cfg.n_experts, None) for _ in layouts]
    cache = ExpertCache(layouts, [2] * cfg.n_layers, cfg.n_experts, policies,
                        torch.device("cpu"))
    cache.warm(arena.layers)
    assert not cache.lends and cache.lend(True) == (0, 0) and cache.generation == 0
    assert cache.capacity == 2 * cfg.n_layers


def lent_engine(path, device, ring=False):  # noqa: ANN001, ANN201
    """The offload engine with lent slots (2 base and 3 lent slots a layer; gathered misses on
    CUDA), and the same engine without them. On CUDA the plan lends (a budget that gives 2 base
    slots, which an explicit --expert-cache 2 turns off; one sequence: the ring is lent too);
    on the CPU, where the plan lends nothing, a cache with lent slots is swapped in (ring: the
    prompts stream through the ring, which decode steps take for the cache too)."""
    if device == "cuda":
        mf, cfg, layouts = model(path)
        kw = dict(kernels="fused", ctx=256, miss="dma",
                  vram_budget_gib=budget_for(mf, cfg, layouts, 2))
        engine, plain = offload(path, device, **kw), offload(path, device, expert_cache="2", **kw)
        assert engine.model.experts.cache.lends and not plain.model.experts.cache.lends
        return engine, plain
    engine = offload(path, device, expert_cache="2", miss="dma",
                     stream_min=2 if ring else 1 << 20)
    ex = engine.model.experts
    # (the plan lends nothing on the CPU: the test swaps in the options and the cache it would)
    ex.options = dataclasses.replace(ex.options, lend_ring=ring)
    cfg = engine.config
    policies = [make_policy("lru", cfg.n_experts, None) for _ in range(cfg.n_layers)]
    ex.cache = ExpertCache(ex.arena.layouts, [2] * cfg.n_layers, cfg.n_experts, policies,
                           ex.device, lent=[3] * cfg.n_layers)
    ex.cache.warm(ex.arena.layers)
    return engine, None


def two_requests(engine: Engine) -> list[np.ndarray]:
    """Two requests, each a 6-token prompt (lent slots go back first) and a decode step for each
    later token of TOKENS (teacher-forced; the lent slots return, filled): decoded logits."""
    ex = engine.model.experts
    cache, ring = ex.cache, ex.ring
    base, grown = cache.capacity, cache.capacity + sum(ls.lent for ls in cache.layers)
    runs = []
    for _ in range(2):
        kv = engine.model.new_cache(len(TOKENS))
        streamed = ring.streamed_bytes
        engine.run_prompt(TOKENS[:6], kv)
        assert not cache.lending and cache.capacity == base
        assert ring.nbytes >= ex.ring_base and ring.streamed_bytes > streamed or not ex.lend_ring
        out = []
        for t in TOKENS[6:]:
            out.append(engine.model.decode(t, kv).float().cpu().numpy().copy())
            assert cache.lending == cache.lends and cache.capacity == grown
            assert ring.nbytes == (0 if ex.lend_ring else ex.ring_base)
        cache.check_integrity()
        runs.append(np.concatenate(out))
    return runs


@pytest.mark.parametrize("ring", [False, True])
def test_lent_slots_give_the_reference_logits_across_requests(synth, device, ring):
    path = synth("qwen3moe", "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)[6:]
    if device == "cuda" and not ring:
        pytest.skip("on CUDA the plan lends the ring with one sequence")
    engine, plain = lent_engine(path, device, ring)
    assert engine.model.experts.lend_ring == ring
    cache, step = engine.model.experts.cache, engine.model.step
    runs = two_requests(engine)
    assert cache.generation == 3  # grown, shrunk for the second prompt, grown again
    assert "(with the" in cache.line() and "lent 2 time(s), given back 1" in cache.line()
    st = engine.model.experts.stats
    st.settle()
    assert st.admissions >= 2 * 3 * engine.config.n_layers  # the lent slots filled twice
    if device == "cpu":
        for run in runs:
            assert_same(run, ref)
        return
    # CUDA: prompt chunks on bf16 tensor cores move the logits by their rounding
    # (test_fused_tensor_core_path_within_bf16_rounding), and decode hits by rounding x to 8
    # bits (test_fused_decode_within_x8_rounding), by a little more or less as the slots hold
    # other experts (hits and CPU-computed misses round apart): KL within 1e-3 of the engine
    # without lent slots (1.2e-4 measured), and the bf16 bound of the reference
    for run, other in zip(runs, two_requests(plain), strict=True):
        assert kl_per_position(other, run).max() < 1e-3
        assert (run.argmax(-1) == other.argmax(-1)).mean() >= 0.8
        assert kl_per_position(ref, run).max() < 2e-3
    # graphs over the slot tensors: captured again only where a new tensor moved
    assert not step._failed and 1 <= step.steps["captured"] <= 2
    assert step._captured is not None and step._captured[0][2] == cache.slots_key()


def test_a_small_cuda_budget_shares_out_the_room_its_fixed_parts_leave(synth):
    """The prompt scratch, the workspace and the ring take shares of the budget less the CUDA
    context, dense weights and margin (not of the whole budget): 1.4 GiB, which those three take
    most of, still plans, each share inside the room."""
    from strata.kernels.tuning import CUDA_CONTEXT
    from strata.quant import DEQUANT_CHUNK_BYTES

    mf, cfg, layouts = model(synth("qwen3moe", "Q4_K_M"))
    plan = make_plan(mf, cfg, EngineConfig(vram_budget_gib=1.4, **CUDA), layouts)
    room = plan.budget - CUDA_CONTEXT - plan.dense - MARGIN
    floor = 3 * cfg.d_model * cfg.d_expert * 4 + DEQUANT_CHUNK_BYTES
    assert 0 < room < 256 << 20 and plan.workspace <= max(room // 4, floor)
    assert plan.left >= 0 and plan.ctx >= 256


def test_a_verify_window_keeps_the_lent_slots_where_the_fused_kernels_cover_it():
    """OffloadExperts.before_pass: lent slots stay through a verify window of more than
    DECODE_MAX_T tokens when the fused kernels cover every layer with experts (the window runs
    no workspace path), so the decode step after it finds the same slot tensors; a prompt chunk
    of the same size, or a window over a layer the fused kernels do not cover, takes them back."""
    from strata.experts.offload import OffloadExperts
    from strata.kernels.tuning import DECODE_MAX_T
    from strata.quant import QType

    calls = []
    layouts = [ExpertLayout(0, (QType.Q4_K,) * 3, 256, 0),  # a dense first layer
               ExpertLayout(1, (QType.Q4_K,) * 3, 256, 256)]

    def executor(window: bool, covered: list[bool]) -> SimpleNamespace:
        cache = SimpleNamespace(lends=True, lend=lambda on: calls.append(on) or (0, 0))
        return SimpleNamespace(cache=cache, ring=None, ring_borrow=0, lend_ring=False,
                               stream_min=64, window=window, arena=SimpleNamespace(
                                   layouts=layouts), fused=SimpleNamespace(covered=covered),
                               account=lambda *a, **k: None)

    t = DECODE_MAX_T + 1
    for window, covered, lent in ((True, [False, True], True), (False, [False, True], False),
                                  (True, [False, False], False)):
        calls.clear()
        OffloadExperts.before_pass(executor(window, covered), t)
        assert calls == [lent], (window, covered, calls)
    calls.clear()
    OffloadExperts.before_pass(executor(False, [False, False]), 1)  # a decode step lends
    assert calls == [True]
