"""scripts/llama_side_by_side.py: -ncmoe fitted to a budget, and the two engines' llama-bench
matrices joined test by test."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from strata.cli.main import main

_spec = importlib.util.spec_from_file_location(
    "side_by_side", Path(__file__).resolve().parents[1] / "scripts" / "llama_side_by_side.py")
sbs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sbs)


def test_ncmoe_fits_the_budget(synth) -> None:
    """More budget never puts more layers' experts on the CPU; a budget that holds the whole
    file, its KV cache and the overhead needs none, one that holds nothing needs them all."""
    from strata.config import ModelConfig
    from strata.gguf import open_model

    path = str(synth("qwen3moe", "Q4_K_M"))
    mf = open_model(path)
    n_layers = ModelConfig.from_model(mf).n_layers
    gib = 1 << 30
    assert sbs.ncmoe(path, (mf.nbytes + sbs.OVERHEAD + (64 << 20)) / gib, 256) == 0
    assert sbs.ncmoe(path, 1e-6, 256) == n_layers
    per = sbs.expert_bytes(mf, n_layers)
    assert all(b > 0 for b in per) and sum(per) < mf.nbytes
    budgets = [(sbs.OVERHEAD + mf.nbytes - sum(per[:k])) / gib for k in range(n_layers + 1)]
    got = [sbs.ncmoe(path, b + 1 / gib, 0) for b in budgets]  # (ctx 0: no KV cache)
    assert got == list(range(n_layers + 1))


def test_table_joins_the_tests(synth, tmp_path, capsys) -> None:
    out = tmp_path / "s.json"
    assert main(["bench", str(synth("qwen3moe", "Q4_K_M")), "-p", "16", "-n", "4", "-d", "0,16",
                 "-r", "1", "--json", str(out)]) == 0
    capsys.readouterr()
    ours = {r["test"]: r for r in json.loads(out.read_text())["results"]}
    # llama-bench -o json's records: one per test, n_prompt / n_gen / n_depth and avg_ts
    llama = [{"n_prompt": 16, "n_gen": 0, "n_depth": 0, "avg_ts": 100.0},
             {"n_prompt": 0, "n_gen": 4, "n_depth": 0, "avg_ts": 10.0},
             {"n_prompt": 0, "n_gen": 4, "n_depth": 16, "avg_ts": 5.0},
             {"n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 7.0}]
    lpath = tmp_path / "l.json"
    lpath.write_text(json.dumps(llama))
    text = sbs.table(str(out), str(lpath), "tiny", 2048.0, 1024.0, 3)
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| test", "| ---"))}
    assert set(rows) == {"pp16", "tg4", "tg4 @ d16", "pp512"}
    assert f"{ours['pp16']['prompt_tok_s'] / 100.0:.2f} |" in rows["pp16"]
    assert f"{ours['tg4 @ d16']['decode_tok_s'] / 5.0:.2f} |" in rows["tg4 @ d16"]
    assert rows["pp512"].endswith("| - | 7.0 | - |")  # run by llama.cpp only
    assert "Strata 2.00 GiB, llama.cpp 1.00 GiB (-ncmoe 3)" in text
