"""Progress on stderr (strata/progress.py): bars in place on a terminal, plain lines otherwise; the
arena fill in GiB and GiB/s, a long prompt's tokens, live tok/s in `strata generate`, checked
with fake streams and through a real pseudo-terminal, and without one."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time

import pytest

from strata.progress import LiveRate, LoadStages, Meter


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_meter_on_a_terminal_redraws_in_place_and_erases():
    err = FakeTerminal()
    m = Meter("expert arena", 4 << 30, "bytes", stream=err, delay=0)
    for i in range(1, 5):
        m.update(i << 30)
        time.sleep(0.11)  # past the redraw interval
    m.close()
    out = err.getvalue()
    assert out.count("\r\x1b[K") >= 5 and out.endswith("\r\x1b[K")
    assert re.search(r"expert arena  4\.00 / 4\.00 GiB  \[#{24}\] 100%  [\d.]+ GiB/s", out), out
    assert "\n" not in out


def test_meter_without_a_terminal_prints_one_line_for_long_work_only():
    err = io.StringIO()
    m = Meter("prompt", 300, "tokens", stream=err, delay=0)
    m.update(150)
    m.update(300)
    m.close()
    assert re.fullmatch(r"strata: prompt: 300 tokens in [\d.]+ s \([\d.]+ tok/s\)\n",
                        err.getvalue())
    quiet = io.StringIO()
    m = Meter("prompt", 300, "tokens", stream=quiet, delay=60)
    m.update(300)
    m.close()
    assert quiet.getvalue() == ""


def test_load_stages():
    err = io.StringIO()
    stages = LoadStages(err)
    for stage, frac in [("reading the model file", 0), ("weights", 0.1), ("weights", 0.5),
                        ("ready", 1)]:
        stages(stage, frac)
    stages.close()
    lines = err.getvalue().splitlines()
    assert [re.sub(r" \([\d.]+ s\)", "", x) for x in lines] == [
        "strata: loading: reading the model file", "strata: loading: weights",
        "strata: loading: ready"]
    term = FakeTerminal()
    stages = LoadStages(term)
    stages("weights", 0.1)
    stages.close()
    assert term.getvalue().startswith("\r\x1b[Kloading: weights (10%")
    assert term.getvalue().endswith("\r\x1b[K") and "\n" not in term.getvalue()


def test_live_rate_where_only_stderr_is_a_terminal():
    out, err = io.StringIO(), FakeTerminal()
    live = LiveRate(out, err, delay=0)
    for i, piece in enumerate(["Once", " upon", " a\ntime"], 1):
        live.text(piece, i)
        time.sleep(0.11)
    live.close()
    assert out.getvalue() == "Once upon a\ntime"  # stdout gets the text alone
    assert re.search(r"generating \[3 tokens, [\d.]+ tok/s\]", err.getvalue())
    assert err.getvalue().endswith("\r\x1b[K")


def _run_in_pty(args: list[str], timeout: float = 240) -> str:
    master, slave = os.openpty()
    env = dict(os.environ, OMP_NUM_THREADS="1", COLUMNS="120", TERM="xterm")
    proc = subprocess.Popen([sys.executable, "-m", "strata", *args], stdin=slave, stdout=slave,
                            stderr=slave, env=env, close_fds=True)
    os.close(slave)
    data = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            data += chunk
        assert proc.wait(30) == 0, data.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    return data.decode(errors="replace")


# (long enough that the prompt takes over the meters' 0.5 s on a fast CPU: ~400 tokens)
PROMPT = "The kernel schedules processes and manages memory for every program. " * 32


@pytest.mark.slow
def test_generate_in_a_terminal_shows_load_prompt_and_live_tok_s():
    out = _run_in_pty(["generate", "--prompt", PROMPT, "--prefill", "8", "-n", "48",
                       "--seed", "2", "--temperature", "0.8"])
    assert "\r\x1b[Kloading: weights" in out  # the load stage, in place
    assert re.search(r"\r\x1b\[Kprompt  \d+ / \d+ tokens  \[[#.]{24}\] +\d+%  [\d.]+ tok/s",
                     out), out  # the long prompt's chunks, in place
    assert re.search(r"\x1b7  \x1b\[2m\[\d+ tokens, [\d.]+ tok/s\]\x1b\[0m\x1b8", out), out
    assert re.search(r"strata: loaded in [\d.]+ s; prompt \d+ tokens at [\d.]+ tok/s; "
                     r"generated \d+ tokens at [\d.]+ tok/s \((length|stop)\)", out)
    assert "strata: loading:" not in out  # no plain stage lines on a terminal


@pytest.mark.slow
def test_generate_without_a_terminal_writes_plain_lines():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "strata", "generate", "--prompt", PROMPT,
                        "--prefill", "8", "-n", "8", "--seed", "2"], capture_output=True,
                       text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "\x1b" not in r.stdout + r.stderr and "\r" not in r.stdout + r.stderr
    for stage in ("reading the model file", "tokenizer and chat template", "weights", "ready"):
        assert re.search(rf"^strata: loading: {stage} \([\d.]+ s\)$", r.stderr, re.M), r.stderr
    assert re.search(r"^strata: prompt: \d+ tokens in [\d.]+ s \([\d.]+ tok/s\)$", r.stderr,
                     re.M), r.stderr
    assert re.search(r"^strata: loaded in .* generated \d+ tokens at [\d.]+ tok/s "
                     r"\((length|stop)\)$", r.stderr, re.M)


def test_arena_fill_reports_gib_and_gib_s(synth, monkeypatch):
    from strata.experts import arena as arena_mod

    seen = []

    class Spy(Meter):
        def __init__(self, *a, **k):
            super().__init__(*a, **k, stream=FakeTerminal(), delay=0)
            seen.append(self)

    monkeypatch.setattr(arena_mod, "Meter", Spy)
    from strata.config import EngineConfig
    from strata.engine.generator import Engine

    Engine.load(synth("qwen3moe", "Q4_K_M"), config=EngineConfig(offload="on"))
    assert not seen  # the arena's bar is for a terminal with log lines on: off here
    from strata.config import ModelConfig
    from strata.experts.arena import Arena
    from strata.experts.layout import expert_layouts
    from strata.gguf import open_model

    mf = open_model(synth("qwen3moe", "Q4_K_M"))
    cfg = ModelConfig.from_model(mf)
    a = Arena(expert_layouts(mf, cfg), cfg.n_experts, pin=False)
    a.fill(mf, progress=True)
    (bar,) = seen
    assert bar.done == a.nbytes and bar.unit == "bytes"
    assert re.search(r"GiB  \[#{24}\] 100%  [\d.]+ GiB/s", bar.line())


@pytest.mark.parametrize("prefill", ["off", "8"])
def test_a_prompt_moves_the_bar_layer_by_layer(synth, monkeypatch, prefill):
    """In one chunk or several, the prompt's bar moves after every layer and the head of each
    pass: (i + 1) / (layers + 1) of the chunk's tokens, up to the whole prompt; the logits are
    those of the same prompt run without a bar."""
    import torch

    from strata.config import EngineConfig
    from strata.engine import generator

    seen = []

    class Spy(Meter):
        def __init__(self, *a, **k):
            super().__init__(*a, **k, stream=FakeTerminal(), delay=0)
            seen.append(self)
            self.done_at: list[float] = []

        def update(self, done: float) -> None:
            self.done_at.append(done)
            super().update(done)

    monkeypatch.setattr(generator, "Meter", Spy)
    engine = generator.Engine.load(synth("qwen3moe", "Q4_K_M"),
                                   config=EngineConfig(prefill=prefill))
    ids = list(range(5, 29))  # 24 tokens: one chunk, or three of 8
    plain = engine.run_prompt(ids, engine.model.new_cache(64))
    assert not seen  # no bar unless the CLI asks for one
    engine.show_progress = True
    shown = engine.run_prompt(ids, engine.model.new_cache(64))
    torch.testing.assert_close(shown, plain, rtol=0, atol=0)
    (bar,) = seen
    n, chunks = len(engine.model.layers), 1 if prefill == "off" else 3
    assert len(bar.done_at) == chunks * (n + 1) + chunks  # each layer, the head, each chunk
    assert bar.done_at == sorted(bar.done_at) and bar.done_at[-1] == len(ids)
    step = len(ids) / chunks
    assert bar.done_at[0] == pytest.approx(step / (n + 1))
    assert re.search(r"prompt  24 / 24 tokens  \[#{24}\] 100%", bar.line())


def test_a_stopped_prompt_erases_its_bar(synth, monkeypatch):
    """Ctrl-C inside a prompt's forward pass (strata chat goes on after it): the bar is erased,
    no summary line is written, and the interrupt reaches the caller."""
    from strata.engine import generator

    bars = []

    class Stops(Meter):
        def __init__(self, *a, **k):
            super().__init__(*a, **k, stream=FakeTerminal(), delay=0)
            bars.append(self)

        def update(self, done: float) -> None:
            super().update(done)
            if done >= 6:
                raise KeyboardInterrupt

    monkeypatch.setattr(generator, "Meter", Stops)
    engine = generator.Engine.load(synth("qwen3moe", "Q4_K_M"))
    engine.show_progress = True
    with pytest.raises(KeyboardInterrupt):
        engine.run_prompt(list(range(5, 29)), engine.model.new_cache(64))
    (bar,) = bars
    text = bar.stream.getvalue()
    assert "prompt  " in text and text.endswith("\r\x1b[K") and "strata: prompt" not in text
