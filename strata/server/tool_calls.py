"""A model's output in its own call format -> content, reasoning and OpenAI tool calls.

Three formats, chosen from the chat template (`parser_for`):
    hermes   Qwen:    <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    glm      GLM-4.5: <tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>...</tool_call>
    harmony  gpt-oss: <|channel|>analysis<|message|>...<|end|><|start|>assistant
                      <|channel|>commentary to=functions.f <|constrain|>json<|message|>{...}<|call|>

Every parser streams: `push(text)` returns the events the text completes, text that could still
turn into a call marker is held back, and a call comes out whole once its end is seen (or at
`flush()`, where a stop token cut it off). A call that does not parse stays text. Events:
("content", text), ("reasoning", text), ("call", ToolCall).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

from strata.server.call_grammar import call_grammar as call_grammar  # the call's grammar
from strata.server.json_checks import SURROGATE

Event = tuple[str, Any]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class Parsed:
    content: str
    reasoning: str
    calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _held(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of buf that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:n]):
                best = n
                break
    return best


class _Tagged:
    """<tool_call>BODY</tool_call> anywhere in the text; BODY decoded by the subclass."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[dict] | None = None):
        self.tools = {t["function"]["name"]: t["function"] for t in tools or []}
        self.buf = ""
        self.inside = False

    def push(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            if not self.inside:
                at = self.buf.find(self.OPEN)
                if at < 0:
                    keep = _held(self.buf, (self.OPEN,))
                    _text(out, "content", self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                _text(out, "content", self.buf[:at])
                self.buf, self.inside = self.buf[at:], True
            end = self.buf.find(self.CLOSE)
            if end < 0:
                return out
            whole = self.buf[:end + len(self.CLOSE)]
            self.buf, self.inside = self.buf[len(whole):], False
            self._call(out, whole, whole[len(self.OPEN):end])

    def flush(self) -> list[Event]:
        out: list[Event] = []
        rest, self.buf = self.buf, ""
        if self.inside:  # a stop token (or max_tokens) came before </tool_call>
            self.inside = False
            self._call(out, rest, rest[len(self.OPEN):])
        else:
            _text(out, "content", rest)
        return out

    def _call(self, out: list[Event], whole: str, body: str) -> None:
        call = self.decode(body)
        if call is None:
            _text(out, "content", whole)
        else:
            out.append(("call", ToolCall(call[0], call[1], new_call_id())))

    def decode(self, body: str) -> tuple[str, str] | None:
        raise NotImplementedError


class HermesParser(_Tagged):
    """Qwen's (NousResearch Hermes's) JSON call."""

    def decode(self, body: str) -> tuple[str, str] | None:
        try:
            obj = json.loads(body.strip())
        except ValueError:
            return None
        if (not isinstance(obj, dict) or not isinstance(obj.get("name"), str)
                or SURROGATE.search(obj["name"])):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models write the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return obj["name"], _json_text(args)


_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class GLMParser(_Tagged):
    """GLM-4.5's name line and key/value pairs: a value is JSON unless its parameter is a string
    (the template writes strings as they are and everything else as JSON)."""

    def decode(self, body: str) -> tuple[str, str] | None:
        name, _, rest = body.strip().partition("\n")
        name = name.strip()
        if not name or "<" in name:
            if "<arg_key>" not in name:
                return None
            name, rest = name[:name.index("<arg_key>")].strip(), name[name.index("<arg_key>"):]
        props = (self.tools.get(name, {}).get("parameters") or {}).get("properties") or {}
        args: dict[str, Any] = {}
        for key, raw in _GLM_ARG.findall(rest):
            key = key.strip()
            if (props.get(key) or {}).get("type") == "string":
                args[key] = raw
                continue
            try:
                args[key] = json.loads(raw)
            except ValueError:
                args[key] = raw
        if _GLM_ARG.sub("", rest).strip():  # text that is not a key/value pair
            return None
        return name, _json_text(args)


class HarmonyParser:
    """gpt-oss's channels: analysis -> reasoning, final (and commentary to nobody) -> content,
    a message to=functions.NAME -> a call with its body as the arguments."""

    MESSAGE, START = "<|message|>", "<|start|>"
    ENDS = ("<|end|>", "<|call|>", "<|return|>")
    _MAX_HEADER = 512  # header text this long without <|message|>: not harmony after all

    def __init__(self, tools: list[dict] | None = None):
        self.buf = ""
        self.state = "header"  # header, or the open message: content, reasoning, call
        self.recipient = ""

    def push(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        while True:
            if self.state == "header":
                at = self.buf.find(self.MESSAGE)
                if at < 0:
                    if len(self.buf) > self._MAX_HEADER:
                        self.state = "content"
                        continue
                    return out
                self._open(self.buf[:at])
                self.buf = self.buf[at + len(self.MESSAGE):]
                continue
            ends = [(i, m) for m in self.ENDS if (i := self.buf.find(m)) >= 0]
            if not ends:
                if self.state != "call":
                    keep = _held(self.buf, (*self.ENDS, self.START))
                    _text(out, self.state, self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                return out
            at, marker = min(ends)
            self._close(out, self.buf[:at])
            self.buf, self.state = self.buf[at + len(marker):], "header"

    def flush(self) -> list[Event]:
        out: list[Event] = []
        rest, self.buf = self.buf, ""
        if self.state == "header":  # an unfinished header: shown only if it is not one
            if rest.strip() and "<|channel|>" not in rest and self.START not in rest:
                _text(out, "content", rest)
        else:
            self._close(out, rest)
        self.state = "header"
        return out

    def _open(self, header: str) -> None:
        header = header.replace(self.START, " ")
        m = re.search(r"to=(\S+?)(?=<\||\s|$)", header)
        self.recipient = m.group(1) if m else ""
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        if self.recipient.startswith("functions."):
            self.state = "call"
        elif channel and channel.group(1) == "analysis":
            self.state = "reasoning"
        else:
            self.state = "content"

    def _close(self, out: list[Event], body: str) -> None:
        if self.state != "call":
            _text(out, self.state, body)
            return
        name, args = self.recipient[len("functions."):], body.strip()
        try:
            parsed = json.loads(args or "{}")
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            args = _json_text(parsed)
        out.append(("call", ToolCall(name, args, new_call_id())))


def _json_text(args: dict[str, Any]) -> str:
    """A call's arguments as JSON text. A lone surrogate the model wrote as an escape ("\\ud800")
    stays an escape: no response can carry it as a character."""
    text = json.dumps(args, ensure_ascii=False)
    return text if SURROGATE.search(text) is None else json.dumps(args)


def _text(out: list[Event], kind: str, text: str) -> None:
    if not text:
        return
    if out and out[-1][0] == kind:
        out[-1] = (kind, out[-1][1] + text)
    else:
        out.append((kind, text))


PARSERS = {"hermes": HermesParser, "glm": GLMParser, "harmony": HarmonyParser}


def format_of(template: str | None, arch: str | None = None) -> str:
    """Which call format a model writes, from its chat template (its architecture otherwise)."""
    t = template or ""
    if "<|channel|>" in t or arch == "gpt-oss":
        return "harmony"
    if "<arg_key>" in t or (arch or "").startswith("glm4"):
        return "glm"
    return "hermes"


def parser_for(fmt: str, tools: list[dict] | None) -> HermesParser | GLMParser | HarmonyParser:
    return PARSERS[fmt](tools)


def parse(fmt: str, text: str, tools: list[dict] | None = None) -> Parsed:
    """A whole answer at once (the same parser as a stream)."""
    p = parser_for(fmt, tools)
    events = p.push(text) + p.flush()
    return Parsed("".join(v for k, v in events if k == "content"),
                  "".join(v for k, v in events if k == "reasoning"),
                  tuple(v for k, v in events if k == "call"))


def forced_prefix(fmt: str, name: str | None) -> str:
    """What the answer starts with when tool_choice is "required" (name None) or names one
    function: written after the generation prompt, so the model goes on inside a call (and, with
    llguidance, call_grammar's grammar writes the rest)."""
    if fmt == "harmony":
        return ("<|channel|>commentary to=functions." +
                (f"{name} <|constrain|>json<|message|>" if name else ""))
    if fmt == "glm":
        return "<tool_call>" + (f"{name}\n" if name else "")
    return "<tool_call>\n" + (json.dumps({"name": name})[:-1] + ', "arguments": ' if name else "")
