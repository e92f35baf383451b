"""Every bad input gets one clear line naming the file and the problem, and exit code 2."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q

from strata.cli.main import main

from gguf_edit import rewrite


def run_cli(*args: str, capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = main(list(args))
    return code, capsys.readouterr().err


def expect_error(capsys, path: Path, *needles: str, culprit: Path | None = None) -> None:
    """`strata info path` fails with one line that names the culprit file (default: path)."""
    code, err = run_cli("info", str(path), capsys=capsys)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, no traceback
    assert (culprit or path).name in lines[0], err
    for n in needles:
        assert n in lines[0], err


def test_nonexistent_path(capsys, tmp_path):
    expect_error(capsys, tmp_path / "missing.gguf", "no such file")


def test_directory(capsys, tmp_path):
    expect_error(capsys, tmp_path, "is a directory")


def test_not_gguf(capsys, tmp_path):
    p = tmp_path / "notes.gguf"
    p.write_text("hello, this is not a model file at all\n" * 4)
    expect_error(capsys, p, "not a GGUF file")


def test_truncated_data(capsys, synth, tmp_path):
    src = synth("qwen3moe", "Q4_K_M")
    p = tmp_path / "cut.gguf"
    p.write_bytes(src.read_bytes()[: src.stat().st_size - 1000])
    expect_error(capsys, p, "truncated file", "tensor")


def test_truncated_header(capsys, synth, tmp_path):
    src = synth("qwen3moe", "Q4_K_M")
    p = tmp_path / "cut.gguf"
    p.write_bytes(src.read_bytes()[:3000])
    expect_error(capsys, p, "truncated file")


def test_unsupported_architecture(capsys, synth, tmp_path):
    p = rewrite(synth("qwen3moe", "Q4_K_M"), tmp_path / "gpt2.gguf",
                meta={"general.architecture": "gpt2"})
    expect_error(capsys, p, "architecture 'gpt2' is not supported", "qwen3moe", "qwen2moe", "llama")


def test_unsupported_tensor_type(capsys, synth, tmp_path):
    # TQ2_0 has the same block size as IQ2_XXS (256 values in 66 bytes): relabel one tensor
    p = rewrite(synth("qwen3moe", "IQ2_XXS"), tmp_path / "tq.gguf",
                tensor_types={"blk.1.ffn_up_exps.weight": Q.TQ2_0})
    expect_error(capsys, p, "blk.1.ffn_up_exps.weight", "TQ2_0")


def test_shape_contradicts_metadata(capsys, synth, tmp_path):
    p = rewrite(synth("qwen3moe", "Q8_0"), tmp_path / "shape.gguf",
                meta={"qwen3moe.expert_feed_forward_length": 512})
    expect_error(capsys, p, "ffn_gate_exps.weight", "shape", "[8, 256, 256]", "[8, 512, 256]")


def test_missing_tensor(capsys, synth, tmp_path):
    p = rewrite(synth("qwen3moe", "Q8_0"), tmp_path / "layers.gguf",
                meta={"qwen3moe.block_count": 4})
    expect_error(capsys, p, "blk.3.", "missing")


def split_set(synth, tmp_path: Path) -> list[Path]:
    src = synth("qwen3moe", "Q4_K_M", split_max_tensors=12)
    shards = sorted(src.parent.glob(f"{src.stem}-0000*-of-*.gguf"))
    assert len(shards) >= 3
    out = []
    for s in shards:
        out.append(tmp_path / s.name.replace(src.stem, "model"))
        shutil.copy(s, out[-1])
    return out


def test_split_missing_shard(capsys, synth, tmp_path):
    shards = split_set(synth, tmp_path)
    shards[1].unlink()
    expect_error(capsys, shards[0], "missing", shards[1].name)


def test_split_mismatched_shard(capsys, synth, tmp_path):
    shards = split_set(synth, tmp_path)
    (tmp_path / "other").mkdir()
    other = split_set(synth, tmp_path / "other")
    shutil.copy(other[0], shards[1])  # shard 1 of another set (shard no 0) in place of shard 2
    expect_error(capsys, shards[2], "different sets", "shard 0 of", culprit=shards[1])


def test_split_set_loads_from_any_shard(capsys, synth, tmp_path):
    shards = split_set(synth, tmp_path)
    for s in shards:
        code, err = run_cli("info", str(s), capsys=capsys)
        assert code == 0, err


def test_debug_shows_traceback(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_text("nope")
    r = subprocess.run([sys.executable, "-m", "strata", "--debug", "info", str(p)],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Traceback" in r.stderr
    r = subprocess.run([sys.executable, "-m", "strata", "info", str(p)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "not a GGUF file" in r.stderr
