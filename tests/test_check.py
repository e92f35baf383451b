"""strata check's routing report: the (layer, token) pairs whose experts differ between two
configurations, and B's KL with its routing pinned to A's experts."""

from __future__ import annotations

import re

import numpy as np
import pytest

from strata.cli.check import decode_logits, routing_diffs
from strata.cli.logits import compute_logits
from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.model.parts.routing import RoutingPin, RoutingTrace, attach

PROMPT = np.random.default_rng(1).integers(0, 512, 40).tolist()
GGML = "--offload on --expert-cache 0 --miss cpu --cpu-kernels ggml --stream-min 100000"


@pytest.fixture(scope="module")
def model(synth):
    return str(synth("qwen3moe", "IQ2_XS-MIX"))  # 3 layers, 8 experts, top 2


def routing_lines(out: str) -> tuple[int, list[str], float, float]:
    """(pairs that differ, the pairs listed, pinned KL max, unpinned KL max) from the report."""
    n = int(re.search(r"routing: (\d+) of \d+ \(layer, token\) pairs differ", out)[1])
    listed = re.findall(r"layer \d+ token \d+: A \[[\d, ]+\] B \[[\d, ]+\]  A's margin", out)
    m = re.search(r"routing pinned to A: KL max (\S+) .*\(unpinned max (\S+)\)", out)
    return n, listed, float(m[1]), float(m[2])


@pytest.mark.parametrize("n_decode", [0, 6])
def test_pinning_to_its_own_routing_changes_nothing(model, n_decode):
    """The trace of a configuration, pinned on the same configuration: the same experts and the
    same weights, so bit for bit the same logits (prompt chunks and decode steps)."""
    # no cache slots: with some, a rerun finds other experts resident (hits and misses then run
    # as two calls of the CPU kernels), which moves logits by ~1e-6 on its own
    engine = Engine.load(model, config=EngineConfig(
        offload="on", expert_cache="0", prefill="7", cpu_kernels="torch"))
    run = (lambda: decode_logits(engine, PROMPT, n_decode)) if n_decode else \
        (lambda: compute_logits(engine, PROMPT))
    plain = run()
    trace = RoutingTrace()
    with attach(engine.model, trace):
        traced = run()
    with attach(engine.model, RoutingPin(trace.ids())):
        pinned = run()
    assert np.array_equal(traced, plain) and np.array_equal(pinned, plain)
    ids, margins = trace.ids(), trace.margins()
    assert sorted(ids) == [0, 1, 2] and all(v.shape == (len(PROMPT), 2) for v in ids.values())
    assert all((m >= 0).all() for m in margins.values())
    assert routing_diffs(trace, trace) == []
    assert all(layer.ffn.hook is None for layer in engine.model.layers)  # detached after


def test_pin_refuses_tokens_it_has_not_recorded(model):
    engine = Engine.load(model, config=EngineConfig(prefill="off"))
    trace = RoutingTrace()
    with attach(engine.model, trace):
        compute_logits(engine, PROMPT[:10])
    with attach(engine.model, RoutingPin(trace.ids())), pytest.raises(ValueError, match="10"):
        compute_logits(engine, PROMPT)


def test_check_reports_no_routing_difference_on_equal_paths(model, capsys):
    from strata.cli.main import main

    assert main(["check", model, "--b", "--offload on --expert-cache 2 --cpu-kernels torch",
                 "--prompt-len", "30"]) == 0
    n, listed, pinned, unpinned = routing_lines(capsys.readouterr().out)
    assert n == 0 and listed == [] and pinned <= 1e-9 and unpinned <= 1e-9


def layer_errors(out: str) -> dict[str, tuple[int, float]]:
    """kind -> (layers, max relative error) from the report's per-kind lines."""
    found = re.findall(r"^  (.+): (\d+) layers, max (\S+) \(layer \d+\), median \S+$", out,
                       re.MULTILINE)
    return {kind: (int(n), float(m)) for kind, n, m in found}


@pytest.mark.parametrize("n_decode", [0, 5])
def test_check_reports_layer_outputs_by_kind(model, synth, capsys, n_decode):
    """Every layer's output, B against A, by layer kind: on equal paths near zero for every
    layer (prompt and decode steps); a hybrid model's two kinds reported apart."""
    from strata.cli.main import main

    args = ["--prompt-len", "24", "--decode", str(n_decode)]
    assert main(["check", model, "--b", "--offload on --expert-cache 2 --cpu-kernels torch",
                 *args]) == 0
    errs = layer_errors(capsys.readouterr().out)
    assert list(errs) == ["gqa + routed"] and errs["gqa + routed"][0] == 3
    assert errs["gqa + routed"][1] <= 1e-5
    hybrid = str(synth("qwen35moe", "Q4_K_M"))
    main(["check", hybrid, "--b", "--offload on --expert-cache 2 --cpu-kernels torch", *args])
    errs = layer_errors(capsys.readouterr().out)
    assert set(errs) == {"delta + routed", "gated + routed"}, errs
    assert all(m <= 1e-4 for _, m in errs.values())


