"""The streaming ring's bank path (strata/experts/ring.py): circular placement of banks, prefetch
across layers, stale banks dropped, every routed miss computed once; prompt chunks streamed with
the routing on the device equal the host-routed ones.

The bank path runs on the CPU too (no streams or events: copies are synchronous), which the
engine never asks for (it takes the per-buffer path there); these tests switch it on with
`ring.grouped = True` to check the bookkeeping without a GPU. CUDA tests are marked `cuda`.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # the bank path computes with moe_grouped

from strata.cli.logits import compute_logits  # noqa: E402
from strata.config import EngineConfig  # noqa: E402
from strata.engine.generator import Engine  # noqa: E402
from strata.experts.compute import group_pairs, run_records  # noqa: E402
from strata.experts.layout import ExpertLayout  # noqa: E402
from strata.experts.offload import ROUTED_MIN, OffloadExperts  # noqa: E402
from strata.experts.ring import Regions, Ring, bank_records  # noqa: E402
from strata.quant import QType, random_rows  # noqa: E402

from hf_reference import kl_per_position  # noqa: E402

# ---- Regions: placement only ---------------------------------------------------------------------


def test_regions_wrap_and_wait_for_consumed_banks() -> None:
    r = Regions(1000)
    a, b, c, d = object(), object(), object(), object()
    assert r.place(256, a) == (0, [])
    assert r.place(512, b) == (256, [])
    assert r.place(512, c) is None  # 768 + 512 > 1000: wraps to 0, over a and b
    r.consume(a)
    assert r.place(512, c) is None  # b (256..768) is still being computed on
    r.consume(b)
    assert r.place(512, c) == (0, [a, b])  # wrapped; c's copy waits on a's and b's `free`
    assert r.place(256, d) == (512, [])  # b's old place, left by the bookkeeping with b
    assert [s.key for s in r.spans] == [c, d]


def test_regions_exact_fit_then_wrap() -> None:
    r = Regions(1024)
    a, b, c = object(), object(), object()
    assert r.place(512, a) == (0, [])
    assert r.place(512, b) == (512, [])  # ends exactly at the end
    assert r.head == 1024
    r.consume(a)
    assert r.place(512, c) == (0, [a])


def test_regions_one_record_ring_alternates() -> None:
    r = Regions(768)
    keys = [object() for _ in range(4)]
    assert r.place(768, keys[0]) == (0, [])
    for prev, key in zip(keys, keys[1:], strict=False):
        assert r.place(768, key) is None  # the only place holds a bank not yet computed
        r.consume(prev)
        assert r.place(768, key) == (0, [prev])


def test_regions_mixed_strides_overlap_several_banks() -> None:
    """Layer 0's banks of 768 bytes, then a layer's banks of 1280: the bigger bank spans parts of
    two smaller ones and must wait for both; starts stay 256-aligned."""
    r = Regions(3 * 768)  # 2304
    small = [object() for _ in range(3)]
    for i, k in enumerate(small):
        assert r.place(768, k) == (768 * i, [])
    big = object()
    assert r.place(1280, big) is None  # wraps to 0: over small[0] and small[1]
    r.consume(small[0])
    assert r.place(1280, big) is None
    r.consume(small[1])
    assert r.place(1280, big) == (0, [small[0], small[1]])
    assert r.head == 1280
    odd = object()  # a size off the alignment still leaves the next start aligned
    assert r.place(300, odd) is None  # over small[2] (1536..2304), not consumed
    r.consume(small[2])
    assert r.place(300, odd) == (1280, [small[2]]) and r.head == 1792


def test_regions_refuse_a_bank_larger_than_the_ring() -> None:
    with pytest.raises(ValueError):
        Regions(512).place(768, object())


@pytest.mark.parametrize("n,m", [(1, 1), (2, 1), (3, 1), (4, 1), (7, 1), (8, 2), (17, 4)])
def test_bank_records_gives_about_four_banks(n: int, m: int) -> None:
    assert bank_records(n * 512 + 100, 512) == m


def test_bank_records_refuses_a_ring_below_one_record() -> None:
    with pytest.raises(ValueError):
        bank_records(511, 512)


# ---- the bank path on the CPU -------------------------------------------------------------------

E, T, K = 9, 40, 3
LAYOUTS = [ExpertLayout(0, (QType.Q4_K, QType.Q4_K, QType.Q6_K), 256, 256),
           ExpertLayout(1, (QType.Q8_0, QType.IQ2_XS, QType.Q8_0), 256, 128)]  # mixed strides


class _Arena:
    """What the ring reads of an Arena: layouts and one record per (layer, expert)."""

    def __init__(self, seed: int = 0, layouts: list[ExpertLayout] = LAYOUTS):
        rng = np.random.default_rng(seed)
        self.layouts, self.n_experts = layouts, E
        self.layers = []
        for lay in layouts:
            rec = torch.zeros(E, lay.stride, dtype=torch.uint8)
            for part, q, rows, cols in zip(lay.views(rec), lay.qtypes,
                                           (lay.d_expert, lay.d_expert, lay.d_model),
                                           (lay.d_model, lay.d_model, lay.d_expert), strict=True):
                part.copy_(torch.from_numpy(random_rows(q, E * rows, cols, rng, 0.05))
                           .view(part.shape))
            self.layers.append(rec)

    def record(self, layer: int, expert: int) -> torch.Tensor:
        return self.layers[layer][expert]


def routing(seed: int, experts: int = E) -> list:
    """Groups of T tokens routed to K distinct experts among the first `experts`."""
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(np.stack([rng.permutation(experts)[:K] for _ in range(T)]))
    return group_pairs(ids, torch.from_numpy(rng.random((T, K), dtype=np.float32)))


def reference(arena: _Arena, layer: int, groups: list, h: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(h)
    recs = arena.layers[layer][[g.expert for g in groups]]
    run_records(arena.layouts[layer], recs, groups, h, out, 1 << 30)
    return out


def bank_ring(records: float) -> Ring:
    """A CPU ring on the bank path holding `records` records of the larger layer."""
    ring = Ring(int(records * max(lay.stride for lay in LAYOUTS)), torch.device("cpu"))
    ring.grouped = True
    return ring


def streamed(ring: Ring, arena: _Arena, layer: int, groups: list, h: torch.Tensor):
    out = torch.zeros_like(h)
    ring.stream(arena, layer, groups, h, out, 1 << 30)
    return out


RING_SIZES = [1, 1.5, 2.7, 5, 40]  # one record of the larger layer (alternating), odd, large


@pytest.mark.parametrize("records", RING_SIZES)
def test_banks_stream_every_routed_miss_once(records: float) -> None:
    arena, ring = _Arena(), bank_ring(records)
    h = torch.randn(T, 256, generator=torch.Generator().manual_seed(1))
    for layer in (0, 1, 0):
        groups = routing(layer + 10)
        out = streamed(ring, arena, layer, groups, h)
        torch.testing.assert_close(out, reference(arena, layer, groups, h), rtol=1e-5,
                                   atol=1e-5)
        assert not ring.banks
    assert ring.streamed_bytes == sum(len(routing(i + 10)) * LAYOUTS[i].nbytes for i in (0, 1, 0))


@pytest.mark.parametrize("records", RING_SIZES)
def test_prefetch_of_the_next_layer_gives_the_same_outputs(records: float) -> None:
    """As the executor does it: this layer's misses, then every expert of the next layer
    (some of which nobody routes to: copied, never computed), then stream this layer."""
    arena = _Arena()
    h = torch.randn(T, 256, generator=torch.Generator().manual_seed(2))
    g0, g1 = routing(20), routing(21, experts=E - 2)  # experts 7, 8 of layer 1 get no token
    plain = bank_ring(records)
    ref = [streamed(plain, arena, 0, g0, h), streamed(plain, arena, 1, g1, h)]
    ring = bank_ring(records)
    ring.prefetch(arena, 0, [g.expert for g in g0])
    ring.prefetch(arena, 1, list(range(E)))
    assert ring.banks[0].layer == 0 and not any(b.issued for b in ring.banks)  # stream issues
    out0 = streamed(ring, arena, 0, g0, h)
    assert ring.banks and all(b.layer == 1 for b in ring.banks)  # layer 1 waits in the ring
    ring.prefetch(arena, 1, [g.expert for g in g1])  # already queued: nothing added
    out1 = streamed(ring, arena, 1, g1, h)
    assert torch.equal(out0, ref[0]) and torch.equal(out1, ref[1])
    assert not ring.banks
    assert ring.streamed_bytes == len(g0) * LAYOUTS[0].nbytes + E * LAYOUTS[1].nbytes


def test_a_stale_bank_of_another_layer_is_dropped_not_computed(monkeypatch) -> None:
    arena, ring = _Arena(), bank_ring(5)
    h = torch.randn(T, 256, generator=torch.Generator().manual_seed(3))
    computed = []
    real = Ring._compute

    def spy(self, bank, groups, *args):  # noqa: ANN001, ANN002, ANN202
        computed.append((bank.layer, [g.expert for g in groups]))
        return real(self, bank, groups, *args)

    monkeypatch.setattr(Ring, "_compute", spy)
    ring.prefetch(arena, 1, list(range(E)))  # left over (say, by an exception)
    g0 = routing(30)
    out = streamed(ring, arena, 0, g0, h)
    assert {layer for layer, _ in computed} == {0}
    assert sorted(e for _, es in computed for e in es) == sorted(g.expert for g in g0)
    torch.testing.assert_close(out, reference(arena, 0, g0, h), rtol=1e-5, atol=1e-5)
    assert not ring.banks  # the layer-1 banks stood before layer 0's: dropped


def test_prefetched_experts_compute_only_when_routed() -> None:
    """A prefetched expert that is no longer routed as a miss (say, it became resident) is not
    computed: only the call's groups count, each once."""
    arena, ring = _Arena(), bank_ring(3)
    h = torch.randn(T, 256, generator=torch.Generator().manual_seed(4))
    g0 = routing(40)
    ring.prefetch(arena, 0, list(range(E)))
    ring.prefetch(arena, 0, list(range(E)))  # twice: no duplicate banks
    assert sum(len(b.experts) for b in ring.banks) == E
    some = g0[::2]
    out = streamed(ring, arena, 0, some, h)
    torch.testing.assert_close(out, reference(arena, 0, some, h), rtol=1e-5, atol=1e-5)


