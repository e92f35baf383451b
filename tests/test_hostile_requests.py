"""Hostile requests against one real `strata serve` (the tiny model, its KV cache in the pool of
--offload on --batch 2): each bad one gets its OpenAI-style 400 naming the field, a normal request
succeeds after it, and the log ends with no traceback and no engine restart. (test_fuzz.py,
test_server_api.py and test_tokenize_api.py hold the earlier cases.)"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from test_server_races import two_whole_slots_together

from strata.server.testing import ServerProcess

pytestmark = pytest.mark.slow
CHAT, DONE = "/v1/chat/completions", "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _call(arguments: str) -> list[dict]:
    """A conversation whose assistant turn made one call with these arguments."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "done"}]


@pytest.fixture(scope="module")
def server(synth, tmp_path_factory):
    args = ["--model-name", "tiny", "--offload", "on", "--batch", "2", "--queue", "2",
            "--ctx", "256", "--max-tokens", "200", "--cpu-kernels", "torch", "--miss", "cpu",
            "--report-dir", str(tmp_path_factory.mktemp("reports"))]
    log = tmp_path_factory.mktemp("serve") / "server.log"
    with ServerProcess(synth("qwen3moe", "Q4_K_M"), args, log_path=log) as s:
        s.wait_health(lambda h: h["status"] == "ok", what="a loaded engine")
        yield s


def _post(server, path: str, body: object = None, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=60,
                      headers={"Content-Type": "application/json"})


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err


def _served(server) -> None:
    r = _post(server, DONE, {"prompt": "Once upon", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text


def _metric(server, line_start: str) -> float:
    text = server.get("/metrics")[1]
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(line_start))


SURROGATE = b'"a\\ud800b"'  # JSON's escape of a lone surrogate: valid JSON, not Unicode
BAD = [
    # a role that is a list, not a string (was a 500: unhashable type)
    (CHAT, {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role", "Strata takes"),
    # a role that is an object (was a 500)
    (CHAT, {"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role", "Strata takes"),
    # tool_choice naming its function as a string, not an object (was a 500: AttributeError)
    (CHAT, {"messages": HI, "tools": [F], "tool_choice": {"type": "function", "function": "f"}},
     "tool_choice", '"function": {"name": ...}'),
    # tool_choice with "function": null (was a 500)
    (CHAT, {"messages": HI, "tools": [F], "tool_choice": {"type": "function", "function": None}},
     "tool_choice", '"function": {"name": ...}'),
    # a call's arguments as JSON text nested 5,000 deep (was a 500: RecursionError)
    (CHAT, {"messages": _call('{"a": ' + "[" * 5000 + "]" * 5000 + "}")},
     "messages[1].tool_calls[0].function.arguments", "too deep"),
    # a call's arguments as JSON text holding an escaped lone surrogate (was a 500: tokenizer)
    (CHAT, {"messages": _call('{"a": "\\ud800"}')},
     "messages[1].tool_calls[0].function.arguments.a", "lone UTF-16 surrogate"),
    # a text part whose text is null (said "only text parts are supported, not 'text'")
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages[0].content[0].text", "must be a string"),
    # reasoning_content that is a number (was dropped without a word)
    (CHAT, {"messages": [{"role": "assistant", "content": "a", "reasoning_content": 5}, *HI]},
     "messages[0].reasoning_content", "must be a string"),
    # stream: 0 (was taken as false, while stream: 1 was refused)
    (DONE, {"prompt": "x", "stream": 0}, "stream", "true or false"),
    # stream_options.include_usage "no" (was taken as true)
    (DONE, {"prompt": "x", "stream": True, "stream_options": {"include_usage": "no"}},
     "stream_options.include_usage", "true or false"),
    # n: true (a bool is an int in Python: it was taken as n=1)
    (CHAT, {"messages": HI, "n": True}, "n", "not supported"),
    # a prompt of floats (said "prompt holds 2 prompts")
    (DONE, {"prompt": [1.0, 2.0]}, "prompt", "list of token ids"),
    # the body `null` (said it nests objects and arrays more than 32 deep)
    (DONE, b"null", None, "must be a JSON object"),
    # a lone surrogate in a chat message (was a 500 from the tokenizer)
    (CHAT, b'{"messages": [{"role": "user", "content": ' + SURROGATE + b'}]}',
     "messages[0].content", "lone UTF-16 surrogate"),
    # a lone surrogate in a completion prompt (crashed the engine: every running request 503)
    (DONE, b'{"prompt": ' + SURROGATE + b', "max_tokens": 2}', "prompt", "lone UTF-16 surrogate"),
    # a lone surrogate in a stop string (was accepted: a stop that can never match)
    (DONE, b'{"prompt": "x", "stop": [' + SURROGATE + b']}', "stop[0]", "lone UTF-16 surrogate"),
    # a lone surrogate in a field's name (was a 500: the error could not be written)
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], ' + SURROGATE + b': 1}',
     "a\\ud800b", "lone UTF-16 surrogate"),
    # a lone surrogate in /tokenize's content (was a 500 from the tokenizer)
    ("/tokenize", b'{"content": ' + SURROGATE + b'}', "content", "lone UTF-16 surrogate"),
    # arrays 40 deep in chat_template_kwargs (already a 400; its param was null)
    (CHAT, {"messages": HI, "chat_template_kwargs": {"x": json.loads("[" * 40 + "]" * 40)}},
     "chat_template_kwargs", "more than 32 deep"),
    # (passed before) a completion's token ids: one past the vocabulary, negative, 2**70 in a batch
    # of one; the engine refuses each
    (DONE, {"prompt": [1, 10**9], "max_tokens": 2}, "prompt", "outside the vocabulary"),
    (DONE, {"prompt": [-1], "max_tokens": 2}, "prompt", "outside the vocabulary"),
    (DONE, {"prompt": [[1, 2**70]], "max_tokens": 2}, "prompt", "outside the vocabulary"),
    # an integer of 5,000 digits (json refuses it: the answer said to call
    # sys.set_int_max_str_digits)
    (DONE, b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}", None, "more than 4300 digits"),
    # max_tokens of 200 digits (the error quoted all of them back)
    (DONE, {"prompt": "x", "max_tokens": 10**199}, "max_tokens", "an integer of 200 digits"),
]


@pytest.mark.parametrize("path,body,param,words", BAD,
                         ids=[f"{i}-{c[2]}" for i, c in enumerate(BAD)])
def test_a_bad_request_is_a_400_naming_the_field(server, path, body, param, words):
    r = _post(server, path, raw=body) if isinstance(body, bytes) else _post(server, path, body)
    assert words in _error(r, 400, param)["message"]
    _served(server)


def test_an_unknown_method_is_a_json_405(server):
    # (passed before) a method no route has, on a route that exists
    r = httpx.request("FOO", server.url + CHAT, timeout=10)
    assert r.status_code == 405 and r.json()["error"]["code"] == "http_405", r.text
    _served(server)


def test_a_lone_surrogate_prompt_leaves_the_engine_running(server):
    # a completion prompt with a lone surrogate, then the same engine process serves on
    pid = server.health()["engine_pid"]
    _error(_post(server, DONE, raw=b'{"prompt": "\\udfff", "max_tokens": 2}'), 400, "prompt")
    _served(server)
    h = server.health()
    assert (h["engine_pid"], h["restarts"]) == (pid, 0)


def test_a_client_gone_mid_body_is_a_499_not_a_traceback(server):
    # headers promising 1,000 bytes, 14 of them, then the connection closes
    before = _metric(server, 'strata_requests_total{endpoint="/v1/completions",status="499"}')
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as c:
        c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
                  b'{"prompt": "ab')
        time.sleep(0.3)
    deadline = time.monotonic() + 10
    while _metric(server, 'strata_requests_total{endpoint="/v1/completions",status="499"}') \
            == before:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    assert "ClientDisconnect" not in server.log()
    _served(server)


