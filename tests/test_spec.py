"""Speculative decoding: drafters, verify windows, exactness (greedy and sampled), adaptive
windows, bounded waits (strata.engine.spec, strata.engine.drafters)."""

from __future__ import annotations

import math

import pytest
import torch

from strata.config import EngineConfig
from strata.demo import demo_model
from strata.engine.drafters import NgramDrafter, check_vocab, make_drafter
from strata.engine.generator import Engine
from strata.engine.sampling import SamplingParams, probabilities
from strata.engine.spec import (
    LayerMarks,
    PassCosts,
    SpecDecoder,
    SpecStats,
    Window,
    accept,
)
from strata.errors import StrataError
from strata.gguf import open_model
from strata.kernels.tuning import SPEC_OFF_STEPS, SPEC_PROBE_SHARE, SPEC_START_STEPS
from strata.model.transformer import Segment
from strata.runtime.waits import StallError

CODE = "def parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument("
PROSE = "The Debian package manager installs"
# the reference path, and the offload runtime on the CPU with every expert a miss, its CPU pool
# on ggml (activations rounded to 8 bits, per token) or on torch's float32 kernels. A window's
# misses take the planned path (OffloadExperts.window), so they run on the same kernels as a
# single token's: were they streamed (this device's stream_min is 2: a "copy" is a memcpy), they
# would run in float32 against ggml's single tokens, ~0.2 apart in the tiny files' logits, which
# flips a random model's near-ties.
PATHS = {
    "reference": dict(offload="off"),
    # (--kernels exact: the dense matrices in float32; under fused, ggml's dense kernels round a
    # window's rows otherwise than one token's, as CUDA's fused kernels do)
    "offload": dict(offload="on", expert_cache="0", miss="cpu", kernels="exact"),
    "offload-torch": dict(offload="on", expert_cache="0", miss="cpu", cpu_kernels="torch"),
}


def load(path, spec: int = 0, draft: str = "auto", **kw) -> Engine:  # noqa: ANN001
    """An engine on the CPU; with --spec, windows that acceptance alone turns off (the tests
    count windows: a timed window would depend on this machine's load)."""
    eng = Engine.load(path, config=EngineConfig(device="cpu", spec=spec, draft=draft, **kw))
    if eng.spec is not None:
        eng.spec.timed = False
    return eng


def greedy(engine: Engine, text: str, n: int) -> list[int]:
    return list(engine.generate(engine.tokenizer.encode(text),
                                SamplingParams(temperature=0, max_tokens=n)))


# ---- drafters -----------------------------------------------------------------------------------

def test_ngram_drafter_longest_latest_match():
    d = NgramDrafter(longest=3, shortest=2)
    # suffix [1, 2, 3]: found at 0 -> proposes what followed it there
    assert d.propose([1, 2, 3, 9, 8, 7, 1, 2, 3], 2) == [9, 8]
    # the latest match wins: [5, 6] at 0 (-> 1) and at 3 (-> 2)
    assert d.propose([5, 6, 1, 5, 6, 2, 5, 6], 3) == [2, 5, 6]
    # only a 1-token match (shorter than the shortest): nothing
    assert d.propose([4, 1, 2, 3, 4], 3) == []
    # the continuation stops at the end of the context
    assert d.propose([7, 7, 7], 4) == [7]
    assert d.propose([1], 4) == [] and d.propose([1, 2, 1, 2], 0) == []


def test_draft_refusals(synth):
    demo = open_model(demo_model())
    with pytest.raises(StrataError, match=r"--draft mtp: .* has no nextn layers \(no "
                       r"qwen3moe.nextn_predict_layers and no blk.N.nextn.\* tensors\)"):
        make_drafter("mtp", demo, "qwen3moe", None)
    assert make_drafter("auto", demo, "qwen3moe", None).name == "ngram"
    with pytest.raises(StrataError, match="choose auto, ngram, mtp or a .gguf"):
        make_drafter("bigram", demo, "qwen3moe", None)
    with pytest.raises(StrataError, match="no such file"):
        make_drafter("/nonexistent/draft.gguf", demo, "qwen3moe", None)
    tiny = synth("qwen3moe", "Q4_K_M")
    with pytest.raises(StrataError, match=r"--draft .*: its vocabulary differs from .* \(1024 "
                       r"against 8192 tokens, first at id \d+\); a draft model must share"):
        check_vocab(demo, open_model(tiny))
    with pytest.raises(StrataError, match="its vocabulary differs"):
        load(demo_model(), spec=4, draft=str(tiny))


# ---- exact: greedy ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["reference", "offload"])
def test_greedy_demo_same_with_spec(path):
    """The trained demo model: n-gram windows accept often on code, and greedy output is the
    same token for token."""
    kw = PATHS[path]
    plain = greedy(load(demo_model(), **kw), CODE, 48)
    eng = load(demo_model(), spec=4, draft="ngram", **kw)
    assert greedy(eng, CODE, 48) == plain
    st = eng.stats.spec
    assert st.windows > 0 and st.accepted > 0
    assert eng.stats.generated_tokens == 48
    assert eng.stats.decode_tokens == 47 and eng.stats.decode_steps < 47


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe", "llama", "glm4moe", "deepseek2",
                                  "gpt-oss"])
