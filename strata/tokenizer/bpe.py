"""Byte-level BPE (`tokenizer.ggml.model == "gpt2"`), built on the `tokenizers` library.

llama.cpp's recipe: cut the text with the pre-tokenizer's regexes (each one splits the pieces the
previous one left, keeping what matched and what did not), spell every byte of a piece with GPT-2's
byte alphabet, then apply the merges by rank. The `llama3` family also takes a whole piece as one
token when the vocabulary has it ("ignore merges"). The regexes are llama.cpp's, spelled its way.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS
    + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
    + r"|\s+(?!\S)|\s+"
)
# o200k (gpt-4o, gpt-oss): tokenizer.json's regex, which llama.cpp rewrites for its own engine
_CASED = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+" + _CASED
    + r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*" + _CASED
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# What llama.cpp uses when `tokenizer.ggml.pre` is missing or "default": GPT-2's regex between a
# punctuation split and two digit splits.
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is not merged up from bytes
    add_bos: bool = False  # llama.cpp's default for tokenizer.ggml.add_bos_token


_LLAMA3_PRE = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_QWEN2_PRE = PreTokenizer((_QWEN2,))

# tokenizer.ggml.pre -> how llama.cpp splits text for it
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(_DEFAULT),
    "gpt-2": PreTokenizer((_GPT2,)),
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "llama-bpe": _LLAMA3_PRE,
    "qwen2": _QWEN2_PRE,
    "deepseek-r1-qwen": _QWEN2_PRE,
    "megrez": _QWEN2_PRE,
    "qwen35": PreTokenizer((_QWEN35,)),
    "gpt-4o": PreTokenizer((_GPT4O,)),
}


def byte_alphabet() -> list[str]:
    """GPT-2's spelling of the bytes 0..255: printable Latin-1 stands for itself, the other 68 bytes
    take the code points from U+0100 up, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    spelled, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelled[byte] = chr(byte)
        else:
            spelled[byte] = chr(0x100 + extra)
            extra += 1
    return [spelled[b] for b in range(256)]


_BYTE_OF = {char: byte for byte, char in enumerate(byte_alphabet())}


def byte_level_bytes(token: str) -> bytes:
    """The bytes a byte-level token stands for (a character outside the alphabet: its UTF-8)."""
    out = bytearray()
    for char in token:
        byte = _BYTE_OF.get(char)
        out += char.encode() if byte is None else bytes((byte,))
    return bytes(out)


def split_merge(merge: str) -> tuple[str, str] | None:
    """'a b' -> ('a', 'b'), cut at the first space after the first character, as llama.cpp does."""
    cut = merge.find(" ", 1)
    return None if cut < 0 else (merge[:cut], merge[cut + 1 :])


def build_bpe(vocab: dict[str, int], merges: list[str], pre: PreTokenizer) -> Backend:
    """A `tokenizers` backend for a byte-level vocabulary; special tokens are added by the caller.

    Merges whose parts or result are not tokens are dropped: llama.cpp could apply them but the
    resulting piece would fall back to single bytes, which the remaining merges also give.
    """
    pairs = []
    for merge in merges:
        pair = split_merge(merge)
        if pair and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab:
            pairs.append(pair)
    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre.ignore_merges)
    backend = Backend(model)
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
    return backend
