"""Constrained decoding (strata/engine/constrain.py): a masked token is never sampled, greedy or
not, on the CPU and on a GPU; the text is one JSON value that the schema accepts, ended by EOS
only where the grammar accepts; the same through Engine.generate on a model."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")

from strata.engine.constrain import Constraint, json_grammar  # noqa: E402
from strata.engine.sampling import SamplingParams, sample  # noqa: E402
from strata.errors import StrataError  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "count": {"type": "integer", "minimum": 0, "maximum": 999},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "count", "ok", "tags"]}


def valid(value, schema) -> bool:
    """The JSON Schema keywords SCHEMA uses (jsonschema is not a dependency)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        return (isinstance(value, dict) and all(k in value for k in schema.get("required", []))
                and (schema.get("additionalProperties", True) or set(value) <= set(props))
                and all(valid(v, props[k]) for k, v in value.items() if k in props))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", 1 << 30)
                and all(valid(v, schema.get("items", {})) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", 1 << 30)
    if kind == "integer":
        return (type(value) is int and schema.get("minimum", -1 << 60) <= value
                <= schema.get("maximum", 1 << 60))
    if kind == "boolean":
        return isinstance(value, bool)
    return True


@pytest.fixture(scope="module")
def demo_tok():
    from strata.demo import demo_model
    from strata.gguf import GGUFFile
    from strata.tokenizer import Tokenizer

    return Tokenizer.from_metadata(GGUFFile(demo_model()).metadata)


def _walk(tok, grammar, params, device="cpu", seed=0, steps=400, bias=None):
    """Sample from random logits through the mask until EOS; check every step."""
    c = Constraint(grammar, tok, tok.vocab_size + 7)  # 7 model rows past the tokenizer's
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        logits = torch.randn(tok.vocab_size + 7, generator=gen).to(device) * 4
        if bias is not None:
            logits[bias] += 100.0  # the model wants this token badly
        allowed = c.allowed(device)
        assert not allowed[tok.vocab_size:].any()
        token = sample(c.mask(logits), params, gen)
        assert allowed[token], f"sampled token {token}, which the grammar forbids"
        if token == tok.eos_id:
            assert c.accepting, "EOS came where the grammar does not accept"
            return tok.decode(out)
        c.accept(token)
        out.append(token)
    raise AssertionError(f"no EOS in {steps} steps: {tok.decode(out)!r}")


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),  # greedy
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0),  # the whole distribution
    SamplingParams(temperature=1.5, top_k=40, top_p=0.9, min_p=0.01),
])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_schema_walk_gives_valid_json(demo_tok, params, seed):
    text = _walk(demo_tok, json_grammar(SCHEMA, strict=True), params, seed=seed)
    value = json.loads(text)
    assert valid(value, SCHEMA) and set(value) == set(SCHEMA["properties"]), text


def test_masked_token_is_never_sampled_even_when_it_dominates(demo_tok):
    bias = demo_tok.encode("hello", False, False)[0]  # never allowed at a JSON object's start
    for seed in range(5):
        text = _walk(demo_tok, json_grammar(SCHEMA, strict=True),
                     SamplingParams(temperature=2.0, top_k=0, top_p=1.0), seed=seed, bias=bias)
        assert valid(json.loads(text), SCHEMA)


def test_json_object_is_any_object(demo_tok):
    c = Constraint(json_grammar(None), demo_tok, demo_tok.vocab_size)
    first = {demo_tok.decode([t]) for t in torch.nonzero(c.allowed()).flatten().tolist()}
    assert first and all(t.startswith("{") for t in first)
    # an object ends where it closes: only EOS is allowed after it
    for t in demo_tok.encode('{"a": [1, 2], "b": {"c": null}}', False, False):
        c.accept(t)
    assert c.accepting
    assert torch.nonzero(c.allowed()).flatten().tolist() == [demo_tok.eos_id]
    for seed in range(3):
        text = _walk(demo_tok, json_grammar(None), SamplingParams(temperature=0.7), seed=seed,
                     steps=2000)
        assert isinstance(json.loads(text), dict)


def test_bad_schema_and_bad_token(demo_tok):
    with pytest.raises(StrataError, match="does not compile"):
        json_grammar({"type": "object", "properties": {"a": {"type": "nosuch"}}})
    c = Constraint(json_grammar(SCHEMA), demo_tok, demo_tok.vocab_size)
    with pytest.raises(StrataError, match="not allowed by the grammar"):
        c.accept(demo_tok.encode("x", False, False)[0])


