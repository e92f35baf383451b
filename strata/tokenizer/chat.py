"""`ChatTemplate`: messages -> prompt text, with the Jinja template in `tokenizer.chat_template`.

Templates come with downloaded files, so they are untrusted code. They run in Jinja's immutable
sandbox, set up the way transformers' `apply_chat_template` sets it up (same options, helpers and
`tojson`), so that a template renders here exactly as it does there. Stricter than there:

- reading an attribute the sandbox calls unsafe (`__class__`, `__globals__`, ...) is an error at
  once, where plain Jinja would hand back an empty value and carry on;
- a render (and the tokenizing of its text) has a deadline and a size cap (`TemplateLimits`):
  every call, filter, `*`, `+`, `%`, `**` and `~` the template makes is checked against both
  before it runs (sizes it would build) and after (sizes it built), the output is counted as it
  streams, and a loop that calls nothing is stopped by an exception raised in the rendering
  thread at the deadline;
- text that spells a special token (`<|im_start|>`) inside message content or other request
  values is tokenized as text: only the template's own markers become control tokens, so a
  message cannot forge a turn of another role.
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from strata.errors import StrataError
from strata.tokenizer.vocab import Tokenizer

# What transformers used when a tokenizer had no template: ChatML.
CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_WIDE_FORMAT = re.compile(r"\d{7,}")  # a format width or precision of a million or more
_MARKERS = ("\U0010fffd", "\U000ffffd", "\uf8ff", "\ue000")  # private-use: escape candidates


@dataclass(frozen=True)
class TemplateLimits:
    """Bounds of one render: wall seconds (render and tokenize) and characters (the output, and
    any string, list or argument the template builds on the way)."""

    seconds: float = 5.0
    max_chars: int = 4 << 20


class _Limit(Exception):
    """The template ran into a TemplateLimits bound (raised inside the render)."""


class _TimeUp(BaseException):
    """Raised asynchronously in the rendering thread at the deadline (a BaseException, so that
    no `except Exception` inside the template machinery swallows it)."""


@dataclass
class _Budget:
    deadline: float
    limits: TemplateLimits


_current = threading.local()  # the budget of the render running in this thread


def _budget() -> _Budget | None:
    return getattr(_current, "budget", None)


def _check_time() -> None:
    b = _budget()
    if b is not None and time.monotonic() > b.deadline:
        raise _Limit(f"ran past its deadline of {b.limits.seconds:g} s")


def _cap() -> int:
    b = _budget()
    return (b.limits if b is not None else TemplateLimits()).max_chars


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set)) else 0


def _check_size(n: int, what: str) -> None:
    if n > _cap():
        raise _Limit(f"{what} would hold {n:,} items, over the limit of {_cap():,}")


def _check_args(args: tuple, kwargs: dict, what: str) -> None:
    """Before a call: no integer argument past the cap (widths, counts), and the strings and
    lists passed in (with the strings inside the lists) add up to at most the cap."""
    total = 0
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > _cap():
            raise _Limit(f"{what} got the number {a}, over the limit of {_cap():,}")
        total += _size(a)
        if isinstance(a, (list, tuple)) and len(a) <= _cap():
            total += sum(_size(x) for x in a)
    _check_size(total, f"the result of {what}")


def _predict(name: str, owner: Any, args: tuple) -> int:
    """What the few string operations that multiply their input would build."""
    if name == "replace" and isinstance(owner, str) and len(args) >= 2:
        old, new = args[0], args[1]
        if isinstance(old, str) and isinstance(new, str):
            return len(owner) + (owner.count(old) if old else len(owner) + 1) * len(new)
    if name == "indent" and isinstance(owner, str) and args and isinstance(args[0], int):
        return len(owner) + (owner.count("\n") + 1) * abs(args[0])
    if name in ("format", "format_map") and isinstance(owner, str) and _WIDE_FORMAT.search(owner):
        raise _Limit(f"a format string with a width of a million or more ({owner[:40]!r})")
    return 0


class _Sandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "%", "**"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe"
        )

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_time()
        _check_args(args, kwargs, "a call")
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        _check_size(_predict(getattr(target, "__name__", ""), getattr(target, "__self__", None),
                             args), "the result of a call")
        out = super().call(__context, __obj, *args, **kwargs)
        _check_size(_size(out), "the result of a call")
        return out

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _size(seq) and isinstance(n, int):
                    _check_size(_size(seq) * max(n, 0), f"{type(seq).__name__} * {n}")
        elif operator == "+":
            _check_size(_size(left) + _size(right), "the result of +")
        elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise _Limit(f"a format string with a width of a million or more ({left[:40]!r})")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 4096:
            if not isinstance(left, (int, float)) or abs(left) > 1:
                raise _Limit(f"the power ** {right} is over the limit of 4096")
        return super().call_binop(context, operator, left, right)

    def concat_checked(self, text: str) -> str:
        """`a ~ b`: checked after joining (each step at most doubles what was checked before)."""
        _check_time()
        _check_size(len(text), "the result of ~")
        return text


class _CodeGenerator(CodeGenerator):
    def visit_Concat(self, node: Any, frame: Any) -> None:
        self.write("environment.concat_checked(")
        super().visit_Concat(node, frame)
        self.write(")")


_Sandbox.code_generator_class = _CodeGenerator


def _guarded_filter(name: str, f: Callable) -> Callable:
    @functools.wraps(f)  # keeps jinja_pass_arg (pass_context, pass_environment)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _check_time()
        values = tuple(a for a in args if not isinstance(a, (jinja2.runtime.Context,
                                                             jinja2.Environment)))
        _check_args(values, kwargs, f"the filter {name}")
        if values:
            _check_size(_predict(name, values[0], values[1:]), f"the filter {name}")
        out = f(*args, **kwargs)
        _check_size(_size(out), f"the result of the filter {name}")
        return out

    return guarded


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training; renders as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, so a template cannot reach Python internals."""

    def __init__(*args: Any, **kwargs: Any):
        self, values = args[0], dict(*args[1:], **kwargs)
        for name in values:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, values)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        _check_time()
        _check_size(_size(value), f"namespace attribute {name!r}")
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> jinja2.Environment:
    if _version(jinja2.__version__) < (3, 1, 6):  # older sandboxes have known escapes
        raise StrataError(f"chat templates need jinja2 >= 3.1.6 (found {jinja2.__version__})")
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _guarded_filter(name, f) for name, f in env.filters.items()}
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace
    )
    return env


