"""Tokenizers and chat templates built from a GGUF file's metadata.

    tok = Tokenizer.from_metadata(meta, source=path)      # tokenizer.ggml.* keys
    chat = ChatTemplate.from_metadata(meta, tok, path)    # tokenizer.chat_template, else ChatML
    ids = tok.encode(chat.render(messages), add_bos=...)  # or chat.encode(messages)
    text = tok.decode(ids); stream = tok.stream()         # stream.push(id) -> whole characters

Kinds: "gpt2" (byte-level BPE, bpe.py) and "llama" (SentencePiece BPE, spm.py); synthetic.py writes
the vocabularies of Strata's synthetic test models.
"""

from strata.tokenizer.chat import ChatTemplate
from strata.tokenizer.stream import StreamDecoder
from strata.tokenizer.vocab import Tokenizer

__all__ = ["ChatTemplate", "StreamDecoder", "Tokenizer"]