def test_generate_follows_the_grammar(synth):
    from strata.config import EngineConfig
    from strata.engine.generator import Engine

    eng = Engine.load(synth("qwen3moe", "Q4_K_M"), config=EngineConfig(prefill="off"))
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9},
                                               "s": {"type": "string", "maxLength": 4}},
              "required": ["n", "s"]}
    prompt = eng.tokenizer.encode("a JSON object:", False)
    for params in (SamplingParams(temperature=0, max_tokens=64),
                   SamplingParams(temperature=1.0, top_k=0, seed=3, max_tokens=64)):
        c = Constraint(json_grammar(schema, strict=True), eng.tokenizer, eng.config.n_vocab)
        ids = list(eng.generate(prompt, params, constraint=c))
        assert eng.stats.finish_reason == "stop"
        assert valid(json.loads(eng.tokenizer.decode(ids)), schema)


@pytest.mark.cuda
def test_mask_on_the_gpu_is_the_cpu_mask(demo_tok):
    grammar = json_grammar(SCHEMA, strict=True)
    text = _walk(demo_tok, grammar, SamplingParams(temperature=1.0, top_k=0), device="cuda")
    assert valid(json.loads(text), SCHEMA)
    c = Constraint(grammar, demo_tok, demo_tok.vocab_size)
    assert torch.equal(c.allowed("cuda").cpu(), c.allowed("cpu"))


def test_window_masks_each_row_and_leaves_the_state(demo_tok):
    """Constraint.window: the drafts cut before the first the grammar forbids; row i allows
    what a grammar that took drafts[:i] allows; the grammar's state afterwards as before."""
    c = Constraint(json_grammar(SCHEMA), demo_tok, demo_tok.vocab_size)
    text = demo_tok.encode('{"name": "ab", "count": 7', False, False)
    for t in text[:3]:
        c.accept(t)
    before = c.allowed()
    good = text[3:]
    drafts, rows = c.window(good + [demo_tok.encode("x", False, False)[0]] + good)
    assert drafts == good and rows.shape == (len(good) + 1, demo_tok.vocab_size)
    assert torch.equal(c.allowed(), before)
    fresh = Constraint(json_grammar(SCHEMA), demo_tok, demo_tok.vocab_size)
    for t in text[:3]:
        fresh.accept(t)
    for i, t in enumerate([*good, None]):
        assert torch.equal(rows[i], fresh.allowed()), i
        if t is not None:
            fresh.accept(t)
    assert c.window([])[0] == [] and torch.equal(c.window([])[1][0], before)


@pytest.mark.parametrize("draft", ["ngram", "replay"])
def test_generate_with_windows_follows_the_grammar(synth, draft):
    """--spec with a grammar: every window row masked, drafts the grammar forbids cut; greedy
    output is the plain constrained output, and windows ran (n-gram drafts, and drafts that
    replay the answer with every third token wrong)."""
    from strata.config import EngineConfig
    from strata.engine.generator import Engine
    from strata.engine.spec import SpecDecoder

    f = synth("qwen3moe", "Q4_K_M")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9},
                                               "s": {"type": "array", "items": {"enum": [
                                                   "a", "b"]}, "maxItems": 30}},
              "required": ["n", "s"]}
    base = Engine.load(f, config=EngineConfig(prefill="off"))
    prompt = base.tokenizer.encode("a JSON object:", False)
    params = SamplingParams(temperature=0, max_tokens=80)

    def constraint():  # noqa: ANN202
        return Constraint(json_grammar(schema, strict=True), base.tokenizer, base.config.n_vocab)

    plain = list(base.generate(prompt, params, constraint=constraint()))
    eng = Engine.load(f, config=EngineConfig(prefill="off", spec=3, draft="ngram"))
    if draft == "replay":
        class Replay:
            name = "replay"

            def propose(self, context, n):  # noqa: ANN001, ANN202
                at = len(context) - len(prompt)
                return [t if (at + i) % 3 else (t + 1) % 1000
                        for i, t in enumerate(plain[at:at + n])]

        eng.spec = SpecDecoder(eng.model, Replay(), 3, timed=False)
    eng.spec.timed = False
    ours = list(eng.generate(prompt, params, constraint=constraint()))
    assert ours == plain
    assert valid(json.loads(eng.tokenizer.decode(ours)), schema)
    st = eng.stats.spec
    assert st.windows > 0 and st.accepted > 0
