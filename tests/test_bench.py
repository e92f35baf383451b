"""strata bench runs end to end and reports what it measured."""

from __future__ import annotations

import json
import statistics

import pytest

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
        # (--stream-min: on the CPU device prompt chunks stream through a ring only when asked)
        code = main(["bench", str(synth("qwen3moe", "Q4_K_M")), "--offload", "on",
                     "--stream-min", "2", "--expert-cache", str(cache), "--prompt-len",
                     str(tokens), "--gen-len", "2", "--runs", "1", "--json", str(out)])
        assert code == 0, capsys.readouterr().err
        return json.loads(out.read_text())["results"][0]

    # 32 tokens route to every expert of each layer: no path changes
    assert bench("a.json", 32, 4)["warmups"] == 1
    monkeypatch.setattr(offload, "ROUTED_MIN", 1.0)
    r = bench("b.json", 2, 0)
    assert r["warmups"] == 2 and len(r["decode_tok_s_all"]) == 1
    assert "after 2 warm-up runs" in capsys.readouterr().err


def test_bench_matrix_has_every_cell(synth, tmp_path, capsys):
    """-p 16,32 -n 4 -d 0,16, as llama-bench runs it: every test at every depth (pp16, pp32, tg4,
    pp16 @ d16, pp32 @ d16, tg4 @ d16), each in the JSON's results and table and a row of the
    printed markdown table with its depth, with the spread of -r 2 runs."""
    out = tmp_path / "m.json"
    code = main(["bench", str(synth("qwen3moe", "Q4_K_M")), "--offload", "on", "-p", "16,32",
                 "-n", "4", "-d", "0,16", "-r", "2", "--json", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    names = ["pp16", "pp32", "tg4", "pp16 @ d16", "pp32 @ d16", "tg4 @ d16"]
    data = json.loads(out.read_text())
    assert data["decode_input"] == "random" and data["backend"] == "CPU"
    assert data["model_info"]["params"] > 0 and data["model_info"]["size_gib"] > 0
    res = data["results"]
    assert [r["test"] for r in res] == names
    # (the depth's 16 tokens are an untimed prefill: no timed prompt in tg4 @ d16)
    assert [(r["prompt_len"], r["gen_len"], r["depth"], r["n_depth"]) for r in res] == [
        (16, 0, 0, 0), (32, 0, 0, 0), (0, 4, 0, 0), (16, 0, 16, 16), (32, 0, 16, 16),
        (0, 4, 16, 16)]
    assert [r["kv_length_before_decode"] for r in res] == [16, 32, 0, 32, 48, 16]
    for r in res[:2] + res[3:5]:
        assert r["prompt_tok_s"] > 0 and len(r["prompt_tok_s_all"]) == 2
    for r in (res[2], res[5]):
        assert r["decode_tok_s"] > 0 and len(r["decode_tok_s_all"]) == 2
        assert r["decode_input"] == "random" and 0 <= r["hit_rate"] <= 1
        assert r["prompt_tok_s"] is None  # tg4 at depth 0 or 16: no timed prompt at all
    assert [row["test"] for row in data["table"]] == names
    assert [(row["n_prompt"], row["n_gen"], row["n_depth"]) for row in data["table"]] == [
        (16, 0, 0), (32, 0, 0), (0, 4, 0), (16, 0, 16), (32, 0, 16), (0, 4, 16)]
    lines = [ln for ln in captured.out.splitlines() if ln.startswith("| qwen3moe")]
    assert [ln.split(" | ")[4] for ln in lines] == names
    assert all(" ± " in ln.split(" | ")[5] for ln in lines)
    assert lines[5].split(" | ")[6].endswith("%") and lines[0].split(" | ")[6] == "-"
    assert [ln.split(" | ")[8].rstrip(" |") for ln in lines] == ["0", "0", "0", "16", "16", "16"]
    assert "| model | size | params | backend | test | t/s |" in captured.out
    assert "VRAM peak / budget | depth |" in captured.out
    assert "decode inputs: random tokens" in captured.out
    assert "; KV cache f32; " in captured.out  # (--kv-type auto on the CPU)


def _recorded(synth, monkeypatch, decode_input: str, prompt_len: int, runs: int = 1):
    """run_bench on the tiny model, recording each decode step's input and the KV cache's length
    at each run's first step."""
    from strata.bench.runner import run_bench
    from strata.engine.generator import Engine

    engine = Engine.load(synth("qwen3moe", "Q4_K_M"))
    model, inputs, starts = engine.model, [], []
    plain = model.decode

    def decode(token, kv):  # noqa: ANN001, ANN202
        if not inputs or len(inputs[-1]) == 6:
            inputs.append([])
            starts.append(kv.length)
        inputs[-1].append(token)
        return plain(token, kv)

    monkeypatch.setattr(model, "decode", decode)
    res = run_bench(engine, prompt_len, 6, runs, seed=3, decode_input=decode_input)
    return res, inputs, starts


def test_random_decode_inputs_differ_from_greedy(synth, monkeypatch):
    greedy, g_in, _ = _recorded(synth, monkeypatch, "greedy", 8)
    rand, r_in, _ = _recorded(synth, monkeypatch, "random", 8)
    assert greedy.decode_input == "greedy" and rand.decode_input == "random"
    assert len(g_in) == len(r_in) == 2  # the warm-up and one measured run
    # greedy feeds the model's own argmax back: the same prompt gives the same inputs each run
    assert g_in[0] == g_in[1]
    # random: a fresh seeded draw each run, none of them the greedy sequence
    assert r_in[0] != r_in[1] and g_in[0] not in r_in
    assert len(set(r_in[0] + r_in[1])) > len(set(g_in[0]))
    again = _recorded(synth, monkeypatch, "random", 8)[1]
    assert again == r_in  # seeded: the same draws in the same order


def test_depth_fills_the_kv_cache_and_runs_give_a_spread(synth, monkeypatch):
    for depth in (0, 16):
        res, inputs, starts = _recorded(synth, monkeypatch, "random", depth, runs=3)
        assert starts == [depth] * 4  # the warm-up and 3 runs, each on a fresh cache
        assert res.kv_length_before_decode == res.depth == depth
        assert res.test == ("tg6" if depth == 0 else "pp16 + tg6 @ d16")
        assert len(res.decode_tok_s_all) == 3
        # the ± is the runs' sample standard deviation (the list is rounded to 3 decimals)
        std = statistics.stdev(res.decode_tok_s_all)
        assert std > 0 and abs(res.decode_tok_s_std - std) < 1e-2


def test_bench_rejects_mixed_and_bad_shapes(synth, capsys):
    m = str(synth("qwen3moe", "Q4_K_M"))
    assert main(["bench", m, "-p", "16", "--prompt-len", "16"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main(["bench", m, "-d", "0,x"]) == 2
    assert "-d" in capsys.readouterr().err
    assert main(["bench", m, "-p", "0", "-n", "0"]) == 2
    assert "no test" in capsys.readouterr().err


def test_the_older_form_keeps_its_cells(synth, tmp_path, capsys):
    """--prompt-len 16 --gen-len 4: one test that times its prompt and the decode steps on it,
    two rows (pp16 at depth 0, tg4 @ d16)."""
    out = tmp_path / "o.json"
    code = main(["bench", str(synth("qwen3moe", "Q4_K_M")), "--prompt-len", "16", "--gen-len",
                 "4", "-r", "1", "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    (r,) = data["results"]
    assert r["test"] == "pp16 + tg4 @ d16" and r["n_depth"] == 0
    assert (r["prompt_len"], r["gen_len"], r["depth"], r["kv_length_before_decode"]) == (
        16, 4, 16, 16)
    assert r["prompt_tok_s"] > 0 and r["decode_tok_s"] > 0
    assert [(row["test"], row["n_prompt"], row["n_gen"], row["n_depth"])
            for row in data["table"]] == [("pp16", 16, 0, 0), ("tg4 @ d16", 0, 4, 16)]


def test_depth_is_an_untimed_prefill_repeated_each_run(synth, monkeypatch):
    """pp8 @ d16: each run (the warm-up and 2 measured) a fresh cache takes the depth's 16
    random tokens (the same each run, seeded), then the 8 timed ones; the depth's time is not
    in the prompt's rate (a clock that the depth's prefill moves 100 s on leaves pp8 above
    1 tok/s; timed, it would be below 8 / 100)."""
    import time
    from types import SimpleNamespace

    from strata.bench import runner
    from strata.engine.generator import Engine

    engine = Engine.load(synth("qwen3moe", "Q4_K_M"))
    calls, plain, skipped = [], engine.run_prompt, [0.0]

    def run_prompt(ids, kv, **kw):  # noqa: ANN001, ANN202
        calls.append((list(ids), kv.length, id(kv)))
        if len(ids) == 16:
            skipped[0] += 100.0
        return plain(ids, kv, **kw)

    monkeypatch.setattr(engine, "run_prompt", run_prompt)
    monkeypatch.setattr(runner, "time",
                        SimpleNamespace(perf_counter=lambda: time.perf_counter() + skipped[0]))
    res = runner.run_bench(engine, 8, 0, 2, seed=5, depth=16)
    assert [(len(ids), start) for ids, start, _ in calls] == [(16, 0), (8, 16)] * 3
    assert len({tuple(ids) for ids, _, _ in calls[::2]}) == 1  # the depth's draw, each run
    assert len({tuple(ids) for ids, _, _ in calls[1::2]}) == 1  # the prompt's
    assert [c[2] for c in calls[::2]] == [c[2] for c in calls[1::2]]  # both into one cache
    assert res.test == "pp8 @ d16" and res.n_depth == res.depth == 16
    assert res.kv_length_before_decode == 24 and min(res.prompt_tok_s_all) > 1
    # the prompt's tokens are those of pp8 at depth 0 (the depth is a draw of its own)
    deep = calls[1][0]
    calls.clear()
    runner.run_bench(engine, 8, 0, 1, seed=5)
    assert [(ids, start) for ids, start, _ in calls] == [(deep, 0)] * 2


def test_decode_at_depth_starts_from_the_depth(synth, monkeypatch):
    """tg6 @ d16: the decode steps start at kv.length 16 each run, no prompt timed."""
    from strata.bench.runner import run_bench
    from strata.engine.generator import Engine

    engine = Engine.load(synth("qwen3moe", "Q4_K_M"))
    model, starts, plain = engine.model, [], engine.model.decode

    def decode(token, kv):  # noqa: ANN001, ANN202
        if kv.length == 16:
            starts.append(kv.length)
        return plain(token, kv)

    monkeypatch.setattr(model, "decode", decode)
    res = run_bench(engine, 0, 6, 2, seed=1, depth=16)
    assert starts == [16] * 3
    assert res.test == "tg6 @ d16" and res.prompt_tok_s is None and res.prompt_len == 0
    assert res.depth == res.n_depth == res.kv_length_before_decode == 16
    assert res.decode_tok_s > 0 and len(res.decode_tok_s_all) == 2
    # greedy: the first step takes the argmax of the depth's last position
    inputs, prompt = [], engine.run_prompt

    def run_prompt(ids, kv, **kw):  # noqa: ANN001, ANN202
        logits = prompt(ids, kv, **kw)
        inputs.append(("argmax", int(logits[0].argmax())))
        return logits

    def greedy(token, kv):  # noqa: ANN001, ANN202
        inputs.append(token)
        return plain(token, kv)

    monkeypatch.setattr(engine, "run_prompt", run_prompt)
    monkeypatch.setattr(model, "decode", greedy)
    run_bench(engine, 0, 3, 1, seed=1, depth=16, decode_input="greedy")
    assert [x for x in inputs if isinstance(x, tuple)] == [inputs[0]] * 2  # the same each run
    assert inputs[1] == inputs[0][1] and len(inputs) == 2 * (1 + 3)


# the paths a prompt at depth runs on: experts offloaded with misses on the CPU, prompt chunks
# streamed through the ring, a hybrid's recurrent state, deepseek2's latent cache, gpt-oss's
# sliding window (16: shorter than the depth), the reference path with a float16 cache
APPEND_PATHS = [
    ("qwen3moe", "Q4_K_M", dict(offload="on", expert_cache="3", miss="cpu")),
    ("qwen3moe", "Q4_K_M", dict(offload="on", expert_cache="2", stream_min=2)),
    ("qwen35moe", "Q4_K_M", dict(offload="on", expert_cache="3", stream_min=2)),
    ("deepseek2", "Q4_K_M", dict(offload="on", expert_cache="3")),
    ("gpt-oss", "MXFP4", dict(offload="on", expert_cache="3", stream_min=2)),
    ("qwen3moe", "Q4_K_M", dict(offload="off", kv_type="f16")),
]


@pytest.mark.parametrize("arch,recipe,kw", APPEND_PATHS,
                         ids=[f"{a}-{k.get('offload')}-{i}" for i, (a, _, k) in
                              enumerate(APPEND_PATHS)])
def test_a_prompt_appends_to_a_cache_at_depth(synth, device, arch, recipe, kw):
    """run_prompt on a cache that already holds the depth's tokens (strata bench's ppN @ dD)
    gives the logits of the whole sequence run at once, and the decode step after it too."""
    import numpy as np
    import torch

    from strata.config import EngineConfig
    from strata.engine.generator import Engine

    from hf_reference import kl_per_position

    cfg = EngineConfig(device=device, prefill="off", cpu_kernels="torch", kernels="exact", **kw)
    engine = Engine.load(synth(arch, recipe), config=cfg)
    ids = [int(x) for x in np.random.default_rng(0).integers(0, engine.config.n_vocab, 32)]
    whole = engine.model.new_cache(33)
    ref = engine.run_prompt(ids, whole, all_logits=True)[24:]  # [8, V]
    kv = engine.model.new_cache(33)
    engine.run_prompt(ids[:24], kv)
    assert kv.length == 24
    got = engine.run_prompt(ids[24:], kv, all_logits=True)  # [8, V]
    assert kv.length == whole.length == 32
    token = int(ref[-1].argmax())
    ref, got = (torch.cat([x, engine.model.decode(token, c)]).float().cpu().numpy()
                for x, c in ((ref, whole), (got, kv)))
    assert kl_per_position(ref, got).max() < 1e-4
    assert (ref.argmax(-1) == got.argmax(-1)).all()


def test_the_plan_covers_the_deepest_test(synth, monkeypatch, capsys):
    """-p 16,64 -n 4 -d 0,5000: the KV cache is planned for the longest test, the largest depth
    and the largest N (pp64 @ d5000: 5064 tokens), past the default 4096."""
    from strata.cli import bench
    from strata.errors import StrataError

    seen = []

    def load(path, config):  # noqa: ANN001, ANN202
        seen.append(config.ctx)
        raise StrataError("stop after the plan")

    monkeypatch.setattr(bench.Engine, "load", load)
    m = str(synth("qwen3moe", "Q4_K_M"))
    assert main(["bench", m, "-p", "16,64", "-n", "4", "-d", "0,5000"]) == 2
    assert main(["bench", m, "-p", "16", "-n", "8000", "-d", "0,5000"]) == 2
    assert seen == [5064, 13000] and "stop after the plan" in capsys.readouterr().err


def test_bench_spec_forces_the_acceptance_and_checks_the_answer(synth, tmp_path, capsys):
    """strata bench-spec: windows whose drafts replay the greedy answer accept exactly the
    forced count a full window (3 of 4; windows cut short by the answer's end accept all they
    hold), 0 accepts none; both give plain greedy decode's tokens; the table and the JSON carry
    each test, with the offloaded experts' work per token plain and through windows (6 experts
    cached of 24, the misses computed by the CPU pool)."""
    from strata.bench.spec_bench import ForcedDrafter

    path = str(synth("qwen3moe", "Q4_K_M"))
    out = tmp_path / "spec.json"
    assert main(["bench-spec", path, "--spec", "4", "-p", "16", "-n", "40", "-r", "1",
                 "--offload", "on", "--expert-cache", "6", "--miss", "cpu",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| 4 | 3 |" in table and "| 4 | 0 |" in table and "| CPU pairs / token |" in table
    got = {r["accept"]: r for r in json.loads(out.read_text())["results"]}
    assert sorted(got) == [0, 3]
    three, zero = got[3], got[0]
    assert three["windows"] > 0 and 0.75 <= three["acceptance"] < 0.9
    assert three["accepted"] >= 3 * (three["windows"] - 2)  # (the last windows: cut short)
    assert zero["accepted"] == 0 and zero["windows"] > 0
    for r in (three, zero):  # (on the CPU windows are exact: the answers the same)
        assert r["plain_tok_s"] > 0 and r["spec_tok_s"] > 0 and len(r["spec_tok_s_all"]) == 1
        assert r["same_until"] == 40
        plain, windows = r["traffic"]["plain"], r["traffic"]["windows"]
        assert plain["pairs"] == 3 * 2  # (3 layers, top-2: every decoded token's pairs)
        assert windows["pairs"] > plain["pairs"]  # (and the pairs of rejected drafts)
        for t in (plain, windows):  # (6 of 24 slots: most pairs miss, all to the CPU pool)
            assert 0 < t["hit_rate"] < 0.6 and t["cpu_ms"] > 0
            assert t["cpu_pairs"] == pytest.approx(t["pairs"] * (1 - t["hit_rate"]))
    d = ForcedDrafter(2, [10, 11, 12, 13], 2, 100)
    assert d.propose([1, 2, 10], 3) == [11, 12, 14]  # (the third of a window wrong)


def test_bench_spec_refuses_bad_flags(synth, capsys):
    path = str(synth("qwen3moe", "Q4_K_M"))
    assert main(["bench-spec", path, "-n", "8"]) == 2
    assert "give --spec T" in capsys.readouterr().err
    assert main(["bench-spec", path, "--spec", "2", "--accept", "3"]) == 2
    assert "--accept 3: give 0 .. --spec 2" in capsys.readouterr().err
