"""Tools for a chat template that takes none (it never reads `tools`): the conversation is
rewritten into messages such a template renders, in the hermes call format, the one the answer
is then parsed with (tool_calls.format_of picks hermes for these templates):

    the tools        a system message (appended to the first one) in Qwen2.5's words, each tool
                     one JSON line inside <tools></tools>, and how to write a call
    assistant calls  the message's content, then <tool_call>\\n{"name", "arguments"}\\n</tool_call>
    tool results     user messages, <tool_response>\\n...\\n</tool_response> each (a run of them is
                     one user message)

A template that reads `tools` gets the messages and tools as they came.
"""

from __future__ import annotations

import json
from typing import Any

_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
          "You are provided with function signatures within <tools></tools> XML tags:\n<tools>")
_HOW = ("</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def takes_tools(template: str | None) -> bool:
    """Whether the chat template reads the `tools` variable (or may: any mention counts)."""
    return template is not None and "tools" in template


def needs_rewrite(template: str | None, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None) -> bool:
    if takes_tools(template):
        return False
    return bool(tools) or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def tools_text(tools: list[dict[str, Any]]) -> str:
    lines = [json.dumps(t, ensure_ascii=False) for t in tools]
    return "\n".join([_INTRO, *lines, _HOW])


def call_text(call: dict[str, Any]) -> str:
    f = call["function"]
    body = json.dumps({"name": f["name"], "arguments": f["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def rewrite(messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The messages (validation.parse_chat's: arguments as objects) for a template that takes
    no tools; `tools` None or empty writes no tool list (tool_choice "none")."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("_results"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            parts = ([m["content"]] if m["content"] else []) + [call_text(c)
                                                                for c in m["tool_calls"]]
            rest = {k: v for k, v in m.items() if k not in ("tool_calls", "content")}
            out.append({**rest, "content": "\n".join(parts)})
        else:
            out.append(dict(m))
    for m in out:
        m.pop("_results", None)
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{tools_text(tools)}"}
        else:
            out.insert(0, {"role": "system", "content": tools_text(tools)})
    return out