def test_greedy_synthetic_same_with_spec(synth, arch, path):
    """Tiny synthetic files of every architecture but the hybrids (refused: their recurrent
    state cannot roll back yet; test_generate_spec_stats_and_refusals); drafts from n-grams and
    from a draft model: the file itself (every draft accepted) and another seed's weights (few
    accepted)."""
    f = synth(arch, "Q4_K_M")
    plain = greedy(load(f, **PATHS[path]), "hello world", 40)
    for draft, full in (("ngram", False), (str(f), True), (str(synth(arch, "Q4_K_M", 1)), False)):
        eng = load(f, spec=3, draft=draft, **PATHS[path])
        assert greedy(eng, "hello world", 40) == plain, draft
        st = eng.stats.spec
        # the target drafting for itself (the draft model on the reference path): every window
        # accepted whole where the target computes in float32 too (ggml's 8-bit activations
        # differ from it by near-ties)
        # (a random model's greedy text may repeat no n-gram: then no window runs; a draft
        # model always drafts)
        assert st.windows > 0 or draft == "ngram"
        assert st.accepted == st.drafted or not full or path == "offload"


class ReplayDrafter:
    """Proposes the target's own greedy tokens, wrong at every `wrong`-th position of the
    answer: windows accept some drafts and reject the rest."""

    name = "replay"

    def __init__(self, prompt: list[int], answer: list[int], wrong: int = 3):
        self.prompt, self.answer, self.wrong = len(prompt), answer, wrong

    def propose(self, context: list[int], n: int) -> list[int]:
        at = len(context) - self.prompt  # the answer's next position
        out = self.answer[at:at + n]
        return [t if (at + i) % self.wrong else (t + 1) % 1000 for i, t in enumerate(out)]


@pytest.mark.parametrize("path", ["reference", "offload"])
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_greedy_hybrid_same_with_spec(synth, arch, path):
    """The hybrids: windows through their Gated DeltaNet layers roll the recurrent state back
    to the last accepted token, so greedy output is the same with n-gram drafts and with
    drafts that replay the answer with every third token wrong (windows with rejections)."""
    f = synth(arch, "Q4_K_M")
    base = load(f, **PATHS[path])
    ids = base.tokenizer.encode("hello world")
    plain = greedy(base, "hello world", 40)
    eng = load(f, spec=3, draft="ngram", **PATHS[path])
    assert greedy(eng, "hello world", 40) == plain
    eng.spec = SpecDecoder(eng.model, ReplayDrafter(ids, plain), 3, timed=False)
    assert greedy(eng, "hello world", 40) == plain
    st = eng.stats.spec
    assert st.windows > 0 and 0 < st.accepted < st.drafted


def test_window_rollback_leaves_the_plain_state(synth):
    """A window of 4 tokens whose last 2 are rejected leaves the KV rows and the recurrent
    state (every linear layer's conv window and delta state) a plain decode of the 2 accepted
    tokens leaves."""
    from strata.engine.spec import rollback
    from strata.model.transformer import Segment

    eng = load(synth("qwen35moe", "Q4_K_M"))
    m = eng.model
    prompt = torch.tensor([5, 6, 7, 8, 9])
    kv0, kv1 = m.new_cache(32), m.new_cache(32)
    for kv in (kv0, kv1):
        m.forward(prompt, [Segment(kv, 5)])
    for t in (11, 12):
        m.decode(t, kv0)
    kv1.open_window(4)
    m.forward(torch.tensor([11, 12, 13, 14]), [Segment(kv1, 4)], all_logits=True)
    kv1.state.stop_recording()
    rollback(m, kv1, 7)
    assert kv1.length == kv0.length == 7
    # (to float rounding: the window's projections run 4 tokens in one matmul; the state of
    # token 13 or 14 would differ by ~1)
    for a, b in ((kv1.state.conv, kv0.state.conv), (kv1.state.ssm, kv0.state.ssm)):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    assert torch.allclose(kv1.store[:, :, :7], kv0.store[:, :, :7], atol=1e-5, rtol=1e-5)
    # the next token decodes the same from both
    assert torch.allclose(m.decode(20, kv1), m.decode(20, kv0), atol=1e-4, rtol=1e-4)
    # a plain step after the window: its states no longer apply, rollback is truncate's
    assert kv1.state.window is None


def test_kv_after_stop_matches_plain(synth):
    """A stop token inside a window: the cache keeps what the plain loop keeps."""
    f = synth("qwen3moe", "Q4_K_M")
    base = load(f)
    ids = base.tokenizer.encode("hello world")
    kv0 = base.model.new_cache(64)
    out = list(base.generate(ids, SamplingParams(temperature=0, max_tokens=12), kv0))
    eng = load(f, spec=4, draft=str(f))
    stop = out[5]
    eng.tokenizer.stop_ids = base.tokenizer.stop_ids | {stop}
    base.tokenizer.stop_ids = eng.tokenizer.stop_ids
    kv0, kv1 = base.model.new_cache(64), eng.model.new_cache(64)
    a = list(base.generate(ids, SamplingParams(temperature=0, max_tokens=12), kv0))
    b = list(eng.generate(ids, SamplingParams(temperature=0, max_tokens=12), kv1))
    assert a == b == out[:out.index(stop)]
    assert eng.stats.finish_reason == base.stats.finish_reason == "stop"
    assert kv1.length == kv0.length
    n = kv0.length
    # (the same rows to float rounding: a window's matmuls run several tokens at once)
    assert torch.allclose(kv1.store[:, :, :n], kv0.store[:, :, :n], atol=1e-4, rtol=1e-4)