def test_banks_copy_runs_of_consecutive_experts() -> None:
    """An Arena copies a run of consecutive records at once; an arena with only `record` (no
    per-layer table) one record at a time: the same bytes land."""
    from strata.experts.ring import _runs

    assert _runs([3, 4, 5, 7, 8, 2]) == [(0, 3, 6), (3, 7, 9), (5, 2, 3)]
    assert _runs([]) == []

    class _Records:  # what test_moe_grouped's arena offers: record() alone
        def __init__(self, arena: _Arena):
            self.layouts, self.record = arena.layouts, arena.record

    arena = _Arena()
    h = torch.randn(T, 256, generator=torch.Generator().manual_seed(8))
    g1 = routing(80)
    a, b = bank_ring(40), bank_ring(40)
    assert torch.equal(streamed(a, arena, 1, g1, h), streamed(b, _Records(arena), 1, g1, h))
    written = len(g1) * LAYOUTS[1].stride  # from 0: the banks fit without wrapping
    assert torch.equal(a.buf[:written], b.buf[:written])


def test_prefetch_is_a_no_op_off_the_bank_path() -> None:
    ring = Ring(4 * LAYOUTS[1].stride, torch.device("cpu"))
    assert not ring.grouped
    ring.prefetch(_Arena(), 0, list(range(E)))
    assert not ring.banks and ring.streamed_bytes == 0


