"""Expert-cache hit rates of each policy at several cache sizes, on real text, through the
engine's own offload runtime and decode step (the CPU path: there the "cache" is a set of host
copies, but which experts stay resident, and so the hit rate, follows the same cache and policy
code as on a GPU).

Each document of --text is fed token by token through decode steps from an empty KV cache (the
routing of real text read as a model reads it while generating: teacher forcing). The profile
policy ranks experts by a profile recorded over --profile-text (`strata profile`), which should
be other text than --text. Also printed: how concentrated the routing is per layer (the busiest
expert's share, and how many experts take 90% of a layer's assignments).

    python scripts/cache_sweep.py MODEL.gguf --text heldout.txt --profile-text train-part.txt \
        --slots 10,20,40,60 --docs 8 --tokens 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from strata.cli.main import main as strata_main
from strata.config import EngineConfig
from strata.engine.generator import Engine


def documents(path: Path, n: int, tokens: int, engine: Engine) -> list[list[int]]:
    """n documents (split at <|endoftext|> lines, else at blank lines) of at least 400 bytes,
    spread over the file, each cut to `tokens` tokens."""
    text = path.read_text(encoding="utf-8")
    sep = "\n<|endoftext|>\n" if "\n<|endoftext|>\n" in text else "\n\n"
    docs = [d.strip() for d in text.split(sep) if len(d.strip()) > 400 and "<|im_" not in d]
    step = max(1, len(docs) // n)
    return [engine.tokenizer.encode(d)[:tokens] for d in docs[::step][:n]]


def coverage(counts: np.ndarray, share: float = 0.9) -> np.ndarray:
    """Per layer: the fewest experts whose assignments add up to `share` of the layer's."""
    c = -np.sort(-counts, axis=1)
    frac = c.cumsum(1) / np.maximum(c.sum(1, keepdims=True), 1)
    return (frac < share).sum(1) + 1


def run_one(model: str, docs: list[list[int]], policy: str, slots: int,
            profile: str | None) -> dict:
    ec = EngineConfig(device="cpu", offload="on", expert_cache=str(slots), cache_policy=policy,
                      expert_profile=profile if policy == "profile" else None, miss="cpu")
    engine = Engine.load(model, config=ec)
    stats = engine.model.experts.stats
    t0 = time.perf_counter()
    n = 0
    for ids in docs:
        kv = engine.model.new_cache(len(ids))
        for tok in ids:
            engine.model.decode(tok, kv)
            n += 1
    dt = time.perf_counter() - t0
    for settle in stats.settlers:
        settle()
    served = stats.hits + stats.cpu + stats.streamed
    return {"policy": policy, "slots": slots, "tokens": n,
            "hit_rate": float(stats.hits.sum() / max(1, served.sum())),
            "hit_rate_per_layer": (stats.hits / np.maximum(served, 1)).round(4).tolist(),
            "decode_tok_s_cpu": n / dt, "routed": stats.routed.tolist()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--text", type=Path, required=True, help="documents to decode")
    ap.add_argument("--profile-text", type=Path, required=True, help="text to profile on")
    ap.add_argument("--slots", default="10,20,40,60", help="cache sizes, slots in all layers")
    ap.add_argument("--policies", default="lru,lfu,profile")
    ap.add_argument("--docs", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256, help="tokens of each document")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    probe = Engine.load(a.model, config=EngineConfig(device="cpu"))
    docs = documents(a.text, a.docs, a.tokens, probe)
    L, E = probe.config.n_layers, probe.config.n_experts
    with tempfile.TemporaryDirectory() as tmp:
        prof = str(Path(tmp) / "profile.json")
        if strata_main(["profile", a.model, "--device", "cpu", "--prompts", str(a.profile_text),
                        "--out", prof]) != 0:
            return 1
        rows = [run_one(a.model, docs, p, int(s), prof) for s in a.slots.split(",")
                for p in a.policies.split(",")]
    routed = np.array(rows[0]["routed"])
    share = routed.max(1) / np.maximum(routed.sum(1), 1)
    cover = coverage(routed)
    print(f"{len(docs)} documents, {sum(map(len, docs))} tokens decoded; {L} layers x {E} "
          f"experts")
    print("routing per layer: busiest expert's share " + " ".join(f"{x:.1%}" for x in share)
          + "; experts for 90% of assignments " + " ".join(map(str, cover)))
    print(f"{'slots':>6} {'of all':>7} " + " ".join(f"{p:>8}" for p in a.policies.split(",")))
    for s in a.slots.split(","):
        r = [x for x in rows if x["slots"] == int(s)]
        print(f"{s:>6} {int(s) / (L * E):>7.1%} " + " ".join(f"{x['hit_rate']:>8.1%}" for x in r))
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, "busiest_share": share.tolist(),
                                      "cover90": cover.tolist()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