def test_next_turn_reuses_the_cache_same_with_spec(synth):
    """A chat's next turn runs only what the cache lacks: the same answers and cache length
    with windows as without."""
    f = synth("qwen3moe", "Q4_K_M")
    turns = []
    for spec, draft in ((0, "auto"), (3, str(f))):
        eng = load(f, spec=spec, draft=draft)
        ids = eng.tokenizer.encode("hello world")
        kv = eng.model.new_cache(128)
        p = SamplingParams(temperature=0, max_tokens=10)
        a = list(eng.generate(ids, p, kv))
        b = list(eng.generate(ids + a + eng.tokenizer.encode(" and more"), p, kv))
        turns.append((a, b, kv.length))
    assert turns[0] == turns[1]


# ---- exact: sampled -----------------------------------------------------------------------------

def _chi2_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square test's p-value of observed counts against probabilities (cells with an
    expected count under 5 pooled)."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_rejection_sampling_follows_the_target():
    """accept() over many seeds: the first token follows p_0 whatever the draft, the second
    (given the first draft was kept) follows p_1. False-failure rate: each p-value is compared
    with 1e-4, so a correct sampler fails this test with probability about 4e-4."""
    torch.manual_seed(0)
    V = 12
    logits = torch.randn(3, V) * 1.5  # [k+1, V]
    params = SamplingParams(temperature=0.9, top_k=10, top_p=0.97, seed=None, max_tokens=8)
    p0, p1 = probabilities(logits[0], params), probabilities(logits[1], params)
    for drafts in ([int(p0.argmax()), int(p1.argmax())],  # likely drafts
                   [int(p0.argsort()[-3]), int(p1.argsort()[-2])]):  # less likely ones
        first, second = torch.zeros(V), torch.zeros(V)
        gen = torch.Generator().manual_seed(1234)
        for _ in range(6000):
            n, nxt = accept(logits, drafts, params, gen)
            tokens = [*drafts[:n], nxt]
            first[tokens[0]] += 1
            if tokens[0] == drafts[0]:
                second[tokens[1]] += 1
        assert _chi2_p(first, p0) > 1e-4, (drafts, first)
        assert _chi2_p(second, p1) > 1e-4, (drafts, second)
        assert first[p0 == 0].sum() == 0 and second[p1 == 0].sum() == 0  # top-k / top-p hold


def test_sampled_generation_runs_and_is_seeded(synth):
    f = synth("qwen3moe", "Q4_K_M")
    eng = load(f, spec=4, draft=str(f))
    p = SamplingParams(temperature=0.8, seed=7, max_tokens=30)
    ids = eng.tokenizer.encode("hello world")
    a = list(eng.generate(ids, p))
    assert a == list(eng.generate(ids, p))  # a seed gives the same text again
    assert len(a) == eng.stats.generated_tokens and eng.stats.spec.windows > 0


# ---- adaptive windows ---------------------------------------------------------------------------

class WrongDrafter:
    """Always proposes a token the target never picks here (0 is never generated)."""

    name = "wrong"

    def propose(self, context: list[int], n: int) -> list[int]:
        return [0] * n


def test_window_shrinks_and_turns_off():
    w = Window(4)
    w.update(4, 4)
    assert w.next_size() == 4
    w.update(4, 0)
    assert w.size == 3
    for _ in range(4):
        w.update(w.size, 0)
    assert w.off == SPEC_OFF_STEPS and w.size == 1
    assert [w.next_size() for _ in range(SPEC_OFF_STEPS)] == [0] * SPEC_OFF_STEPS
    assert w.next_size() == 1  # a probe
    w.update(1, 0)
    assert w.off == 2 * SPEC_OFF_STEPS  # failed: off again, twice as long
    w.off = 0
    w.update(1, 0)
    assert w.off == 4 * SPEC_OFF_STEPS
    w.off = 0
    w.update(1, 1)  # a probe that accepts: on, and the next pause is short again
    assert w.off == 0 and w.size == 2 and w.accept_backoff == SPEC_OFF_STEPS


def test_slow_windows_turn_off():
    """Windows whose seconds per token exceed a plain step's by SPEC_SLOWER turn off; a window
    that gains enough stays on."""
    w = Window(4)
    w.update(4, 4, 0.5)  # no plain step timed yet: not judged, two plain steps next
    assert w.off == 2 and [w.next_size() for _ in range(3)] == [0, 0, 4]
    w.plain(0.9)  # (right after the window: not taken)
    assert w.plain_s is None
    w.plain(0.1)
    assert w.plain_s == 0.1 and w.off == 0 and w.costs.steps == {}
    w.update(4, 3, 0.3)  # 0.075 s a token against 0.1: on
    assert w.off == 0
    for _ in range(4):
        w.update(4, 1, 0.4)  # 0.2 s a token: the running mean crosses 0.11 at the second
    assert w.window_s is None and w.off == 4 * SPEC_OFF_STEPS  # turned off 3 times in a row
    assert w.backoff == 8 * SPEC_OFF_STEPS
    w.off = 0
    w.update(4, 4, 0.2)  # 0.04 s a token: on, and the next pause is short again
    assert w.off == 0 and w.backoff == SPEC_OFF_STEPS


