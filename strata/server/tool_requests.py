"""The tool side of a chat request: `tools`, `tool_choice`, and the messages that carry calls
(an assistant's `tool_calls`, a `tool` message's result), checked; every 400 names the field.

The template gets the tools as OpenAI writes them ({"type": "function", "function": {...}}) and a
call's arguments as an object (templates iterate them or write them with tojson).
"""

from __future__ import annotations

import json
from typing import Any

from strata.server.errors import bad_request
from strata.server.json_checks import check_json

TOOL_CHOICES = ("auto", "none", "required")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def check_tools(v: Any) -> list[dict[str, Any]] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise bad_request(f"tools must be a list of tools, not {type(v).__name__}", "tools")
    out, names = [], set()
    for i, t in enumerate(v):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise bad_request(f'{where}: give {{"type": "function", "function": {{...}}}}', where)
        extra = sorted(set(t) - {"type", "function"})
        if extra:
            raise bad_request(f"{where}: unknown field(s) {', '.join(extra)}",
                              f"{where}.{extra[0]}")
        f = t.get("function")
        if not isinstance(f, dict):
            raise bad_request(f"{where}.function must be an object", f"{where}.function")
        extra = sorted(set(f) - _FUNCTION_KEYS)
        if extra:
            raise bad_request(f"{where}.function: unknown field(s) {', '.join(extra)}",
                              f"{where}.function.{extra[0]}")
        name = f.get("name")
        if not isinstance(name, str) or not name.strip():
            raise bad_request(f"{where}.function.name: give the function's name",
                              f"{where}.function.name")
        if name in names:
            raise bad_request(f"{where}.function.name: {name!r} is given twice",
                              f"{where}.function.name")
        names.add(name)
        if not isinstance(f.get("description", ""), str):
            raise bad_request(f"{where}.function.description must be a string",
                              f"{where}.function.description")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON Schema object, not "
                              f"{type(params).__name__}", f"{where}.function.parameters")
        if not isinstance(f.get("strict", False), bool):
            raise bad_request(f"{where}.function.strict must be true or false",
                              f"{where}.function.strict")
        out.append({"type": "function", "function": {k: f[k] for k in f if f[k] is not None}})
    return out


def check_tool_choice(v: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """("auto" | "none" | "required", the function named or None)."""
    names = [t["function"]["name"] for t in tools or []]
    if v is None:
        return ("auto" if tools else "none"), None
    if isinstance(v, str):
        if v not in TOOL_CHOICES:
            raise bad_request(f"tool_choice={v!r}: choose from {', '.join(TOOL_CHOICES)} or "
                              '{"type": "function", "function": {"name": ...}}', "tool_choice")
        if v == "required" and not tools:
            raise bad_request("tool_choice='required' needs tools", "tool_choice")
        return v, None
    f = v.get("function") if isinstance(v, dict) else None
    name = f.get("name") if isinstance(f, dict) else None
    if not isinstance(v, dict) or v.get("type") != "function" or not isinstance(name, str):
        raise bad_request('tool_choice: give "auto", "none", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not in tools "
                          f"({', '.join(names) or 'none given'})", "tool_choice")
    return "required", name


def check_calls(v: Any, i: int) -> list[dict[str, Any]]:
    """An assistant message's tool_calls, with each call's arguments parsed into an object."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(v, list):
        raise bad_request(f"{where} must be a list", where)
    out = []
    for j, c in enumerate(v):
        at = f"{where}[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or c.get("type", "function") != "function":
            raise bad_request(f'{at}: give {{"id", "type": "function", "function": {{"name", '
                              f'"arguments"}}}}', at)
        if not isinstance(f.get("name"), str) or not f["name"]:
            raise bad_request(f"{at}.function.name: give the function's name",
                              f"{at}.function.name")
        args = f.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError as e:
                raise bad_request(f"{at}.function.arguments is not valid JSON: {e}",
                                  f"{at}.function.arguments") from None
            except RecursionError:
                raise bad_request(f"{at}.function.arguments nests objects and arrays too deep",
                                  f"{at}.function.arguments") from None
            check_json(args, f"{at}.function.arguments")  # (as the body's own values are)
        if not isinstance(args, dict):
            raise bad_request(f"{at}.function.arguments must be a JSON object",
                              f"{at}.function.arguments")
        call_id = c.get("id", "")
        if not isinstance(call_id, str):
            raise bad_request(f"{at}.id must be a string", f"{at}.id")
        out.append({"id": call_id, "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out
