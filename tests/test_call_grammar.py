"""A forced call's grammar (strata/server/call_grammar.py) in each call format: it compiles for
schemas with required and optional properties, enums, numbers, nested objects, arrays, $refs and
strict mode; every text it lets a sampler write (random logits through its mask) parses back,
through the format's own parser, into one call to a given function whose arguments the schema
accepts; texts that break the schema are refused."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("llguidance")

from strata.engine.constrain import Constraint, lark_grammar  # noqa: E402
from strata.engine.sampling import SamplingParams, sample  # noqa: E402
from strata.errors import StrataError  # noqa: E402
from strata.server.tool_calls import call_grammar, forced_prefix, parse  # noqa: E402

FORMATS = ("hermes", "glm", "harmony")


def tool(name: str, parameters, strict: bool = False) -> dict:
    f = {"name": name, "parameters": parameters}
    return {"type": "function", "function": {**f, "strict": True} if strict else f}


WEATHER = tool("get_weather", {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "unit": {"enum": ["celsius", "fahrenheit", "1"]}},  # "1": JSON text, written as JSON
    "required": ["city", "unit"], "additionalProperties": False})
MEASURE = tool("measure", {"type": "object", "properties": {
    "value": {"type": "number", "minimum": -100, "maximum": 100},
    "exact": {"type": "boolean"},
    "note": {"type": ["string", "null"], "maxLength": 8},
    "kind": {"type": "string", "enum": ["len", "mass"]},
    "scale": {"const": 2}},
    "required": ["value", "kind"], "additionalProperties": False})
PERSON = tool("add_person", {"type": "object", "properties": {
    "who": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]},
    "langs": {"type": "array", "items": {"enum": ["python", "c", "rust"]}, "maxItems": 3},
    "home": {"$ref": "#/$defs/place"}},
    "required": ["who", "langs"],
    "$defs": {"place": {"type": "object", "properties": {"town": {"enum": ["Oslo", "Rome"]}},
                        "required": ["town"]}}}, strict=True)
NOARGS = tool("get_time", {"type": "object", "properties": {}}, strict=True)  # {} only
TOOLS = [WEATHER, MEASURE, PERSON, NOARGS]
SCHEMAS = {t["function"]["name"]: t["function"] for t in TOOLS}


def conforms(value, schema, root=None, strict=False) -> bool:
    """The JSON Schema keywords the tools above use (jsonschema is not a dependency); strict:
    objects that list properties allow no others."""
    root = schema if root is None else root
    if "$ref" in schema:
        return conforms(value, root["$defs"][schema["$ref"].split("/")[-1]], root, strict)
    if "enum" in schema and value not in schema["enum"]:
        return False
    if "const" in schema and value != schema["const"]:
        return False
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if kinds is not None and not any(_is(value, k) for k in kinds):
        return False
    if isinstance(value, dict):
        props = schema.get("properties", {})
        closed = schema.get("additionalProperties", not (strict and props)) is False
        return (all(k in value for k in schema.get("required", []))
                and not (closed and set(value) - set(props))
                and all(conforms(v, props[k], root, strict) for k, v in value.items()
                        if k in props))
    if isinstance(value, list):
        return (len(value) <= schema.get("maxItems", 1 << 30)
                and all(conforms(v, schema.get("items", {}), root, strict) for v in value))
    if isinstance(value, str):
        return schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return schema.get("minimum", -1e300) <= value <= schema.get("maximum", 1e300)
    return True


def _is(value, kind: str) -> bool:
    return {"object": isinstance(value, dict), "array": isinstance(value, list),
            "string": isinstance(value, str), "boolean": isinstance(value, bool),
            "null": value is None,
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, (int, float)) and not isinstance(value, bool)}[kind]


def call_ok(name: str, arguments: dict) -> bool:
    f = SCHEMAS[name]
    return conforms(arguments, f.get("parameters") or {"type": "object"},
                    strict=bool(f.get("strict")))


@pytest.fixture(scope="module")
def toks():
    """A tokenizer per format: harmony's has its special tokens, the others are Qwen's."""
    from test_tokenizer import vocab_meta

    from strata.tokenizer import Tokenizer
    from strata.tokenizer.synthetic import synthetic_vocab

    qwen = Tokenizer.from_metadata(vocab_meta(synthetic_vocab("qwen", 1024)))
    harmony = Tokenizer.from_metadata(vocab_meta(synthetic_vocab("harmony", 1024)))
    return {"hermes": qwen, "glm": qwen, "harmony": harmony}


def constraint(fmt: str, tok, name: str | None, tools=TOOLS) -> Constraint:
    return Constraint(lark_grammar(call_grammar(fmt, tools, name)), tok, tok.vocab_size)


def walk(c: Constraint, tok, seed: int, steps: int = 600) -> list[int]:
    """Tokens a sampler writes through the mask from random logits, to the grammar's end."""
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0)
    out: list[int] = []
    for _ in range(steps):
        if c.done:
            return out
        token = sample(c.mask(torch.randn(tok.vocab_size, generator=gen) * 3), params, gen)
        if token == tok.eos_id:
            assert c.accepting
            return out
        c.accept(token)
        out.append(token)
    raise AssertionError(f"no end in {steps} steps: {tok.decode(out)!r}")


