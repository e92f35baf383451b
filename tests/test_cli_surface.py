"""The command line's edges: a bad flag, file, value or environment setting is refused in one
line that names it, with exit code 2, no traceback and no file left behind (tests/test_cli.py
has the commands' normal runs). Cases marked "(passing before)" held already and are here
because test_cli.py did not cover them."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from strata.cli.main import COMMANDS, build_parser, main

CUDA = torch.cuda.is_available()


def strata(capsys, *argv) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `strata ARGV` in this process (argparse's errors exit)."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, argv, says: str) -> str:
    """`strata ARGV` exits 2, and its stderr is one line that contains `says` beside the log
    lines of what ran before (`strata: ...`), with no traceback."""
    code, _, err = strata(capsys, *argv)
    lines = [line for line in err.splitlines()
             if ": error: " in line or not line.startswith("strata: ")]
    assert code == 2, err
    assert len(lines) == 1 and ": error: " in lines[0] and says in lines[0], err
    assert "Traceback" not in err
    return err


@pytest.fixture(scope="module")
def model(synth) -> str:
    return str(synth())


@pytest.mark.parametrize(("flags", "says"), [
    (["--vram-budget", "4GB"], "--vram-budget: '4GB': give a size in GiB"),  # GB is not GiB
    (["--vram-budget", "abc"], "--vram-budget: 'abc'"),  # not a number
    (["--vram-budget", "-1"], "--vram-budget -1.0: give a size in GiB above 0"),  # (passing before)
    (["--vram-budget", "0"], "--vram-budget 0.0"),  # (passing before)
    (["--vram-budget", "nan"], "--vram-budget nan"),  # (passing before)
    (["--vram-budget", "inf"], "--vram-budget inf"),  # (passing before)
    (["--ctx", "0"], "--ctx 0: give at least 1"),  # (passing before)
    (["--ctx", "-5"], "--ctx -5: give at least 1"),  # (passing before)
    (["--ctx", str(1 << 30)], "at most 16777216"),  # (passing before)
    (["--ctx", "4", "-n", "8"], "--ctx 4: a prompt and -n 8 tokens need more"),  # before the load
    (["--threads", "0"], "--threads 0: give at least 1"),  # (passing before)
    (["--threads", "-3"], "--threads -3: give at least 1"),  # (passing before)
    (["--ring-bytes", "inf"], "--ring-bytes inf: give auto or a positive number"),  # an overflow
    (["--ring-bytes", "-5"], "--ring-bytes -5"),  # (passing before)
    (["--stream-min", "1e3"], "--stream-min 1e3"),  # (passing before)
    (["--prefill", "0"], "--prefill 0: give auto, auto:N"),  # (passing before; now pre-load)
    (["--prefill", "auto:x"], "--prefill auto:x"),  # (passing before; now before the load)
    (["--expert-cache", "-1"], "--expert-cache -1"),  # (passing before)
    (["--cpu-share", "-1"], "--cpu-share -1"),  # (passing before)
    (["--spec", "65"], "--spec 65: give 0 (off) to 64"),  # (passing before)
    (["--draft", "ngram"], "--draft ngram: drafts fill the verify windows"),  # without --spec
    (["--spec", "4", "--draft", "foo"], "--draft foo: choose"),  # (passing before; now pre-load)
    (["--spec", "4", "--draft", "missing.gguf"], "--draft missing.gguf: no such file"),  # (same)
    (["--cache-policy", "profile"], "--cache-policy profile needs --expert-profile"),  # was ignored
    (["--expert-profile", "missing.json"], "--expert-profile missing.json: no such file"),  # same
    (["--device", "mps"], "--device mps: choose auto, cpu, cuda or cuda:N"),  # (passing before)
    (["--device", "cpu:0"], "--device cpu:0: choose"),  # (passing before)
    (["--device", "cuda:-1"], "--device cuda:-1: give cuda:N"),  # (passing before)
    (["--seed", "-1"], "--seed -1: give a number from 0 to 2**64 - 1"),  # (passing before)
    (["--temperature", "-1"], "--temperature -1.0: must be >= 0"),  # was temperature=-1.0
    (["-n", "-1"], "-n -1: must be >= 0"),  # was max_tokens=-1
    (["--min-p", "2"], "--min-p 2.0: must be in [0, 1]"),  # was min_p=2.0
    (["-n", "abc"], "argument -n/--max-tokens: invalid int value: 'abc'"),  # no usage block
    (["--kv-type", "f8"], "argument --kv-type: invalid choice: 'f8'"),  # no usage block
    (["--prompt", "a", "--chat", "b"], "argument --chat: not allowed with argument --prompt"),
])
def test_generate_refuses_a_bad_engine_or_sampling_flag(model, capsys, flags, says):
    refused(capsys, ["generate", model, *flags], says)


def test_expert_profile_that_is_a_folder(model, tmp_path, capsys):
    # was an internal error (IsADirectoryError) under the offload runtime, ignored without it
    refused(capsys, ["generate", model, "--expert-profile", tmp_path], "is a folder")


@pytest.mark.skipif(CUDA, reason="a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"],
                         ids=["current", "first", "second"])  # (an id "cuda" is skipped here)
def test_cuda_is_refused_without_a_gpu(model, capsys, device):
    # --device cuda: refused before a device is logged (was: a log line "device: cuda", then
    # the engine's error); cuda:N was refused so already
    err = refused(capsys, ["generate", model, "--device", device], f"--device {device}: ")
    assert "strata: device:" not in err


@pytest.mark.skipif(CUDA, reason="a machine without CUDA")
def test_serve_refuses_cuda_without_a_gpu(model, capsys):
    # was accepted: the server started and stayed up with an engine that could not load
    refused(capsys, ["serve", model, "--print-config", "--device", "cuda"],
            "--device cuda: torch sees no CUDA device; use --device cpu")


def test_vram_budget_spellings_and_unused_flags(model, capsys):
    # 4G and 4GiB read as GiB; the offload runtime's flags on the reference path are named
    for spelling in ("4", "4G", "4GiB", "4.5g"):
        code, _, err = strata(capsys, "generate", model, "--vram-budget", spelling, "-n", "1",
                           "--offload", "off")
        assert code == 0, err
        assert f"--vram-budget {float(spelling.rstrip('GiBg'))}: no effect: the offload " \
               "runtime is off (--offload off" in err


def test_serve_takes_the_same_budget_spellings(model, capsys):
    # the server's config reads the engine flags' types
    code, out, err = strata(capsys, "serve", model, "--print-config", "--vram-budget", "4GiB")
    assert code == 0 and '"vram-budget": 4.0' in out, err


def test_ctx_below_the_prompt_and_answer(model, capsys):
    # was ignored on the CPU (the cache grew past it); the plan refuses it on CUDA
    refused(capsys, ["generate", model, "--ctx", "8", "-n", "4"],
            "--ctx 8: the prompt's 6 tokens and -n 4 need 10 tokens of KV cache")


@pytest.mark.parametrize(("argv", "says"), [
    (["--seed", "-1"], "--seed -1"),  # was an internal error (numpy) after the header
    (["--seed", str(1 << 70)], "--seed 1180591620717411303424"),  # was, after the whole write
    (["--layers", "100000000"], "--layers 100000000: give 1 to 1024"),  # planned for minutes
    (["--split-max-size", "-5"], "--split-max-size '-5'"),  # wrote one file a tensor
    (["--split-max-size", "inf"], "--split-max-size 'inf'"),  # an internal error (overflow)
    (["--split-max-tensors", "-1"], "--split-max-tensors -1"),  # (passing before)
    (["--preset", "nope"], "--preset nope: unknown preset"),  # (passing before)
    (["--quant", "NOPE"], "--quant NOPE: unknown recipe"),  # (passing before)
    (["--quant", "Q4_K_M,blk.*=NOPE"], "must be PATTERN=TYPE"),  # (passing before)
    (["--arch", "nope"], "argument --arch: invalid choice: 'nope'"),  # no usage block
    (["--preset", "30b-a3b", "--arch", "llama"], "--preset 30b-a3b is a qwen3moe model"),
])
def test_synth_refuses_and_writes_nothing(tmp_path, capsys, argv, says):
    out = tmp_path / "m.gguf"
    refused(capsys, ["synth", out, *argv], says)
    assert list(tmp_path.iterdir()) == []


def test_synth_keeps_an_existing_split_set(tmp_path, capsys):
    # a split set's shards were overwritten without --force (only OUT itself was checked)
    shard = tmp_path / "m-00001-of-00002.gguf"
    shard.write_bytes(b"mine")
    refused(capsys, ["synth", tmp_path / "m.gguf"], f"{shard} exists; pass --force")
    assert shard.read_bytes() == b"mine"


def test_synth_force_leaves_only_the_new_model(tmp_path, capsys):
    # --force over a single file with a split set, then over that set with one file: the files
    # the new model did not write over went on lying beside it (and the balance line read them)
    out, names = tmp_path / "m.gguf", lambda: sorted(p.name for p in tmp_path.iterdir())
    assert strata(capsys, "synth", out, "--preset", "tiny")[0] == 0
    assert strata(capsys, "synth", out, "--preset", "tiny", "--split-max-tensors", "20",
                  "--force")[0] == 0
    assert names() == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    assert strata(capsys, "synth", out, "--preset", "tiny", "--force")[0] == 0
    assert names() == ["m.gguf"]
    assert strata(capsys, "info", out)[0] == 0


def test_synth_output_paths(tmp_path, capsys):
    # (passing before) a missing folder, a name without .gguf, a FIFO: refused, nothing written
    refused(capsys, ["synth", tmp_path / "no" / "m.gguf"], "the folder")
    refused(capsys, ["synth", tmp_path / "m.txt"], "must end in .gguf")
    os.mkfifo(tmp_path / "f.gguf")
    refused(capsys, ["synth", tmp_path / "f.gguf", "--force"], "not a regular file")
    assert [p.name for p in tmp_path.iterdir()] == ["f.gguf"]


@pytest.mark.parametrize("command", [
    ["logits", "MODEL", "--tokens", "1,2", "--out"],
    ["profile", "MODEL", "--prompts", "PROMPTS", "--out"],
    ["bench", "MODEL", "-p", "4", "-n", "2", "-r", "1", "--json"],
    ["bench-spec", "MODEL", "--spec", "2", "-p", "4", "-n", "4", "-r", "1", "--json"],
    ["bench-serve", "--url", "http://127.0.0.1:1", "--json"],
])
def test_an_output_that_is_not_a_regular_file(model, tmp_path, capsys, command):
    # a FIFO (or /dev/null) was replaced by the finished write's rename: refused before the run
    (tmp_path / "prompts.txt").write_text("one prompt")
    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    argv = [model if a == "MODEL" else tmp_path / "prompts.txt" if a == "PROMPTS" else a
            for a in command]
    refused(capsys, [*argv, fifo], f"{fifo}: not a regular file")
    assert fifo.is_fifo() and sorted(p.name for p in tmp_path.iterdir()) == ["out", "prompts.txt"]


@pytest.mark.parametrize("flag", ["--out", "--json"])
def test_an_output_in_a_missing_folder_or_a_folder(model, tmp_path, capsys, flag):
    # (passing before) refused before the model loads
    command = ["logits", model, "--tokens", "1"] if flag == "--out" else \
        ["bench", model, "-p", "4", "-n", "2"]
    refused(capsys, [*command, flag, tmp_path / "no" / "x"], "the folder")
    refused(capsys, [*command, flag, tmp_path], "is a folder")
    assert list(tmp_path.iterdir()) == []


def test_logits_refusals_name_their_flag(model, tmp_path, capsys):
    out = tmp_path / "l.npy"
    # was "the prompt is empty"
    refused(capsys, ["logits", model, "--text", "", "--out", out],
            "--text: the text gives no tokens")
    # was ignored on the CPU
    refused(capsys, ["logits", model, "--tokens", "1,2,3", "--ctx", "2", "--out", out],
            "--ctx 2: the 3 tokens of --tokens need 3")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("argv", "says"), [
    (["--ctx", "0"], "--ctx 0: give at least 4"),  # was read as 512
    (["--chunks", "0"], "--chunks 0: give at least 1"),  # was "--ctx 512: ... fewer than one chunk"
    (["--chunks", "-5"], "--chunks -5"),  # was read as all
    (["--file", "missing.txt"], "--file missing.txt: cannot read it as UTF-8 text (No such file"),
    (["--spec", "2"], "--spec 2: speculative decoding serves"),  # (passing before)
])
def test_perplexity_refusals(model, tmp_path, capsys, argv, says):
    text = tmp_path / "t.txt"
    text.write_text("some words to score")
    refused(capsys, ["perplexity", model, "--file", text, *argv], says)


@pytest.mark.parametrize(("argv", "says"), [
    (["--seed", "-1"], "--seed -1"),  # was an internal error after the ceilings were measured
    (["--sweep-vram", "nan"], "--sweep-vram 'nan': give sizes in GiB above 0"),  # internal error
    (["--sweep-vram", "inf"], "--sweep-vram 'inf'"),  # an internal error
    (["--sweep-vram", "4GB"], "--sweep-vram '4GB'"),  # (passing before) not GiB
    (["--ctx", "2"], "--ctx 2: the longest test's depth, prompt and decode tokens need 4"),  # ran
    (["--plot", "x.png"], "--plot x.png: draws the curve of --sweep-vram"),  # was ignored
    (["-r", "0"], "--runs must be >= 1"),  # (passing before)
    (["-p", "-1"], "-p '-1'"),  # (passing before)
])
def test_bench_refusals(model, capsys, argv, says):
    refused(capsys, ["bench", model, "-p", "4", "-n", "2", *argv], says)


@pytest.mark.parametrize(("argv", "says"), [
    (["--seed", "-1"], "--seed -1"),  # was an internal error after the load
    (["-p", "0"], "-p 0: give at least 1 prompt token"),  # now before the load
    (["-n", "1"], "-n 1: give at least 2 tokens to decode"),  # now before the load
    (["--accept", "5"], "--accept 5: give 0 .. --spec 2"),  # (passing before; now pre-load)
    (["--ctx", "8"], "--ctx 8: -p 4 and -n 8 need 12"),  # was ignored on the CPU
])
def test_bench_spec_refusals(model, capsys, argv, says):
    refused(capsys, ["bench-spec", model, "--spec", "2", "-p", "4", "-n", "8", *argv], says)


def test_bench_spec_past_the_context(model, capsys):
    # was an internal error: 300 GB asked of the allocator
    refused(capsys, ["bench-spec", model, "--spec", "2", "-p", "99999999"],
            "-p 99999999 and -n 64: 100000063 tokens exceed the model's context of 4096")


@pytest.mark.parametrize(("argv", "says"), [
    (["--seed", "-1"], "--seed -1"),  # was an internal error (numpy)
    (["--prompt-len", "-1"], "--prompt-len -1: give at least 1"),  # an internal error
    (["--prompt-len", "0"], "--prompt-len 0: give at least 1"),  # was "the prompt is empty"
    (["--max-kl", "nan"], "--max-kl nan: give a tolerance of 0 or more"),  # always DIFFERENT
    (["--max-kl", "-1"], "--max-kl -1.0"),  # always DIFFERENT
    (["--decode", "-1"], "--decode -1: give 0 or more"),  # now before the loads
    (["--b", "--spec 2"], "--b '--spec 2': --spec: strata check compares logits"),  # was ignored
    (["--b", "--threads abc"], "--b '--threads abc': argument --threads"),  # (passing before)
])
def test_check_refusals(model, capsys, argv, says):
    refused(capsys, ["check", model, "--b", "--kv-type f16", *argv], says)


def test_check_prompt_past_the_context(model, capsys):
    # drew 10^8 random ids (minutes) before the prompt was found too long
    refused(capsys, ["check", model, "--b", "--kv-type f16", "--prompt-len", "99999999"],
            "--prompt-len 99999999: the model's context is 4096 tokens")


@pytest.mark.parametrize(("argv", "says"), [
    (["--seed", "-1"], "--seed -1"),  # was sent on to numpy
    (["--warmup", "-1"], "--warmup -1: give 0 (none) or more"),  # was taken as one request
    (["-c", "0"], "--concurrency '0'"),  # (passing before)
    (["--temperature", "nan"], "--temperature nan"),  # (passing before)
])
def test_bench_serve_refuses_before_it_connects(capsys, argv, says):
    refused(capsys, ["bench-serve", "--url", "http://127.0.0.1:1", *argv], says)


def test_chat_needs_room_for_an_answer(model, capsys):
    # -n 0: every answer empty; refused before the load
    refused(capsys, ["chat", model, "-n", "0"], "-n 0: give at least 1 token an answer")


@pytest.mark.parametrize(("name", "value"), [
    ("STRATA_WAIT_TIMEOUT", "abc"),  # was a traceback, at the import of strata.runtime.waits
    ("STRATA_WAIT_TIMEOUT", "0"),  # every bounded wait would time out at once
    ("STRATA_WAIT_TIMEOUT", "nan"),  # no wait would ever time out
    ("STRATA_CPU_SHARE_POOL", "zzz"),  # was refused only after the load, and only on CUDA
])
def test_a_bad_environment_setting(model, capsys, monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    refused(capsys, ["generate", model], f"strata generate: error: {name}={value}: give")


def test_a_bad_environment_setting_before_any_import(model):
    # in a fresh process: the import that read it raised a traceback, exit code 1
    r = subprocess.run([sys.executable, "-m", "strata", "info", model], capture_output=True,
                       text=True, env={**os.environ, "STRATA_WAIT_TIMEOUT": "abc"}, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.startswith("strata info: error: STRATA_WAIT_TIMEOUT=abc") and \
        r.stderr.count("\n") == 1


def test_an_unreadable_model(model, capsys, monkeypatch):
    # a file this process may not read (chmod 000, not root): was an internal error, exit 1
    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr("strata.cli.info.open_model", denied)
    refused(capsys, ["info", model], f"{model}: Permission denied; check its permissions")


@pytest.mark.parametrize("path", ["missing.gguf", "DIR", "/dev/null"])
def test_model_paths(tmp_path, capsys, path):
    # (passing before) a missing file, a folder, a device
    refused(capsys, ["info", tmp_path if path == "DIR" else path], "")


def test_help_lists_every_command_and_one_line_errors(capsys):
    help_text = build_parser().format_help()
    assert all(f"    {name}" in help_text for name in COMMANDS)  # every subcommand, by name
    # no command: one line (was argparse's usage block)
    refused(capsys, [], "strata: error: the following arguments are required: COMMAND")


def test_help_tells_what_the_code_does():
    # profile's --prompts claimed "one JSON string a line", which was never read
    sub = next(a for a in build_parser("profile")._actions
               if isinstance(a, argparse._SubParsersAction))
    assert "JSON string" not in " ".join(sub.choices["profile"].format_help().split())
    for command in COMMANDS:  # each command's --help builds, with its own usage line
        p = build_parser(command)
        sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        assert f"usage: strata {command}" in sub.choices[command].format_help()


def _until(stream, text: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    seen = ""
    while text not in seen and time.monotonic() < end:
        seen += stream.readline()
    assert text in seen, seen


def test_ctrl_c_during_generation(model):
    # (passing before) SIGINT as the text starts to stream: exit code 130, no traceback
    p = subprocess.Popen([sys.executable, "-m", "strata", "generate", model, "-n", "4000",
                          "--temperature", "0", "--device", "cpu"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert p.stdout.read(1) == "O"  # ("Once upon a time", written before the first token)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err


def test_ctrl_c_at_the_chat_prompt(model):
    # (passing before) README: at the prompt Ctrl-C ends the program with exit code 130
    p = subprocess.Popen([sys.executable, "-m", "strata", "chat", model],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    _until(p.stderr, "/reset forgets the conversation")
    time.sleep(0.3)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and "Traceback" not in err, err


def test_an_unknown_flag_is_its_commands_error(model, capsys):
    # a flag no parser knows: the command's error and its --help (it was strata's own)
    err = refused(capsys, ["bench", model, "--nope"], "unrecognized arguments: --nope")
    assert err.startswith("strata bench: error:") and "see strata bench --help" in err, err
