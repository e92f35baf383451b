"""Runs the same prompt several times with decode steps between, as `strata bench` does, and says
for each pass and layer how its experts went (device-routed streaming of every uncached expert,
or host-read routing streaming the routed misses), the bytes the ring copied for it, the
routed fraction the choice was made from, and how far each pass's last logits are from the
first pass's (they must agree: same prompt, fresh KV cache).

    python scripts/diag_prompt_passes.py MODEL --device cuda --vram-budget 2 [--passes 3]
        [--cprofile N]

--cprofile N prints where the host spent pass 0 (cProfile: the N functions of most cumulative
time, then of most own time): after start-up the first pass took 6-11 s against 0.4-0.6 s
later on the H200 (run 44); the 3 GiB run came after the 2 GiB one had filled Triton's disk
cache.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import pstats
import time

import numpy as np
import torch

from strata.config import EngineConfig
from strata.engine.generator import Engine
from strata.experts import offload
from strata.experts import ring as ring_mod


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--vram-budget", type=float, default=2.0)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--verbose", action="store_true", help="print the layers' rows too")
    p.add_argument("--cprofile", type=int, default=0, metavar="N",
                   help="profile pass 0 on the host and print its N costliest functions")
    a = p.parse_args()
    ec = EngineConfig(device=a.device, offload="on", vram_budget_gib=a.vram_budget,
                      ctx=a.prompt_len + a.gen_len)
    engine = Engine.load(a.model, config=ec)
    model, cfg = engine.model, engine.config
    experts = model.experts
    prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, a.prompt_len).tolist()

    log: dict[str, collections.Counter] = {"path": collections.Counter(),
                                           "bytes": collections.Counter()}
    paths: dict[int, str] = {}
    copy0 = ring_mod.Ring._copy

    def copy(self, arena, bank, waits):  # noqa: ANN001
        log["bytes"][bank.layer] += len(bank.experts) * bank.lay.nbytes
        return copy0(self, arena, bank, waits)

    choose0 = offload.OffloadExperts.choose

    def choose(self, layer, tokens, topk):  # noqa: ANN001
        path = choose0(self, layer, tokens, topk)
        if path in ("streamed_routed", "streamed"):  # (the executor's two streaming paths)
            paths[layer] = "routed" if path == "streamed_routed" else "host"
        return path

    ring_mod.Ring._copy = copy
    offload.OffloadExperts.choose = choose
    report = []
    first = None
    for i in range(a.passes):
        fractions = dict(experts.routed_fraction)
        paths.clear()
        log["bytes"].clear()
        kv = model.new_cache(a.prompt_len + a.gen_len)
        streamed0 = experts.ring.streamed_bytes
        mem0 = torch.cuda.memory_stats() if a.device == "cuda" else {}
        if a.device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        prof = cProfile.Profile() if a.cprofile and i == 0 else None
        if prof is not None:
            prof.enable()
        logits = engine.run_prompt(prompt, kv)
        if a.device == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
            for order in ("cumulative", "tottime"):  # the call chain, then the leaves
                pstats.Stats(prof).sort_stats(order).print_stats(a.cprofile)
        mem1 = torch.cuda.memory_stats() if a.device == "cuda" else {}
        # the allocator's trips to the driver and its retries after freeing its cache (each a
        # device-wide sync): what a budget close to the peak would cost a pass
        alloc = {k: mem1.get(k, 0) - mem0.get(k, 0)
                 for k in ("num_alloc_retries", "num_device_alloc", "num_device_free",
                           "num_ooms")}
        experts.stats.settle()  # as strata bench reads its counters: routed_fraction lands
        last = logits[-1].float().cpu()
        if first is None:
            first = last
        diff = float((last - first).abs().max() / first.abs().max())
        uncached = [int((ls.slot_of < 0).sum()) for ls in experts.cache.layers]
        layers = sorted(set(paths) | set(log["bytes"]))
        rows = [{"layer": la, "path": paths.get(la), "fraction_before": fractions.get(la),
                 "fraction_after": experts.routed_fraction.get(la), "uncached": uncached[la],
                 "gib": log["bytes"][la] / 2**30} for la in layers]
        total = (experts.ring.streamed_bytes - streamed0) / 2**30
        n_host = sum(r["path"] == "host" for r in rows)
        print(f"pass {i}: {wall:.3f} s; allocator {alloc}")
        print(f"pass {i}: streamed {total:.2f} GiB; {n_host} of {len(rows)} layers host-read; "
              f"last logits max |diff| from pass 0 (of max |logit|): {diff:.3g}; argmax "
              f"{int(last.argmax())} vs {int(first.argmax())}")
        for r in rows:
            if a.verbose and (r["path"] != "routed" or r["layer"] < 2):
                print("   ", json.dumps(r))
        report.append({"pass": i, "wall_s": wall, "allocator": alloc, "gib": total,
                       "max_diff": diff, "layers": rows})
        token = int(logits[-1].argmax())
        for _ in range(a.gen_len):
            token = int(model.decode(token, kv)[0].argmax())
        del kv
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
