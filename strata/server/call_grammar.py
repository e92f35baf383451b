"""The grammar of a forced tool call: what follows tool_calls.forced_prefix, in each call format.

With tool_choice "required" (name None: any one of the tools) or a named function the answer
starts inside a call, and this Lark text (llguidance's, compiled by constrain.lark_grammar) makes
the rest one whole call whose arguments follow the function's `parameters` JSON schema (`strict`:
every object that lists properties is closed), written so that the format's parser
(tool_calls.py) reads back exactly that call. [...] is what the grammar writes for "required";
for a named function the prefix has written it:

    hermes   [{"name": "f", "arguments": ]ARGS}\\n</tool_call>
    harmony  [f <|constrain|>json<|message|>]ARGS<|call|>       <|call|>: the special token,
                                                                 which ends generation
    glm      [f\\n](<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n)*</tool_call>

ARGS is one JSON object (", " and ": ", as constrain.json_value writes it). GLM's key/value form
holds less than a schema can say, so there (`_glm_args`): the keys are the schema's
`properties` (then any `required` name it does not list, any value), in that order, each at most
once, the required ones always; no other keys. A value whose schema's type is "string" is its raw
text, as GLM's template writes it and the parser reads it: one of its `enum` / `const`, else any
text of minLength..maxLength characters that holds no "</arg_value>" or "</tool_call>"
(`pattern` and `format` are not enforced there). An `enum` / `const` without that type is its
values, each written as the parser reads it back (a string raw unless that text is JSON, then as
JSON). Any other value (numbers, booleans, null, arrays, nested objects, anyOf...) is JSON text
that its schema accepts, with the root's $defs for a $ref. Object-level keywords
(minProperties, patternProperties, dependentRequired, a top-level anyOf) are not enforced.

In every format, a string inside JSON arguments that holds the format's end marker as text
("</arg_value>", "</tool_call>", "<|call|>" written in plain characters) would cut the call short
when read back: the grammar does not keep such strings out.

A function whose name the format cannot write (harmony: whitespace or "<|"; glm: "<", a newline,
leading or trailing space) is left out of "required"'s choice; with none left there is no grammar.
"""

from __future__ import annotations

import json
import re
from typing import Any

from strata.engine.constrain import json_value
from strata.errors import StrataError

_GLM_END = "</arg_value>"
_NAMEABLE = {
    "hermes": lambda n: True,
    "harmony": lambda n: re.fullmatch(r"\S+", n) is not None and "<|" not in n,
    "glm": lambda n: bool(n) and n == n.strip() and "<" not in n and "\n" not in n,
}


def call_grammar(fmt: str, tools: list[dict], name: str | None) -> str | None:
    """Lark text for what follows forced_prefix(fmt, name): one call to the named function (name
    None: to any one of tools) whose arguments follow its parameters schema; None where no
    function can be written. Raises StrataError for parameters no call can satisfy."""
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if name is None:
        chosen = [f for f in chosen if _NAMEABLE[fmt](f["name"])]
    if not chosen:
        return None
    rules, alts = [], []
    for i, f in enumerate(chosen):
        params, strict = f.get("parameters"), bool(f.get("strict"))
        if fmt == "glm":
            rules += _glm_args(f"args{i}", params, strict, f["name"])
        else:
            rules.append(f"args{i}: {json_value(params, strict)}")
        alts.append(f"{_head(fmt, f['name'])} args{i}" if name is None else f"args{i}")
    end = {"hermes": '"}\\n</tool_call>"', "harmony": "<|call|>", "glm": '"</tool_call>"'}[fmt]
    return "\n".join([f"start: ({' | '.join(alts)}) {end}", *rules]) + "\n"


def _head(fmt: str, name: str) -> str:
    """The call's start up to its arguments, where forced_prefix left the name out."""
    if fmt == "harmony":
        return f'{_lit(name + " ")} <|constrain|> "json" <|message|>'
    if fmt == "glm":
        return _lit(name + "\n")
    return _lit(json.dumps({"name": name})[:-1] + ', "arguments": ')


def _glm_args(rule: str, params: Any, strict: bool, name: str) -> list[str]:
    """Rules for GLM's key/value pairs of one function (the module's docstring says what)."""
    params = params if isinstance(params, dict) else {}
    props = dict(params["properties"]) if isinstance(params.get("properties"), dict) else {}
    required = [k for k in params.get("required") or [] if isinstance(k, str)]
    props.update({k: {} for k in required if k not in props})
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    rules, items = [], []
    for j, (key, schema) in enumerate(props.items()):
        if key != key.strip() or "<" in key:  # the parser would not read it back
            if key in required:
                raise StrataError(f"{name}.{key}: a key GLM's arguments cannot hold")
            continue
        value = f"{rule}_{j}".upper() if _raw_string(schema) else f"{rule}_{j}"
        rules.append(f"{value}: {_glm_value(schema, strict, defs, f'{name}.{key}')}")
        head = _lit(f"<arg_key>{key}</arg_key>\n<arg_value>")
        items.append(f'({head} {value} "\\n")' + ("" if key in required else "?"))
    return [f"{rule}: {' '.join(items) or _lit('')}", *rules]


def _raw_string(schema: Any) -> bool:
    """The parser reads this parameter's value as raw text (tool_calls.GLMParser)."""
    return isinstance(schema, dict) and schema.get("type") == "string"


def _glm_value(schema: Any, strict: bool, defs: dict, where: str) -> str:
    """One value and its "</arg_value>": a Lark terminal for raw text, else a rule."""
    schema = schema if isinstance(schema, dict) else {}
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None and not isinstance(values, list):
        raise StrataError(f"{where}: enum is not a list")
    if _raw_string(schema):
        if values is None:
            lo, hi = schema.get("minLength", 0), schema.get("maxLength", "")
            if not all(type(n) is int and n >= 0 for n in (lo, hi) if n != ""):
                raise StrataError(f"{where}: minLength and maxLength must be counts")
            return (f"(/(?s:.){{{lo},{hi}}}/ & "
                    f'~/(?s:.)*<\\/(arg_value|tool_call)>(?s:.)*/) "{_GLM_END}"')
        texts = [v for v in values if isinstance(v, str)]
    elif values is not None:
        texts = [_as_read(v) for v in values]
    else:
        if defs and "$ref" in json.dumps(schema):
            schema = {**defs, **schema}
        return f'{json_value(schema, strict)} "{_GLM_END}"'
    texts = [t for t in texts if _GLM_END not in t and "</tool_call>" not in t]
    if not texts:
        raise StrataError(f"{where}: no value of its enum can be written as a GLM argument")
    return "(" + " | ".join(_lit(t + _GLM_END) for t in texts) + ")"


def _as_read(value: Any) -> str:
    """A value's text such that GLMParser reads it back as that value."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, ensure_ascii=False)


def _lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text)