def feeds(c: Constraint, tok, text: str) -> bool:
    """The grammar takes the whole text (its tokens, special ones included) and accepts."""
    for t in tok.encode(text, False, True):
        if not c.matcher.consume_token(t):
            return False
    return c.accepting


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", [None, *SCHEMAS])
def test_grammar_compiles_and_every_walk_parses_to_a_valid_call(toks, fmt, name):
    tok = toks[fmt]
    for seed in range(4):
        c = constraint(fmt, tok, name)
        text = forced_prefix(fmt, name) + tok.decode(walk(c, tok, seed))
        got = parse(fmt, text, TOOLS)
        assert got.content == "" and len(got.calls) == 1, text
        call = got.calls[0]
        assert call.name == name if name else call.name in SCHEMAS
        assert call_ok(call.name, json.loads(call.arguments)), text


GOOD = {  # a call to get_weather as each format writes it, after forced_prefix(fmt, None)
    "hermes": '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
              '</tool_call>',
    "glm": "get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
           "<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>",
    "harmony": 'get_weather <|constrain|>json<|message|>{"city": "Oslo", "unit": "celsius"}'
               "<|call|>",
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_call_written_as_the_format_writes_it_is_taken(toks, fmt):
    assert feeds(constraint(fmt, toks[fmt], None), toks[fmt], GOOD[fmt])
    got = parse(fmt, forced_prefix(fmt, None) + GOOD[fmt], TOOLS).calls
    assert [(c.name, json.loads(c.arguments)) for c in got] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})]


def _glm(name: str | None, pairs: list[tuple[str, str]]) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
    return (f"{name}\n" if name else "") + body + "</tool_call>"


def _harmony(name: str | None, args: str) -> str:
    return (f"{name} <|constrain|>json<|message|>" if name else "") + args + "<|call|>"


@pytest.mark.parametrize("name,pairs,ok", [
    ("get_weather", [("city", "Oslo"), ("days", "3"), ("unit", '"1"')], True),
    ("get_weather", [("city", "Oslo"), ("unit", "fahrenheit")], True),
    ("get_weather", [("city", "Oslo")], False),  # unit is required
    ("get_weather", [("city", "Oslo"), ("unit", "kelvin")], False),  # not in the enum
    ("get_weather", [("city", "Oslo"), ("days", "three"), ("unit", "celsius")], False),
    ("get_weather", [("city", "Oslo"), ("days", "15"), ("unit", "celsius")], False),  # > 14
    ("get_weather", [("city", "a" * 13), ("unit", "celsius")], False),  # maxLength 12
    ("get_weather", [("city", ""), ("unit", "celsius")], False),  # minLength 1
    ("get_weather", [("city", "a</tool_call>"), ("unit", "celsius")], False),  # ends the call
    ("get_weather", [("city", "<b>\n</b>"), ("unit", "celsius")], True),  # raw text
    ("get_weather", [("city", "Oslo"), ("unit", "celsius"), ("unit", "celsius")], False),
    ("get_weather", [("city", "Oslo"), ("zip", "1"), ("unit", "celsius")], False),
    ("measure", [("value", "2.5"), ("note", "null"), ("kind", "len"), ("scale", "2")], True),
    ("measure", [("value", "2.5"), ("note", "7"), ("kind", "len")], False),  # string or null
    ("measure", [("value", "2.5"), ("kind", '"len"')], False),  # a string is raw text
    ("add_person", [("who", '{"name": "Ada", "age": 36}'), ("langs", '["c"]'),
                    ("home", '{"town": "Rome"}')], True),
    ("add_person", [("who", '{"name": "Ada"}'), ("langs", "[]")], False),  # age required
    ("add_person", [("who", '{"name": "Ada", "age": 36, "x": 1}'), ("langs", "[]")], False),
    ("add_person", [("who", '{"name": "Ada", "age": 36}'), ("langs", '["go"]')], False),
    ("add_person", [("who", '{"name": "Ada", "age": 36}'), ("langs", "[]"),
                    ("home", '{"town": "Paris"}')], False),  # the $ref's enum
    ("get_time", [], True),
    ("get_time", [("x", "1")], False),
    ("nope", [], False),  # not a tool
])
def test_glm_calls_that_break_the_schema_are_refused(toks, name, pairs, ok):
    text = _glm(name, pairs)
    assert feeds(constraint("glm", toks["glm"], None), toks["glm"], text) == ok, text
    if ok:
        (call,) = parse("glm", "<tool_call>" + text, TOOLS).calls
        assert call.name == name and call_ok(name, json.loads(call.arguments))
        named = constraint("glm", toks["glm"], name)  # the same pairs after a named prefix
        assert feeds(named, toks["glm"], _glm(None, pairs))


