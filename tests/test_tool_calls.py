"""Tool calls: the request checks (tools, tool_choice, tool messages), the three output parsers on
text written the way Qwen3, gpt-oss and GLM-4.5 write it (whole and streamed in pieces), and tool
messages rendered through a template that takes tools."""

from __future__ import annotations

import json

import pytest
from tool_templates import GLM45_TOOLS_HINT, HARMONY_HINT, QWEN3_TOOLS

from strata.server.errors import APIError
from strata.server.tool_calls import forced_prefix, format_of, parse, parser_for
from strata.server.validation import parse_chat

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]

QWEN = ('<think>\nThe user wants the weather in Paris. I should call get_weather.\n</think>\n\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
HARMONY = ('<|channel|>analysis<|message|>User asks weather in Paris. Need get_weather.<|end|>'
           '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
           '<|message|>{"city":"Paris","days":2}')  # <|call|> is a stop token: not in the text
HARMONY_FINAL = ('<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant'
                 '<|channel|>final<|message|>Hello! How can I help?')
GLM = ('\n<think>The user asks about Paris weather.</think>\nLet me check.\n'
       '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
       '<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>')


def _streamed(fmt: str, text: str, size: int, tools=None):
    p = parser_for(fmt, tools)
    events = []
    for i in range(0, len(text), size):
        events += p.push(text[i:i + size])
    events += p.flush()
    content = "".join(v for k, v in events if k == "content")
    reasoning = "".join(v for k, v in events if k == "reasoning")
    return content, reasoning, [(c.name, json.loads(c.arguments)) for k, c in events
                                if k == "call"]


@pytest.mark.parametrize("fmt,text,content,reasoning,calls", [
    # Qwen3: reasoning stays in the text (as without tools), two calls
    ("hermes", QWEN, QWEN[:QWEN.index("<tool_call>")] + "\n", "",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
    # gpt-oss: analysis is reasoning, the commentary message to functions.* the call
    ("harmony", HARMONY, "", "User asks weather in Paris. Need get_weather.",
     [("get_weather", {"city": "Paris", "days": 2})]),
    # gpt-oss answering in the final channel: content, no call
    ("harmony", HARMONY_FINAL, "Hello! How can I help?", "Simple greeting.", []),
    # GLM-4.5: a string parameter stays text, the integer one is JSON
    ("glm", GLM, GLM[:GLM.index("<tool_call>")], "",
     [("get_weather", {"city": "Paris", "days": 2})]),
])
@pytest.mark.parametrize("size", [1, 3, 7, 10_000])
def test_parsers_whole_and_streamed(fmt, text, content, reasoning, calls, size):
    got = _streamed(fmt, text, size, [WEATHER, TIME])
    assert got == (content, reasoning, calls)
    whole = parse(fmt, text, [WEATHER, TIME])
    assert (whole.content, whole.reasoning) == (content, reasoning)
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == calls
    assert all(c.id.startswith("call_") for c in whole.calls)


def test_parsers_leave_plain_text_and_broken_calls_as_text():
    assert parse("hermes", "no call here, <tool").content == "no call here, <tool"
    broken = "<tool_call>\n{not json}\n</tool_call> after"
    got = parse("hermes", broken)
    assert (got.content, got.calls) == (broken, ())
    cut = '<tool_call>\n{"name": "get_time", "arguments": {}}'  # a stop token before the end
    assert [c.name for c in parse("hermes", cut).calls] == ["get_time"]
    assert parse("glm", "<tool_call>\n</tool_call>").calls == ()
    assert parse("harmony", "plain text from a model that is not harmony").content.startswith(
        "plain text")


def test_format_from_template():
    assert format_of(QWEN3_TOOLS) == "hermes"
    assert format_of("x" + GLM45_TOOLS_HINT) == "glm"
    assert format_of(HARMONY_HINT) == "harmony"
    assert format_of(None) == "hermes"


@pytest.mark.parametrize("fmt", ["hermes", "glm", "harmony"])
def test_forced_prefix_then_the_model_goes_on(fmt):
    rest = {"hermes": '{"city": "Oslo"}}\n</tool_call>',
            "glm": "<arg_key>city</arg_key><arg_value>Oslo</arg_value></tool_call>",
            "harmony": '{"city": "Oslo"}'}[fmt]
    got = parse(fmt, forced_prefix(fmt, "get_weather") + rest, [WEATHER])
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather",
                                                                       {"city": "Oslo"})]
    assert got.content == ""


def _chat(**body):
    return parse_chat({"messages": USER, **body}, 256)


def test_tools_reach_the_template_and_choice_is_parsed():
    req = _chat(tools=[WEATHER, TIME])
    assert req.template_kwargs["tools"] == [WEATHER, TIME] and req.tool_choice == "auto"
    req = _chat(tools=[WEATHER], tool_choice="none")
    assert "tools" not in req.template_kwargs and req.tool_choice == "none"
    req = _chat(tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert (req.tool_choice, req.tool_name) == ("required", "get_time")


@pytest.mark.parametrize("body,param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
])
def test_bad_tools_name_the_parameter(body, param):
    with pytest.raises(APIError) as e:
        _chat(**body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_tool_messages_round_trip_through_the_template():
    from test_tokenizer import vocab_meta

    from strata.tokenizer import ChatTemplate, Tokenizer
    from strata.tokenizer.synthetic import synthetic_vocab

    tok = Tokenizer.from_metadata(vocab_meta(synthetic_vocab("qwen", 600)))
    req = parse_chat({"tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."}, *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 14}'}]}, 256)
    text = ChatTemplate(QWEN3_TOOLS, tok).render(req.messages, True, **req.template_kwargs)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(WEATHER) in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert ('<|im_start|>user\n<tool_response>\n{"temp_c": 14}\n</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in text
    # what the template writes for a call, the parser reads back as the same call
    got = parse("hermes", call)
    assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather",
                                                                       {"city": "Paris"})]