# ---- the executor: prompt chunks routed on the device -------------------------------------------

PROMPT = [int(x) for x in np.random.default_rng(0).integers(0, 1024, 70)]


@pytest.fixture(scope="module")
def pack(synth):
    """Three layers with records of three sizes (IQ2_XS, Q4_K, IQ1_M)."""
    path = synth("qwen3moe", "IQ2_XS-MIX")
    return path, compute_logits(Engine.load(path, config=EngineConfig(prefill="off")), PROMPT)


def engine(path, device: str, ring_records: float, routed: bool, monkeypatch,
           **kw) -> Engine:
    """routed=False: the host reads each chunk's routing (the per-routing bank path)."""
    kw.setdefault("kernels", "exact")
    config = EngineConfig(device=device, offload="on", debug=True, cpu_kernels="torch",
                          prefill="16", stream_min=2, **kw)
    probe = Engine.load(path, config=config)
    largest = max(lay.stride for lay in probe.model.experts.arena.layouts)
    e = Engine.load(path, config=replace(config, ring_bytes=int(ring_records * largest)))
    ring = e.model.experts.ring
    if device == "cpu":
        ring.grouped = True  # the bank path on the CPU (see the module doc)
    assert ring.grouped
    if not routed:
        monkeypatch.setattr(OffloadExperts, "_streams_routed", lambda *a: False)
    return e