def test_the_plain_step_after_a_window_does_not_set_the_measure():
    """The plain step right after a window may pay for it (on an H100 at 4 GiB windows of ~30
    plain steps were never judged slower than it): it is not timed,
    so such windows are judged slow against the steps after it; a first window, before any
    plain step is timed, is not judged."""
    costs = PassCosts()
    w = Window(4, costs=costs)
    w.update(4, 3, 0.45)  # a first window (not judged), ~30 plain steps of 0.015
    w.next_size(), w.next_size()
    w.plain(0.12)  # its aftermath: not the measure
    w.plain(0.015)
    assert w.off == 0 and costs.steps == {}
    w.update(4, 3, 0.45)  # judged against 0.015, not 0.12: off
    assert w.off >= SPEC_OFF_STEPS and costs.steps == {4: pytest.approx(30.0)}
    w.plain(0.12)  # (after a window again: not taken, the mean stays at 0.015)
    assert w.plain_s == pytest.approx(0.015)
    w.off = 0
    w.update(4, 3, 0.45)
    assert costs.seen == {4: 2}
    fresh = Window(4, costs=costs)  # the decoder knows: a new sequence starts with them off
    assert fresh.off > 64 and fresh.size == 1


def test_a_window_that_captured_its_graph_is_not_judged():
    """A window that captured its size's CUDA graph (an eager pass, then the capture) paid a
    one-time cost: it is not judged against plain steps, nor is the plain step after it timed;
    the same cost without a capture turns the windows off."""
    w = Window(4)
    w.update(4, 4, 0.5)  # the first: no plain step timed yet
    w.next_size(), w.next_size()
    w.plain(0.9), w.plain(0.1)
    w.update(4, 0, 3.0, one_time=True)  # 3 s a token against 0.1, but a capture
    assert w.off == 0 and w.window_s is None and w.costs.steps == {}
    w.plain(5.0)  # the step after it: not taken
    assert w.plain_s == pytest.approx(0.1)
    w.update(3, 0, 3.0)  # as slow without a capture: off
    assert w.off >= SPEC_OFF_STEPS and w.costs.steps == {3: pytest.approx(30.0)}


def test_spec_step_says_which_window_captured(synth, monkeypatch):
    """SpecDecoder.step passes one_time to the Window where the model's window graphs counted a
    capture during its verify pass (its first window here), not otherwise."""
    eng = load(synth("qwen3moe", "Q4_K_M"))
    spec = eng.spec = SpecDecoder(eng.model, WrongDrafter(), 4, timed=False)
    captures = {"n": 0}
    verify = spec._verify

    def capturing(*args, **kw):  # noqa: ANN002, ANN003
        captures["n"] += captures["n"] == 0  # (the first window captures its graph)
        return verify(*args, **kw)

    calls = []
    update = Window.update

    def record(self, drafted, accepted, seconds=None, one_time=False):  # noqa: ANN001
        calls.append(one_time)
        update(self, drafted, accepted, seconds, one_time)

    monkeypatch.setattr(spec, "_verify", capturing)
    monkeypatch.setattr(spec, "_captured", lambda: captures["n"])
    monkeypatch.setattr(Window, "update", record)
    greedy(eng, "hello world", 20)
    assert len(calls) >= 2 and calls[0] and not any(calls[1:])
    assert SpecDecoder(eng.model, WrongDrafter(), 4)._captured() == 0  # (no graphs on the CPU)


def test_slow_windows_pause_by_what_they_cost():
    """A window that costs many plain steps pauses long enough to keep its loss to
    SPEC_PROBE_SHARE of the pause (not the SPEC_OFF_STEPS a cheap one gets), at most 4x the
    doubling pause a verdict (one slowed window does not stop them for long); the decoder's
    costs, once two windows of a size are measured, start a new sequence's windows off where
    no acceptance could pay and at one draft where a full window costs many plain steps."""
    costs = PassCosts()
    w = Window(4, costs=costs)
    w.plain(0.01)
    w.update(4, 3, 0.2)  # 20 plain steps for 4 tokens: 0.05 s a token against 0.01
    lost = (0.05 / 0.01 - 1) * 4  # 16 plain steps lost: 320 would keep them to 5%
    assert math.ceil(lost / SPEC_PROBE_SHARE) == 320 and w.off == 4 * SPEC_OFF_STEPS
    assert Window(4, costs=costs).off == 0  # (one window measured: not yet the engine's)
    w.off = 0
    w.update(4, 3, 0.2)  # again: the pause grows with the doubling (32 x 4), up to 320
    assert w.off == 8 * SPEC_OFF_STEPS and costs.steps == {4: pytest.approx(20.0)}
    w.off = 0
    w.update(4, 3, 0.2)
    assert w.off == 16 * SPEC_OFF_STEPS
    w.off = 0
    w.update(4, 3, 0.2)
    assert w.off == 320  # (4 x 128 would pass it)
    # another sequence: even 4 of 4 accepted cannot pay; a first window could lose 19 steps
    fresh = Window(4, costs=costs)
    assert fresh.off == math.ceil(19 / SPEC_PROBE_SHARE) and fresh.size == 1
    assert Window(4, timed=False, costs=costs).off == 0
    assert PassCosts().pause_for(4) == 0  # (nothing measured: on)
    costs.add(1, 1.5)  # a window of 1 draft at 1.5 plain steps could pay for its 2 tokens
    costs.add(1, 1.5)
    assert Window(4, costs=costs).off == 0
    assert costs.pause_for(0) == 0  # (sizes past the limit do not count)
    small = PassCosts()
    small.add(4, 1.5)
    small.add(4, 1.5)
    assert Window(4, costs=small).size == 4 and Window(4, costs=PassCosts()).size == 4
    small.add(4, 3.0)
    small.add(4, 3.0)
    assert small.steps[4] > SPEC_START_STEPS and Window(4, costs=small).size == 1
    cheap = Window(4)
    cheap.plain(0.01)
    cheap.update(4, 0, 0.012)  # 1.2 plain steps for 1 token: off, SPEC_OFF_STEPS
    assert cheap.off == SPEC_OFF_STEPS


