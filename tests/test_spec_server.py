"""Verify windows in the server: `strata serve --spec` (one decoding sequence a step), its
/metrics, and a window whose GPU work never finishes (STRATA_FAULT timeout@verify)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.server.batching import BatchRunner
from strata.server.faults import FaultPlan, FaultTrigger
from strata.server.metrics import Metrics
from strata.server.protocol import Delta, Finished, StepDone, Submit
from strata.server.testing import ServerProcess


def _run(engine: Engine, prompt: str, n: int) -> tuple[str, list[StepDone]]:
    sent: list = []
    runner = BatchRunner(engine, sent.append, FaultTrigger(None))
    runner.submit(Submit("r1", None, prompt, {"temperature": 0.0}, n, n, ignore_eos=True))
    while runner.active:
        runner.step()
    done = [m for m in sent if isinstance(m, Finished)]
    assert len(done) == 1 and done[0].completion_tokens == n
    return "".join(m.text for m in sent if isinstance(m, Delta)) + done[0].text, \
        [m for m in sent if isinstance(m, StepDone)]


def _metrics(steps: list[StepDone]) -> str:
    """/metrics' text after these steps."""
    m = Metrics()
    for s in steps:
        m.step(s)
    return m.render(running=0, queued=0, loaded=True, restarts=0)


def test_batch_runner_windows_same_text_and_metrics(synth):
    f = synth("qwen3moe", "Q4_K_M")
    plain, _ = _run(Engine.load(f, config=EngineConfig(device="cpu")), "hello world", 30)
    eng = Engine.load(f, config=EngineConfig(device="cpu", spec=3, draft=str(f)))
    eng.spec.timed = False  # (the windows counted below: not by this machine's load)
    eng.spec.new_sequence(None)
    text, steps = _run(eng, "hello world", 30)
    assert text == plain
    windows = [s for s in steps if s.drafted]
    assert windows and all(s.decode_tokens == s.accepted + 1 for s in windows)
    out = _metrics(steps)
    assert f"strata_spec_windows_total {len(windows)}" in out
    assert f"strata_spec_drafted_tokens_total {sum(s.drafted for s in windows)}" in out
    assert f"strata_spec_accepted_tokens_total {sum(s.accepted for s in windows)}" in out
    assert 'strata_spec_acceptance{position="0"} 1' in out  # the file drafting for itself
    assert 'strata_spec_decode_tokens_per_second{step="window"}' in out


def test_verify_fault_syntax():
    plan = FaultPlan.parse("timeout@verify:2*3")
    assert str(plan) == "timeout@verify:2*3"


@pytest.mark.slow
def test_serve_spec_and_verify_window_stall(synth, tmp_path):
    """`strata serve --spec 3`: the first engine's first window's GPU work never finishes: its
    bounded wait runs out (STRATA_WAIT_TIMEOUT 2 s) and the stall is reported at once, naming
    the window; the engine started again decodes through windows, and /metrics counts them."""
    f = synth("qwen3moe", "Q4_K_M")
    args = ["--model-name", "tiny", "--watchdog", "60", "--report-dir", str(tmp_path),
            "--spec", "3", "--draft", str(f)]
    env = {"STRATA_FAULT": "timeout@verify:1", "STRATA_WAIT_TIMEOUT": "2"}
    with ServerProcess(f, args, env=env, log_path=tmp_path / "server.log") as s:
        def complete() -> httpx.Response:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 12, "ignore_eos": True,
                    "temperature": 0}
            return httpx.post(s.url + "/v1/completions", json=body, timeout=120)

        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        r = complete()
        assert r.status_code == 503 and "verify window of 4 tokens" in r.text, r.text
        h = s.wait_health(lambda h: h["status"] == "ok" and h["restarts"] == 1,
                          what="a restart after the window's stall")
        text = Path(h["last_stall"]["report"]).read_text()
        assert "verify window of 4 tokens at position" in text
        assert "the GPU never finished layer 0" in text
        r = complete()
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12, r.text
        metrics = s.get("/metrics")[1]
        assert "strata_spec_windows_total" in metrics
        windows = next(line for line in metrics.splitlines()
                       if line.startswith("strata_spec_windows_total"))
        assert int(windows.split()[1]) > 0