def test_response_format_without_llguidance_is_a_400_saying_what_to_install(monkeypatch):
    from strata.engine import constrain

    monkeypatch.setattr(constrain, "available", lambda: False)
    with pytest.raises(APIError) as e:
        _chat(response_format={"type": "json_object"})
    assert (e.value.status, e.value.param) == (400, "response_format")
    assert "pip install 'strata[serve]'" in e.value.message
    assert _chat(response_format={"type": "text"}).grammar is None


def test_strata_imports_and_serves_without_llguidance():
    import subprocess
    import sys

    code = ("import sys; sys.modules['llguidance'] = None\n"
            "import strata, strata.server.app, strata.server.batching, strata.engine.generator\n"
            "from strata.engine import constrain\n"
            "from strata.server.validation import parse_chat\n"
            "assert not constrain.available()\n"
            "r = parse_chat({'messages': [{'role': 'user', 'content': 'x'}], 'tools': ["
            "{'type': 'function', 'function': {'name': 'f'}}], 'tool_choice': 'required'}, 9)\n"
            "assert r.tool_choice == 'required' and r.grammar is None\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_response_format_with_a_required_call_is_refused():
    pytest.importorskip("llguidance")
    with pytest.raises(APIError) as e:
        _chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    assert e.value.param == "response_format"


def test_response_objects_carry_reasoning_and_calls():
    from strata.server.app import _event_chunks
    from strata.server.responses import Builder

    b = Builder("chat", "chatcmpl-1", "m")
    got = parse("harmony", HARMONY, [WEATHER])
    full = b.full(got.content, "tool_calls", 10, 20, got.reasoning, got.calls)
    msg = full["choices"][0]["message"]
    assert msg["content"] is None and msg["reasoning_content"].startswith("User asks")
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather",
                                                "arguments": '{"city": "Paris", "days": 2}'}
    chunks = [json.loads(c.decode()[len("data: "):])
              for kind, value in (("reasoning", "think"), ("call", got.calls[0]))
              for c in _event_chunks(b, kind, value, 0)]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"reasoning_content": "think"}
    assert deltas[1]["tool_calls"][0] | {"function": None} == {
        "index": 0, "id": got.calls[0].id, "type": "function", "function": None}
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[2] == {"tool_calls": [{"index": 0, "function": {
        "arguments": '{"city": "Paris", "days": 2}'}}]}


def test_a_template_without_tools_gets_them_as_qwen_writes_them():
    """The demo model's template takes no tools: the tools, an assistant's calls and the tool
    results, rewritten into plain messages (tool_prompt.py), render through it to exactly the
    text Qwen3's template writes for the conversation as it came; a template that reads `tools`
    keeps it as it came."""
    from strata.demo import demo_model
    from strata.gguf import open_model
    from strata.server.tool_prompt import needs_rewrite, rewrite
    from strata.tokenizer import ChatTemplate, Tokenizer

    meta = open_model(demo_model()).metadata
    demo = ChatTemplate.from_metadata(meta, Tokenizer.from_metadata(meta))
    qwen = ChatTemplate(QWEN3_TOOLS, Tokenizer.from_metadata(meta))
    assert "tools" not in demo.template
    calls = [{"id": f"call_{i}", "type": "function", "function": {
        "name": name, "arguments": json.dumps(args)}} for i, (name, args) in enumerate(
            [("get_weather", {"city": "Paris"}), ("get_time", {})])]
    for system in ([], [{"role": "system", "content": "Be brief."}]):
        for content in (None, "Let me look."):
            req = parse_chat({"tools": [WEATHER, TIME], "messages": [
                *system, *USER, {"role": "assistant", "content": content, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "call_0", "content": '{"temp_c": 14}'},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
                {"role": "assistant", "content": "14 C at noon."},
                {"role": "user", "content": "And tomorrow?"}]}, 256)
            assert needs_rewrite(demo.template, req.messages, req.tools)
            assert not needs_rewrite(qwen.template, req.messages, req.tools)
            want = qwen.render(req.messages, True, **req.template_kwargs)
            assert "<tool_response>\n12:00\n</tool_response>" in want
            got = demo.render(rewrite(req.messages, req.tools), True, **req.template_kwargs)
            assert got == want
    # tool_choice "none": no tool list, the calls and results still written
    req = parse_chat({"tools": [WEATHER], "tool_choice": "none", "messages": [
        *USER, {"role": "assistant", "content": None, "tool_calls": calls[:1]},
        {"role": "tool", "tool_call_id": "call_0", "content": "3"}]}, 256)
    text = demo.render(rewrite(req.messages, None))
    assert "<tools>" not in text and '"arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert not needs_rewrite(demo.template, USER, None)
