"""Write the trained demo model (scripts/train_demo_model.py) as a qwen3moe GGUF, with its
tokenizer and chat template in the metadata, through the project's GGUF writer.

    python scripts/export_demo_gguf.py --weights out/demo-weights --tokenizer tokenizer.json \
        --out strata-demo-F32.gguf --type F32

--type F32, F16 or BF16 (every matrix; norms stay F32, as llama.cpp's converter keeps them), or
Q8_0 (gguf-py's quantizer). llama.cpp's llama-quantize makes the other packs from the F32 file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_demo_model import Shape, unpack_weights  # noqa: E402

from strata.config import expected_tensors  # noqa: E402
from strata.gguf.writer import add_tensor, write_tensor_chunks  # noqa: E402
from strata.synth.presets import Preset  # noqa: E402
from strata.synth.writer import add_metadata, config_of  # noqa: E402
from strata.tokenizer.synthetic import QWEN_TEMPLATE, SyntheticVocab  # noqa: E402
from strata.tokenizer.vocab import CONTROL, NORMAL, USER_DEFINED  # noqa: E402

TYPES = {"F32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
         "F16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
         "BF16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
         "Q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0)}
DESCRIPTION = ("Strata's demo model: a small qwen3moe trained from scratch on English prose and "
               "code that Debian and Python ship (scripts/train_demo_model.py).")


def preset_of(s: Shape) -> Preset:
    return Preset("qwen3moe", s.n_layers, s.d_model, s.n_heads, s.n_kv_heads, s.head_dim,
                  s.n_experts, s.n_experts_used, s.d_expert, s.n_vocab, d_ff=4 * s.d_model,
                  context_length=s.context, rope_theta=s.rope_theta, rms_eps=s.rms_eps)


def trained_vocab(tokenizer: Path, n_vocab: int) -> SyntheticVocab:
    """The GGUF vocabulary of a byte-level BPE tokenizer.json (train_demo_model.py tokenizer)."""
    spec = json.loads(tokenizer.read_text())
    ids = dict(spec["model"]["vocab"])
    kinds = {}
    for t in spec["added_tokens"]:
        ids[t["content"]] = t["id"]
        kinds[t["content"]] = CONTROL if t["content"].startswith("<|") else USER_DEFINED
    tokens = sorted(ids, key=ids.__getitem__)
    if [ids[t] for t in tokens] != list(range(n_vocab)):
        raise SystemExit(f"{tokenizer}: ids are not 0..{n_vocab - 1}")
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return SyntheticVocab(
        model="gpt2", pre="qwen2", tokens=tokens, token_types=[kinds.get(t, NORMAL)
                                                                for t in tokens],
        merges=merges, scores=None, bos_id=None, eos_id=ids["<|im_end|>"],
        eot_id=ids["<|endoftext|>"], pad_id=ids["<|endoftext|>"], add_bos=False,
        chat_template=QWEN_TEMPLATE)


def tensor_bytes(a: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return a.astype(np.float32)
    if qtype == GGMLQuantizationType.F16:
        return a.astype(np.float16)
    return quantize(a.astype(np.float32), qtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--weights", type=Path, required=True, help="train_demo_model.py pack's dest")
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--type", choices=TYPES, default="F32")
    a = ap.parse_args(argv)
    s = Shape(**json.loads((a.weights / "shape.json").read_text()))
    p = preset_of(s)
    weights = {k: v.numpy() for k, v in unpack_weights(a.weights).items()}
    expected = expected_tensors(config_of(p, tied_output=True))
    if set(expected) != set(weights):
        raise SystemExit(f"weights and qwen3moe tensors differ: {set(expected) ^ set(weights)}")
    qtype, ftype = TYPES[a.type]
    tmp = a.out.with_name(a.out.name + ".tmp")
    w = GGUFWriter(tmp, "qwen3moe")
    add_metadata(w, p, name="strata-demo-qwen3moe", description=DESCRIPTION, file_type=ftype)
    trained_vocab(a.tokenizer, s.n_vocab).add_to(w)
    data = {}
    for name, shape in expected.items():
        arr = weights[name].reshape(shape)
        data[name] = tensor_bytes(arr, GGMLQuantizationType.F32 if arr.ndim == 1 else qtype)
        raw = GGMLQuantizationType.F32 if arr.ndim == 1 else qtype
        add_tensor(w, name, shape, raw, data[name].nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name in expected:
        write_tensor_chunks(w, data[name].nbytes, [data[name].view(np.uint8)])
    w.close()
    tmp.replace(a.out)
    print(f"{a.out}: {a.out.stat().st_size / 1e6:.1f} MB, {s.n_params() / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
