"""`Tokenizer`: text <-> token ids for a GGUF file, from its `tokenizer.ggml.*` metadata.

Encoding runs on the `tokenizers` library (see bpe.py and spm.py for how each kind is built).
Decoding is done here, token by token, the way llama.cpp turns a token into its piece of text:

    normal        byte-level BPE: its characters back to bytes; SPM: "▁" back to a space
    byte (6)      the byte its `<0xNN>` spelling names
    control (3),
    unknown (2)   its text as written, or nothing when skip_special
    user (4)      its text as written, always
    unused (5)    nothing

SPM adds a space in front of every stretch of text that starts the input or follows a special token,
and decoding takes one such space off again, so decode(encode(text)) == text.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from strata.errors import StrataError
from strata.tokenizer.bpe import PRE_TOKENIZERS, build_bpe, byte_level_bytes
from strata.tokenizer.spm import SPACE, build_spm, byte_token_value
from strata.tokenizer.stream import StreamDecoder

log = logging.getLogger("strata")

# tokenizer.ggml.token_type values
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end of generation wherever they appear in a vocabulary.
END_OF_TURN_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<|call|>",
})  # fmt: skip

_TEXT, _SPECIAL, _USER, _HIDDEN = 0, 1, 2, 3  # how a token decodes, from its type
_KIND_OF_TYPE = {NORMAL: _TEXT, BYTE: _TEXT, CONTROL: _SPECIAL, UNKNOWN: _SPECIAL,
                 USER_DEFINED: _USER}  # fmt: skip


def _shown(value: Any) -> str:
    """A metadata value as an error message shows it: short."""
    if isinstance(value, (list, tuple)):
        return f"an array of {len(value)}"
    return repr(value)[:60]


def _array(meta: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str,
           where: str) -> list | None:
    """An array of `kind` values (bool never counts as a number), or None where it is absent."""
    value = meta.get(key)
    if value is None:
        return None
    if not isinstance(value, (list, tuple)):
        raise StrataError(f"{where}: {key} is {_shown(value)}: expected an array of {what}")
    bad = next((i for i, v in enumerate(value) if not isinstance(v, kind) or isinstance(v, bool)),
               None)
    if bad is not None:
        raise StrataError(f"{where}: {key}[{bad}] is {_shown(value[bad])}: expected an array of "
                          f"{what}")
    return list(value)


def _field(meta: Mapping[str, Any], key: str, n: int, default: Any, where: str,
           kind: type | tuple[type, ...] = int, what: str = "integers") -> list:
    value = _array(meta, key, kind, what, where)
    if value is None:
        return [default] * n
    if len(value) < n:
        raise StrataError(f"{where}: {key} has {len(value)} entries for {n} tokens")
    return value[:n]


def read_tokens(meta: Mapping[str, Any], where: str) -> list[str]:
    """tokenizer.ggml.tokens: a non-empty array of strings."""
    tokens = _array(meta, "tokenizer.ggml.tokens", str, "strings", where)
    if not tokens:
        raise StrataError(f"{where}: tokenizer.ggml.tokens is missing or empty")
    return tokens


def _read_flag(meta: Mapping[str, Any], key: str, default: bool, where: str) -> bool:
    value = meta.get(key, default)
    if not isinstance(value, bool) and value not in (0, 1):
        raise StrataError(f"{where}: {key} is {_shown(value)}: expected true or false")
    return bool(value)


def _read_vocab(meta: Mapping[str, Any], where: str) -> tuple[list[str], list[int], dict[str, int]]:
    """Tokens, their types, and token -> id."""
    tokens = read_tokens(meta, where)
    types = _field(meta, "tokenizer.ggml.token_type", len(tokens), NORMAL, where)
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if vocab.setdefault(token, index) != index:
            raise StrataError(
                f"{where}: tokenizer.ggml.tokens has {token!r} twice ({vocab[token]}, {index})"
            )
        if token in END_OF_TURN_TEXTS and types[index] == NORMAL:
            types[index] = CONTROL  # as llama.cpp does
    return tokens, types, vocab


def _gpt2_backend(
    meta: Mapping[str, Any], vocab: dict[str, int], where: str
) -> tuple[Backend, bool]:
    """The byte-level backend, and whether this pre-tokenizer adds BOS by default."""
    name = meta.get("tokenizer.ggml.pre") or "default"
    pre = PRE_TOKENIZERS.get(name) if isinstance(name, str) else None
    if pre is None:
        raise StrataError(
            f"{where}: tokenizer.ggml.pre is {_shown(name)}, a pre-tokenizer Strata does not know "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    merges = _array(meta, "tokenizer.ggml.merges", str, "strings", where)
    if merges is None:
        raise StrataError(f"{where}: tokenizer.ggml.merges is missing (needed for 'gpt2')")
    return build_bpe(vocab, merges, pre), pre.add_bos


class Tokenizer:
    """Encode and decode text for one GGUF vocabulary. Build it with `from_metadata`."""

    def __init__(
        self,
        backend: Backend,
        tokens: list[str],
        types: list[int],
        *,
        byte_level: bool,
        space_prefix: bool,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: frozenset[int],
        add_bos: bool,
    ):
        self._backend = backend
        self._raw_backend: Backend | None = None  # a copy that reads special tokens as plain text
        self._tokens = tokens
        self._types = types
        self._kinds = bytes(_KIND_OF_TYPE.get(t, _HIDDEN) for t in types)
        self._pieces: list[bytes | None] = [None] * len(tokens)
        self._byte_level = byte_level
        self._space_prefix = space_prefix
        self._ids: dict[str, int] | None = None
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        self.add_bos = add_bos

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any], source: str = "") -> Tokenizer:
        where = source or "GGUF metadata"
        model = meta.get("tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            said = "is missing" if model is None else f"is {_shown(model)}"
            raise StrataError(
                f"{where}: tokenizer.ggml.model {said}; Strata supports 'gpt2' (byte-level BPE) "
                "and 'llama' (SentencePiece BPE)"
            )
        tokens, types, vocab = _read_vocab(meta, where)
        n = len(tokens)

        def token_id(key: str, default: int | None = None) -> int | None:
            """An id of the vocabulary, or None (absent, or out of range: llama.cpp's warning
            and default)."""
            name = f"tokenizer.ggml.{key}"
            value = meta.get(name, default)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise StrataError(f"{where}: {name} is {_shown(value)}: expected a token id")
            if value is not None and not 0 <= value < n:
                if name in meta:  # (llama.cpp's defaults pass quietly)
                    log.warning("%s: %s is %d, outside the vocabulary of %d tokens: not used",
                                where, name, value, n)
                return None
            return value

        if model == "gpt2":
            backend, default_add_bos = _gpt2_backend(meta, vocab, where)
            bos, eos, space_prefix = token_id("bos_token_id"), token_id("eos_token_id"), False
        else:  # llama.cpp's defaults for a SentencePiece vocabulary: <unk> 0, <s> 1, </s> 2
            bos, eos = token_id("bos_token_id", 1), token_id("eos_token_id", 2)
            unk_id = token_id("unknown_token_id", 0)
            unk = tokens[unk_id] if unk_id is not None and types[unk_id] == UNKNOWN else None
            space_prefix = _read_flag(meta, "tokenizer.ggml.add_space_prefix", True, where)
            scores = [float(s) for s in _field(meta, "tokenizer.ggml.scores", n, 0.0, where,
                                               (int, float), "numbers")]
            backend, default_add_bos = build_spm(vocab, tokens, scores, space_prefix, unk), True

        add_bos = _read_flag(meta, "tokenizer.ggml.add_bos_token", default_add_bos, where)
        if add_bos and bos is None:
            raise StrataError(
                f"{where}: tokenizer.ggml.add_bos_token is true but tokenizer.ggml.bos_token_id "
                "is missing or out of range"
            )
        special = [t for t, kind in zip(tokens, types, strict=True) if kind in (CONTROL, UNKNOWN)]
        user = [t for t, kind in zip(tokens, types, strict=True) if kind == USER_DEFINED]
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
        stops = {eos, token_id("eot_token_id"), token_id("eom_token_id")}
        stops |= {vocab[t] for t in END_OF_TURN_TEXTS if t in vocab}
        if "<|return|>" in vocab and "<|call|>" in vocab and "<|end|>" in vocab:
            # harmony (gpt-oss): <|end|> closes a message (the analysis before the final one),
            # not the turn; llama.cpp drops it from its end-of-generation set the same way
            stops.discard(vocab["<|end|>"])
        stops.discard(None)
        return cls(backend, tokens, types, byte_level=model == "gpt2", space_prefix=space_prefix,
                   bos_id=bos, eos_id=eos, stop_ids=frozenset(stops), add_bos=add_bos)  # fmt: skip

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids for `text`. With parse_special, control tokens written in the text (such as
        "<|im_start|>") become their ids; user-defined tokens always do, as in llama.cpp."""
        backend = self._backend if parse_special else self._plain_backend()
        # (encode_batch gives encode's ids and lets go of the GIL while it works: a long prompt
        # tokenized in a server thread does not stop the others)
        ids = backend.encode_batch([text], add_special_tokens=False)[0].ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        out, fresh = bytearray(), True
        for token in ids:
            piece, fresh = self.token_bytes(int(token), skip_special, fresh)
            out += piece
        return out.decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = False) -> StreamDecoder:
        """A decoder that takes one token at a time and returns only whole characters."""
        return StreamDecoder(self, skip_special)

    def token_text(self, token: int) -> str:
        """The token as the file spells it (byte-level tokens in GPT-2's alphabet)."""
        return self._tokens[token]

    def special_texts(self) -> list[str]:
        """The text of every control (and unknown) token: what parse_special turns into ids."""
        return [t for t, k in zip(self._tokens, self._kinds, strict=True) if k == _SPECIAL]

    def token_id(self, text: str) -> int | None:
        """The id of the token spelled exactly `text`, or None."""
        if self._ids is None:
            self._ids = {token: index for index, token in enumerate(self._tokens)}
        return self._ids.get(text)

    def token_bytes(self, token: int, skip_special: bool, fresh: bool) -> tuple[bytes, bool]:
        """The bytes `token` adds to the text, and whether the next token starts a new stretch of
        text. `fresh` says whether this one does (at the start, or after a special token)."""
        if not 0 <= token < self.vocab_size:
            raise ValueError(
                f"token id {token} is outside the vocabulary (0..{self.vocab_size - 1})"
            )
        kind = self._kinds[token]
        if kind == _SPECIAL:
            return (b"" if skip_special else self._piece(token)), True
        if kind == _USER:
            return self._piece(token), True
        piece = self._piece(token)
        if not piece:
            return piece, fresh
        if fresh and self._space_prefix and piece[:1] == b" ":
            piece = piece[1:]  # the space that encoding put in front of this stretch
        return piece, False

    def _piece(self, token: int) -> bytes:
        piece = self._pieces[token]
        if piece is None:
            piece = self._pieces[token] = self._make_piece(token)
        return piece

    def _make_piece(self, token: int) -> bytes:
        text, kind = self._tokens[token], self._kinds[token]
        if kind == _HIDDEN:
            return b""
        if kind != _TEXT:
            return text.encode()
        if self._types[token] == BYTE:
            value = byte_token_value(text)
            return b"" if value is None else bytes((value,))
        if self._byte_level:
            return byte_level_bytes(text)
        return text.replace(SPACE, " ").encode()

    def _plain_backend(self) -> Backend:
        if self._raw_backend is None:
            raw = Backend.from_str(self._backend.to_str())
            raw.encode_special_tokens = True
            self._raw_backend = raw
        return self._raw_backend
