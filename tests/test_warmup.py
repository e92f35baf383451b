"""The serving engine's warm-up (strata.server.warmup): it leaves nothing behind but built kernels
and captured graphs: the counters are back at zero and a request's tokens are those of an engine
that never warmed up; `strata serve` says it ran."""

from __future__ import annotations

import httpx

from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.engine.sampling import SamplingParams
from strata.server.testing import ServerProcess
from strata.server.warmup import warm_up


def test_warm_up_leaves_no_state_behind(synth) -> None:
    path = synth("qwen3moe", "Q4_K_M")
    config = EngineConfig(offload="on", expert_cache="0", cpu_kernels="torch")
    params = SamplingParams(temperature=0, max_tokens=12)
    prompt = [5, 17, 300, 4, 88, 901, 12]
    cold = list(Engine.load(path, config=config).generate(prompt, params))
    warm = Engine.load(path, config=config)
    assert warm_up(warm) > 0
    st = warm.model.experts.stats
    assert st.hits.sum() + st.cpu.sum() + st.streamed.sum() == 0 and st.steps == 0
    assert st.routed.sum() == 0
    assert list(warm.generate(prompt, params)) == cold


def test_serve_warms_up_before_it_says_loaded(synth, tmp_path) -> None:
    log = tmp_path / "server.log"
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), ["--offload", "on"], log_path=log) as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        assert "warm-up: kernels built and decode graphs captured in" in s.log()
        r = httpx.post(s.url + "/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), ["--warmup", "0"],
                       log_path=tmp_path / "cold.log") as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        assert "warm-up:" not in s.log()


def test_warm_up_runs_a_prompt_of_each_prompt_graph_bucket(synth) -> None:
    """Where the prompt graphs apply, the warm-up runs one prompt in each of their buckets (on
    CUDA its first chunk captures it): here their passes run uncaptured over the static
    buffers on the CPU, one per bucket past the first prompt's."""
    from strata.engine.chunk_graph import ChunkGraphs

    engine = Engine.load(synth("qwen3moe", "Q4_K_M"), config=EngineConfig(
        offload="on", expert_cache="24", cpu_kernels="torch"))
    model = engine.model
    model.fused_attention = True  # (the fused chunk path's torch forms, as on CUDA)
    model.chunks = ChunkGraphs(model, (16, 32, 64), mode="eager")
    assert model.chunks.why is None
    warm_up(engine)
    # the 32-token prompt, one of 16, 32 and 64 tokens, the second sequence's 32: every bucket
    assert model.chunks.steps["warm"] == 5 and model.chunks.steps["eager"] == 0
    # with --spec's verify windows planned: one window of each size too
    model.chunks = ChunkGraphs(model, (16, 32, 64), mode="eager", windows=3)
    warm_up(engine)
    assert model.chunks.window_steps["warm"] == 3 and model.chunks.steps["eager"] == 0
