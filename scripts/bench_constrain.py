"""Per-token cost of constrained decoding (strata/engine/constrain.py) on two vocabularies.

    python scripts/bench_constrain.py            # the demo model's 8,192 tokens and Qwen's 151,936

For each, one JSON document is fed through the grammar token by token (teacher forcing, so every
step is a real one): the time to compute the allowed set as a [V] mask, to mask a [V] logits
tensor with it, and to accept the token. One CPU thread.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.engine.constrain import Constraint, json_grammar  # noqa: E402
from strata.tokenizer import Tokenizer  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "tags", "ok"]}
DOC = {"name": "Ada Lovelace, analyst of the Analytical Engine", "age": 36, "ok": True,
       "tags": ["mathematics", "poetry", "engines", "notes on the sketch"] * 6}  # schema order


def tokenizers() -> dict[str, Tokenizer]:
    from strata.demo import demo_model
    from strata.gguf import GGUFFile
    from strata.tokenizer.synthetic import synthetic_vocab

    q = synthetic_vocab("qwen", 151936)
    meta = {"tokenizer.ggml.model": q.model, "tokenizer.ggml.pre": q.pre,
            "tokenizer.ggml.tokens": q.tokens, "tokenizer.ggml.token_type": q.token_types,
            "tokenizer.ggml.merges": q.merges, "tokenizer.ggml.eos_token_id": q.eos_id,
            "tokenizer.ggml.padding_token_id": q.pad_id, "tokenizer.ggml.add_bos_token": False}
    return {"demo": Tokenizer.from_metadata(GGUFFile(demo_model()).metadata),
            "qwen-151936": Tokenizer.from_metadata(meta)}


def main() -> None:
    torch.set_num_threads(1)
    for name, tok in tokenizers().items():
        t0 = time.perf_counter()
        c = Constraint(json_grammar(SCHEMA), tok, tok.vocab_size)
        setup = time.perf_counter() - t0
        ids = tok.encode(json.dumps(DOC), False, False) + [tok.eos_id]
        logits = torch.randn(tok.vocab_size)
        mask_s, apply_s, accept_s = [], [], []
        for t in ids:
            a = time.perf_counter()
            allowed = c.allowed()
            b = time.perf_counter()
            logits.masked_fill(~allowed, float("-inf"))
            d = time.perf_counter()
            assert allowed[t], f"token {t} ({tok.decode([t])!r}) was masked"
            if t != tok.eos_id:
                c.accept(t)
            accept_s.append(time.perf_counter() - d)
            mask_s.append(b - a)
            apply_s.append(d - b)

        def us(xs: list[float]) -> str:
            xs = sorted(xs)
            return f"median {xs[len(xs) // 2] * 1e6:7.1f} us, mean {sum(xs) / len(xs) * 1e6:7.1f}"

        print(f"{name}: V={tok.vocab_size}, {len(ids)} tokens, tokenizer + grammar {setup:.2f} s")
        print(f"  allowed set   {us(mask_s)}")
        print(f"  mask logits   {us(apply_s)}")
        print(f"  accept token  {us(accept_s)}")


if __name__ == "__main__":
    main()