def test_the_decoders_sequences_share_their_costs(synth):
    eng = load(synth("qwen3moe", "Q4_K_M"), spec=3)
    spec = eng.spec
    spec.new_sequence("a")
    a = spec.window
    spec.new_sequence("b")
    assert spec.window is not a and spec.window.costs is a.costs is spec.costs


def test_low_acceptance_turns_windows_off(synth):
    f = synth("qwen3moe", "Q4_K_M")
    eng = load(f)
    plain = greedy(eng, "hello world", 40)
    assert 0 not in plain
    eng.spec = SpecDecoder(eng.model, WrongDrafter(), 4, timed=False)
    assert greedy(eng, "hello world", 40) == plain
    st = eng.stats.spec
    assert st.accepted == 0 and st.windows <= 7 and st.plain_steps >= 30


# ---- bounded waits ------------------------------------------------------------------------------

class StuckEvent:
    """A fake CUDA event: the GPU 'finishes' layers below `done` only."""

    made = 0
    done = 1

    def __init__(self):
        self.index = StuckEvent.made
        StuckEvent.made += 1

    def record(self):
        pass

    def query(self):
        return self.index < StuckEvent.done


def test_verify_window_stall_names_window_size_and_layer(synth):
    f = synth("qwen3moe", "Q4_K_M")
    eng = load(f)
    StuckEvent.made = 0
    eng.spec = SpecDecoder(eng.model, NgramDrafter(), 4, timeout_s=0.05, event=StuckEvent)
    eng.spec.drafter.propose = lambda ctx, n: [1, 2, 3]
    with pytest.raises(StallError, match=r"verify window of 4 tokens at position \d+: waited 0 s; "
                       r"the GPU never finished layer 1 \(stage 'verify window', layer 3"):
        list(eng.generate(eng.tokenizer.encode("hello"), SamplingParams(temperature=0,
                                                                        max_tokens=8)))


def test_layer_marks_name_the_head():
    StuckEvent.made, StuckEvent.done = 0, 3
    m = LayerMarks(5, 10, 3, torch.device("cpu"), event=StuckEvent)
    for i in range(4):
        m.after(i)
    with pytest.raises(StallError, match="never finished the output head"):
        m.wait(0.01)
    StuckEvent.done = 1


def test_batched_windows_stall_names_the_batch(synth):
    """Several sequences' windows in one forward whose GPU work stops: the stall names the
    windows' tokens, how many sequences and the layer."""
    from strata.engine.spec import Decoding

    eng = load(synth("qwen3moe", "Q4_K_M"))
    StuckEvent.made = 0
    spec = SpecDecoder(eng.model, NgramDrafter(), 3, timeout_s=0.05, event=StuckEvent)
    spec.drafter.propose = lambda ctx, n: [1, 2, 3][:n]
    seqs = []
    for i, prompt in enumerate(([5, 6, 7], [8, 9])):
        kv = eng.model.new_cache(16)
        eng.model.forward(torch.tensor(prompt[:-1]), [Segment(kv, len(prompt) - 1)])
        seqs.append(Decoding(i, prompt, kv, SamplingParams(temperature=0), None, 8))
    with pytest.raises(StallError, match=r"verify windows of 8 tokens of 2 sequences \(the first "
                       r"at position 2\): waited 0 s; the GPU never finished layer 1"):
        spec.step_batch(seqs)


# ---- the offload executor over a window ---------------------------------------------------------

def test_window_reads_each_expert_once(synth):
    """A window of 5 tokens takes the planned path (a pass of 5 tokens that is no window
    streams here, stream_min being 2): per layer one CPU pool call whose groups are the union
    of the tokens' experts, each once, and every pair counted."""
    f = synth("qwen3moe", "Q4_K_M")
    eng = load(f, spec=4, **PATHS["offload"])
    ex = eng.model.experts
    calls = []
    run_cpu = ex._run_cpu

    def spy(layer, groups, h):  # noqa: ANN001, ANN202
        calls.append((layer, h.shape[0], [g.expert for g in groups],
                      sum(len(g.tokens) for g in groups)))
        return run_cpu(layer, groups, h)

    ex._run_cpu = spy
    kv = eng.model.new_cache(32)
    from strata.model.transformer import Segment

    eng.model.forward(torch.tensor([5, 6, 7]), [Segment(kv, 3)])
    calls.clear()
    before = ex.stats.cpu.copy()
    ex.window = True  # as SpecDecoder.step sets it around a window's forward
    eng.model.forward(torch.tensor([1, 2, 3, 4, 5]), [Segment(kv, 5)], all_logits=True)
    ex.window = False
    K = eng.config.n_experts_used
    assert [c[0] for c in calls] == list(range(eng.config.n_layers))
    for _, t, experts, pairs in calls:
        assert t == 5 and len(experts) == len(set(experts)) and pairs == 5 * K
    assert ((ex.stats.cpu - before) == 5 * K).all()