def _run_many(engine: Engine, prompts: list[str], n: int, sampled: bool = False,
              ids: dict | None = None, grammar: str | None = None
              ) -> tuple[dict[str, str], list[StepDone]]:
    """The prompts submitted together (greedy; with `sampled`, the second at temperature 0.8
    with a seed; with a grammar, the first and last follow it), every one decoding n tokens
    (or, with a grammar, up to n) -> (text by request id, the steps); `ids` gets each request's
    prompt and tokens."""
    sent: list = []
    runner = BatchRunner(engine, sent.append, FaultTrigger(None))
    finish = runner._finish

    def keep(s, reason):  # noqa: ANN001, ANN202
        if ids is not None:
            ids[s.rid] = (s.context[:s.prompt_len], s.context[s.prompt_len:])
        finish(s, reason)

    runner._finish = keep
    for i, p in enumerate(prompts):
        sampling = ({"temperature": 0.8, "seed": 5} if sampled and i == 1
                    else {"temperature": 0.0})
        ruled = grammar is not None and i in (0, len(prompts) - 1)
        runner.submit(Submit(f"r{i}", None, p, sampling, n, n, ignore_eos=not ruled,
                             grammar=grammar if ruled else None))
    while runner.active:
        runner.step()
    done = {m.rid: m for m in sent if isinstance(m, Finished)}
    assert sorted(done) == [f"r{i}" for i in range(len(prompts))]
    assert all(d.completion_tokens == n or grammar is not None for d in done.values())
    texts = {rid: "".join(m.text for m in sent if isinstance(m, Delta) and m.rid == rid)
             + d.text for rid, d in done.items()}
    return texts, [m for m in sent if isinstance(m, StepDone)]


_REPEATS = ["one two three one two three one two three", "red green blue red green blue red",
            "a b c d a b c d a b c d a b"]


class _ReplayMany:
    """Drafts each sequence's own greedy answer (found by its prompt), wrong at every third
    position: windows that accept some drafts and reject the rest."""

    name = "replay"
    from_context = True

    def __init__(self, runs: dict):
        self.runs = list(runs.values())  # (prompt ids, answer ids)

    def propose(self, context: list[int], n: int) -> list[int]:
        for prompt, answer in self.runs:
            if context[:len(prompt)] == prompt:
                at = len(context) - len(prompt)
                return [t if (at + i) % 3 else (t + 1) % 100
                        for i, t in enumerate(answer[at:at + n])]
        return []


@pytest.mark.parametrize(("arch", "offload"), [("qwen3moe", "off"), ("qwen3moe", "on"),
                                               ("qwen35moe", "off"), ("qwen35moe", "on")])
def test_batched_windows_same_text_as_without_spec(synth, arch, offload):
    """Several sequences decoding with --spec: their windows are checked in one forward (a
    step's tokens outnumber one window's), each sequence's text as without --spec, with n-gram
    drafts and with drafts that replay the answers with every third token wrong: over separate
    caches (the reference path), over the batch's paged KV pool (the offload runtime, --batch
    3), with recurrent states rolled back (qwen35moe)."""
    from strata.engine.spec import SpecDecoder

    f = synth(arch, "Q4_K_M")
    # (--kernels exact: under fused, ggml's dense kernels round a window's rows otherwise than
    # one token's)
    ec = {"device": "cpu", "offload": offload, "sequences": 3, "kernels": "exact"}
    runs: dict = {}
    plain, _ = _run_many(Engine.load(f, config=EngineConfig(**ec)), _REPEATS, 24, ids=runs)
    eng = Engine.load(f, config=EngineConfig(**ec, spec=3, draft="ngram"))
    eng.spec.timed = False  # (the windows counted below: not by this machine's load)
    texts, _ = _run_many(eng, _REPEATS, 24)
    assert texts == plain
    eng.spec = SpecDecoder(eng.model, _ReplayMany(runs), 3, timed=False)
    texts, steps = _run_many(eng, _REPEATS, 24)
    assert texts == plain
    together = [s for s in steps if s.drafted and s.decode_tokens > s.accepted + 1]
    assert together, "no step checked several sequences' windows in one forward"
    st = eng.spec.stats
    assert 0 < st.accepted < st.drafted
    assert not eng.spec._windows  # (each finished sequence's window state dropped)
    # /metrics counts each sequence's window of a batched step as one window, by position
    out = _metrics(steps)
    assert f"strata_spec_windows_total {st.windows}" in out
    assert f"strata_spec_drafted_tokens_total {st.drafted}" in out
    assert f"strata_spec_accepted_tokens_total {st.accepted}" in out
    assert f'strata_spec_acceptance{{position="0"}} {st.by_position()[0]:g}' in out
    assert 'position="3"' not in out  # (windows of at most 3 drafts)


def test_batched_windows_sampled_beside_greedy(synth):
    """A sampled sequence without drafts beside greedy ones in batched windows (its token from
    the pass's row, as a plain step's): the greedy texts as without --spec, the sampled one its
    full length, and its text the same on a second run (its own generator: what the others
    draft and accept does not move its draws)."""
    from strata.engine.spec import SpecDecoder

    f = synth("qwen3moe", "Q4_K_M")
    runs: dict = {}
    plain, _ = _run_many(Engine.load(f, config=EngineConfig(device="cpu")), _REPEATS, 20,
                         sampled=True, ids=runs)
    del runs["r1"]  # (the sampled one: no drafts)
    texts = []
    for _ in range(2):
        eng = Engine.load(f, config=EngineConfig(device="cpu", spec=3, draft="ngram"))
        eng.spec = SpecDecoder(eng.model, _ReplayMany(runs), 3, timed=False)
        got, steps = _run_many(eng, _REPEATS, 20, sampled=True)
        assert any(s.drafted and s.decode_tokens > s.accepted + 1 for s in steps)
        texts.append(got)
    assert texts[0]["r0"] == plain["r0"] and texts[0]["r2"] == plain["r2"]
    assert texts[0] == texts[1]


