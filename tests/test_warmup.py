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