def test_spec_stats_by_position():
    st = SpecStats()
    st.add(3, 1, 0.1)
    st.add(2, 2, 0.1)
    assert st.drafted_at == [2, 2, 1] and st.accepted_at == [2, 1, 0]
    assert st.by_position() == [1.0, 0.5, 0.0] and st.window_tokens == 5
    assert "2 windows, 5 drafted, 3 accepted (60.0%; by position 1.00 0.50 0.00)" in st.line()


# ---- the command line ---------------------------------------------------------------------------

def test_generate_spec_stats_and_refusals(synth, capfd, tmp_path):
    from strata.cli.main import main

    f = str(synth("qwen3moe", "Q4_K_M"))
    base = ["generate", f, "--device", "cpu", "--prompt", "hello world", "-n", "24",
            "--temperature", "0"]
    assert main(base) == 0
    plain = capfd.readouterr().out
    assert main([*base, "--spec", "3", "--draft", f, "--stats"]) == 0
    out, err = capfd.readouterr()
    assert out == plain
    assert "strata: spec: " in err and " windows, " in err and "accepted (100.0%" in err
    assert main([*base, "--spec", "2", "--draft", "mtp"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert "--draft mtp" in err[-1] and "has no nextn layers" in err[-1]
    assert main([*base, "--spec", "-1"]) == 2
    assert "--spec -1: give 0 (off) to 64" in capfd.readouterr().err
    # commands that decode no drafted tokens, and a hybrid draft model (its own cache's
    # recurrent state cannot roll back to a shared prefix): one line each, exit 2
    out = str(tmp_path / "l.npy")
    for argv, needle in ((["logits", f, "--out", out, "--text", "hi", "--spec", "4"],
                          "strata logits decodes no"),
                         (["perplexity", f, "--file", f, "--spec", "4"],
                          "strata perplexity decodes no"),
                         (["bench", f, "--spec", "4"], "strata bench decodes no drafted"),
                         (["generate", str(synth("qwen35moe", "Q4_K_M")), "--prompt", "hi",
                           "-n", "4", "--spec", "4", "--draft",
                           str(synth("qwen35moe", "Q4_K_M"))], "cannot yet be rolled back")):
        assert main(argv) == 2, argv
        lines = [ln for ln in capfd.readouterr().err.strip().splitlines()
                 if not ln.startswith(("strata: device: ", "strata: loading: "))]
        assert len(lines) == 1 and needle in lines[0], (argv, lines)


# ---- CUDA (never run on a machine without a GPU) ------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("decode_step", ["graphs", "off"])
def test_greedy_same_with_spec_cuda_offload(synth, decode_step):
    """The offload runtime on CUDA: plain steps on the decode step (graphs) or the batched
    forward, windows on the forward with all logits; --kernels exact keeps both float32-exact
    up to 4 tokens, so windows of 3 drafts + 1 agree with single tokens."""
    f = synth("qwen3moe", "Q4_K_M")
    kw = dict(device="cuda", offload="on", expert_cache="2", kernels="exact",
              decode_step=decode_step)
    plain = list(Engine.load(f, config=EngineConfig(**kw)).generate(
        [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=32)))
    eng = Engine.load(f, config=EngineConfig(spec=3, draft=str(f), **kw))
    assert list(eng.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=32))) == plain
    assert eng.stats.spec.windows > 0 and eng.stats.spec.accepted == eng.stats.spec.drafted


def test_the_plan_counts_a_draft_model(synth):
    """--spec with --draft PATH.gguf on CUDA: the draft's weights (in their GGUF blocks, as a
    draft loads on CUDA: memory_plan.draft_in_blocks) are a line of the target's plan,
    and its KV rows join the target's in the KV line, out of what is left; n-gram and no spec
    count nothing, and neither does the CPU's plan (its budget is host RAM)."""
    from strata.config import ModelConfig, kv_elem_bytes
    from strata.engine.memory_plan import dense_bytes, draft_bytes, make_plan
    from strata.experts.layout import expert_layouts
    from strata.model.weights import embed_on_host

    f, d = synth("qwen3moe", "Q4_K_M"), synth("qwen2moe", "Q8_0")
    mf, dmf = open_model(f), open_model(d)
    cfg, dcfg = ModelConfig.from_model(mf), ModelConfig.from_model(dmf)
    layouts = expert_layouts(mf, cfg)
    kw = dict(device="cuda", vram_budget_gib=2, ctx=512, kv_type="f16")
    plain = make_plan(mf, cfg, EngineConfig(**kw), layouts)
    ngram = make_plan(mf, cfg, EngineConfig(spec=3, draft="ngram", **kw), layouts)
    drafted = make_plan(mf, cfg, EngineConfig(spec=3, draft=str(d), **kw), layouts)
    weights = dense_bytes(dmf, dcfg, True, host_embed=embed_on_host(dcfg, "cuda")) + sum(
        ref.info.nbytes for name, ref in dmf.tensors.items() if "_exps." in name)
    assert weights < dense_bytes(dmf, dcfg, False)  # (float32 would be more)
    row = dcfg.n_kv_layers * dcfg.kv_row * kv_elem_bytes("f16")
    assert draft_bytes(EngineConfig(spec=3, draft=str(d), **kw)) == (weights, row) and row > 0
    assert plain.draft == ngram.draft == 0 and drafted.draft == weights
    assert drafted.kv == ngram.kv + 512 * row and drafted.ctx == ngram.ctx == 512
    # (against the n-gram plan: the same --spec windows' graphs, the rest of the plan alike)
    assert drafted.left == ngram.left - weights - 512 * row
    assert any(line.startswith("  draft model") and str(d) in line for line in drafted.lines())
    # (--batch 3: each sequence's drafts keep a draft cache of their own)
    batch = {k: make_plan(mf, cfg, EngineConfig(spec=3, draft=k, sequences=3, **kw), layouts)
             for k in ("ngram", str(d))}
    assert batch[str(d)].kv == batch["ngram"].kv + 3 * 512 * row
    cpu = make_plan(mf, cfg, EngineConfig(spec=3, draft=str(d), device="cpu", vram_budget_gib=2,
                                          ctx=512), layouts)
    assert cpu.draft == 0


