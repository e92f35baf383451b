"""`strata chat`: the conversation's prompts and KV reuse, and the program through a real
pseudo-terminal (typed lines, Ctrl-C as the terminal sends it, exit codes)."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import termios
import threading
import time

import pytest
import torch

from strata.cli.chat import Conversation, Session, common_prefix
from strata.demo import demo_model
from strata.engine.generator import Engine
from strata.engine.sampling import SamplingParams
from strata.errors import StrataError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def demo():
    return Engine.load(demo_model())


@pytest.mark.parametrize("system", [None, "Answer in one line."])
def test_history_plus_template_tokens_equal_the_whole_render(demo, system):
    """What the cache holds after each answer (prompt + answer tokens), extended by the next
    prompt's new tokens, is exactly the template's render of the whole conversation; and the
    new prompt extends all of it (only the new turn's tokens run)."""
    tok, chat = demo.tokenizer, demo.chat
    conv = Conversation(chat, system, limit=4096, reply=64)
    cached: list[int] = []
    for user, reply in [("Hello", "Hi there."), ("What is Linux?", "A kernel: <b>free</b>."),
                        ("And ls?", "It lists files\nin a folder.")]:
        ids, dropped = conv.prompt(user)
        assert dropped == 0
        keep = common_prefix(cached, ids)
        assert keep == len(cached)  # the whole history is reused
        assert cached[:keep] + ids[keep:] == chat.encode(conv.messages(user), add_bos=False)
        cached = ids + tok.encode(reply, add_bos=False, parse_special=False)
        conv.turns.append((user, reply))


def test_oldest_turns_dropped_to_fit(demo):
    conv = Conversation(demo.chat, "Be brief.", limit=100, reply=20)
    conv.turns = [(f"question {i} " * 3, f"answer {i} " * 3) for i in range(4)]
    whole = len(demo.chat.encode(conv.messages("last question"), add_bos=False))
    assert whole + 20 > 100
    ids, dropped = conv.prompt("last question")
    assert 1 <= dropped < 4 and len(ids) + 20 <= 100
    assert conv.turns[-1][0].startswith("question 3")
    assert conv.messages()[0] == {"role": "system", "content": "Be brief."}
    with pytest.raises(StrataError, match="does not fit the context of 60 tokens"):
        Conversation(demo.chat, None, limit=60, reply=20).prompt("word " * 80)


def test_reused_cache_answers_as_a_fresh_one(synth):
    """Turn 2 on the cache of turn 1 (only the new tokens run) gives the tokens and logits of
    the whole conversation run from scratch."""
    engine = Engine.load(synth("qwen3moe", "Q4_K_M"))
    conv = Conversation(engine.chat, "sys", limit=512, reply=8)
    s = Session(engine, 512)
    ids, _ = conv.prompt("first")
    first = list(s.answer(ids, GREEDY))
    conv.turns.append(("first", engine.tokenizer.decode(first, skip_special=True)))
    ids2, _ = conv.prompt("second")
    second = list(s.answer(ids2, GREEDY))
    assert s.reused > 0 and s.ran < len(ids2)
    fresh = Session(engine, 512)
    assert list(fresh.answer(ids2, GREEDY)) == second and fresh.reused == 0
    kv = engine.model.new_cache(512)
    full = engine.run_prompt(ids2, kv)
    kv2 = engine.model.new_cache(512)
    engine.run_prompt(ids2[:s.reused], kv2)
    part = engine.run_prompt(ids2[s.reused:], kv2)
    torch.testing.assert_close(part, full, rtol=1e-4, atol=1e-4)


# --- the program in a pseudo-terminal ---------------------------------------------------------
class Terminal:
    """`strata chat ARGS` with a pty as its controlling terminal: what it writes is collected,
    keys are typed into it (b"\\x03" is Ctrl-C, delivered by the terminal as SIGINT)."""

    def __init__(self, args: list[str]):
        master, slave = os.openpty()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TERM": "dumb"}

        def controlling_tty() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            # (a suite started in the background by a non-interactive shell inherits SIGINT
            # ignored, and Python keeps an ignored SIGINT: the terminal's Ctrl-C would do nothing)
            signal.signal(signal.SIGINT, signal.SIG_DFL)

        self.proc = subprocess.Popen([sys.executable, "-m", "strata", "chat", *args],
                                     stdin=slave, stdout=slave, stderr=slave, env=env,
                                     preexec_fn=controlling_tty, close_fds=True)
        os.close(slave)
        self.master, self.out, self.seen = master, bytearray(), 0
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 4096)
            except OSError:
                return
            if not data:
                return
            self.out += data

    def text(self) -> str:
        return self.out.decode(errors="replace").replace("\r", "")

    def expect(self, pattern: str, timeout: float = 120.0) -> str:
        """Wait for `pattern` (a regex) in what came after the last match; return that part."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.text()
            m = re.compile(pattern).search(text, self.seen)
            if m:
                part, self.seen = text[self.seen:m.end()], m.end()
                return part
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        raise AssertionError(f"no {pattern!r} within {timeout} s; output:\n{self.text()}")

    def type(self, keys: str | bytes) -> None:
        os.write(self.master, keys.encode() if isinstance(keys, str) else keys)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(5)
        os.close(self.master)


TOK_S = r"strata: prompt \d+ new tokens \((\d+) reused\) at [\d.]+ tok/s; answer (\d+) tokens " \
        r"at [\d.]+ tok/s \((\w+)\)"


def _two_turns(t: Terminal) -> None:
    t.expect(r">>> ")
    t.type("Hello\n")
    part = t.expect(TOK_S)
    assert re.search(TOK_S, part).group(1) == "0"
    t.expect(r">>> ")
    t.type("What is Linux?\n")
    part = t.expect(TOK_S)
    m = re.search(TOK_S, part)
    assert int(m.group(1)) > 0, part  # the first turn's tokens came from the cache
    answer = part.split("What is Linux?", 1)[-1].split("strata: prompt", 1)[0]
    assert answer.strip() or m.group(2) == "0", part  # streamed text on the terminal


@pytest.mark.slow
def test_chat_in_a_terminal_synthetic(synth):
    t = Terminal([str(synth("qwen3moe", "Q4_K_M")), "--system", "Be brief.", "-n", "24",
                  "--seed", "3"])
    try:
        _two_turns(t)
        t.expect(r">>> ")
        t.type("/reset\n")
        t.expect(r"the conversation is forgotten")
        t.expect(r">>> ")
        t.type("again\n")
        part = t.expect(TOK_S)
        assert re.search(TOK_S, part).group(1) == "0"  # nothing reused after /reset
        t.expect(r">>> ")
        t.type("/exit\n")
        assert t.wait() == 0
    finally:
        t.close() if t.proc.poll() is None else None


@pytest.mark.slow
def test_chat_in_a_terminal_demo_ctrl_c():
    """The demo model (no MODEL): two turns, Ctrl-C during a long answer returns to the prompt,
    the chat goes on, /exit ends with 0; Ctrl-C at the prompt ends with 130."""
    t = Terminal(["-n", "900", "--temperature", "0"])
    try:
        _two_turns(t)
        t.expect(r">>> ")
        t.type("Write a long story about the Linux kernel and its modules.\n")
        t.expect(r"modules\.\n")  # the terminal's echo of the line (before the program reads it)
        # the answer is streaming (three words on a line of its own, not the program's "strata:"
        # lines, such as the one saying old turns were dropped): the program read the line
        t.expect(r"(?m)^(?!strata: )\W*\w+ \w+ \w+")
        t.type(b"\x03")
        part = t.expect(TOK_S)
        assert re.search(TOK_S, part).group(3) == "stopped", part
        t.expect(r">>> ")
        assert t.proc.poll() is None  # still running
        t.type("Thanks\n")
        part = t.expect(TOK_S)
        assert int(re.search(TOK_S, part).group(1)) > 0
        t.expect(r">>> ")
        t.type("/exit\n")
        assert t.wait() == 0
    finally:
        t.close() if t.proc.poll() is None else None
    t = Terminal(["-n", "8"])
    t.expect(r">>> ")
    t.type(b"\x03")
    assert t.wait() == 130


@pytest.mark.slow
def test_chat_end_of_input_exits_0(synth):
    t = Terminal([str(synth("qwen3moe", "Q4_K_M")), "-n", "4"])
    t.expect(r">>> ")
    t.type(b"\x04")  # Ctrl-D at an empty line: end of input
    assert t.wait() == 0


@pytest.mark.parametrize("flag,message", [
    ("cuda:x", "give cuda:N with N a device number"),
    ("gpu", "choose auto, cpu, cuda or cuda:N"),
    ("cuda:64", "no such device"),
])
def test_device_flag_checked(flag, message):
    from strata.cli.engine_flags import resolve_device

    with pytest.raises(StrataError, match=message):
        resolve_device(flag)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only machine's answer")
def test_cuda_0_on_a_cpu_machine_is_one_line(synth):
    r = subprocess.run([sys.executable, "-m", "strata", "chat", str(synth("qwen3moe", "Q4_K_M")),
                        "--device", "cuda:0"], capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        "strata chat: error: --device cuda:0: no such device; torch sees no CUDA device; use "
        "--device cpu")


def test_the_line_after_an_answer_stopped_in_its_prompt():
    """Ctrl-C before the first token: the line says the prompt was stopped (no rates of 0)."""
    from types import SimpleNamespace

    from strata.engine.generator import GenerationStats

    s = Session(SimpleNamespace(stats=GenerationStats(prompt_tokens=848)), 1024)
    s.finish, s.reused = "stopped", 12
    assert s.line(0) == ("strata: stopped in the prompt of 848 new tokens (12 reused); nothing "
                         "answered")
    s.engine.stats = GenerationStats(prompt_tokens=8, prompt_s=0.5, decode_tokens=3,
                                     decode_s=0.25)
    assert re.fullmatch(TOK_S, s.line(4)).groups() == ("12", "4", "stopped")
