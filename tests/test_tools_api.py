"""Tools and response_format through `strata serve`, with the official openai client, on the
shipped demo model (its chat template swapped for one that takes tools, written as Qwen3's is);
forced calls also in GLM's key/value format (a tiny synthetic model with GLM-4.5's template) and
gpt-oss's harmony format (a tiny synthetic gpt-oss).

The demo model does not call tools by itself: tool messages round-trip through its template, and a
call comes out where tool_choice requires one (the start of the call is written after the prompt,
the arguments follow the function's schema by constrained decoding).
"""

from __future__ import annotations

import json

import openai
import pytest
from test_call_grammar import conforms
from test_constrain import valid
from tool_templates import GLM45_TOOLS, QWEN3_TOOLS

from strata.server.testing import ServerProcess

from gguf_edit import rewrite

pytest.importorskip("llguidance")
pytestmark = pytest.mark.slow
MODEL = "demo"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}
ASK = [{"role": "system", "content": "You answer questions about Strata."},
       {"role": "user", "content": "What is the weather in Oslo?"}]
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "langs": {"type": "array", "items": {"enum": ["python", "c", "rust"]}, "maxItems": 3}},
    "required": ["name", "age", "langs"]}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from strata.demo import demo_model

    tmp = tmp_path_factory.mktemp("tools")
    model = rewrite(demo_model(), tmp / "demo-tools.gguf", {"tokenizer.chat_template": QWEN3_TOOLS})
    args = ["--model-name", MODEL, "--max-tokens", "200", "--watchdog", "60",
            "--report-dir", str(tmp)]
    with ServerProcess(model, args, log_path=tmp / "server.log") as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        yield s


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_tool_messages_round_trip_through_the_template(client):
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME],
                                       max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert isinstance(r.choices[0].message.content, str)
    # the prompt holds the tools, the call and its result as the template writes them
    with_tools = r.usage.prompt_tokens
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert with_tools > plain.usage.prompt_tokens + 50


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": {"name": "get_weather"}},
    "required",
])
def test_tool_choice_gives_a_call_that_follows_the_schema(client, choice):
    forced_call(client, [WEATHER, TIME], choice, valid)


def forced_call(client, tools, choice, check, max_tokens=120):
    """tool_choice `choice` gives one call whose arguments `check(value, schema)` passes, the
    same streamed."""
    kw = dict(model=MODEL, messages=ASK, tools=tools, tool_choice=choice,
              max_tokens=max_tokens, temperature=0)
    r = client.chat.completions.create(**kw)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert finish == "tool_calls", msg
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {t["function"]["name"]: t for t in tools}[call.function.name]
    assert check(json.loads(call.function.arguments), schema["function"]["parameters"])
    if isinstance(choice, dict):
        assert call.function.name == choice["function"]["name"]
    # streamed: the same call in delta.tool_calls, no call text as content
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == (msg.content or "")
    parts = [tc for d in deltas for tc in d.tool_calls or []]
    assert parts[0].id == call.id or parts[0].id.startswith("call_")
    assert parts[0].function.name == call.function.name
    assert "".join(p.function.arguments or "" for p in parts) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


PERSON_TOOL = {"type": "function", "function": {"name": "add_person", "strict": True,
                                                "parameters": {**PERSON, "properties": {
                                                    **PERSON["properties"], "boss": {
                                                        "type": "object", "properties": {
                                                            "name": {"enum": ["Ada", "Alan"]}},
                                                        "required": ["name"]}}}}}
OTHER_FORMATS = [WEATHER, TIME, PERSON_TOOL]