@pytest.mark.parametrize("name,args,ok", [
    ("get_weather", '{"city": "Oslo", "days": 3, "unit": "1"}', True),
    ("get_weather", '{"city": "Oslo"}', False),
    ("get_weather", '{"city": "Oslo", "unit": "kelvin"}', False),
    ("get_weather", '{"city": "Oslo", "days": 0, "unit": "celsius"}', False),
    ("measure", '{"value": 2.5, "note": null, "kind": "mass"}', True),
    ("measure", '{"value": "2.5", "kind": "mass"}', False),
    ("add_person", '{"who": {"name": "Ada", "age": 36}, "langs": ["rust"]}', True),
    ("add_person", '{"who": {"name": "Ada", "age": 36}, "langs": [], "x": 1}', False),  # strict
    ("get_time", "{}", True),
    ("nope", "{}", False),
])
def test_harmony_calls_that_break_the_schema_are_refused(toks, name, args, ok):
    tok = toks["harmony"]
    assert feeds(constraint("harmony", tok, None), tok, _harmony(name, args)) == ok, args
    if ok:
        assert feeds(constraint("harmony", tok, name), tok, _harmony(None, args))
        (call,) = parse("harmony", forced_prefix("harmony", name) + args + "<|call|>",
                        TOOLS).calls
        assert (call.name, json.loads(call.arguments)) == (name, json.loads(args))
    # without its <|call|> the call is not finished
    assert not feeds(constraint("harmony", tok, None), tok, _harmony(name, args)[:-8])


@pytest.mark.parametrize("fmt,text,ok", [
    ("harmony", '{"any": [1, {"thing": null}]}<|call|>', True),
    ("harmony", "[]<|call|>", False),
    ("glm", "</tool_call>", True),
    ("glm", "<arg_key>any</arg_key>\n<arg_value>1</arg_value>\n</tool_call>", False),
])
def test_a_function_without_parameters(toks, fmt, text, ok):
    """Any object where JSON holds the arguments; none in GLM's pairs (no property to name)."""
    c = constraint(fmt, toks[fmt], "f", [tool("f", None)])
    assert feeds(c, toks[fmt], text) == ok


def test_names_the_format_cannot_write_are_left_out_of_required():
    odd = [tool("has space", None), tool("a<b", None), tool("ok", None)]
    assert '"has space' not in call_grammar("harmony", odd, None)
    assert '"a<b' in call_grammar("harmony", odd, None)
    assert "a<b" not in call_grammar("glm", odd, None) and '"ok\\n"' in call_grammar(
        "glm", odd, None)
    assert '"has space\\n"' in call_grammar("glm", odd, None)  # (GLM's name is a line)
    assert call_grammar("glm", odd[1:2], None) is None
    assert call_grammar("glm", odd[1:2], "a<b") is not None  # named: its prefix is written


def test_schemas_that_cannot_be_written_say_why():
    bad = tool("f", {"type": "object", "properties": {"a": {"type": "nosuch"}}})
    for fmt in FORMATS:
        with pytest.raises(StrataError, match="does not compile"):
            lark_grammar(call_grammar(fmt, [bad], None))
    none = tool("f", {"type": "object", "properties": {"a": {"type": "string", "enum": [1]}}})
    with pytest.raises(StrataError, match="f.a: no value of its enum"):
        call_grammar("glm", [none], None)


def test_what_glms_template_writes_for_a_call_the_grammar_takes(toks):
    from tool_templates import GLM45_TOOLS

    from strata.server.validation import parse_chat
    from strata.tokenizer import ChatTemplate

    args = {"who": {"name": "Ada", "age": 36}, "langs": ["c", "rust"], "home": {"town": "Oslo"}}
    req = parse_chat({"tools": TOOLS, "messages": [
        {"role": "user", "content": "Add Ada."},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "add_person", "arguments": json.dumps(args)}}]}]}, 256)
    text = ChatTemplate(GLM45_TOOLS, toks["glm"]).render(req.messages, False,
                                                         **req.template_kwargs)
    call = text[text.rindex("<tool_call>"):]
    assert call.startswith("<tool_call>add_person\n<arg_key>who</arg_key>\n<arg_value>{")
    (got,) = parse("glm", call, TOOLS).calls
    assert (got.name, json.loads(got.arguments)) == ("add_person", args)
    after = call[len(forced_prefix("glm", None)):]
    assert feeds(constraint("glm", toks["glm"], None), toks["glm"], after)