def count_routed(monkeypatch) -> list[int]:
    """The layers the executor streamed with the routing on the device."""
    layers = []
    real = OffloadExperts._run_streamed_routed

    def spy(self, layer, *args):  # noqa: ANN001, ANN002, ANN202
        layers.append(layer)
        return real(self, layer, *args)

    monkeypatch.setattr(OffloadExperts, "_run_streamed_routed", spy)
    return layers


@pytest.mark.parametrize("records", [1, 2.5, 64])
def test_prompt_routed_on_the_device_equals_host_routing(pack, records, monkeypatch) -> None:
    """16-token chunks route 32 pairs over 8 experts: every layer streams its uncached experts
    with the routing on the device, the next layer's queued behind. The logits match the
    host-routed bank path's (same products, sums in another order) and the reference's; the
    counters agree once settled; every copy is counted."""
    path, ref = pack
    layers = count_routed(monkeypatch)
    on = engine(path, "cpu", records, True, monkeypatch, expert_cache="3", cache_policy="lru")
    ours = compute_logits(on, PROMPT)
    assert set(layers) == {0, 1, 2}
    with monkeypatch.context() as m:
        off = engine(path, "cpu", records, False, m, expert_cache="3")
        plain = compute_logits(off, PROMPT)
    np.testing.assert_allclose(ours, plain, rtol=1e-5, atol=1e-5)
    assert kl_per_position(ref, ours).max() < 1e-4
    st_on, st_off = on.model.experts.stats, off.model.experts.stats
    assert st_on.summary()["pairs_streamed"] == st_off.summary()["pairs_streamed"] > 0
    assert (st_on.streamed == st_off.streamed).all() and (st_on.hits == st_off.hits).all()
    assert (st_on.routed == st_off.routed).all() and st_on.cpu.sum() == 0
    assert st_on.bytes_h2d == on.model.experts.ring.streamed_bytes >= st_off.bytes_h2d
    assert not on.model.experts.ring.banks  # the last layer drains the ring
    for i, ls in enumerate(on.model.experts.cache.layers):  # the LRU policy saw the routing
        routed = set(np.flatnonzero(st_on.routed[i]).tolist())
        assert set(list(ls.policy.order)[-len(routed):]) == routed