@pytest.mark.cuda
def test_a_draft_model_keeps_the_targets_cap(synth):
    """The draft loads with --offload off inside the target's plan: torch's allocator stays
    capped at the target's budget less the CUDA context (it lifted the cap before)."""
    from strata.kernels.tuning import CUDA_CONTEXT

    f = synth("qwen3moe", "Q4_K_M")
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved()
    eng = Engine.load(f, config=EngineConfig(device="cuda", vram_budget_gib=2, spec=3,
                                             draft=str(f), expert_cache="2"))
    total = torch.cuda.get_device_properties(0).total_memory
    cap = held + (2 << 30) - CUDA_CONTEXT
    assert eng.spec is not None and cap < total
    with pytest.raises(torch.OutOfMemoryError):  # a tensor past the cap is refused
        torch.empty(cap + (64 << 20), dtype=torch.uint8, device="cuda")


@pytest.mark.cuda
def test_layer_marks_cuda_events():
    """Real CUDA events: a window's marks complete and the wait returns."""
    m = LayerMarks(4, 0, 2, torch.device("cuda"))
    x = torch.randn(256, 256, device="cuda")
    for i in range(3):
        x = x @ x
        m.after(i)
    m.wait(30)
    assert len(m.events) == 3 and all(ev.query() for ev in m.events)


@pytest.mark.parametrize("miss", ["auto", "dma"])
def test_window_accounting_with_cache_slots(synth, miss):
    """Some experts in cache slots, the misses split (auto) or all copied (dma): a window's
    pairs are all counted once, hits + CPU + copied."""
    f = synth("qwen3moe", "Q4_K_M")
    eng = load(f, spec=4, offload="on", expert_cache="6", miss=miss)
    ex = eng.model.experts
    from strata.model.transformer import Segment

    kv = eng.model.new_cache(32)
    eng.model.forward(torch.tensor([5, 6, 7]), [Segment(kv, 3)])
    st = ex.stats
    before = st.hits + st.cpu + st.streamed, st.bytes_h2d
    ex.window = True
    eng.model.forward(torch.tensor([1, 2, 3, 4, 5]), [Segment(kv, 5)], all_logits=True)
    ex.window = False
    K = eng.config.n_experts_used
    assert ((st.hits + st.cpu + st.streamed - before[0]) == 5 * K).all()
    if miss == "dma":  # every miss copied: some bytes moved
        assert st.bytes_h2d > before[1] and (st.cpu == 0).all()


@pytest.mark.cuda
@pytest.mark.parametrize("decode_step", ["graphs", "off"])
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_greedy_hybrid_same_with_spec_cuda(synth, arch, decode_step):
    """The hybrids on CUDA: plain steps on the decode step (its captured graphs update the
    recurrent state in place), windows on the forward, rolled back by copies into that same
    state; drafts replaying the answer with every third token wrong."""
    f = synth(arch, "Q4_K_M")
    kw = dict(device="cuda", offload="on", expert_cache="2", kernels="exact",
              decode_step=decode_step)
    base = Engine.load(f, config=EngineConfig(**kw))
    ids = [1, 2, 3, 4]
    plain = list(base.generate(ids, SamplingParams(temperature=0, max_tokens=32)))
    eng = Engine.load(f, config=EngineConfig(spec=3, draft="ngram", **kw))
    eng.spec = SpecDecoder(eng.model, ReplayDrafter(ids, plain), 3, timed=False)
    assert list(eng.generate(ids, SamplingParams(temperature=0, max_tokens=32))) == plain
    assert 0 < eng.stats.spec.accepted < eng.stats.spec.drafted


