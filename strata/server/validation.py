"""Request bodies -> checked requests. Every 400 names the field and says why.

A parameter Strata does not implement is refused by name when it asks for something (n > 1,
logprobs, the old functions / function_call, ...), never silently ignored. A few that change
nothing here (user, metadata, store, ...) are accepted. Unknown fields are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from strata.errors import StrataError
from strata.server.errors import bad_request
from strata.server.tool_requests import check_calls, check_tool_choice, check_tools

MAX_STOP_STRINGS = 16
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls",
            "safety_identifier", "prompt_cache_key"}
_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "top_k", "min_p", "seed",
           "max_tokens", "stop", "n", "logit_bias", "presence_penalty", "frequency_penalty",
           "ignore_eos"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "reasoning_effort", "chat_template_kwargs",
                   "logprobs", "top_logprobs", "tools", "tool_choice", "functions",
                   "function_call", "response_format", "audio", "modalities", "prediction",
                   "web_search_options"}
_COMPLETION = _COMMON | {"prompt", "echo", "best_of", "logprobs", "suffix"}
_RESERVED_KWARGS = {"messages", "add_generation_prompt", "add_bos", "tools"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass
class ParsedRequest:
    kind: str  # "chat" or "completion"
    model: str | None
    stream: bool
    include_usage: bool
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[int] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # rendered in the prompt unless tool_choice is none
    tool_choice: str = "none"  # auto, none, required (a named function is required + tool_name)
    tool_name: str | None = None
    grammar: str | None = None  # response_format as a grammar (strata.engine.constrain)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _short(v: Any, most: int = 40) -> str:
    """repr(v), cut to `most` characters (a client's value quoted back in an error)."""
    text = repr(v) if not isinstance(v, int) or abs(v) < 10 ** most else f"an integer of " \
        f"{len(str(abs(v)))} digits"
    return text if len(text) <= most else text[:most - 3] + "..."


def _number(body: dict, name: str, lo: float, hi: float, integer: bool = False) -> Any:
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v) or (integer and not (isinstance(v, int) or float(v).is_integer())):
        raise bad_request(f"{name} must be {'an integer' if integer else 'a number'}, "
                          f"not {_short(v)}", name)
    if not lo <= v <= hi:
        raise bad_request(f"{name}={_short(v)} is out of range: it must be in [{lo}, {hi}]",
                          name)
    return int(v) if integer else float(v)


def _refuse_unsupported(body: dict, kind: str) -> None:
    asks = {
        "n": lambda v: v not in (None, 1) or isinstance(v, bool),
        "logprobs": lambda v: v not in (None, False, 0),
        "top_logprobs": lambda v: v not in (None, 0),
        "functions": lambda v: bool(v),
        "function_call": lambda v: v not in (None, "none"),
        "logit_bias": lambda v: bool(v),
        "presence_penalty": lambda v: v not in (None, 0),
        "frequency_penalty": lambda v: v not in (None, 0),
        "audio": lambda v: v is not None,
        "modalities": lambda v: v not in (None, ["text"]),
        "prediction": lambda v: v is not None,
        "web_search_options": lambda v: v is not None,
        "echo": lambda v: v not in (None, False),
        "best_of": lambda v: v not in (None, 1) or isinstance(v, bool),
        "suffix": lambda v: v not in (None, ""),
    }
    bad = [k for k, asks_for in asks.items() if k in body and asks_for(body[k])]
    if bad:
        raise bad_request(f"{', '.join(f'{k}={body[k]!r}' for k in bad)}: not supported by "
                          f"Strata's {kind} endpoint (it serves n=1 plain text, without "
                          "logprobs, penalties or logit_bias)", bad[0],
                          "unsupported_parameter")


def _common(body: Any, kind: str, allowed: set[str], max_tokens_limit: int) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed - _IGNORED)
    if unknown:
        raise bad_request(f"unknown parameter(s): {', '.join(unknown)}", unknown[0],
                          "unknown_parameter")
    _refuse_unsupported(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", "model")
    stream = _flag(body, "stream")
    opts = body.get("stream_options")
    if opts is not None:
        if not stream:
            raise bad_request("stream_options is only allowed with stream: true", "stream_options")
        if not isinstance(opts, dict) or set(opts) - {"include_usage"}:
            raise bad_request("stream_options takes only include_usage", "stream_options")
    include_usage = _flag(opts or {}, "include_usage", "stream_options.")
    sampling = {
        "temperature": _number(body, "temperature", 0, 2),
        "top_p": _number(body, "top_p", 0, 1),
        "top_k": _number(body, "top_k", -1, 1 << 31, integer=True),
        "min_p": _number(body, "min_p", 0, 1),
        "seed": _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True),
    }
    if sampling["top_p"] == 0:
        raise bad_request("top_p=0 keeps no tokens: it must be in (0, 1]", "top_p")
    if sampling["top_k"] == -1:
        sampling["top_k"] = 0  # -1 (vLLM's spelling) and 0 both turn top-k off
    name = "max_tokens"
    if body.get("max_completion_tokens") is not None:
        name = "max_completion_tokens"
    max_tokens = _number(body, name, 1, max_tokens_limit, integer=True)
    return ParsedRequest(kind, model, stream, include_usage,
                         sampling={k: v for k, v in sampling.items() if v is not None},
                         max_tokens=max_tokens, stop=_stop(body.get("stop")),
                         ignore_eos=_flag(body, "ignore_eos"))


def _flag(body: dict, name: str, where: str = "") -> bool:
    """A true/false field; null or absent is false."""
    v = body.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad_request(f"{where}{name} must be true or false, not {v!r:.40}", where + name)
    return bool(v)


