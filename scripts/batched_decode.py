"""Decode tok/s by batch size, at the engine (no server): B sequences of a 32-token prompt each,
then timed decode passes of one token per sequence, as `strata serve --batch` runs them (B = 1
takes the single-sequence decode step, as the server does). Medians of --repeats.

    python scripts/batched_decode.py MODEL.gguf [engine flags] --batches 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.cli.engine_flags import add_engine_arguments, engine_config  # noqa: E402
from strata.engine.generator import Engine  # noqa: E402
from strata.model.parts import Segment  # noqa: E402

PROMPT = 32


def seconds_per_pass(engine: Engine, batch: int, steps: int, seed: int,
                     step: object | None = None) -> float:
    """step: a BatchStep (strata.engine.batch_step) whose pool the sequences take (--step
    batched), else caches of their own and the plain forward."""
    m = engine.model
    gen = torch.Generator().manual_seed(seed)
    if step is not None:
        kvs = [step.pool.take() for _ in range(batch)]
    else:
        kvs = [m.new_cache(PROMPT + steps + 1) for _ in range(batch)]
    toks = torch.randint(0, engine.config.n_vocab, (batch * PROMPT,), generator=gen)
    m.forward(toks, [Segment(kv, PROMPT) for kv in kvs])
    step_tokens = torch.randint(0, engine.config.n_vocab, (steps, batch), generator=gen)
    t0 = time.perf_counter()
    for row in step_tokens:
        if batch == 1:
            m.decode(int(row[0]), kvs[0])
        elif step is not None:
            step(row.tolist(), kvs)
        else:
            m.forward(row, [Segment(kv, 1) for kv in kvs])
    return (time.perf_counter() - t0) / steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--steps", type=int, default=40, help="timed decode passes per run (40)")
    p.add_argument("--repeats", type=int, default=3, help="runs per batch size (3)")
    p.add_argument("--step", choices=("forward", "batched"), default="forward",
                   help="several sequences through the plain forward (each its own cache) or "
                        "the batched decode step over one paged KV pool, as strata serve")
    add_engine_arguments(p)
    args = p.parse_args()
    engine = Engine.load(args.model, config=engine_config(args))
    step = None
    if args.step == "batched":
        from strata.engine.batch_step import BatchStep
        from strata.runtime.kv_slots import KVSlots
        from strata.server.kv_batch import KV_BLOCK

        m, most = engine.model, max(int(x) for x in args.batches.split(","))
        pool = KVSlots(m.cfg, m.device, most, PROMPT + max(args.steps, 4) + 1, m.kv_dtype,
                       KV_BLOCK)
        step = BatchStep(m, pool, engine.engine_config.decode_step)
    print(f"executor {type(engine.model.experts).__name__}; torch threads "
          f"{torch.get_num_threads()}")
    print("| sequences | ms / pass | tok/s | x one sequence |")
    print("| ---: | ---: | ---: | ---: |")
    base = None
    for b in (int(x) for x in args.batches.split(",")):
        seconds_per_pass(engine, b, 4, 99, step)  # warm-up
        dt = statistics.median(seconds_per_pass(engine, b, args.steps, r, step)
                               for r in range(args.repeats))
        rate = b / dt
        base = base or rate
        print(f"| {b} | {dt * 1e3:.2f} | {rate:.0f} | {rate / base:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
