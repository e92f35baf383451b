"""The commands end to end: generate (demo model too), logits, info, synth."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys

import numpy as np
import pytest

from strata.cli.main import main
from strata.gguf import open_model


def test_generate_demo_model_streams_text_and_summary(capfd):
    assert main(["generate", "--prompt", "The file system", "-n", "12", "--seed", "3"]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("The file system") and len(out) > len("The file system\n")
    assert "the demo model" in err and "trained" in err
    assert "loaded in" in err and "prompt" in err and "tok/s" in err
    assert main(["generate", "--chat", "hi", "-n", "3", "--temperature", "0"]) == 0


def test_demo_model_greedy_text_is_english(capfd):
    """The trained demo model's greedy continuation is made of English words: most of its words
    are in the prompt's language (a random model's are not; checked on the synthetic one)."""
    from strata.demo import demo_model

    words = set("the a an of to in is are be it that this for with as on by or and not can "
                 "file files system command line program user directory which when if each "
                 "from use used see also name value default option options set".split())
    assert main(["generate", str(demo_model()), "--prompt", "The command", "-n", "40",
                 "--temperature", "0"]) == 0
    text = capfd.readouterr().out
    tokens = [w.strip(".,;:()\"'").lower() for w in text.split()]
    assert len(tokens) >= 15
    assert sum(t in words for t in tokens) / len(tokens) > 0.3, text


def test_generate_is_deterministic_per_seed(synth, capfd):
    path = str(synth("qwen3moe", "Q4_K_M"))
    outs = []
    for seed in (7, 7, 8):
        assert main(["generate", path, "--prompt", "Once", "-n", "12", "--seed", str(seed)]) == 0
        outs.append(capfd.readouterr().out)
    assert outs[0] == outs[1] and outs[0] != outs[2]


def test_generate_rejects_bad_sampling(synth, capsys):
    assert main(["generate", str(synth()), "--top-p", "1.5"]) == 2
    assert "--top-p 1.5: must be in (0, 1]" in capsys.readouterr().err  # (the flag, named)


def test_logits_writes_one_row_per_position(synth, tmp_path):
    out = tmp_path / "l.npy"
    assert main(["logits", str(synth()), "--tokens", "1,2,3,4", "--out", str(out)]) == 0
    arr = np.load(out)
    assert arr.shape == (4, 1024) and arr.dtype == np.float32 and np.isfinite(arr).all()


@pytest.mark.parametrize("tokens,msg", [("1,x", "comma-separated integers"),
                                        ("1,99999", "outside the vocabulary")])
def test_logits_rejects_bad_tokens(synth, tmp_path, capsys, tokens, msg):
    assert main(["logits", str(synth()), "--tokens", tokens, "--out", str(tmp_path / "x")]) == 2
    assert msg in capsys.readouterr().err


def test_info_lists_types_per_layer(synth, capsys):
    assert main(["info", str(synth("qwen3moe", "IQ2_XS-MIX"))]) == 0
    out = capsys.readouterr().out
    assert "qwen3moe: 3 layers" in out and "IQ2_XS" in out and "IQ1_M" in out


def test_synth_names_the_file_type(synth):
    """general.file_type as llama.cpp numbers its types (llama-bench names the model by it):
    IQ2_XS 20, Q4_K_M 15; none for ALL-TYPES."""
    from gguf import GGUFReader

    for recipe, ftype in (("IQ2_XS", 20), ("Q4_K_M", 15), ("ALL-TYPES", None)):
        field = GGUFReader(synth("qwen3moe", recipe)).fields.get("general.file_type")
        assert (field.contents() if field else None) == ftype, recipe


def test_synth_is_deterministic_streamed_and_splits(tmp_path, capsys):
    def digest(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()

    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    for path, seed in ((a, "5"), (b, "5"), (c, "6")):
        assert main(["synth", str(path), "--arch", "qwen2moe", "--quant", "Q4_K_M",
                     "--seed", seed]) == 0
    err = capsys.readouterr().err
    assert "routing balance" in err and "0 of 18 experts unused" in err
    assert digest(a) == digest(b) != digest(c)
    assert main(["synth", str(a), "--arch", "qwen2moe"]) == 2  # exists, no --force
    split, whole = tmp_path / "s.gguf", tmp_path / "w.gguf"
    assert main(["synth", str(split), "--split-max-tensors", "10"]) == 0
    assert main(["synth", str(whole)]) == 0
    shards = sorted(tmp_path.glob("s-0000*-of-*.gguf"))
    assert len(shards) > 2
    parts, one = open_model(shards[-1]), open_model(whole)
    assert list(parts.tensors) == list(one.tensors)
    for name in ("token_embd.weight", "blk.2.ffn_down_exps.weight"):
        assert np.array_equal(parts.tensors[name].data(), one.tensors[name].data())


def test_help_lists_every_command():
    r = subprocess.run([sys.executable, "-m", "strata", "--help"], capture_output=True, text=True)
    for cmd in ("generate", "logits", "info", "synth", "profile", "bench"):
        assert cmd in r.stdout


def test_log_lines_follow_stderr_when_it_is_swapped(monkeypatch):
    """The CLI's handler writes to sys.stderr as it is at each line: a stream swapped in and
    closed (pytest's capture does this between tests) takes no later line and raises nothing."""
    import io
    import logging

    from strata.cli.main import setup_logging

    first, second = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    setup_logging(False)
    log = logging.getLogger("strata.test")
    log.info("one")
    first.close()
    monkeypatch.setattr(sys, "stderr", second)
    monkeypatch.setattr(logging, "raiseExceptions", True)
    log.info("two")
    assert second.getvalue() == "strata: two\n"


@pytest.mark.parametrize(("flags", "device", "kv"), [
    ([], "cpu", "f32"),  # auto: the reference's float32 on the CPU
    (["--device", "cuda"], "cuda", "f16"),  # auto: f16 on CUDA (as llama.cpp keeps it)
    (["--device", "cuda", "--kv-type", "f32"], "cuda", "f32"),
    (["--device", "cpu", "--kv-type", "q8_0"], "cpu", "q8_0"),
])
def test_kv_type_auto_follows_the_device(flags, device, kv, monkeypatch):
    import argparse

    import torch

    from strata.cli.engine_flags import add_engine_arguments, engine_config

    # (no GPU for auto; --device cuda is refused where torch sees none: one seen for those)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: device == "cuda")
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    ec = engine_config(p.parse_args(flags))
    assert (ec.device, ec.kv_type) == (device, kv)


def _option_helps():
    """(command, flag, default, help) for every option of every command that takes a value
    (serve's flags read a "not given" marker: their defaults are ServeConfig's and the engine
    flags')."""
    import argparse
    from dataclasses import fields

    from strata.cli.main import COMMANDS, build_parser
    from strata.server.config import ENGINE_DEFAULTS, ServeConfig

    serve = {f.name: f.default for f in fields(ServeConfig)} | ENGINE_DEFAULTS
    for command in COMMANDS:
        parser = build_parser(command)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        for a in sub.choices[command]._actions:
            if not a.option_strings or a.nargs == 0 or a.dest in ("help", "debug"):
                continue  # switches, --help
            default = serve.get(a.dest) if command == "serve" else a.default
            yield command, a.option_strings[-1], default, " ".join((a.help or "").split())


def _says_default(default, text: str) -> bool:
    """The help says its default: in words after "default", or as a parenthesis that opens with
    it, "(4096)", "(auto: ...)", "(lfu, ...)", "(1; 0: off)" (numbers by value: "(1e-4)")."""
    if re.search(r"\bdefault\b", text) or re.search(r"\(" + re.escape(str(default)) + r"[;:,)]",
                                                    text):
        return True
    for word in re.findall(r"\(([^\s;:,()]+)(?=[;:,)])", text):
        if word == str(default):
            return True
        try:
            if float(word) == float(default):
                return True
        except (TypeError, ValueError):
            pass
    return False


def test_every_flag_says_what_it_does_and_its_default():
    """Every option that takes a value has a help text; one with a default says it; and no help
    quotes a measurement (the figures live in docs/ and bench/)."""
    checked, missing = 0, []
    for command, flag, default, text in _option_helps():
        assert len(text) > 10, f"strata {command} {flag}: no help text"
        assert not re.search(r"\d ?(%|(tok/s|GiB/s|GB/s|ms|us|µs)\b)|\b(faster|slower)\b",
                             text), f"strata {command} {flag}: a measurement in --help: {text}"
        if default is not None:
            checked += 1
            if not _says_default(default, text):
                missing.append(f"strata {command} {flag} (default {default!r}): {text}")
    assert checked > 60
    assert not missing, "\n".join(missing)


@pytest.mark.cuda
def test_generate_on_a_named_cuda_device():
    """--device cuda:N: the engine loads there, says so in its log, and generates."""
    r = subprocess.run([sys.executable, "-m", "strata", "generate", "--device", "cuda:0",
                        "--prompt", "The Linux kernel", "-n", "8", "--seed", "1"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "strata: device: cuda:0 (--device cuda:0)" in r.stderr.splitlines(), r.stderr
    assert r.stdout.strip().startswith("The Linux kernel") and len(r.stdout.split()) > 3
