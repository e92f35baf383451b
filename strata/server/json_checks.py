"""What every JSON value from a client passes before anything reads it: objects and arrays nest at
most MAX_DEPTH deep, and every string is Unicode (JSON's "\\ud800" escape can write a lone
surrogate, which no tokenizer or response can encode). Each 400 names where, as `param` does:
messages[0].content.
"""

from __future__ import annotations

import re
from typing import Any

from strata.server.errors import bad_request

MAX_DEPTH = 32  # nesting of a request body's objects and arrays
SURROGATE = re.compile("[\ud800-\udfff]")  # a lone one (a pair is one character)


def check_json(value: Any, where: str = "") -> None:
    """Raise the 400 for parsed JSON nested more than MAX_DEPTH deep or holding a lone surrogate;
    `where`: the value's place in the body ("" for the body itself). Iterative: no recursion
    limit, and only containers and strings beyond ASCII are visited."""
    todo: list[tuple[Any, int, tuple]] = [(value, 0, ())]  # (value, depth, (key, parent's))
    while todo:
        v, d, at = todo.pop()
        if isinstance(v, str) and SURROGATE.search(v):
            path = _path(where, at)
            raise bad_request(f"{path or 'the request body'}: a string holds a lone UTF-16 "
                              "surrogate (a \\ud800-\\udfff escape without its pair), which is "
                              "not Unicode: send the character itself or its whole pair",
                              path or None, "invalid_unicode")
        if not isinstance(v, (dict, list)):
            continue
        if d == MAX_DEPTH:  # (named by the request field it is in)
            field = where or _path("", at).split(".")[0].split("[")[0]
            raise bad_request(f"{field or 'the request body'}: objects and arrays nest more than "
                              f"{MAX_DEPTH} deep", field or None)
        for k, x in v.items() if isinstance(v, dict) else enumerate(v):
            if isinstance(x, (dict, list)) or (isinstance(x, str) and not x.isascii()):
                todo.append((x, d + 1, (k, at)))
            if isinstance(k, str) and not k.isascii():
                todo.append((k, d + 1, (k, at)))  # (a key's own text)


def _path(where: str, at: tuple) -> str:
    parts = []
    while at:
        key, at = at
        parts.append(f"[{key}]" if isinstance(key, int) else
                     "." + key.encode("utf-8", "backslashreplace").decode())
    return (where + "".join(reversed(parts))).lstrip(".")
