"""Hostile model files beyond test_gguf_errors and test_fuzz: each mutation of a tiny synthetic
model ends in one line naming the file and the field or tensor, exit code 2 and no output file
(or, where a stray tensor is one the metadata does not describe, in a normal run that does not
read it). Cases marked "(passed before)" pin behaviour the older tests did not cover."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf import GGUFValueType as T

from strata.cli.main import main
from strata.errors import StrataError
from strata.gguf import GGUFFile
from strata.tokenizer import ChatTemplate, Tokenizer
from strata.tokenizer.chat import TemplateLimits

from gguf_edit import rewrite

K = "tokenizer.ggml."
F32 = 0  # ggml type id


def run(capsys, *argv: str) -> tuple[int, list[str]]:
    code = main(list(argv))
    err = capsys.readouterr().err
    # (a model command's first line names its device, and each load stage is a line)
    return code, [ln for ln in err.strip().splitlines()
                  if not ln.startswith(("strata: device: ", "strata: loading: "))]


def refused(capsys, tmp_path: Path, path: Path, *needles: str, command: str = "logits") -> str:
    """`strata logits` (or info) on path: exit code 2, one line naming the file and every
    needle, and no --out file."""
    out = tmp_path / "out.npy"
    argv = (["info", str(path)] if command == "info" else
            ["logits", str(path), "--tokens", "1,2", "--out", str(out)])
    code, lines = run(capsys, *argv)
    assert code == 2 and len(lines) == 1 and "error:" in lines[0], lines
    for n in (path.name, *needles):
        assert n in lines[0], lines
    assert not out.exists()
    return lines[0]


def runs(capsys, path: Path, *flags: str) -> None:
    """`strata generate` on path runs to its end (exit code 0)."""
    code, lines = run(capsys, "generate", str(path), "-n", "2", "--prompt", "hi there", *flags)
    assert code == 0, lines


def edited(src: Path, dst: Path, change: Callable[[GGUFReader], None]) -> Path:
    """A copy of src that change(reader) edits in place (gguf-py's reader opened r+: each field's
    parts are views of the file; a tensor's field parts: name length, name, n_dims, dims, type,
    offset)."""
    shutil.copy(src, dst)
    reader = GGUFReader(dst, "r+")
    change(reader)
    reader.data.flush()
    return dst


def tensor_field(reader: GGUFReader, name: str):  # noqa: ANN201 (gguf's ReaderField)
    return next(t.field for t in reader.tensors if t.name == name)


def with_tensors(src: Path, dst: Path, add: dict[str, tuple[list[int], bytes]] | None = None,
                 drop: tuple[str, ...] = (), shapes: dict[str, list[int]] | None = None) -> Path:
    """A copy of src with tensors dropped, relabelled to other shapes (bytes unchanged) or added
    (float32, shape in torch order, their bytes)."""
    add, shapes = add or {}, shapes or {}
    r = GGUFReader(src)
    w = GGUFWriter(dst, r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            sub = f.types[-1] if f.types[0] == T.ARRAY else None
            w.add_key_value(name, f.contents(), f.types[0], sub_type=sub)
    tensors = [(t.name, shapes.get(t.name, [int(n) for n in reversed(t.shape.tolist())]),
                t.tensor_type, np.asarray(t.data).view(np.uint8).reshape(-1))
               for t in r.tensors if t.name not in drop]
    tensors += [(name, shape, F32, np.frombuffer(data, np.uint8))
                for name, (shape, data) in add.items()]
    for name, shape, qtype, data in tensors:
        w.add_tensor_info(name, shape, np.dtype(np.float32), data.nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for *_, data in tensors:
        w.write_tensor_data(data)
    w.close()
    return dst


def zeros(*shape: int) -> tuple[list[int], bytes]:
    return list(shape), np.zeros(shape, np.float32).tobytes()


@pytest.fixture(scope="module")
def q3(synth) -> Path:
    return synth("qwen3moe", "Q8_0")


# --- the tokenizer's keys: each a wrong kind of value --------------------------------------
BAD_TOKENIZER = [
    # tokens a number: was TypeError
    ({K + "tokens": 5}, "tokenizer.ggml.tokens is 5"),
    # tokens a string: was read as one token a character ("the prompt is empty")
    ({K + "tokens": "abc"}, "tokenizer.ggml.tokens is 'abc'"),
    # tokens an array of numbers: was TypeError in the tokenizers library
    ({K + "tokens": (list(range(1, 1025)), T.ARRAY)}, "tokenizer.ggml.tokens[0] is 1"),
    # token_type a number: was TypeError
    ({K + "token_type": 1}, "tokenizer.ggml.token_type is 1"),
    # merges an array of numbers: was AttributeError
    ({K + "merges": ([1, 2], T.ARRAY)}, "tokenizer.ggml.merges[0] is 1"),
    # pre an array: was TypeError (unhashable)
    ({K + "pre": (["qwen2"], T.ARRAY)}, "tokenizer.ggml.pre is an array of 1"),
    # eos id a string: was ValueError from int()
    ({K + "eos_token_id": "abc"}, "tokenizer.ggml.eos_token_id is 'abc'"),
    # eos id NaN: was ValueError from int()
    ({K + "eos_token_id": (float("nan"), T.FLOAT32)}, "tokenizer.ggml.eos_token_id is nan"),
    # eot id an array: was TypeError from int()
    ({K + "eot_token_id": ([1], T.ARRAY)}, "tokenizer.ggml.eot_token_id is an array of 1"),
    # add_bos_token "no": was read as true ("add_bos_token is true but ...")
    ({K + "add_bos_token": "no"}, "tokenizer.ggml.add_bos_token is 'no'"),
]


@pytest.mark.parametrize("meta,says", BAD_TOKENIZER, ids=[s for _, s in BAD_TOKENIZER])
def test_bad_tokenizer_keys(q3, tmp_path, capsys, meta, says):
    bad = rewrite(q3, tmp_path / "bad.gguf", meta=meta)
    refused(capsys, tmp_path, bad, says)


BAD_SPM = [
    # scores strings: was ValueError from float()
    ({K + "scores": (["a"] * 1024, T.ARRAY)}, "tokenizer.ggml.scores[0] is 'a'"),
    # unknown id a string: was ValueError from int()
    ({K + "unknown_token_id": "x"}, "tokenizer.ggml.unknown_token_id is 'x'"),
    # add_space_prefix "no": was read as true
    ({K + "add_space_prefix": "no"}, "tokenizer.ggml.add_space_prefix is 'no'"),
    # scores shorter than the tokens (passed before)
    ({K + "scores": ([0.0] * 5, T.ARRAY)}, "tokenizer.ggml.scores has 5 entries for 1024"),
]


@pytest.mark.parametrize("meta,says", BAD_SPM, ids=[s for _, s in BAD_SPM])
def test_bad_sentencepiece_keys(synth, tmp_path, capsys, meta, says):
    bad = rewrite(synth("llama", "Q8_0"), tmp_path / "bad.gguf", meta=meta)
    refused(capsys, tmp_path, bad, says)


@pytest.mark.parametrize("n", [600, 1100])
def test_vocabulary_of_another_size_than_the_embedding(q3, tmp_path, capsys, n):
    # 600 or 1100 tokens for token_embd's 1024 rows: was ValueError / IndexError on their ids
    tokens = list(GGUFFile(q3).metadata[K + "tokens"])[:n] + [f"<x{i}>" for i in range(n - 1024)]
    bad = rewrite(q3, tmp_path / "vocab.gguf", meta={
        K + "tokens": (tokens, T.ARRAY), K + "token_type": ([1] * n, T.ARRAY),
        K + "eos_token_id": 3, K + "padding_token_id": None})
    for command in ("info", "logits"):
        refused(capsys, tmp_path, bad, f"tokenizer.ggml.tokens has {n:,} tokens",
                "token_embd.weight has 1,024 rows", command=command)


def test_draft_with_a_bad_token_list(q3, tmp_path, capsys):
    # a --draft model whose tokens are a number: was TypeError comparing the vocabularies
    draft = rewrite(q3, tmp_path / "draft.gguf", meta={K + "tokens": 5})
    code, lines = run(capsys, "generate", str(q3), "-n", "2", "--spec", "2", "--draft",
                      str(draft))
    assert code == 2 and len(lines) == 1 and "draft.gguf: tokenizer.ggml.tokens is 5" in lines[0]


def test_sentencepiece_long_token_loads_at_once(synth):
    # one 300k-character token: merges_from_scores took every cut of it (~20 s; 1M: minutes)
    meta = dict(GGUFFile(synth("llama", "Q8_0")).metadata)
    meta[K + "tokens"] = [*meta[K + "tokens"][:-1], "a" * 300_000]
    t0 = time.monotonic()
    Tokenizer.from_metadata(meta, "long.gguf")
    assert time.monotonic() - t0 < 3


# --- chat templates that do not compile ------------------------------------------------------
DEEP_TEMPLATES = {
    # 30 nested for loops: was SyntaxError (Python's 20 nested blocks)
    "for": "{% for a in [1] %}" * 30 + "x" + "{% endfor %}" * 30,
    # 100 nested ifs: was IndentationError
    "if": "{% if true %}" * 100 + "x" + "{% endif %}" * 100,
    # 5000 nested parentheses: was RecursionError
    "parens": "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",
}


@pytest.mark.parametrize("name", list(DEEP_TEMPLATES))
def test_template_nested_too_deeply(q3, tmp_path, capsys, name):
    bad = rewrite(q3, tmp_path / "deep.gguf",
                  meta={"tokenizer.chat_template": DEEP_TEMPLATES[name]})
    refused(capsys, tmp_path, bad, "tokenizer.chat_template does not compile")


def test_template_compile_has_a_deadline(q3):
    # 2.4 MB of template: its compile ran 20 s (5 MB: 42 s) with no bound
    tok = Tokenizer.from_metadata(GGUFFile(q3).metadata)
    t0 = time.monotonic()
    with pytest.raises(StrataError) as e:
        ChatTemplate("{{ messages[0].content }}" * 100_000, tok, "big.gguf",
                     TemplateLimits(seconds=0.5))
    assert time.monotonic() - t0 < 3
    assert str(e.value).startswith("big.gguf: tokenizer.chat_template did not compile within")


# --- the tensor table ------------------------------------------------------------------------
def test_overlapping_tensor_data(q3, tmp_path, capsys):
    # blk.1.attn_q's data offset set to blk.0.attn_q's: was read as two views of one tensor
    def same_offset(r: GGUFReader) -> None:
        offset = tensor_field(r, "blk.0.attn_q.weight").parts[-1][0]
        tensor_field(r, "blk.1.attn_q.weight").parts[-1][0] = offset

    bad = edited(q3, tmp_path / "overlap.gguf", same_offset)
    refused(capsys, tmp_path, bad, "blk.0.attn_q.weight and blk.1.attn_q.weight overlap")


def test_duplicate_tensor_name(q3, tmp_path, capsys):
    # blk.1.attn_q renamed blk.0.attn_q (same length, in place) (passed before)
    def rename(r: GGUFReader) -> None:
        tensor_field(r, "blk.1.attn_q.weight").parts[1][:] = np.frombuffer(
            b"blk.0.attn_q.weight", np.uint8)

    bad = edited(q3, tmp_path / "twice.gguf", rename)
    refused(capsys, tmp_path, bad, "tensor blk.0.attn_q.weight appears twice")


def test_duplicate_metadata_key(q3, tmp_path, capsys):
    # a key written as "xxxxxxxxxxxx" and renamed general.name in place (passed before)
    def rename(r: GGUFReader) -> None:
        r.fields["xxxxxxxxxxxx"].parts[1][:] = np.frombuffer(b"general.name", np.uint8)

    bad = edited(rewrite(q3, tmp_path / "src.gguf", meta={"xxxxxxxxxxxx": "x"}),
                 tmp_path / "twice.gguf", rename)
    refused(capsys, tmp_path, bad, "metadata key general.name appears twice")


@pytest.mark.parametrize("part,index,value,says", [
    # blk.1.attn_q's data offset 2^40 (passed before)
    (-1, 0, 2**40, "truncated file: tensor blk.1.attn_q.weight"),
    # its row count 2^40 (passed before)
    (3, 1, 2**40, "truncated file: tensor blk.1.attn_q.weight"),
    # its row length 100, not a multiple of Q8_0's 32 (passed before)
    (3, 0, 100, "row length 100 is not a multiple of the Q8_0 block size 32"),
    # its type 99, no ggml type (passed before)
    (4, 0, 99, "tensor blk.1.attn_q.weight has unknown ggml type 99"),
])
def test_bad_tensor_entry(q3, tmp_path, capsys, part, index, value, says):
    def change(r: GGUFReader) -> None:
        tensor_field(r, "blk.1.attn_q.weight").parts[part][index] = value

    refused(capsys, tmp_path, edited(q3, tmp_path / "entry.gguf", change), says)


def test_array_count_past_the_file(q3, tmp_path, capsys):
    # tokenizer.ggml.merges' count 2^62: was "the header ends early", naming no key
    def change(r: GGUFReader) -> None:
        r.fields[K + "merges"].parts[4][0] = 2**62  # (key length, key, type, item type, count)

    bad = edited(q3, tmp_path / "count.gguf", change)
    refused(capsys, tmp_path, bad, "truncated file", "inside metadata key tokenizer.ggml.merges",
            command="info")


def test_five_dimensions(q3, tmp_path, capsys):
    # blk.1.attn_q relabelled [1, 1, 1, 256, 256] (passed before)
    bad = rewrite(q3, tmp_path / "dims.gguf",
                  tensor_shapes={"blk.1.attn_q.weight": [1, 1, 1, 256, 256]})
    refused(capsys, tmp_path, bad, "blk.1.attn_q.weight has shape [1, 1, 1, 256, 256]")


def test_one_layer_without_its_down_experts(q3, tmp_path, capsys):
    # blk.2.ffn_down_exps dropped, the other layers whole (passed before)
    bad = with_tensors(q3, tmp_path / "gap.gguf", drop=("blk.2.ffn_down_exps.weight",))
    refused(capsys, tmp_path, bad, "tensor blk.2.ffn_down_exps.weight is missing")


@pytest.mark.parametrize("meta,says", [
    # rope.dimension_count odd (passed before)
    ({"qwen3moe.rope.dimension_count": 63}, "qwen3moe.rope.dimension_count is 63"),
    # rope.dimension_count past the head dim (passed before)
    ({"qwen3moe.rope.dimension_count": 128}, "qwen3moe.rope.dimension_count is 128"),
    # expert_count a float (passed before)
    ({"qwen3moe.expert_count": (8.0, T.FLOAT32)}, "qwen3moe.expert_count is 8.0"),
])
def test_bad_shape_keys(q3, tmp_path, capsys, meta, says):
    refused(capsys, tmp_path, rewrite(q3, tmp_path / "bad.gguf", meta=meta), says)


# --- files and shards ------------------------------------------------------------------------
def test_big_endian_file(q3, tmp_path, capsys):
    # the version written big-endian: was "GGUF version 50331648 is not supported"
    data = bytearray(q3.read_bytes())
    data[4:8] = (3).to_bytes(4, "big")
    bad = tmp_path / "big.gguf"
    bad.write_bytes(bytes(data))
    refused(capsys, tmp_path, bad, "big-endian", "--bigendian", command="info")


def test_shard_named_as_a_model(synth, tmp_path, capsys):
    # shard 2 of a split set copied to model.gguf: was "... but the file names say 1"
    src = synth("qwen3moe", "Q8_0", split_max_tensors=12)
    shards = sorted(src.parent.glob(f"{src.stem}-0000*-of-*.gguf"))
    count = len(shards)
    bad = tmp_path / "model.gguf"
    shutil.copy(shards[1], bad)
    refused(capsys, tmp_path, bad, f"is shard 2 of {count} of a split set", "not named like one",
            f"-of-{count:05d}.gguf")


# --- tensors the metadata does not describe --------------------------------------------------
def test_stray_shared_expert_in_one_layer(q3, tmp_path, capsys):
    # a shared expert of odd shapes in qwen3moe's blk.1 only: was run (RuntimeError); not read
    bad = with_tensors(q3, tmp_path / "stray.gguf", add={
        "blk.1.ffn_gate_shexp.weight": zeros(3, 256), "blk.1.ffn_up_shexp.weight": zeros(5, 256),
        "blk.1.ffn_down_shexp.weight": zeros(256, 7)})
    runs(capsys, bad)


def test_stray_shared_expert_gate(synth, tmp_path, capsys):
    # a shared-expert gate [5] in glm4moe's blk.1 (glm has none): was RuntimeError; not read
    bad = with_tensors(synth("glm4moe", "Q8_0"), tmp_path / "gate.gguf",
                       add={"blk.1.ffn_gate_inp_shexp.weight": zeros(5)})
    runs(capsys, bad)


def test_selection_bias_in_a_later_layer_only(synth, tmp_path, capsys):
    # deepseek2's blk.1 exp_probs_b dropped, blk.2's made [4, 2]: was RuntimeError; not read
    bad = with_tensors(synth("deepseek2", "Q8_0"), tmp_path / "bias.gguf",
                       drop=("blk.1.exp_probs_b.bias",), shapes={"blk.2.exp_probs_b.bias": [4, 2]})
    runs(capsys, bad)


def test_empty_tensor_in_an_mtp_block(synth, tmp_path, capsys):
    # a [0, 256] tensor in qwen35moe's MTP block: was loaded (ValueError); now not read
    bad = with_tensors(synth("qwen35moe", "Q8_0"), tmp_path / "mtp.gguf",
                       add={"blk.4.extra.weight": ([0, 256], b"")})
    runs(capsys, bad)


def test_tensor_of_no_layer_number(synth, tmp_path, capsys):
    # a blk.x.foo.weight in glm4moe, --spec --offload on: was ValueError sizing the MTP head
    bad = with_tensors(synth("glm4moe", "Q8_0"), tmp_path / "blkx.gguf",
                       add={"blk.x.foo.weight": zeros(4)})
    runs(capsys, bad, "--spec", "2", "--offload", "on")


@pytest.mark.parametrize("change,says", [
    # the nextn head's norm [64, 4] for [256]: was RuntimeError under --spec
    ({"shapes": {"blk.3.nextn.shared_head_norm.weight": [64, 4]}},
     "tensor blk.3.nextn.shared_head_norm.weight has shape [64, 4]"),
    # a nextn embedding of 5 rows for 1024 tokens: was IndexError under --spec
    ({"add": {"blk.3.nextn.embed_tokens.weight": zeros(5, 256)}},
     "tensor blk.3.nextn.embed_tokens.weight has shape [5, 256]"),
    # a nextn output head of 5 rows: was read as a 5-token vocabulary under --spec
    ({"add": {"blk.3.nextn.shared_head_head.weight": zeros(5, 256)}},
     "tensor blk.3.nextn.shared_head_head.weight has shape [5, 256]"),
])
def test_nextn_optional_tensor_of_a_wrong_shape(synth, tmp_path, capsys, change, says):
    bad = with_tensors(synth("glm4moe", "Q8_0"), tmp_path / "nextn.gguf", **change)
    refused(capsys, tmp_path, bad, says)


# --- keys that passed their checks but broke the engine --------------------------------------
@pytest.mark.parametrize("meta,says", [
    # every layer dense: was IndexError in the expert layouts (--offload on)
    ({"deepseek2.leading_dense_block_count": 3}, "deepseek2.leading_dense_block_count is 3"),
    # rope.freq_base 1 under YaRN: was ZeroDivisionError (ln 1)
    ({"deepseek2.rope.freq_base": (1.0, T.FLOAT32)}, "deepseek2.rope.freq_base is 1.0"),
])
def test_keys_that_broke_the_engine(synth, tmp_path, capsys, meta, says):
    bad = rewrite(synth("deepseek2", "Q8_0"), tmp_path / "bad.gguf", meta=meta)
    refused(capsys, tmp_path, bad, says)


def test_a_tensor_name_past_ggmls_limit(q3, tmp_path, capsys):
    # an extra tensor named with 5,000 bytes (llama.cpp refuses names of 64 bytes or more; the
    # error lines that quote a name were that long)
    bad = with_tensors(q3, tmp_path / "name.gguf", add={"x" * 5000: zeros(4)})
    line = refused(capsys, tmp_path, bad, "has a name of 5,000 bytes (GGUF allows 63)")
    assert len(line) < 400, len(line)


def test_an_eos_id_past_the_vocabulary_is_said(q3, tmp_path, capsys):
    # eos id 5,000 in a vocabulary of 1,024: dropped as llama.cpp drops it, now with a warning
    # naming the key (it was dropped silently)
    bad = rewrite(q3, tmp_path / "eos.gguf", meta={K + "eos_token_id": 5000})
    code, lines = run(capsys, "generate", str(bad), "-n", "1", "--prompt", "hi")
    assert code == 0 and any("tokenizer.ggml.eos_token_id is 5000, outside the vocabulary of "
                             "1024 tokens" in ln for ln in lines), lines
