"""strata bench runs end to end and reports what it measured."""

from __future__ import annotations

import json

from strata.cli.main import main


def test_bench_sweep_writes_json_and_plot(synth, tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "sweep.png"
    # LRU admits every copied miss (LFU, the default, few on a model this small)
    code = main(["bench", str(synth("qwen3moe", "Q4_K_M")), "--offload", "on", "--miss", "cpu",
                 "--expert-cache", "6", "--cache-policy", "lru", "--prompt-len", "8",
                 "--gen-len", "4", "--runs", "2", "--sweep-vram", "0.6,0.7", "--json", str(out),
                 "--plot", str(png)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["ceilings"]["host_read_GBs"] > 0
    assert [r["config"]["vram_budget_gib"] for r in data["results"]] == [0.6, 0.7]
    for r in data["results"]:
        assert r["decode_tok_s"] > 0 and r["prompt_tok_s"] > 0 and len(r["decode_tok_s_all"]) == 2
        assert 0 <= r["hit_rate"] < 1 and r["cpu_pairs_per_token"] > 0
        # --miss cpu: the only copies to the device are the cache's admissions (LRU takes one
        # CPU-computed expert a layer and step)
        assert r["admissions_per_token"] > 0 and r["h2d_bytes_per_token"] > 0
        assert r["decode_captures"] == 0  # no CUDA graphs on the CPU
        # --prefetch as given (auto: null) and as it ran (auto resolves to off on the CPU)
        assert r["config"]["prefetch"] is None and r["prefetch"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_bad_sweep(synth, capsys):
    assert main(["bench", str(synth("qwen3moe", "Q4_K_M")), "--sweep-vram", "2,x"]) == 2
    assert "--sweep-vram" in capsys.readouterr().err


def test_bench_warms_up_again_while_a_prompt_path_changes(synth, tmp_path, capsys, monkeypatch):
    """A warm-up whose settled routing moves a layer to the other prompt path (here every layer:
    2 tokens route to at most 4 of the 8 uncached experts, and ROUTED_MIN asks for all) is run
    again, so no measured pass is the new path's first."""
    from strata.experts import offload

    def bench(name: str, tokens: int, cache: int) -> dict:
        out = tmp_path / name
        code = main(["bench", str(synth("qwen3moe", "Q4_K_M")), "--offload", "on",
                     "--expert-cache", str(cache), "--prompt-len", str(tokens), "--gen-len", "2",
                     "--runs", "1", "--json", str(out)])
        assert code == 0, capsys.readouterr().err
        return json.loads(out.read_text())["results"][0]

    # 32 tokens route to every expert of each layer: no path changes
    assert bench("a.json", 32, 4)["warmups"] == 1
    monkeypatch.setattr(offload, "ROUTED_MIN", 1.0)
    r = bench("b.json", 2, 0)
    assert r["warmups"] == 2 and len(r["decode_tok_s_all"]) == 1
    assert "after 2 warm-up runs" in capsys.readouterr().err
