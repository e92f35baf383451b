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
    assert set(rows) == {"pp16", "tg4", "tg4 @ d16", "pp512", "pp16 @ d16"}
    assert f"{ours['pp16']['prompt_tok_s'] / 100.0:.2f} |" in rows["pp16"]
    assert f"{ours['tg4 @ d16']['decode_tok_s'] / 5.0:.2f} |" in rows["tg4 @ d16"]
    assert rows["pp512"].endswith("| - | 7.0 | - |")  # run by llama.cpp only
    assert rows["pp16 @ d16"].endswith("| - | - |")  # run by Strata only
    assert "Strata 2.00 GiB, llama.cpp 1.00 GiB (-ncmoe 3)" in text


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith(("| test", "| ---"))]


def test_table_keys_every_test_by_its_depth(tmp_path) -> None:
    """Hand-written JSON of both sides, a pp test at two depths: pp128 and pp128 @ d16384 are two
    rows, each its own ratio (keyed without the depth, llama's pp128 @ d16384 took pp128's place:
    0.57 here instead of 0.45); every test either side ran, in llama-bench's order (by depth, the
    pp tests then the tg tests), a dash where a side lacks it; Strata's JSON written before the
    n_prompt / n_gen / n_depth fields is read by its test names."""
    def row(test: str, tok_s: float, n_prompt: int, n_gen: int, n_depth: int) -> dict:
        return {"test": test, "tok_s": tok_s, "std": 0.0, "hit_rate": None, "budget_gib": 4.0,
                "vram_peak_gib": 3.5, "n_prompt": n_prompt, "n_gen": n_gen, "n_depth": n_depth}

    strata = {"results": [], "table": [row("pp128", 450.0, 128, 0, 0),
                                       row("tg64", 40.0, 0, 64, 0),
                                       row("pp128 @ d16384", 200.0, 128, 0, 16384),
                                       row("tg64 @ d16384", 20.0, 0, 64, 16384),
                                       row("pp512 @ d16384", 300.0, 512, 0, 16384)]}
    llama = [{"n_prompt": 128, "n_gen": 0, "n_depth": 0, "avg_ts": 1000.0},
             {"n_prompt": 2048, "n_gen": 0, "n_depth": 0, "avg_ts": 2000.0},
             {"n_prompt": 0, "n_gen": 64, "n_depth": 0, "avg_ts": 80.0},
             {"n_prompt": 128, "n_gen": 0, "n_depth": 16384, "avg_ts": 350.0},
             {"n_prompt": 0, "n_gen": 64, "n_depth": 16384, "avg_ts": 50.0}]
    spath, lpath = tmp_path / "s.json", tmp_path / "l.json"
    spath.write_text(json.dumps(strata))
    lpath.write_text(json.dumps(llama))
    want = [["pp128", "450.0", "1,000.0", "0.45"],
            ["pp2048", "-", "2,000.0", "-"],
            ["tg64", "40.0", "80.0", "0.50"],
            ["pp128 @ d16384", "200.0", "350.0", "0.57"],
            ["pp512 @ d16384", "300.0", "-", "-"],
            ["tg64 @ d16384", "20.0", "50.0", "0.40"]]
    assert _rows(sbs.table(str(spath), str(lpath), "x", None, None, None)) == want
    for r in strata["table"]:  # an older strata bench --json: the test names alone
        for k in ("n_prompt", "n_gen", "n_depth"):
            del r[k]
    spath.write_text(json.dumps(strata))
    assert _rows(sbs.table(str(spath), str(lpath), "x", None, None, None)) == want