def test_disconnects_give_the_pool_back(server):
    """(Passed before: the pool's blocks and slots come back when clients leave mid-stream, end
    to end.) Two streams dropped after their first tokens, then two requests that each need a
    whole slot (200 prompt tokens + 50 of 256 rows) run together."""
    body = {"prompt": "Keep going", "max_tokens": 200, "stream": True, "ignore_eos": True}
    for _ in range(2):
        with httpx.stream("POST", server.url + DONE, json=body, timeout=60) as r:
            lines = (ln for ln in r.iter_lines() if ln.startswith("data:"))
            next(lines), next(lines)
    server.wait_health(lambda h: h["running"] == 0, timeout=30, what="the streams cancelled")
    two_whole_slots_together(server.url + DONE)


def test_no_traceback_and_no_restart(server):
    """Last: every request above was answered without a traceback or an engine restart."""
    assert server.health()["restarts"] == 0
    assert "Traceback" not in server.log(), server.log()[-3000:]


# --- without a server -------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,text", [
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": "\\ud800"}}\n</tool_call>'),
    ("harmony", '<|channel|>commentary to=functions.f <|constrain|>json<|message|>'
                '{"a": "\\udfff"}<|call|>'),
    ("glm", '<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>"\\ud800"</arg_value>\n</tool_call>'),
])
def test_a_call_the_model_writes_with_a_lone_surrogate_escape_stays_writable(fmt, text):
    # the model's own arguments holding "\ud800" (was a 500 when the answer was written)
    from strata.server.tool_calls import parse

    call, = parse(fmt, text, [F]).calls
    assert json.loads(call.arguments) == {"a": json.loads(text[text.index('"\\u'):][:8])}
    call.arguments.encode("utf-8")  # (the response's encoding)


def test_a_call_name_with_a_lone_surrogate_stays_text():
    # a hermes call whose name holds "\udc00": no call, the text as the model wrote it
    from strata.server.tool_calls import parse

    text = '<tool_call>\n{"name": "f\\udc00", "arguments": {}}\n</tool_call>'
    got = parse("hermes", text, [F])
    assert got.calls == () and got.content == text


def test_a_request_that_breaks_the_engines_checks_fails_alone():
    # a Submit whose checks raise what they did not foresee: a 500 for it, the engine serves on
    from strata.server.batching import BatchRunner
    from strata.server.protocol import Failed, Submit

    sent: list = []
    runner = BatchRunner.__new__(BatchRunner)  # (no engine: only submit runs)
    runner.send, runner.seqs = sent.append, {}

    def broken(sub: Submit) -> None:
        raise TypeError("TextInputSequence must be str")

    runner._make_sequence = broken
    runner.submit(Submit("r1", None, "x", {}, 2, 2))
    assert sent == [Failed("r1", 500, "the engine could not take the request: TypeError: "
                                      "TextInputSequence must be str")]
    assert runner.active == 0
