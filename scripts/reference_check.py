"""`strata logits` (the reference path) against HF transformers on synthetic models, on a device.

    python3 scripts/reference_check.py --device cuda --out results.json

Writes tiny models of every architecture in several quant mixes, plus real Qwen3 / Mixtral widths
cut to two layers, and prints max KL per position and top-1 agreement for each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from strata.cli.logits import compute_logits  # noqa: E402
from strata.config import EngineConfig  # noqa: E402
from strata.engine.generator import Engine  # noqa: E402
from strata.synth.presets import get_preset  # noqa: E402
from strata.synth.recipes import Recipe  # noqa: E402
from strata.synth.writer import write_model  # noqa: E402

from hf_reference import hf_gguf_logits, hf_mixtral_logits, kl_per_position  # noqa: E402

CASES = [  # (arch, preset, layers or None, recipe)
    ("qwen3moe", "tiny", None, "Q4_K_M"), ("qwen3moe", "tiny", None, "IQ2_XS-MIX"),
    ("qwen3moe", "tiny", None, "ALL-TYPES"), ("qwen2moe", "tiny", None, "Q4_K_M"),
    ("qwen2moe", "tiny", None, "ALL-TYPES"), ("llama", "tiny", None, "Q4_K_M"),
    ("llama", "tiny", None, "ALL-TYPES"), ("qwen3moe", "30b-a3b", 2, "Q4_K_M"),
    ("qwen3moe", "30b-a3b", 2, "IQ3_XXS"), ("llama", "mixtral-8x7b", 2, "Q4_K_M"),
]
TOKENS = [5, 311, 17, 902, 64, 64, 1000, 3, 250, 777, 41, 8, 512, 99, 1, 600]


def configs(device: str) -> list[tuple[str, EngineConfig]]:
    """The reference path, and the offload runtime all-resident and with most experts missing."""
    return [("reference", EngineConfig(device=device, offload="off")),
            ("offload all-resident", EngineConfig(device=device, offload="on",
                                                  kernels="exact")),
            ("offload 4 slots, dma", EngineConfig(device=device, offload="on", expert_cache="4",
                                                  miss="dma", kernels="exact")),
            ("offload 4 slots, cpu", EngineConfig(device=device, offload="on", expert_cache="4",
                                                  miss="cpu", kernels="exact",
                                                  cpu_kernels="torch"))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch, preset_name, layers, recipe in CASES:
            preset = get_preset(preset_name, arch)
            if layers:
                preset = replace(preset, n_layers=layers)
            path = Path(tmp) / f"{arch}-{preset_name}-{recipe}.gguf"
            write_model(path, preset, Recipe(recipe), seed=1)
            ref = (hf_mixtral_logits if arch == "llama" else hf_gguf_logits)(path, TOKENS)
            for name, ec in configs(args.device):
                t0 = time.perf_counter()
                engine = Engine.load(path, config=ec)
                ours = compute_logits(engine, TOKENS)
                ours_s = time.perf_counter() - t0
                kl = kl_per_position(ref, ours)
                rows.append({"arch": arch, "preset": preset_name, "layers": preset.n_layers,
                             "recipe": recipe, "device": args.device, "config": name,
                             "max_kl": float(kl.max()),
                             "top1_agree": float((ours.argmax(-1) == ref.argmax(-1)).mean()),
                             "max_abs_diff": float(abs(ours - ref).max()),
                             "load_and_logits_s": round(ours_s, 2)})
                r = rows[-1]
                print(f"{arch:9} {preset_name:13} L={r['layers']:<3} {recipe:12} {name:22} "
                      f"max KL {r['max_kl']:.2e}  top-1 {100 * r['top1_agree']:.0f}%  "
                      f"max|diff| {r['max_abs_diff']:.2e}", flush=True)
                del engine
            path.unlink()
    ok = all(r["max_kl"] < 1e-4 and r["top1_agree"] == 1.0 for r in rows)
    print("all cases within max KL 1e-4 and the same top token" if ok else "MISMATCH")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