def test_batched_windows_with_grammars(synth):
    """Two sequences under a JSON grammar beside a free one, --spec 3 with drafts that replay
    the answers with every third token wrong: each window row masked to what its grammar
    allows, a forbidden draft cut; every text as without --spec, the constrained ones valid
    JSON; windows of several sequences ran in one forward."""
    import json

    from strata.engine.constrain import json_grammar
    from strata.engine.spec import SpecDecoder

    pytest.importorskip("llguidance")
    f = synth("qwen3moe", "Q4_K_M")
    grammar = json_grammar({"type": "object", "properties": {"k": {"type": "array", "items": {
        "enum": ["ab", "cd"]}, "maxItems": 40}}, "required": ["k"]}, strict=True)
    runs: dict = {}
    plain, _ = _run_many(Engine.load(f, config=EngineConfig(device="cpu")), _REPEATS, 40,
                         ids=runs, grammar=grammar)
    eng = Engine.load(f, config=EngineConfig(device="cpu", spec=3, draft="ngram"))
    eng.spec = SpecDecoder(eng.model, _ReplayMany(runs), 3, timed=False)
    texts, steps = _run_many(eng, _REPEATS, 40, grammar=grammar)
    assert texts == plain
    for rid in ("r0", "r2"):
        assert isinstance(json.loads(texts[rid]), dict), texts[rid]
    assert any(s.drafted and s.decode_tokens > s.accepted + 1 for s in steps)
    assert 0 < eng.spec.stats.accepted < eng.spec.stats.drafted


@pytest.mark.parametrize(("arch", "offload"), [("qwen35moe", "off"), ("qwen35moe", "on"),
                                               ("glm4moe", "off")])
def test_batched_windows_with_mtp_drafts(synth, arch, offload):
    """--draft mtp in a batch: the MTP head keeps a state per sequence (its hidden states, its
    own cache), the plain steps run the forward (the head needs their hidden states), and the
    windows of several sequences run in one forward: each text as without --spec."""
    f = synth(arch, "Q4_K_M")
    # (--kernels exact: under fused, ggml's dense kernels round a window's rows otherwise than
    # one token's)
    ec = {"device": "cpu", "offload": offload, "sequences": 3, "kernels": "exact"}
    plain, _ = _run_many(Engine.load(f, config=EngineConfig(**ec)), _REPEATS, 20)
    eng = Engine.load(f, config=EngineConfig(**ec, spec=3, draft="mtp"))
    eng.spec.timed = False
    assert eng.spec.drafter.name == "mtp" and eng.spec.batches
    texts, steps = _run_many(eng, _REPEATS, 20)
    assert texts == plain
    assert any(s.drafted and s.decode_tokens > s.accepted + 1 for s in steps)
    import gc

    gc.collect()
    assert len(eng.spec.drafter._states) == 0  # (each sequence's state gone with its cache)


@pytest.mark.parametrize("offload", ["off", "on"])
def test_batched_windows_with_a_draft_model(synth, offload):
    """--draft PATH.gguf in a batch: the draft model keeps a cache per sequence, and the
    sequences draft together (their new tokens in one forward of several segments, each greedy
    step of them all in one more); the windows of several sequences run in one forward, each
    text as without --spec. The file drafts for itself, so nearly every draft is accepted: a
    draft made from another sequence's cache would not be."""
    f = synth("qwen3moe", "Q4_K_M")
    ec = {"device": "cpu", "offload": offload, "sequences": 3, "kernels": "exact"}
    plain, _ = _run_many(Engine.load(f, config=EngineConfig(**ec)), _REPEATS, 20)
    eng = Engine.load(f, config=EngineConfig(**ec, spec=3, draft=str(f)))
    eng.spec.timed = False
    drafter = eng.spec.drafter
    assert drafter.name == "model" and eng.spec.batches
    draft_model, widths = drafter.engine.model, []
    forward = draft_model.forward

    def counted(tokens, segments, *a, **k):  # noqa: ANN001, ANN202
        widths.append(len(segments))
        return forward(tokens, segments, *a, **k)

    draft_model.forward = counted
    texts, steps = _run_many(eng, _REPEATS, 20)
    assert texts == plain
    assert any(s.drafted and s.decode_tokens > s.accepted + 1 for s in steps)
    assert max(widths) == 3  # (the three sequences drafted in one forward)
    st = eng.spec.stats
    assert st.accepted >= 0.9 * st.drafted > 0, (st.accepted, st.drafted)
    import gc

    gc.collect()
    assert len(drafter._states) == 0  # (each sequence's draft cache gone with its own)