def test_a_layer_whose_chunks_route_few_experts_reads_its_routing(pack, monkeypatch) -> None:
    """Settled counts give each layer the fraction of its uncached experts the chunks routed
    to; below ROUTED_MIN the layer goes back to host routing (copying only the routed experts,
    and measuring the fraction of that chunk), and the logits stay the same."""
    path, ref = pack
    layers = count_routed(monkeypatch)
    e = engine(path, "cpu", 2.5, True, monkeypatch, expert_cache="3")
    first = compute_logits(e, PROMPT)
    ex = e.model.experts
    ex.stats.settle()
    assert set(ex.routed_fraction) == {0, 1, 2}
    assert all(0 < f <= 1 for f in ex.routed_fraction.values())
    ex.routed_fraction[1] = ROUTED_MIN / 2  # say layer 1's chunks used half its experts
    layers.clear()
    again = compute_logits(e, PROMPT)
    # layer 1's first chunk read its routing on the host, which measured the fraction again
    assert layers.count(1) < layers.count(0) == layers.count(2) > 0
    np.testing.assert_allclose(again, first, rtol=1e-5, atol=1e-5)
    assert kl_per_position(ref, again).max() < 1e-4


# ---- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("records", [1, 2.5, 64])
def test_prompt_routed_on_the_device_on_cuda(pack, records, monkeypatch) -> None:
    """--kernels fused streams through banks on the GPU with the routing on the device: the
    logits are those of the host-routed banks (same math, sums in another order), and within
    bf16 rounding of the exact ring (float32 experts; the rest of the fused engine alike: bf16
    attention alone moves this pack's logits by KL ~0.5 from the float32 reference)."""
    path, _ = pack
    layers = count_routed(monkeypatch)
    on = engine(path, "cuda", records, True, monkeypatch, expert_cache="3", kernels="fused")
    ours = compute_logits(on, PROMPT)
    assert set(layers) == {0, 1, 2}
    assert not on.model.experts.ring.banks
    with monkeypatch.context() as m:
        off = engine(path, "cuda", records, False, m, expert_cache="3", kernels="fused")
        plain = compute_logits(off, PROMPT)
    st_on, st_off = on.model.experts.stats, off.model.experts.stats
    st_on.settle()  # the device-routed layers' counts are on the device until read
    assert (st_on.streamed == st_off.streamed).all() and (st_on.hits == st_off.hits).all()
    exact = engine(path, "cuda", records, False, monkeypatch, expert_cache="3",
                   kernels="fused")
    exact.model.experts.ring.grouped = False  # run_records per buffer, float32
    truth = compute_logits(exact, PROMPT)
    # the two bank paths round each pair's output to bf16 alike but add them in another order
    # (and cuBLAS groups them differently), so they differ by bf16 rounding carried through
    # the layers: as far from each other as each is from the float32 ring, and no further
    kl_on, kl_off = kl_per_position(truth, ours), kl_per_position(truth, plain)
    kl = kl_per_position(plain, ours)
    assert kl_off.max() < 2e-2 and kl_on.max() < 2e-2 and kl.max() < 2e-2, (kl_on, kl_off, kl)
    assert kl_on.mean() < 2 * kl_off.mean() + 1e-4, (kl_on, kl_off)
    assert (ours.argmax(-1) == plain.argmax(-1)).mean() >= 0.9


@pytest.mark.cuda
def test_a_stale_bank_is_dropped_on_cuda(monkeypatch) -> None:
    arena = _Arena()
    arena.layers = [rec.pin_memory() for rec in arena.layers]
    ring = Ring(3 * LAYOUTS[1].stride, torch.device("cuda"), grouped=True)
    assert ring.grouped
    computed = []
    real = Ring._compute

    def spy(self, bank, *args):  # noqa: ANN001, ANN002, ANN202
        computed.append(bank.layer)
        return real(self, bank, *args)

    monkeypatch.setattr(Ring, "_compute", spy)
    h = torch.randn(T, 256, generator=torch.Generator().manual_seed(6))
    ring.prefetch(arena, 1, list(range(E)))
    g0 = routing(60)
    out = torch.zeros(T, 256, device="cuda")
    ring.stream(arena, 0, g0, h.cuda(), out, 1 << 30)
    torch.cuda.synchronize()
    assert set(computed) == {0} and not ring.banks
    ref = reference(arena, 0, g0, h)
    err = float((out.cpu() - ref).norm() / ref.norm())
    assert err < 1.5e-2, err