def _stop(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_request("stop must be a non-empty string or a list of them", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"stop has {len(items)} strings; at most {MAX_STOP_STRINGS}", "stop")
    return tuple(items)


def _content(m: dict, i: int) -> str | None:
    c = m.get("content")
    if c is None or isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for j, part in enumerate(c):
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{i}].content: only text parts are supported, not "
                                  f"{kind!r}", f"messages[{i}].content")
            if not isinstance(part.get("text"), str):
                where = f"messages[{i}].content[{j}].text"
                raise bad_request(f"{where} must be a string", where)
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                      f"messages[{i}].content")


def parse_chat(body: Any, max_tokens_limit: int) -> ParsedRequest:
    req = _common(body, "chat", _CHAT, max_tokens_limit)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad_request("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        role = m.get("role") if isinstance(m, dict) else None
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(f"messages[{i}].role is {role!r}; Strata takes "
                              f"{', '.join(sorted(_ROLES))}",
                              f"messages[{i}].role")
        extra = set(m) - {"role", "content", "name", "reasoning_content", "refusal",
                          "tool_calls", "tool_call_id"}
        if extra:
            raise bad_request(f"messages[{i}]: unsupported field(s) {', '.join(sorted(extra))}",
                              f"messages[{i}].{sorted(extra)[0]}")
        content = _content(m, i)
        if content is None and m["role"] != "assistant":
            raise bad_request(f"messages[{i}].content is missing", f"messages[{i}].content")
        role = "system" if m["role"] == "developer" else m["role"]
        msg = {"role": role, "content": content or ""}
        if m.get("reasoning_content") is not None:
            if not isinstance(m["reasoning_content"], str):
                raise bad_request(f"messages[{i}].reasoning_content must be a string",
                                  f"messages[{i}].reasoning_content")
            msg["reasoning_content"] = m["reasoning_content"]
        _tool_fields(m, msg, i)
        out.append(msg)
    req.messages = out
    req.grammar = _response_format(body.get("response_format"))
    req.tools = check_tools(body.get("tools"))
    req.tool_choice, req.tool_name = check_tool_choice(body.get("tool_choice"), req.tools)
    if req.tools and req.tool_choice != "none":
        req.template_kwargs["tools"] = req.tools
    if req.grammar is not None and req.tool_choice == "required":
        raise bad_request("response_format and tool_choice='required' (or a named function) "
                          "both decide the answer's form: give one of them", "response_format")
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort={effort!r}: choose from "
                              f"{', '.join(REASONING_EFFORTS)}", "reasoning_effort")
        req.template_kwargs["reasoning_effort"] = effort
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
            raise bad_request("chat_template_kwargs must be an object", "chat_template_kwargs")
        taken = sorted(set(kwargs) & _RESERVED_KWARGS)
        if taken:
            raise bad_request(f"chat_template_kwargs: {', '.join(taken)} is set by the server",
                              "chat_template_kwargs")
        req.template_kwargs.update(kwargs)
    return req


def _response_format(v: Any) -> str | None:
    """json_object / json_schema -> the grammar the engine enforces; text -> None."""
    if v is None:
        return None
    kinds = ("text", "json_object", "json_schema")
    if not isinstance(v, dict) or v.get("type") not in kinds:
        raise bad_request(f"response_format: give {{\"type\": ...}} with a type from "
                          f"{', '.join(kinds)}", "response_format")
    if v["type"] == "text":
        return None
    schema, strict = None, False
    if v["type"] == "json_schema":
        js = v.get("json_schema")
        where = "response_format.json_schema"
        if not isinstance(js, dict):
            raise bad_request(f'{where}: give {{"name", "schema", "strict"}}', where)
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.schema must be a JSON Schema object", f"{where}.schema")
        strict = js.get("strict") or False
        if not isinstance(strict, bool):
            raise bad_request(f"{where}.strict must be true or false", f"{where}.strict")
    from strata.engine import constrain  # no torch: the schema is only checked here

    if not constrain.available():
        raise bad_request(f"response_format={v['type']} needs llguidance on the server: "
                          f"{constrain.INSTALL}", "response_format", "unsupported_parameter")
    try:
        return constrain.json_grammar(schema, strict)
    except StrataError as e:
        raise bad_request(f"response_format: {e}", "response_format.json_schema.schema"
                          if schema is not None else "response_format") from None


def _tool_fields(m: dict, msg: dict, i: int) -> None:
    """An assistant's tool_calls and a tool message's tool_call_id / name, checked."""
    for key in ("tool_call_id", "name"):
        if key in m and not isinstance(m[key], str):
            raise bad_request(f"messages[{i}].{key} must be a string", f"messages[{i}].{key}")
    if m.get("tool_calls") is not None:
        if m["role"] != "assistant":
            raise bad_request(f"messages[{i}].tool_calls: only an assistant message makes calls",
                              f"messages[{i}].tool_calls")
        msg["tool_calls"] = check_calls(m["tool_calls"], i)
    if m["role"] == "tool":
        for key in ("tool_call_id", "name"):
            if key in m:
                msg[key] = m[key]


def parse_completion(body: Any, max_tokens_limit: int) -> ParsedRequest:
    req = _common(body, "completions", _COMPLETION, max_tokens_limit)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        req.prompt = p
    elif isinstance(p, str) and p:
        req.prompt = p
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad_request(f"prompt holds {len(p)} prompts; Strata takes one per request",
                          "prompt", "unsupported_parameter")
    else:
        raise bad_request("prompt must be a non-empty string or a list of token ids (integers)",
                          "prompt")
    return req
