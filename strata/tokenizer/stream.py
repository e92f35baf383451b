"""`StreamDecoder`: text for tokens as they are generated, one at a time.

A token can end in the middle of a UTF-8 character (byte tokens, and byte-level pieces of emoji or
CJK), so the bytes go through an incremental UTF-8 decoder that holds back an unfinished character
until the token that completes it arrives. Pushing every token of a sequence and then flushing gives
exactly `Tokenizer.decode` of that sequence.
"""

from __future__ import annotations

import codecs
from typing import Protocol


class TokenBytes(Protocol):
    """What a stream needs of its tokenizer (vocab.Tokenizer has it): a token's bytes, and whether
    the next text token starts a stretch of text."""

    def token_bytes(self, token: int, skip_special: bool, fresh: bool) -> tuple[bytes, bool]: ...


class StreamDecoder:
    def __init__(self, tokenizer: TokenBytes, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._fresh = True  # the next text token starts a stretch of text (see vocab.py)

    def push(self, token: int) -> str:
        """The text that `token` completes; may be empty while a character is unfinished."""
        data, self._fresh = self._tokenizer.token_bytes(token, self._skip_special, self._fresh)
        return self._utf8.decode(data)

    def flush(self) -> str:
        """What is left at the end: an unfinished character comes out as U+FFFD."""
        return self._utf8.decode(b"", final=True)