@pytest.mark.cuda
def test_the_bank_path_makes_no_host_sync() -> None:
    """Prefetch and stream two layers (after a warm-up that compiles the kernels) with
    torch.cuda.set_sync_debug_mode('error'): no .item(), .tolist(), .cpu() or synchronize."""
    arena = _Arena()
    arena.layers = [rec.pin_memory() for rec in arena.layers]
    ring = Ring(3 * LAYOUTS[0].stride, torch.device("cuda"), grouped=True)
    h = torch.randn(T, 256, generator=torch.Generator().manual_seed(7)).cuda()
    g0, g1 = routing(70), routing(71)

    def run() -> torch.Tensor:
        out = torch.zeros(T, 256, device="cuda")
        ring.prefetch(arena, 0, [g.expert for g in g0])
        ring.prefetch(arena, 1, list(range(E)))
        ring.stream(arena, 0, g0, h, out, 1 << 30)
        ring.stream(arena, 1, g1, h, out, 1 << 30)
        return out

    twice_without_sync(run)
    assert not ring.banks


def twice_without_sync(run) -> torch.Tensor:  # noqa: ANN001
    """run() once (compiling the kernels), then again under set_sync_debug_mode('error'): no
    .item(), .tolist(), .cpu() or synchronize; both give the same result, returned."""
    first = run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(first, again)
    return first


def routed_ids(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, K] (distinct experts per token) and weights [T, K], as the router gives them."""
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(np.stack([rng.permutation(E)[:K] for _ in range(T)]))
    return ids, torch.from_numpy(rng.random((T, K), dtype=np.float32))


@pytest.mark.parametrize("records", RING_SIZES)
def test_stream_routed_equals_host_routing(records: float) -> None:
    """Every expert of layer 0 queued, layer 1's behind: stream_routed (pairs found on the
    device, per bank) gives the host-routed banks' sums for both layers."""
    arena = _Arena(3)
    h = torch.randn(T, 256, generator=torch.Generator().manual_seed(8))
    ring, host_ring = bank_ring(records), bank_ring(records)
    for layer, seed in ((0, 80), (1, 81)):
        ids, wts = routed_ids(seed)
        ring.prefetch(arena, layer, list(range(E)))
        if layer == 0:
            ring.prefetch(arena, 1, list(range(E)))
        out = torch.zeros_like(h)
        ring.stream_routed(arena, layer, h, ids, wts, out, 1 << 30)
        want = streamed(host_ring, arena, layer, group_pairs(ids, wts), h)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert not ring.banks


@pytest.mark.parametrize("records", [1, 2.7, 40])
def test_banks_compute_experts_with_biases(records: float) -> None:
    """gpt-oss's experts (MXFP4, biases, the clamped SwiGLU) on the bank path: host-routed banks
    (experts_forward_grouped with each row's expert id) and device-routed ones (moe_forward_
    grouped with the biases' rows by bank position) equal run_records, which reads the
    layout's biases itself; a ring not given a biased layer's device biases keeps its banks
    off."""
    from strata.model.weights import ExpertBias

    g = torch.Generator().manual_seed(12)
    bias = ExpertBias(*(3 * torch.randn(E, n, generator=g) for n in (128, 128, 256)))
    lay = ExpertLayout(0, (QType.MXFP4,) * 3, 256, 128, bias)
    arena = _Arena(5, [lay])
    h = 3 * torch.randn(T, 256, generator=g)
    ids, wts = routed_ids(120)
    groups = group_pairs(ids, wts)
    ref = reference(arena, 0, groups, h)

    def ring() -> Ring:
        r = Ring(int(records * lay.stride), torch.device("cpu"))
        r.grouped = True
        r.use_biases([lay], {0: ((bias.gate, bias.up, bias.down), bias.act)})
        assert r.grouped
        return r

    host = streamed(ring(), arena, 0, groups, h)
    routed, out = ring(), torch.zeros_like(h)
    routed.prefetch(arena, 0, list(range(E)))
    routed.stream_routed(arena, 0, h, ids, wts, out, 1 << 30)
    for name, got in (("host-routed", host), ("device-routed", out)):
        err = float((got - ref).norm() / ref.norm())
        assert err < 1e-5, f"{name} banks at {records} records: rel err {err:.2e}"
    off = Ring(lay.stride, torch.device("cpu"))
    off.grouped = True
    off.use_biases([lay], {})
    assert not off.grouped