def _plain(value: Any) -> Any:
    """Only plain JSON-like data reaches the template; anything else becomes a placeholder."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    # Subclasses (enums, numpy scalars) go back to the base type and lose their methods.
    for base in (bool, str, int, float):
        if isinstance(value, base):
            return base.__str__(value) if base is str else base(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalar
        return _plain(value.item())
    return f"<{type(value).__name__}>"


def _strings(value: Any) -> list[str]:
    """Every string in plain data (keys included)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def _mark(value: Any, pattern: re.Pattern, marker: str) -> Any:
    """Plain data with a marker written in front of every special-token text in its strings."""
    if isinstance(value, str):
        return pattern.sub(lambda m: marker + m.group(0), value)
    if isinstance(value, dict):
        return {_mark(k, pattern, marker): _mark(v, pattern, marker) for k, v in value.items()}
    if isinstance(value, list):
        return [_mark(v, pattern, marker) for v in value]
    return value


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: no None values, reasoning under all its usual names."""
    if not isinstance(message, Mapping):
        raise StrataError(f"a message is {type(message).__name__}, not an object")
    out = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class _Deadline:
    """Raises _TimeUp in the thread that entered it, if still inside after `seconds`."""

    def __init__(self, seconds: float):
        self._tid = threading.get_ident()
        self._lock = threading.Lock()
        self._inside = True
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def _fire(self) -> None:
        with self._lock:
            if self._inside:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self._tid),
                                                           ctypes.py_object(_TimeUp))

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._inside = False
        self._timer.cancel()


def _settle() -> None:
    for _ in range(2):  # a backward jump: an exception raised at the deadline arrives by now
        pass


class ChatTemplate:
    """Renders a conversation into the prompt text the model was trained on."""

    def __init__(self, template: str, tokenizer: Tokenizer, source: str = "",
                 limits: TemplateLimits | None = None):
        self.template = template
        self.limits = limits or TemplateLimits()
        self._tokenizer = tokenizer
        self._where = source or "GGUF metadata"
        try:  # (untrusted code: its compile is bounded as its renders are)
            with _Deadline(self.limits.seconds):
                self._compiled = _environment().from_string(template)
            _settle()
        except jinja2.TemplateSyntaxError as e:
            raise StrataError(
                f"{self._where}: tokenizer.chat_template does not parse: {_one_line(e)}"
            ) from None
        except (RecursionError, SyntaxError):  # (Python's own limits on nesting)
            raise StrataError(f"{self._where}: tokenizer.chat_template does not compile: it nests "
                              "too deeply") from None
        except _TimeUp:
            raise StrataError(f"{self._where}: tokenizer.chat_template did not compile within "
                              f"{self.limits.seconds:g} s ({len(template):,} characters)") from None
        self._specials = {
            f"{name}_token": tokenizer.token_text(token_id)
            for name, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id))
            if token_id is not None
        }
        texts = sorted(tokenizer.special_texts(), key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, texts))) if texts else None

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @classmethod
    def from_metadata(
        cls, meta: Mapping[str, Any], tokenizer: Tokenizer, source: str = "",
        limits: TemplateLimits | None = None,
    ) -> ChatTemplate:
        """The file's template, or ChatML when it has none."""
        template = meta.get("tokenizer.chat_template") or CHATML
        if not isinstance(template, str):
            raise StrataError(f"{source or 'GGUF metadata'}: tokenizer.chat_template is "
                              f"{type(template).__name__}, not a string")
        return cls(template, tokenizer, source, limits)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text. Extra keyword arguments reach the template as variables
        (enable_thinking, reasoning_effort, tools, documents, ...)."""
        text, marker = self._bounded(lambda: self._render(messages, add_generation_prompt,
                                                          kwargs, escape=False))
        return text

    def encode(
        self, messages: list[dict], add_generation_prompt: bool = True,
        add_bos: bool | None = None, **kwargs: Any,
    ) -> list[int]:
        """Prompt token ids: the rendered text with the template's special tokens parsed (those
        written inside messages and other values stay text), and BOS added only when the
        tokenizer wants one (or `add_bos` says so) and the template did not already write it."""
        def run() -> list[int]:
            text, marker = self._render(messages, add_generation_prompt, kwargs, escape=True)
            plain = text.replace(marker, "") if marker else text
            bos = self._specials.get("bos_token")
            want = self._tokenizer.add_bos if add_bos is None else add_bos
            ids = self._encode(text, marker)
            if want and not (bos and plain.startswith(bos)) and self._tokenizer.bos_id is not None:
                ids.insert(0, self._tokenizer.bos_id)
            return ids

        return self._bounded(run)

    # --- internals -------------------------------------------------------------------------
    def _bounded(self, fn: Callable[[], Any]) -> Any:
        """fn() within the limits: one line naming the template when it runs past them."""
        lim = self.limits
        _current.budget = _Budget(time.monotonic() + lim.seconds, lim)
        try:
            try:
                with _Deadline(lim.seconds):
                    out = fn()
                _settle()
            finally:
                _current.budget = None
        except (_TimeUp, _Limit) as e:
            why = str(e) if isinstance(e, _Limit) else f"ran past its deadline of {lim.seconds:g} s"
            raise StrataError(f"{self._where}: tokenizer.chat_template stopped: {why}; the request "
                              "(or the template) is too large") from None
        return out

    def _render(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict[str, Any],
                escape: bool) -> tuple[str, str]:
        if not isinstance(messages, list):
            raise StrataError(f"messages is {type(messages).__name__}, not a list")
        values = {"kwargs": _plain(kwargs), "messages": [_message(m) for m in messages]}
        marker = ""
        if escape and self._special_re is not None:
            strings = _strings(values)
            if any(self._special_re.search(s) for s in strings):
                marker = next((m for m in _MARKERS
                               if m not in self.template and not any(m in s for s in strings)),
                              "")
                if marker:
                    values = _mark(values, self._special_re, marker)
                else:  # every marker is taken: refuse rather than parse user text as control
                    raise StrataError("the request spells special tokens and uses every "
                                      "private-use marker character; remove one of them")
        context = {"tools": None, "documents": None, **self._specials, **values["kwargs"]}
        context["messages"] = values["messages"]
        context["add_generation_prompt"] = add_generation_prompt
        cap, parts, n = self.limits.max_chars, [], 0
        try:
            for chunk in self._compiled.generate(context):
                n += len(chunk)
                if n > cap:
                    raise _Limit(f"wrote more than {cap:,} characters")
                _check_time()
                parts.append(chunk)
        except (_Limit, _TimeUp):
            raise
        except Exception as e:  # the template is foreign code; whatever it raises is its failure
            raise StrataError(
                f"{self._where}: tokenizer.chat_template failed: {type(e).__name__}: {_one_line(e)}"
            ) from None
        return "".join(parts), marker

    def _encode(self, text: str, marker: str) -> list[int]:
        """Token ids without BOS: special-token texts become control tokens unless `marker`
        stands right in front of them (they came from the request: tokenized as text)."""
        tok = self._tokenizer
        if not marker:
            return tok.encode(text, add_bos=False, parse_special=True)
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            if m.start() > 0 and text[m.start() - 1] == marker:
                continue
            ids += tok.encode(text[pos:m.start()].replace(marker, ""), add_bos=False,
                              parse_special=False) if m.start() > pos else []
            ids.append(tok.token_id(m.group(0)))
            pos = m.end()
        rest = text[pos:].replace(marker, "")
        return ids + (tok.encode(rest, add_bos=False, parse_special=False) if rest else [])


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__
