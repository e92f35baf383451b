"""The built-in demo model, shipped in the package: a small qwen3moe trained by this project.

39M parameters (5 layers, d 512, 16 experts of width 256, 4 used, tied embeddings, 8192-token
byte-level BPE), trained from scratch on one H200 for 7.4 minutes (322M tokens) on English prose
and code that Debian and Python ship: the Python and Linux documentation, the Debian
Administrator's Handbook, man pages and the Python standard library
(scripts/build_demo_corpus.py, scripts/train_demo_model.py), exported through the project's GGUF
writer and quantized to Q4_K_M by llama.cpp's llama-quantize with an importance matrix
(scripts/make_demo_packs.sh). The record of the run: bench/2026-12-01-demo-model.md. It writes
readable, often wandering English and code; it knows no facts worth trusting.
"""

from __future__ import annotations

from importlib.resources import as_file, files
from pathlib import Path

DEMO_FILE = "strata-demo-Q4_K_M.gguf"
DEMO_TEXT = "the demo model: a 39M-parameter qwen3moe trained on Debian's and Python's docs"


def demo_model() -> Path:
    """The demo model's GGUF file inside the installed package."""
    with as_file(files(__name__) / DEMO_FILE) as path:  # (a real file: the package is on disk)
        return Path(path)
