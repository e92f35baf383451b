"""The commands end to end: generate (demo model too), logits, info, synth."""

from __future__ import annotations

import hashlib
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
    assert "top_p=1.5" in capsys.readouterr().err


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

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    ec = engine_config(p.parse_args(flags))
    assert (ec.device, ec.kv_type) == (device, kv)
