"""The demo model's pipeline on a tiny shape: tokenizer, training, the packed trip back, GGUF
export. The training model's own forward must be the qwen3moe that Strata and llama.cpp run on
the exported file, and the tokenizer must tokenize as Strata's and llama.cpp's readers do."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from strata.cli.logits import compute_logits
from strata.engine.generator import Engine

from hf_reference import kl_per_position

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
sys.path.insert(0, str(SCRIPTS))

import export_demo_gguf  # noqa: E402
import train_demo_model as tdm  # noqa: E402

TEXT = ("The kernel schedules each task on a processor. When a task waits for input, another "
        "one runs.\n\ndef area(r):\n    return 3.14159 * r * r  # the area of a circle\n\n"
        "Use the --verbose flag to print each file's name as it is copied; 42 files, 7 MB.\n")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("demo")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    words = TEXT.split(" ")
    docs = [" ".join(rng.permutation(words)) for _ in range(60)]
    docs.append("<|im_start|>user\nWhat is cp?<|im_end|>\n<|im_start|>assistant\n"
                "cp copies files.<|im_end|>\n")
    (corpus / "train.txt").write_text("".join(d + f"\n{tdm.SEP}\n" for d in docs))
    (corpus / "heldout.txt").write_text(TEXT + f"\n{tdm.SEP}\n")
    tok = root / "tokenizer.json"
    tdm.main(["tokenizer", "--corpus", str(corpus / "train.txt"), "--vocab", "320",
              "--out", str(tok)])
    run = root / "run"
    # two calls of one schedule: the second resumes from the first's checkpoint
    args = ["train", "--corpus", str(corpus), "--tokenizer", str(tok), "--out", str(run),
            "--shape", "test", "--device", "cpu", "--batch", "4", "--budget-minutes", "0.1",
            "--lr", "1e-2", "--log-every", "1", "--eval-every", "2"]
    tdm.main([*args, "--stop-minutes", "0.04"])
    tdm.main(args)
    weights = root / "weights"
    tdm.main(["pack", "--out", str(run), "--dest", str(weights), "--part-bytes", "20000"])
    gguf_path = root / "demo-F32.gguf"
    export_demo_gguf.main(["--weights", str(weights), "--tokenizer", str(tok),
                           "--out", str(gguf_path)])
    return {"root": root, "run": run, "weights": weights, "gguf": gguf_path, "tok": tok}


def test_training_resumes_and_logs(trained):
    import json

    recs = [json.loads(line) for line in (trained["run"] / "log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in recs if not r.get("final_eval")]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # the second call went on
    finals = [r for r in recs if r.get("final_eval")]
    assert len(finals) == 2 and finals[1]["step"] > finals[0]["step"]
    assert finals[1]["train_s"] >= 0.1 * 60 - 1  # the whole schedule ran
    assert all(math.isfinite(r["loss"]) for r in recs if "loss" in r)
    assert recs[-2]["loss"] < recs[0]["loss"] - 0.1  # it learned something


def test_pack_round_trip_is_exact(trained):
    saved = torch.load(trained["run"] / "checkpoint.pt", weights_only=False)
    model = tdm.DemoMoE(tdm.Shape(**saved["shape"]))
    model.load_state_dict(saved["export"] or saved["model"])  # what pack packs
    back = tdm.unpack_weights(trained["weights"])
    assert len(list(trained["weights"].glob("weights.part*"))) > 1  # split into parts
    for name, t in model.gguf_tensors().items():
        assert torch.equal(back[name], t.to(torch.bfloat16).float()), name


def _bf16_model(trained) -> tdm.DemoMoE:
    """The training model holding the exported (bf16-rounded) weights."""
    saved = torch.load(trained["run"] / "checkpoint.pt", weights_only=False)
    model = tdm.DemoMoE(tdm.Shape(**saved["shape"]))
    model.load_gguf_tensors(tdm.unpack_weights(trained["weights"]))
    return model.eval()


def test_exported_gguf_runs_the_training_forward(trained):
    """Strata's reference path on the exported file gives the training model's logits."""
    model = _bf16_model(trained)
    tokens = [5, 100, 17, 300, 64, 64, 200, 3, 250, 77, 41, 8, 260, 301]
    with torch.no_grad():
        ref, _ = model(torch.tensor([tokens]))
    ours = compute_logits(Engine.load(trained["gguf"]), tokens)
    kl = kl_per_position(ref[0].double().numpy(), ours)
    assert kl.max() < 1e-4, kl
    assert (ours.argmax(-1) == ref[0].numpy().argmax(-1)).all()


def test_exported_tokenizer_matches_training_tokenizer(trained):
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(trained["tok"]))
    engine = Engine.load(trained["gguf"])
    for text in (TEXT, "What is cp? 1234 copies\n\n  spaces", "<|im_start|>user\nhi<|im_end|>"):
        assert engine.tokenizer.encode(text) == hf.encode(text).ids, text


def test_exported_gguf_matches_llama_cpp(trained):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed")
    tokens = [5, 100, 17, 300, 64, 64, 200, 3, 250, 77, 41, 8, 260, 301]
    from llama_worker import llama_scores

    # (llama.cpp's KV cache in float32, as Strata's reference: its default f16 rounds q and k
    # to 11 bits, which near a router tie of a model trained for a few seconds passed 1e-4)
    theirs = llama_scores(trained["gguf"], [tokens], type_k=0, type_v=0)[0]
    text = "What is cp? 1234 copies"
    their_ids = llama_cpp.Llama(str(trained["gguf"]), vocab_only=True, verbose=False).tokenize(
        text.encode(), add_bos=False, special=True)
    ours = compute_logits(Engine.load(trained["gguf"]), tokens)
    assert kl_per_position(theirs, ours).max() < 1e-4
    assert Engine.load(trained["gguf"]).tokenizer.encode(text) == their_ids