def test_window_copies_the_next_layers_guess_ahead(synth):
    """Spec-aware prefetch: in a verify window each layer's residual after its attention goes
    through the next layer's router, and that layer's likeliest uncached experts are admitted
    into its slots before it routes (on CUDA their copies run beside this layer's compute).
    The experts it then routes to are hits instead of copies, counted as prefetch used; the
    window's logits are the same as without; greedy text with --spec as without it."""
    from dataclasses import replace

    f = synth("qwen3moe", "Q4_K_M")
    kw = dict(offload="on", expert_cache="12", miss="dma", kernels="exact",  # (4 slots a layer)
              cpu_kernels="torch")
    got = {}
    for n in (0, 4):
        eng = load(f, spec=4, **kw)
        ex = eng.model.experts
        ex.options = replace(ex.options, window_prefetch=n)
        found, settle = [], ex.settle_ahead

        def seen(layer, routed, ex=ex, found=found, settle=settle):  # noqa: ANN001, ANN202
            # (each guessed expert the layer routes to: in its slots when it routes)
            found += [ex.cache.layers[layer].slot_of[e] >= 0
                      for e in ex._ahead.get(layer, ()) if e in routed]
            settle(layer, routed)

        ex.settle_ahead = seen
        kv = eng.model.new_cache(32)
        eng.model.forward(torch.tensor([5, 6, 7]), [Segment(kv, 3)])
        st = ex.stats
        pairs = (st.hits + st.cpu + st.streamed).sum()
        ex.window = True  # as SpecDecoder sets it around a window's forward
        logits = eng.model.forward(torch.tensor([1, 2, 3, 4, 5]), [Segment(kv, 5)],
                                   all_logits=True)
        ex.window = False
        K = eng.config.n_experts_used
        assert (st.hits + st.cpu + st.streamed).sum() - pairs == 5 * K * eng.config.n_layers
        got[n] = (logits, found, int(st.ahead_used.sum()), int(st.ahead_unused.sum()),
                  ex.guessed)
    (plain, found0, used0, unused0, _), (ahead, found4, used4, _, left) = got[0], got[4]
    assert used0 == unused0 == 0 and not found0
    assert used4 > 0 and len(found4) == used4 and all(found4)
    assert left is None  # (the last guess was taken)
    assert torch.allclose(ahead, plain, atol=1e-5, rtol=0)
    # end to end: windows with the guess copied ahead, the greedy text as without --spec
    # (drafts replaying the answer, every third wrong)
    ids = [1, 2, 3, 4]
    base = list(load(f, **kw).generate(ids, SamplingParams(temperature=0, max_tokens=24)))
    eng = load(f, spec=3, **kw)
    eng.spec = SpecDecoder(eng.model, ReplayDrafter(ids, base), 3, timed=False)
    eng.model.experts.options = replace(eng.model.experts.options, window_prefetch=4)
    assert list(eng.generate(ids, SamplingParams(temperature=0, max_tokens=24))) == base
    assert 0 < eng.stats.spec.accepted < eng.stats.spec.drafted
    assert eng.model.experts.stats.ahead_used.sum() > 0


def test_forced_acceptance_takes_the_drafts_asked_for(synth):
    """SpecDecoder.forced (strata bench-spec): a window accepts exactly that many of its drafts,
    wrong ones too (a replay a near-tie moved off the windows' answer), then the token of the row
    after them; the cache holds the context and every token given but the last."""
    f = synth("qwen3moe", "Q4_K_M")
    eng = load(f, spec=3)

    class Wrong:  # drafts no greedy decode gives: 1000 - 1 - position
        name = "wrong"

        def propose(self, context: list[int], n: int) -> list[int]:
            return [(999 - len(context) - i) % 1000 for i in range(n)]

    spec = SpecDecoder(eng.model, Wrong(), 3, timed=False, forced=2)
    kv = eng.model.new_cache(64)
    context = [1, 2, 3, 4]
    eng.model.forward(torch.tensor(context[:-1]), [Segment(kv, 3)])
    greedy_params = SamplingParams(temperature=0, max_tokens=16)
    for _ in range(4):
        drafts = Wrong().propose(context, 3)
        out = spec.step(context, kv, greedy_params, None, 16)
        assert out[:2] == drafts[:2] and len(out) == 3
        context += out
        assert kv.length == len(context) - 1
    assert spec.stats.windows == 4 and spec.stats.accepted == 8 and spec.stats.drafted == 12
    # and the token after them is the model's own at that point
    ref = eng.model.forward(torch.tensor(context[:-1]), [Segment(eng.model.new_cache(64),
                                                                 len(context) - 1)],
                            all_logits=True)
    assert int(torch.argmax(ref[-1])) == context[-1]


@pytest.mark.cuda
def test_a_windows_hits_take_the_per_pair_kernels(synth):
    """Every expert in VRAM, --kernels fused: a verify window's 6 tokens run the decode step's
    per-pair kernels (moe._decode, rounded as a decode step rounds), a prompt chunk of 6 the
    grouped kernels."""
    import strata.kernels.gpu.moe as moe_mod

    f = synth("qwen3moe", "Q4_K_M")
    eng = Engine.load(f, config=EngineConfig(device="cuda", offload="on", expert_cache="24",
                                             kernels="fused", spec=5, prompt_graphs="off"))
    ex = eng.model.experts
    assert all(ex.resident(i, 6) for i in range(eng.config.n_layers))
    calls = []
    decode = moe_mod._decode

    def spy(*a, **k):  # noqa: ANN002, ANN003, ANN202
        calls.append(a[0].shape[0])
        return decode(*a, **k)

    moe_mod._decode = spy
    try:
        kv = eng.model.new_cache(64)
        eng.model.forward(torch.tensor([1, 2, 3, 4, 5, 6]), [Segment(kv, 6)])
        assert calls == []  # (a prompt chunk: not the per-pair kernels)
        ex.window = True
        eng.model.forward(torch.tensor([7, 8, 9, 10, 11, 12]), [Segment(kv, 6)],
                          all_logits=True)
        ex.window = False
    finally:
        moe_mod._decode = decode
    assert calls == [6] * eng.config.n_layers