@pytest.mark.cuda
def test_stream_routed_makes_no_host_sync() -> None:
    """Two layers streamed with the routing on the device (after a warm-up that compiles the
    kernels) under torch.cuda.set_sync_debug_mode('error'), equal to the host-routed banks."""
    arena = _Arena(4)
    arena.layers = [rec.pin_memory() for rec in arena.layers]
    ring = Ring(3 * LAYOUTS[0].stride, torch.device("cuda"), grouped=True)
    host_ring = Ring(3 * LAYOUTS[0].stride, torch.device("cuda"), grouped=True)
    h = torch.randn(T, 256, generator=torch.Generator().manual_seed(9)).cuda()
    routes = [routed_ids(90), routed_ids(91)]
    on_gpu = [(ids.cuda(), wts.cuda()) for ids, wts in routes]

    def run() -> torch.Tensor:
        out = torch.zeros(T, 256, device="cuda")
        for layer, (ids, wts) in enumerate(on_gpu):
            ring.prefetch(arena, layer, list(range(E)))
            if layer == 0:
                ring.prefetch(arena, 1, list(range(E)))
            ring.stream_routed(arena, layer, h, ids, wts, out, 1 << 30)
        return out

    first = twice_without_sync(run)
    assert not ring.banks
    want = torch.zeros(T, 256, device="cuda")
    for layer, (ids, wts) in enumerate(routes):
        host_ring.stream(arena, layer, group_pairs(ids, wts), h, want, 1 << 30)
    torch.testing.assert_close(first, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("routed", [True, False])
def test_the_ring_borrows_for_streamed_chunks_and_gives_it_back(pack, routed,
                                                                monkeypatch) -> None:
    """With --ring-bytes auto the ring grows by what the plan leaves (ring_borrow) for the
    passes that stream and shrinks back before a decode step; banks are larger meanwhile, and
    the logits are those of the reference."""
    path, ref = pack
    config = EngineConfig(device="cpu", offload="on", debug=True, cpu_kernels="torch",
                          prefill="16", stream_min=2, expert_cache="3", kernels="exact")
    e = Engine.load(path, config=config)
    ex = e.model.experts
    ring = ex.ring
    ring.grouped = True  # the bank path on the CPU (see the module doc)
    if not routed:
        monkeypatch.setattr(OffloadExperts, "_streams_routed", lambda *a: False)
    base = ring.nbytes
    assert ex.ring_base == base and ex.ring_borrow > 0
    sizes = []
    real = Ring._issue

    def spy(self, arena):  # noqa: ANN001, ANN202
        sizes.append(self.nbytes)
        return real(self, arena)

    monkeypatch.setattr(Ring, "_issue", spy)
    ours = compute_logits(e, PROMPT)
    assert sizes and set(sizes) == {base + ex.ring_borrow}
    assert kl_per_position(ref, ours).max() < 1e-4
    kv = e.model.new_cache(8)
    e.run_prompt(PROMPT[:8], kv)
    assert ring.nbytes == base + ex.ring_borrow and not ring.banks
    e.model.decode(PROMPT[8], kv)
    assert ring.nbytes == base and ring.buf.numel() == base  # given back
    ring.prefetch(ex.arena, 0, [0, 1])  # left queued (say, by an exception): dropped
    e.run_prompt(PROMPT[9:30], kv)
    assert not ring.banks and ring.nbytes == base + ex.ring_borrow
