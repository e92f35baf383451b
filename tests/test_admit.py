"""Cache admissions on the device (STRATA_DEVICE_ADMIT=1, experimental): a gathered decode layer
copies one missed expert's record from the row its gather filled into a slot the host designated
before the step, and the host's maps take it when the step is settled. On the CPU: the kernel
under Triton's interpreter, its sm_90 build, and the cache's bookkeeping (designate, pending,
settle_pending); on CUDA: decode steps that admit this way give the reference logits, and only
the gathers' records count as copied."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_decode_step import PROMPT
from test_lend import records_match, tiny  # noqa: F401 (a fixture)
from test_offload import TOKENS, assert_same, offload

from strata.cli.logits import compute_logits
from strata.engine.generator import Engine
from strata.experts.cache import FREE, PENDING, ExpertCache, IntegrityError
from strata.experts.offload import reapply_admissions
from strata.experts.policy import make_policy

triton = pytest.importorskip("triton")

from interpreted import fresh_seed, run_interpreted  # noqa: E402

_ADMIT = """
    import torch
    from strata.kernels.gpu import admit_from_rows
    from strata.kernels.gpu.moe import GATHER_BLOCK

    rng = np.random.default_rng(seed)
    e, k = 11, 6
    for nbytes in (90, 4 * GATHER_BLOCK + 36):  # one block; two blocks and part of a third
        stride = 4 * ((nbytes + 3) // 4) + 8
        words = 4 * ((nbytes + 3) // 4)
        rows = torch.from_numpy(rng.integers(0, 256, (k, stride), dtype=np.uint8))
        slots = torch.from_numpy(rng.integers(0, 256, (4, stride), dtype=np.uint8))
        slot_of = torch.full((e,), -1, dtype=torch.int32)
        slot_of[[3, 8]] = torch.tensor([0, 2], dtype=torch.int32)
        ids = torch.tensor([[3, 8, 5, 9, 1, 7]])  # pairs 0, 1 resident; 2 the first missed
        victim = torch.tensor([1], dtype=torch.int32)
        admitted = torch.tensor([99], dtype=torch.int32)
        before = slots.clone()
        admit_from_rows(ids, slot_of, rows, slots, victim, admitted, nbytes)
        assert int(admitted[0]) == 5
        assert torch.equal(slots[1, :words], rows[2, :words])
        assert torch.equal(slots[1, words:], before[1, words:])  # past the record: untouched
        assert torch.equal(slots[[0, 2, 3]], before[[0, 2, 3]])
        # the first missed pair is the CPU's (host_from 2 covers pairs 0-1 only): none is copied
        slots2, adm = before.clone(), torch.tensor([7], dtype=torch.int32)
        admit_from_rows(ids, slot_of, rows, slots2, victim, adm, nbytes, host_from=2)
        assert int(adm[0]) == -1 and torch.equal(slots2, before)
        admit_from_rows(ids, slot_of, rows, slots2, victim, adm, nbytes, host_from=4)
        assert int(adm[0]) == 5 and torch.equal(slots2[1, :words], rows[2, :words])
        # no victim designated: nothing written
        slots3, adm = before.clone(), torch.tensor([7], dtype=torch.int32)
        admit_from_rows(ids, slot_of, rows, slots3, torch.tensor([-1], dtype=torch.int32), adm,
                        nbytes)
        assert int(adm[0]) == -1 and torch.equal(slots3, before)
        # every pair resident (and -1, no expert): nothing written
        slot_of_all = torch.arange(e, dtype=torch.int32) % 4
        slots4, adm = before.clone(), torch.tensor([7], dtype=torch.int32)
        admit_from_rows(torch.tensor([[3, -1, 5, 9, 1, 7]]), slot_of_all, rows, slots4, victim,
                        adm, nbytes)
        assert int(adm[0]) == -1 and torch.equal(slots4, before)
        # a layer without slots: admitted says none
        adm = torch.tensor([7], dtype=torch.int32)
        admit_from_rows(ids, slot_of, rows, slots[:0], victim, adm, nbytes)
        assert int(adm[0]) == -1
    try:
        admit_from_rows(torch.zeros(2, k, dtype=torch.int64), slot_of, rows, slots, victim,
                        admitted, 90)
    except ValueError as err:
        assert "one token" in str(err)
    else:
        raise AssertionError("two tokens accepted")
    print("ok")
"""


def test_admit_from_rows_under_the_interpreter() -> None:
    run_interpreted(_ADMIT, fresh_seed(), timeout=300)


def test_admit_kernel_compiles_for_sm90() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from strata.kernels.gpu import moe

    sig = {"ids": "*i64", "slot_of": "*i32", "rows": "*i32", "slots": "*i32", "victim": "*i32",
           "admitted": "*i32", "nwords": "i32", "stride_rows": "i32", "stride_slots": "i32",
           "TOPK": "constexpr", "KP": "constexpr", "HOST_FROM": "constexpr",
           "BLOCK": "constexpr"}
    consts = {"TOPK": 8, "KP": 8, "HOST_FROM": 6, "BLOCK": moe.GATHER_BLOCK}
    k = triton.compile(ASTSource(moe._admit_rows_kernel, sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32))
    assert k.asm["cubin"]


def test_designated_slots_stay_pending_until_settled(tiny):  # noqa: F811
    cfg, layouts, arena = tiny
    policies = [make_policy("lru", cfg.n_experts, None) for _ in layouts]
    cache = ExpertCache(layouts, [3] * cfg.n_layers, cfg.n_experts, policies,
                        torch.device("cpu"))
    cache.warm(arena.layers)
    ls = cache.layers[0]
    assert sorted(ls.resident()) == [0, 1, 2]
    for e in (2, 0, 1):  # LRU: 2 the oldest
        ls.policy.touch([e], [1])
    slot = cache.designate(0)
    assert slot == 2 and ls.slot_of[2] == -1 and ls.expert_in[slot] == PENDING and ls.dirty
    assert cache.pending == 1
    cache.check_integrity()  # resident + free (pending counted free) == capacity
    ls.policy.touch([1], [1])  # 0 the oldest now
    second = cache.designate(0)  # the next step's: never the pending one, 0's (slot 0)
    assert second == 0 and ls.slot_of[0] == -1 and cache.pending == 2
    # a host admission meanwhile takes no pending slot: the layer has none to give but 1's
    assert cache.admit(0, 6, arena.layers[0][6], keep={1}) is None
    assert cache.settle_pending(0, slot, 5)  # the device put expert 5 there
    assert ls.slot_of[5] == slot and ls.expert_in[slot] == 5
    assert not cache.settle_pending(0, second, -1)  # it wrote nothing: the slot is free
    assert ls.expert_in[second] == FREE and cache.pending == 0
    with pytest.raises(IntegrityError, match="not designated"):
        cache.settle_pending(0, second, 4)
    cache.sync()
    cache.layers[0].slots[slot].copy_(arena.layers[0][5])  # (what the device copied)
    records_match(cache, arena)
    assert cache.designate(0) == second  # a free slot first
    empty = ExpertCache(layouts, [0] * cfg.n_layers, cfg.n_experts, policies,
                        torch.device("cpu"))
    assert empty.designate(0) == -1


def test_lending_waits_for_pending_slots(tiny):  # noqa: F811
    cfg, layouts, arena = tiny
    policies = [make_policy("lru", cfg.n_experts, None) for _ in layouts]
    cache = ExpertCache(layouts, [2] * cfg.n_layers, cfg.n_experts, policies,
                        torch.device("cpu"), lent=[2] * cfg.n_layers)
    cache.warm(arena.layers)
    slot = cache.designate(1)
    with pytest.raises(IntegrityError, match="not settled"):
        cache.lend(True)
    cache.settle_pending(1, slot, -1)
    assert cache.lend(True)[0] > 0


def test_the_next_step_enters_the_last_steps_admissions_in_the_tables():
    """reapply_admissions (inside a decode step's graph): tables[l, admitted[l]] = slot[l] for
    the admitting layers where both are set; every other entry as it was."""
    tables = torch.full((4, 6), -1, dtype=torch.int32)
    tables[0, 1], tables[2, 3] = 0, 2
    before = tables.clone()
    admitted = torch.tensor([4, 5, -1, 2], dtype=torch.int32)
    slots = torch.tensor([1, -1, 0, 3], dtype=torch.int32)
    reapply_admissions(tables, torch.tensor([0, 1, 2]), admitted, slots)
    want = before.clone()
    want[0, 4] = 1  # layer 1: no slot was designated; layer 2: nothing admitted; 3: not listed
    assert torch.equal(tables, want)


def test_an_unknown_admit_setting_is_refused(synth, monkeypatch, capsys):
    from strata.cli.main import main

    monkeypatch.setenv("STRATA_DEVICE_ADMIT", "yes")
    path = synth("qwen3moe", "Q4_K_M")
    assert main(["generate", str(path), "--prompt", "hi", "--max-tokens", "1",
                 "--offload", "on"]) == 2
    err = capsys.readouterr().err
    assert "STRATA_DEVICE_ADMIT='yes': give 1" in err and len(err.strip().splitlines()) == 1


@pytest.mark.cuda
@pytest.mark.parametrize("cache", ["3", "5"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_decode_steps_admitting_on_the_device_give_reference_logits(synth, monkeypatch, cache,
                                                                     prefetch):
    """Teacher-forced decode steps (graphs after the first) with every layer gathering and
    admitting on the device: the reference logits, the maps whole once settled, admissions
    made, and the bytes copied to the device exactly the gathers' and the unused guesses'."""
    monkeypatch.setenv("STRATA_DEVICE_ADMIT", "1")
    path = synth("qwen3moe", "Q4_K_M")
    ref = compute_logits(Engine.load(path), TOKENS)[PROMPT:]
    engine = offload(path, "cuda", expert_cache=cache, miss="dma", prefetch=prefetch,
                     cache_policy="lru")  # device admission runs under LRU only
    step, ex = engine.model.step, engine.model.experts
    assert len(step.admitting) == engine.config.n_layers == len(ex.admit_rows)
    st = ex.stats
    kv = engine.model.new_cache(len(TOKENS))
    engine.run_prompt(TOKENS[:PROMPT], kv)
    st.settle()
    before = (st.bytes_h2d, st.streamed.copy(), st.ahead_unused.copy(), st.admissions)
    out = [engine.model.decode(t, kv).float().cpu().numpy().copy() for t in TOKENS[PROMPT:]]
    assert_same(np.concatenate(out), ref)
    assert not step._failed and step.steps["replayed"] == len(TOKENS) - PROMPT - 1
    st.settle()
    assert ex.cache.pending == 0
    ex.cache.flush()  # the device tables from the settled maps: they must agree exactly
    torch.cuda.synchronize()
    assert not any(ls.dirty for ls in ex.cache.layers)
    ex.cache.check_integrity()
    records_match(ex.cache, ex.arena)  # every admitted slot holds its expert's record
    assert st.admissions > before[3]  # the tiny model routes 2 of 8 experts: misses to admit
    crossed = sum((int(st.streamed[i] - before[1][i]) + int(st.ahead_unused[i] - before[2][i]))
                  * lay.nbytes for i, lay in enumerate(ex.arena.layouts))
    assert st.bytes_h2d - before[0] == crossed
