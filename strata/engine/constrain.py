"""Constrained decoding: a grammar (JSON, a JSON Schema) decides which tokens may come next.

llguidance (the `serve` extra) computes the set of allowed tokens for each step as a bitmask;
`Constraint.mask` sets every other logit to -inf before sampling, so a masked token can never be
sampled, greedy or not; `accept` moves the grammar on by the sampled token. EOS is allowed only
where the grammar accepts (the text so far is a whole value), and once the value is complete only
EOS is. Median cost per token on one CPU thread (scripts/bench_constrain.py): the allowed set
7 us and the masking of the logits 8 us on an 8,192-token vocabulary; 29 us and 98 us on Qwen's
151,936; accepting a token 2-3 us.

    grammar = json_grammar({"type": "json_schema", "json_schema": {...}})  # checked, no tokenizer
    c = Constraint(grammar, tokenizer, n_vocab)
    token = sample(c.mask(logits), params, gen); c.accept(token)
    drafts, allowed = c.window(drafts)   # a verify window's rows (--spec), the state unmoved

Legend: V vocab (the model's rows; tokens past the tokenizer's are never allowed), W = ceil(V/32).
"""

from __future__ import annotations

import json
import weakref
from typing import TYPE_CHECKING, Any

from strata.errors import StrataError

if TYPE_CHECKING:  # torch is imported where a mask is made: the server process checks schemas
    import torch

INSTALL = "pip install 'strata[serve]' (or llguidance==1.9.*)"
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Tokenizer -> LLTokenizer


def available() -> bool:
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:
        raise StrataError(f"constrained decoding needs llguidance: {INSTALL}") from None
    return llguidance


def json_grammar(schema: dict[str, Any] | None, strict: bool = False) -> str:
    """The grammar for one JSON value written as json.dumps writes it (", " and ": ", no other
    whitespace): any object when schema is None, else the schema's; strict: an object schema that
    lists properties allows no others unless it says so. Raises StrataError for a schema
    llguidance cannot compile, naming the reason."""
    llg = _llg()
    target = {"type": "object"} if schema is None else (_closed(schema) if strict else schema)
    opts = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(json.dumps(target), overrides=opts)
    except (ValueError, TypeError) as e:
        raise StrataError(f"the JSON schema does not compile: {e}") from None
    why = llg.LLMatcher.validate_grammar(grammar)
    if why:
        raise StrataError(f"the JSON schema does not compile: {why}")
    return grammar


def lark_grammar(lark: str) -> str:
    """A grammar from llguidance's Lark text (tool calls: tool_calls.call_grammar)."""
    llg = _llg()
    grammar = llg.LLMatcher.grammar_from_lark(lark)
    why = llg.LLMatcher.validate_grammar(grammar)
    if why:
        raise StrataError(f"the grammar does not compile: {why}")
    return grammar


def json_value(schema: dict[str, Any] | None, strict: bool = False) -> str:
    """A JSON Schema as a Lark rule body (`%json {...}`), written as json_grammar writes it."""
    target = {"type": "object"} if schema is None else (_closed(schema) if strict else schema)
    style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return "%json " + json.dumps({**target, "x-guidance": style})


def _closed(schema: Any) -> Any:
    """OpenAI's strict mode: additionalProperties false wherever an object lists properties."""
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class _Vocab:
    """What llguidance needs of a tokenizer: every token's bytes, EOS, and which are special."""

    def __init__(self, tokenizer: Any):
        specials = {tokenizer.token_id(t) for t in tokenizer.special_texts()}
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = sorted(i for i in specials if i is not None)
        # special tokens never match text: llguidance's convention is a leading 0xff byte
        self.tokens = [(b"\xff" if i in specials else b"") +
                       tokenizer.token_bytes(i, False, False)[0]
                       for i in range(tokenizer.vocab_size)]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        s = text.decode("utf-8", errors="replace") if isinstance(text, bytes) else text
        return self._tokenizer.encode(s, False, False)


def _ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's tokenizer for ours, built once (0.35 s for 151,936 tokens)."""
    got = _TOKENIZERS.get(tokenizer)
    if got is None:
        llg = _llg()
        got = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tokenizer)))
        _TOKENIZERS[tokenizer] = got
    return got


class Constraint:
    """One sequence's grammar state."""

    def __init__(self, grammar: str, tokenizer: Any, n_vocab: int):
        llg = _llg()
        self.matcher = llg.LLMatcher(_ll_tokenizer(tokenizer), grammar)
        if self.matcher.is_error():
            raise StrataError(f"the grammar does not compile: {self.matcher.get_error()}")
        self.n_vocab = n_vocab
        self._shifts: Any = None  # [32] int32 on the logits' device

    def allowed(self, device: Any = "cpu") -> torch.Tensor:
        """[V] bool: the tokens that may come next. Unpacked by numpy for the CPU; for a GPU
        the W words go over and are unpacked there."""
        import numpy as np
        import torch

        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # [W * 4]
        out = torch.zeros(self.n_vocab, dtype=torch.bool, device=device)
        if out.device.type == "cpu":
            bits = torch.from_numpy(np.unpackbits(words, bitorder="little").view(np.bool_))
        else:
            w = torch.from_numpy(words.view(np.int32).copy()).to(out.device, non_blocking=True)
            if self._shifts is None or self._shifts.device != out.device:
                self._shifts = torch.arange(32, dtype=torch.int32, device=out.device)
            bits = ((w.unsqueeze(1) >> self._shifts) & 1).view(-1).bool()  # [W * 32]
        n = min(self.n_vocab, bits.numel())
        out[:n] = bits[:n]
        return out

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [V] with every token the grammar forbids at -inf (a new tensor)."""
        if self.matcher.is_error():
            raise StrataError(f"the grammar failed: {self.matcher.get_error()}")
        return logits.masked_fill(~self.allowed(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise StrataError(f"token {token} is not allowed by the grammar: "
                              f"{self.matcher.get_error()}")

    def window(self, drafts: list[int], device: Any = "cpu") -> tuple[list[int], torch.Tensor]:
        """A verify window's grammar (strata.engine.spec): the drafts cut before the first one
        the grammar forbids after the ones before it (it could never be accepted), and the
        allowed tokens of each of the window's rows, [k+1, V] bool (row i: after drafts[:i]).
        The grammar moves through the drafts and back (llguidance's rollback): its state is as
        before."""
        import torch

        if self.matcher.is_error():
            raise StrataError(f"the grammar failed: {self.matcher.get_error()}")
        drafts = drafts[:self.matcher.validate_tokens(drafts)]
        rows = [self.allowed(device)]
        for d in drafts:
            self.accept(d)
            rows.append(self.allowed(device))
        if drafts and not self.matcher.rollback(len(drafts)):
            raise StrataError(f"the grammar could not step back {len(drafts)} drafted tokens: "
                              f"{self.matcher.get_error()}")
        return drafts, torch.stack(rows)

    @property
    def done(self) -> bool:
        """The value is complete (only EOS may follow, or it came)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()
