"""The offload executor built whole: one frozen options object, named paths chosen in one place
each (a pass's, a decode step's), and one call that counts pairs and bytes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from test_offload import TOKENS, offload

from strata.experts.offload import DECODE_PATHS, OffloadOptions
from strata.experts.paths import PATHS


def test_options_are_given_at_construction_and_frozen(synth) -> None:
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cpu", expert_cache="5", stream_min=6,
                     cpu_share=1)
    ex = engine.model.experts
    assert isinstance(ex.options, OffloadOptions)
    assert ex.stream_min == ex.options.stream_min == 6 and ex.options.debug
    assert ex.options.cpu_share == 1 and ex.options.prefetch == 0  # (CPU: no prefetch)
    assert not ex.fused.x8  # --kernels exact
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.options.stream_min = 1  # type: ignore[misc]
    assert {p.name for p in PATHS} == set(ex.paths)


def test_a_pass_path_is_chosen_in_one_place(synth) -> None:
    """choose: streamed from stream_min tokens on (the ring's per-buffer path on the CPU),
    planned below; the chosen path is the one that runs."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cpu", expert_cache="5", stream_min=6)
    ex = engine.model.experts
    k = engine.config.n_experts_used
    assert ex.choose(0, 1, k) == "planned" and ex.choose(0, 6, k) == "streamed"
    ran = []
    for name, path in ex.paths.items():
        real = path.run

        def spy(*a, _name=name, _real=real, **kw):  # noqa: ANN002, ANN003, ANN202
            ran.append(_name)
            return _real(*a, **kw)

        path.run = spy
    kv = engine.model.new_cache(len(TOKENS))
    engine.run_prompt(TOKENS[:8], kv)  # one chunk of 8: streamed
    assert set(ran) == {"streamed"} and len(ran) == engine.config.n_layers
    ran.clear()
    engine.model.step = None
    engine.model.decode(TOKENS[8], kv)
    assert set(ran) == {"planned"}


@pytest.mark.parametrize("cache", ["0", "24"])
def test_decode_paths_name_every_layer(synth, cache) -> None:
    """On the CPU a layer with every expert in a slot runs inside the piece (resident), any
    other waits on the host; the decode step takes its pieces from those names."""
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cpu", expert_cache=cache)
    ex, step = engine.model.experts, engine.model.step
    paths = ex.decode_paths(engine.config.n_experts_used, [True] * engine.config.n_layers)
    assert set(paths) <= set(DECODE_PATHS)
    assert paths == step.paths == [("resident" if cache == "24" else "host")] * len(paths)
    assert len(step.pieces) == (1 if cache == "24" else engine.config.n_layers + 1)
    assert ex.decode_paths(2, [False, True, True])[0] == "none"


def test_accounting_is_one_call(synth) -> None:
    engine = offload(synth("qwen3moe", "Q4_K_M"), "cpu", expert_cache="0", decode_step="off")
    ex = engine.model.experts
    st = ex.stats
    before = (st.hits.copy(), st.streamed.copy(), st.cpu.copy(), st.bytes_h2d, st.admissions)
    ex.account(1, hits=3, streamed=2, cpu=1, nbytes=100)
    ex.account(np.array([0, 2]), hits=5)
    ex.account(slice(None), streamed=np.array([1, 1, 1]))
    ex.account(None, nbytes=7, admissions=2)
    assert (st.hits - before[0]).tolist() == [5, 3, 5]
    assert (st.streamed - before[1]).tolist() == [1, 3, 1]
    assert (st.cpu - before[2]).tolist() == [0, 1, 0]
    assert st.bytes_h2d - before[3] == 107 and st.admissions - before[4] == 2
