"""The demo model's loss curve (train and held-out loss against tokens seen) as a PNG, from the
log.jsonl that scripts/train_demo_model.py writes.

    python scripts/plot_demo_training.py out/demo-run/log.jsonl bench/2026-12-01-demo-model/loss.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    log, out = Path(argv[0]), Path(argv[1])
    recs = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    train = [(r["tokens"] / 1e6, r["loss"]) for r in recs if "loss" in r]
    held = [(r["tokens"] / 1e6, r["heldout_loss"]) for r in recs
            if "heldout_loss" in r and not r.get("final_eval")]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(*zip(*train, strict=True), lw=0.8, label="train (one batch)")
    ax.plot(*zip(*held, strict=True), "o-", ms=3, label="held out (4 batches)")
    ax.set_xlabel("tokens seen (millions)")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_ylim(1.0, 4.5)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("strata demo model (qwen3moe, 39M parameters), one H200")
    fig.tight_layout()
    tmp = out.with_name(out.stem + ".tmp.png")
    fig.savefig(tmp)
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
