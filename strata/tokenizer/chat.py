"""`ChatTemplate`: messages -> prompt text, with the Jinja template in `tokenizer.chat_template`.

Templates come with downloaded files, so they are untrusted code. They run in Jinja's immutable
sandbox, set up the way transformers' `apply_chat_template` sets it up (same options, helpers and
`tojson`), so that a template renders here exactly as it does there. One thing is stricter: reading
an attribute the sandbox calls unsafe (`__class__`, `__globals__`, ...) is an error at once, where
plain Jinja would hand back an empty value and carry on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
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


class _Sandbox(ImmutableSandboxedEnvironment):
    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} is unsafe"
        )


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


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: no None values, reasoning under all its usual names."""
    out = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((out[k] for k in _REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, **out, "reasoning_content": reasoning}
    return out


class ChatTemplate:
    """Renders a conversation into the prompt text the model was trained on."""

    def __init__(self, template: str, tokenizer: Tokenizer, source: str = ""):
        self.template = template
        self._tokenizer = tokenizer
        self._where = source or "GGUF metadata"
        try:
            self._compiled = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise StrataError(
                f"{self._where}: tokenizer.chat_template does not parse: {_one_line(e)}"
            ) from None
        self._specials = {
            f"{name}_token": tokenizer.token_text(token_id)
            for name, token_id in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id))
            if token_id is not None
        }

    @classmethod
    def from_metadata(
        cls, meta: Mapping[str, Any], tokenizer: Tokenizer, source: str = ""
    ) -> ChatTemplate:
        """The file's template, or ChatML when it has none."""
        return cls(meta.get("tokenizer.chat_template") or CHATML, tokenizer, source)

    def render(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text. Extra keyword arguments reach the template as variables
        (enable_thinking, reasoning_effort, tools, documents, ...)."""
        context = {"tools": None, "documents": None, **self._specials, **_plain(kwargs)}
        context["messages"] = [_message(m) for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        try:
            return self._compiled.render(context)
        except Exception as e:  # the template is foreign code; whatever it raises is its failure
            raise StrataError(
                f"{self._where}: tokenizer.chat_template failed: {type(e).__name__}: {_one_line(e)}"
            ) from None

    def encode(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        """Prompt token ids: the rendered text with its special tokens parsed, and BOS added only
        when the tokenizer wants one and the template did not already write it."""
        text = self.render(messages, add_generation_prompt, **kwargs)
        bos = self._specials.get("bos_token")
        add_bos = self._tokenizer.add_bos and not (bos and text.startswith(bos))
        return self._tokenizer.encode(text, add_bos=add_bos, parse_special=True)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:3] if part.isdigit())


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__