def test_layer_outputs_join_a_decode_steps_unsummed_pairs_with_prompt_rows(model):
    """A decode step on CUDA's fused expert kernels hands a layer's output on as the K pairs'
    rows [1, K, D] (unsummed: the next add_rms_norm adds them), a prompt pass as [T, D]: both
    join as [tokens, D], the pairs summed in add_rms_norm's order."""
    import torch

    from strata.cli.check import LayerOutputs
    from strata.kernels.gpu.decode_ops import add_rms_norm

    g = torch.Generator().manual_seed(0)
    d = 16
    prompt, pairs, summed = (torch.randn(*s, generator=g) for s in ((5, d), (1, 2, d), (1, d)))
    out = LayerOutputs(Engine.load(model).model)
    for delta in (prompt, pairs, summed):
        out._keep(0, delta)
    rows = out.outputs(0)
    assert rows.shape == (7, d) and rows.dtype == np.float32
    x = torch.zeros(1, d)  # (the residual step's own sum of the pairs: x += delta)
    add_rms_norm(x, pairs, torch.ones(d), 1e-6)
    assert np.array_equal(rows[:5], prompt.numpy()) and np.array_equal(rows[6:], summed.numpy())
    assert np.array_equal(rows[5], x[0].numpy())


def test_check_reports_layer_outputs_of_decode_steps_with_unsummed_pairs(model, capsys,
                                                                         monkeypatch):
    """strata check with decode steps whose experts hand on unsummed pairs (as CUDA's fused
    kernels do; here each pair run alone and stacked [1, K, D]): the per-kind report joins
    them with the prompt's rows, near zero on equal paths (an internal error before)."""
    import torch

    from strata.cli.main import main
    from strata.experts.offload import OffloadExperts

    real, calls = OffloadExperts.step_experts, []

    def unsummed(self, path, layer, h, ids, wts, sum_pairs, aids):  # noqa: ANN001, ANN202
        if sum_pairs:
            return real(self, path, layer, h, ids, wts, sum_pairs, aids)
        calls.append(layer)
        return torch.stack([real(self, path, layer, h, ids[:, k:k + 1], wts[:, k:k + 1],
                                 True, aids) for k in range(ids.shape[1])], 1)  # [1, K, D]

    monkeypatch.setattr(OffloadExperts, "step_experts", unsummed)
    # (every expert in a slot: the CPU's decode step runs each layer's experts in its piece)
    assert main(["check", model, "--b", "--offload on --expert-cache 24 --cpu-kernels torch",
                 "--prompt-len", "24", "--decode", "5"]) == 0
    errs = layer_errors(capsys.readouterr().out)
    assert calls and errs["gqa + routed"][0] == 3 and errs["gqa + routed"][1] <= 1e-5, errs


@pytest.mark.parametrize("n_decode", [0, 8])
def test_check_names_flipped_near_ties_and_pinning_removes_the_spike(model, capsys, n_decode):
    """ggml's 8-bit activations flip near-ties of this model's routers (against the float32
    reference): the report names the pairs, each with a small margin in A, and with B's routing
    pinned to A's experts the KL falls far below the unpinned one."""
    pytest.importorskip("ggml", reason="ggml-python is not installed")
    from strata.cli.main import main

    args = ["check", model, "--b", GGML, "--prompt-len", "40"]
    if n_decode:
        args += ["--decode", str(n_decode)]
    assert main(args) == 1
    out = capsys.readouterr().out
    n, listed, pinned, unpinned = routing_lines(out)
    assert n > 0 and len(listed) == min(n, 5), out
    margins = [float(m) for m in re.findall(r"A's margin (\S+)", out)]
    assert min(margins) < 1e-2, out  # a near-tie (later flips may follow from an earlier one)
    assert pinned < unpinned / 10, out
    assert layer_errors(out)["gqa + routed"][1] > 1e-4, out  # ggml's 8-bit activations
    if n_decode:
        assert f"{n_decode} decode steps: KL max" in out


def test_routing_diffs_match_the_traces(model):
    """The pairs the report lists are the ones whose expert sets differ between the traces."""
    pytest.importorskip("ggml", reason="ggml-python is not installed")
    traces = []
    for flags in (dict(prefill="off"), dict(offload="on", expert_cache="0", miss="cpu",
                                            cpu_kernels="ggml", stream_min=100000)):
        engine = Engine.load(model, config=EngineConfig(**flags))
        traces.append(RoutingTrace())
        with attach(engine.model, traces[-1]):
            compute_logits(engine, PROMPT)
    diffs = routing_diffs(*traces)
    assert diffs
    ia, ib = traces[0].ids(), traces[1].ids()
    for layer, t, ea, eb, _ in diffs:
        assert ea == set(ia[layer][t].tolist()) != eb == set(ib[layer][t].tolist())


def test_the_router_runs_in_float32_whatever_its_input_holds():
    """route() and the pinned weights compute softmax(h @ router.T) in float32, also for a
    bfloat16 h (the router's input after a bf16 path) or router."""
    import torch

    from strata.kernels.torch_ops import route, route_weights

    g = torch.Generator().manual_seed(0)
    h, router = torch.randn(5, 64, generator=g), torch.randn(8, 64, generator=g)
    ids, wts = route(h.bfloat16(), router.bfloat16(), 2, True)
    ref_ids, ref_wts = route(h.bfloat16().float(), router.bfloat16().float(), 2, True)
    assert wts.dtype == torch.float32 and torch.equal(ids, ref_ids) and torch.equal(wts, ref_wts)
    pinned = route_weights(h.bfloat16(), router.bfloat16(), ids, True)
    assert pinned.dtype == torch.float32 and torch.equal(pinned, ref_wts)


def test_check_keeps_float32_kv_on_both_sides_unless_named(monkeypatch):
    import torch

    from strata.cli.check import parse_flags

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (--device cuda needs one)
    assert parse_flags("b", "--device cuda").kv_type == "f32"  # (auto would give f16 there)
    assert parse_flags("b", "--device cuda --kv-type auto").kv_type == "f16"
    assert parse_flags("a", "--offload off --kv-type q8_0").kv_type == "q8_0"
