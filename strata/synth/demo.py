"""The built-in demo model: a tiny synthetic qwen3moe written to the user's cache on first use."""

from __future__ import annotations

import os
from pathlib import Path

from strata.cache import cache_dir
from strata.synth.presets import get_preset
from strata.synth.recipes import Recipe
from strata.synth.writer import write_model

DEMO_NAME = "strata-demo-qwen3moe-tiny-Q4_K_M-v2.gguf"


def demo_model() -> Path:
    path = cache_dir() / DEMO_NAME
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.gguf")
        write_model(tmp, get_preset("tiny", "qwen3moe"), Recipe("Q4_K_M"), seed=0)
        tmp.replace(path)  # atomic: a half-written demo model is never left behind
    return path
