"""strata bench-serve: load a running OpenAI-compatible server (strata serve, llama-server) with
concurrent streamed completions and report TTFT, inter-token latency and aggregate tok/s per
concurrency level (strata.bench.serve_load says how it measures)."""

from __future__ import annotations

import argparse
import json
import sys

from strata.bench.serve_load import Server, prompt_pool, run_level
from strata.cli.limits import check_seed
from strata.cli.output import atomic_path, check_folder
from strata.errors import StrataError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000",
                   help="the server (http://127.0.0.1:8000: strata serve's default port)")
    p.add_argument("--api-key", default=None, help="sent as a bearer token (none)")
    p.add_argument("--model", default=None, help="the request's model field (none)")
    p.add_argument("-c", "--concurrency", default="1,4,8", metavar="C,C,...",
                   help="clients at once, one level each (1,4,8)")
    p.add_argument("--requests", type=int, default=None, metavar="N",
                   help="requests per level (4 x its concurrency, at least 8; a first level of "
                   "1 client: with the warm-up, at least 10, so the first request after load "
                   "and the tenth are compared)")
    p.add_argument("--prompt-len", type=int, default=128,
                   help="prompt tokens of each request (128)")
    p.add_argument("--output-len", type=int, default=64,
                   help="output tokens of each request, EOS ignored (64)")
    p.add_argument("--request-rate", type=float, default=None, metavar="R",
                   help="requests/s arriving as a Poisson process, at most C in flight "
                   "(default: closed loop, each client sends its next request when its last ends)")
    p.add_argument("--warmup", type=int, default=1,
                   help="requests sent one at a time before the levels, not counted (1)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="each request's sampling temperature, with a seed of its own; 0: greedy "
                   "(1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts, arrivals and requests' sampling (0)")
    p.add_argument("--json", default=None, help="write every level's figures to this JSON file")


def _levels(spec: str) -> list[int]:
    try:
        out = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise StrataError(f"--concurrency {spec!r}: give client counts, e.g. 1,4,8") from None
    if not out or min(out) < 1 or max(out) > 1024:
        raise StrataError(f"--concurrency {spec!r}: each level must be 1 to 1024 clients")
    return out


def run(args: argparse.Namespace) -> int:
    levels = _levels(args.concurrency)
    for name in ("prompt_len", "output_len"):
        if getattr(args, name) < 1:
            raise StrataError(f"--{name.replace('_', '-')} must be at least 1")
    if args.request_rate is not None and not args.request_rate > 0:
        raise StrataError("--request-rate must be above 0 requests/s")
    if not 0 <= args.temperature <= 2:
        raise StrataError(f"--temperature {args.temperature}: give 0 (greedy) to 2")
    if args.requests is not None and args.requests < 1:
        raise StrataError("--requests must be at least 1")
    if args.warmup < 0:
        raise StrataError(f"--warmup {args.warmup}: give 0 (none) or more requests")
    check_seed(args.seed)
    if args.json:
        check_folder(args.json, "--json")
    server = Server(args.url.rstrip("/"), args.api_key, args.model)
    pool = prompt_pool(server, args.seed)
    sent: list = []  # the requests sent one at a time, in order: warm-up, then a first level of 1
    if args.warmup:
        sent += run_level(server, 1, args.warmup, args.prompt_len, args.output_len, pool,
                          args.seed + 1, temperature=args.temperature).results
    rows = []
    for i, c in enumerate(levels):
        n = args.requests or max(8, 4 * c)
        if i == 0 and c == 1 and args.requests is None and args.request_rate is None:
            n = max(n, 10 - len(sent))  # (the tenth request sent one at a time: _first_and_tenth)
        level = run_level(server, c, n, args.prompt_len, args.output_len, pool,
                          args.seed + 2 + i, args.request_rate, args.temperature)
        rows.append(level.summary())
        _print_row(rows[-1], rows[0], first=i == 0)
        if i == 0 and c == 1 and args.request_rate is None:
            sent += level.results
    first = _first_and_tenth(sent)
    if args.json:
        with atomic_path(args.json, "--json") as tmp:
            tmp.write_text(json.dumps({"url": args.url, "prompt_len": args.prompt_len,
                                       "output_len": args.output_len, "levels": rows,
                                       **first}, indent=1))
    return 1 if any(r["failed"] for r in rows) else 0


def _first_and_tenth(sent: list) -> dict:
    """The time to first token of the first request this run sent and of the tenth, where the
    warm-up and a first level of one client sent ten one at a time (on a server started just
    before: the first request after load against a warm one); printed, and returned for the
    JSON."""
    if len(sent) < 10 or not sent[0].ok or not sent[9].ok:
        return {}
    a, b = 1e3 * sent[0].ttft, 1e3 * sent[9].ttft
    print(f"first request of this run: TTFT {a:.0f} ms; the tenth: {b:.0f} ms "
          f"({a / b:.2f}x)" if b else f"first request of this run: TTFT {a:.0f} ms")
    return {"first_ttft_ms": a, "tenth_ttft_ms": b}


def _print_row(r: dict, base: dict, first: bool) -> None:
    if first:
        print("| clients | requests | output tok/s | x 1st level | TTFT p50 / p99 ms | "
              "ITL p50 / p99 ms | TPOT p50 ms | E2E p50 s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    scale = r["output_tok_s"] / base["output_tok_s"] if base["output_tok_s"] else 0.0
    failed = f" ({r['failed']} failed: {'; '.join(r['errors'])})" if r["failed"] else ""
    print(f"| {r['concurrency']} | {r['requests']}{failed} | {r['output_tok_s']:.1f} | "
          f"{scale:.2f} | {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
          f"{r['itl_p50_ms']:.1f} / {r['itl_p99_ms']:.1f} | {r['tpot_p50_ms']:.1f} | "
          f"{r['e2e_p50_ms'] / 1e3:.2f} |", flush=True)
    sys.stdout.flush()