@pytest.fixture(scope="module", params=["glm", "harmony"])
def other_client(request, synth, tmp_path_factory):
    """A server whose model writes calls in GLM's format (a tiny qwen3moe with GLM-4.5's
    template) or in harmony (a tiny gpt-oss with its template)."""
    tmp = tmp_path_factory.mktemp(request.param)
    model = synth("gpt-oss", "MXFP4") if request.param == "harmony" else rewrite(
        synth("qwen3moe", "Q4_K_M"), tmp / "glm-tools.gguf",
        {"tokenizer.chat_template": GLM45_TOOLS})
    args = ["--model-name", MODEL, "--max-tokens", "200", "--watchdog", "60",
            "--report-dir", str(tmp)]
    with ServerProcess(model, args, log_path=tmp / "server.log") as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("choice", [
    {"type": "function", "function": {"name": "get_weather"}},
    {"type": "function", "function": {"name": "add_person"}},
    "required",
])
def test_tool_choice_in_glm_and_harmony_follows_the_schema(other_client, choice):
    """A random-weight model writes whatever the mask leaves it: the call is still whole and
    its arguments still follow the schema (strict: closed objects)."""
    strict = PERSON_TOOL["function"]["parameters"]
    forced_call(other_client, OTHER_FORMATS, choice,
                lambda value, schema: conforms(value, schema, strict=schema is strict),
                max_tokens=160)


def test_parameters_that_do_not_compile_are_a_400_naming_tools(client, other_client):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nosuch"}}, "required": ["a"]}}}
    for c in (client, other_client):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=ASK, tools=[bad],
                                      tool_choice="required", max_tokens=2)
        assert e.value.body["param"] == "tools" and "does not compile" in str(e.value.body)


def test_tool_choice_none_and_auto_answer_in_text(client):
    for choice in ("none", "auto"):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER],
                                           tool_choice=choice, max_tokens=6, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert not r.choices[0].message.tool_calls


@pytest.mark.parametrize("tools,param", [
    ({"type": "function"}, "tools"),
    ([{"type": "function", "function": {"description": "no name"}}], "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}],
     "tools[0].function.parameters"),
])
def test_bad_tools_get_a_400_naming_the_parameter(client, tools, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, tools=tools, max_tokens=2)
    assert e.value.body["param"] == param


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_json_schema_output_validates(client, stream, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Describe a programmer."}],
              response_format=fmt, max_tokens=150, temperature=temperature, seed=5)
    if stream:
        chunks = list(client.chat.completions.create(**kw, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = client.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert finish == "stop", text
    value = json.loads(text)
    assert valid(value, PERSON) and set(value) == set(PERSON["properties"]), text


def test_json_object_output_parses(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give the config as JSON."}],
        response_format={"type": "json_object"}, max_tokens=200, temperature=0)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still the start of one object
        assert text.startswith("{")


def test_bad_response_format(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "nosuch"}}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       response_format={"type": "yaml"})
    assert e.value.body["param"] == "response_format"


STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}


def test_constrained_answers_beside_others_are_their_serial_ones(client):
    """Grammars masking some sequences of a shared forward pass: a json_schema answer, a
    json_object one, a forced call and a plain one, run together, are each what it was alone
    (same seed) and still follow its grammar."""
    from concurrent.futures import ThreadPoolExecutor

    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                     "strict": True}}
    kinds = [dict(response_format=schema), dict(response_format={"type": "json_object"}),
             dict(tools=[STRICT_WEATHER], tool_choice="required"), {}]

    def one(i: int):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Describe programmer {i}."}],
            max_tokens=60, temperature=1.0, seed=40 + i, **kinds[i % len(kinds)])
        c = r.choices[0]
        calls = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
        return c.message.content, calls, c.finish_reason

    serial = [one(i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, range(4), timeout=300))
    assert together == serial
    for i, (text, calls, finish) in enumerate(serial):
        if i % 4 == 0:
            assert finish == "stop" and valid(json.loads(text), PERSON), text
        if i % 4 == 1:
            assert text.startswith("{")
        if i % 4 == 2:
            assert finish == "tool_calls" and calls[0][0] == "get_weather", (text, calls)
            assert valid(json.loads(calls[0][1]), WEATHER["function"]["parameters"])
