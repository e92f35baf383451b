"""SentencePiece-style BPE (`tokenizer.ggml.model == "llama"`), built on the `tokenizers` library.

llama.cpp tokenizes each stretch of plain text (between special tokens) like this: put a space in
front when `add_space_prefix` is set, write every space as U+2581 ("▁"), start from single
characters, and keep merging the adjacent pair whose joined text is the token with the highest
score (on a tie, the leftmost pair). A character that no token covers becomes its UTF-8 bytes,
spelled `<0xNN>`. There is no splitting into words.

That is BPE with a merge list ranked by the score of the merged token, which is what is built here:
every way to cut a token into two tokens becomes a merge, best score first.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer as Backend
from tokenizers import models, normalizers

SPACE = "\u2581"  # ▁, SentencePiece's spelling of a space


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (left, right) pair of tokens that joins into a token, best joined score first."""
    vocab = {token: index for index, token in enumerate(tokens)}
    # cuts only where both parts have a token's length: a hostile 1M-character token would
    # otherwise take 1M slices of up to 1M characters
    lengths = sorted({len(token) for token in tokens})
    ranked = []
    for index, token in enumerate(tokens):
        for cut in lengths:
            if cut >= len(token):
                break
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def byte_token_value(token: str) -> int | None:
    """0xNN for a token spelled `<0xNN>`, else None."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return int(token[3:5], 16)
        except ValueError:
            return None
    return None


def build_spm(
    vocab: dict[str, int],
    tokens: Sequence[str],
    scores: Sequence[float],
    add_space_prefix: bool,
    unk: str | None,
) -> Backend:
    """A `tokenizers` backend for a SentencePiece vocabulary; the caller adds special tokens.

    The normalizer runs once per stretch of text between special tokens, so the prefix space lands
    where llama.cpp puts it: at the start and after every special token.
    """
    model = models.BPE(
        vocab=vocab,
        merges=merges_from_scores(tokens, scores),
        unk_token=unk,
        byte_fallback=True,
        fuse_unk=False,
    )
    backend = Backend(model)
    replace = normalizers.Replace(" ", SPACE)
    if add_space_prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), replace])
    else:
        backend.normalizer = replace
    return backend
