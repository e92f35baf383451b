"""The trained demo model as a test bed: the expert cache and its policies on a real model's
routing of real text (a random model routes near-uniformly), decoded token by token through the
offload runtime's decode step, against the reference path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.config import EngineConfig
from strata.demo import demo_model
from strata.engine.generator import Engine

from hf_reference import kl_per_position

TEXT = ("The kill command sends a signal to a process. If no signal is given, it sends TERM, "
        "which asks the process to exit. To list the signals, run kill -l. A process that "
        "ignores TERM can be stopped with KILL, which cannot be caught.\n\n"
        "def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n")


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], np.ndarray]:
    engine = Engine.load(demo_model())
    ids = engine.tokenizer.encode(TEXT)
    kv = engine.model.new_cache(len(ids))
    logits = engine.run_prompt(ids, kv, all_logits=True).float().numpy()
    return ids, logits


def decode_all(engine: Engine, ids: list[int]) -> np.ndarray:
    kv = engine.model.new_cache(len(ids))
    out = [engine.model.decode(t, kv).float().clone() for t in ids]
    return torch.cat(out).numpy()


def test_demo_model_knows_its_text(reference):
    """Trained, not random: the next token of this text is far likelier than chance."""
    ids, logits = reference
    logp = torch.log_softmax(torch.from_numpy(logits[:-1]).double(), -1)
    nll = -logp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    assert nll < 0.5 * np.log(logits.shape[1]), nll  # uniform would be log(8192) = 9.0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("slots", ["8", "40"])
def test_cache_on_real_routing_gives_reference_logits(reference, policy, slots):
    ids, ref = reference
    engine = Engine.load(demo_model(), config=EngineConfig(
        device="cpu", offload="on", expert_cache=slots, cache_policy=policy, miss="cpu",
        cpu_kernels="torch", kernels="exact", debug=True))  # debug: the cache's invariants
    ours = decode_all(engine, ids)
    assert kl_per_position(ref, ours).max() < 1e-4
    assert (ours.argmax(-1) == ref.argmax(-1)).all()
    st = engine.model.experts.stats
    cfg = engine.config
    assert st.hits.sum() + st.cpu.sum() + st.streamed.sum() == \
        len(ids) * cfg.n_layers * cfg.n_experts_used
    assert 0 < st.hit_rate < 1


def test_real_routing_has_locality_a_cache_keeps(reference):
    """On real text some experts are busier than others and routing repeats itself (unlike a
    random model's near-uniform routing, where a cache of a quarter of the experts hits about a
    quarter of the time): each policy's cache of 20 of the 80 experts serves well over a quarter
    of the pairs (measured: LRU 39.6%, LFU 40.9% on this text)."""
    ids, _ = reference
    for policy in ("lru", "lfu"):
        engine = Engine.load(demo_model(), config=EngineConfig(
            device="cpu", offload="on", expert_cache="20", cache_policy=policy, miss="cpu"))
        decode_all(engine, ids)
        st = engine.model.experts.stats
        cfg = engine.config
        assert st.hit_rate > 1.4 * 20 / (cfg.n_layers * cfg.n_experts), (policy, st.hit_rate)
    share = st.routed.max(1) / st.routed.sum(1)
    assert share.max() > 2.0 / cfg.n_experts  # the busiest expert: twice an even share


def test_shipped_pack_loads_in_transformers_and_agrees():
    """HF transformers' own GGUF loader reads the shipped Q4_K_M pack (dequantizing it), and its
    float32 forward gives Strata's reference logits."""
    pytest.importorskip("transformers")
    from hf_reference import hf_gguf_logits

    path = demo_model()
    ids = Engine.load(path).tokenizer.encode(TEXT)[:48]
    theirs = hf_gguf_logits(path, ids, tied_output=True)
    engine = Engine.load(path)
    ours = engine.run_prompt(ids, engine.model.new_cache(len(ids)), all_logits=True).numpy()
    assert kl_per_position(theirs, ours).max() < 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


def test_perplexity_command_scores_as_llama_cpp(tmp_path, capsys):
    """`strata perplexity` scores chunks as llama-perplexity does: the same figure, within the
    8-bit activation rounding of llama.cpp's CPU path, as llama.cpp's own logits scored so."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    from strata.cli.main import main

    text = tmp_path / "text.txt"
    text.write_text(TEXT * 3)
    ctx = 64
    assert main(["perplexity", str(demo_model()), "--file", str(text), "--ctx", str(ctx)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("Final estimate: PPL = "), line
    ours = float(line.split()[4])

    from llama_worker import llama_scores

    vocab = llama_cpp.Llama(str(demo_model()), vocab_only=True, verbose=False)
    ids = vocab.tokenize(text.read_text().encode(), add_bos=False, special=False)
    chunks = [ids[c * ctx:(c + 1) * ctx] for c in range(len(ids) // ctx)]
    nll = []
    for chunk, scores in zip(chunks, llama_scores(demo_model(), chunks, n_ctx=ctx), strict=True):
        logp = torch.log_softmax(torch.tensor(scores, dtype=torch.float64), -1)
        first = ctx // 2
        nll += [-logp[j, chunk[j + 1]].item() for j in range(first, ctx - 1)]
    theirs = float(np.exp(np.mean(nll)))
    assert len(ids) // ctx >= 2 and abs(ours / theirs - 1) < 0.01, (ours, theirs)
