"""Benchmark the fused GGUF kernels (strata.kernels.gpu) on the GPU against the machine's ceilings.

    python scripts/bench_kernels.py --tune --out bench_kernels.json     # everything
    python scripts/bench_kernels.py --types Q4_K,IQ2_XS --tokens 1,4096  # a subset

For each type, matrix shape (N rows x K columns) and token count M it reports the median time of
one quant_matmul, the bandwidth it achieved (weight bytes + x + y, over the time) against the HBM
copy bandwidth measured in the same run, and its TFLOP/s against cuBLAS bf16 (torch.matmul) on
the same shape. Calls are captured in a CUDA graph that cycles through enough copies of the
weights (>= 256 MB) that the 60 MB L2 cannot hold them, and triton.testing.do_bench times graph
replays (median); launch overhead is therefore not in the kernel times. The decode MoE layer of
Qwen3-30B-A3B (128 experts, 8 routed, gate + up + down, one token) is timed the same way and also
eagerly (host wall time per call, launches included). The prompt MoE layer of the same model
(8 to 4096 tokens, --moe-prompt-tokens; Q4_K/Q4_K/Q6_K and IQ2_XS/IQ2_XS/IQ3_XXS,
--moe-prompt-types, MXFP4/MXFP4/MXFP4 at gpt-oss-20b's layer instead; every expert resident) is
timed eagerly through each of moe_forward's paths:
the per-pair kernels with 8-bit x (up to 64 tokens), the grouped one (dequantize to bf16 ->
torch._grouped_mm, moe_grouped.py), the fused tl.dot kernels (moe._prompt) and, for Q4_K
gate/up and MXFP4 packs, the integer tensor-core kernels (moe_mmq.py); a batched decode step of T
sequences runs the same layer; --moe-prompt-only runs just that.

quant_matmul runs the FMA GEMV up to 4 tokens, the fused tensor-core kernel up to 63 and
dequantize -> cuBLAS from 64 (matmul.DEQUANT_MIN_M); the fused kernel is also timed alone at
4096 tokens for four types. --tune first times GEMV tiles (BN, BK, stages, warps) on the
14336 x 4096 single-token case and uses the fastest per type for everything after.

Compiling ~300 kernel variants takes minutes on one core, so a pool of processes compiles them
first (--workers) into Triton's on-disk cache; the timed pass then runs alone on the GPU.
Results and the measured tables: docs/kernels.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.quant import QType, random_rows, row_nbytes  # noqa: E402

MODEL_SHAPES = {  # name: (N rows, K columns) of one matrix
    "30B-A3B gate/up": (768, 2048),
    "30B-A3B down": (2048, 768),
    "235B-A22B gate/up": (1536, 4096),
    "235B-A22B down": (4096, 1536),
    "Mixtral gate/up 14336x4096": (14336, 4096),
    "Mixtral down": (4096, 14336),
}
BIG = "Mixtral gate/up 14336x4096"
# the 30B-A3B's attention projections and output head, which a batched decode step of B
# sequences multiplies by B rows (--dense-batch)
DENSE_SHAPES = {
    "30B-A3B q": (4096, 2048),
    "30B-A3B k/v": (512, 2048),
    "30B-A3B o": (2048, 4096),
    "30B-A3B head": (151936, 2048),
}
DENSE_TOKENS = [1, 2, 4, 8, 16]
DENSE_TYPES = ["Q4_K", "Q6_K"]
PRIORITY = ["Q4_K", "Q6_K", "Q8_0", "IQ2_XS", "IQ3_XXS", "Q5_K", "IQ4_XS"]
ALL_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
             "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL",
             "IQ4_XS", "MXFP4"]
TOKENS = [1, 4, 16, 512, 4096]
# the prompt MoE layer's token counts and packs (gate/up/down); moe.GROUPED_MIN_TOKENS switches
# the 30B-A3B layer to the grouped path at 256 tokens, an estimate these rows are to settle
MOE_PROMPT_TOKENS = [32, 64, 128, 256, 512, 4096]
MOE_PROMPT_TYPES = [("Q4_K", "Q4_K", "Q6_K"), ("IQ2_XS", "IQ2_XS", "IQ3_XXS")]
FUSED_GEMM = ["Q4_K", "Q6_K", "Q8_0", "IQ2_XS"]  # also timed without the cuBLAS route
ROTATE_BYTES = 256 << 20  # weight copies per timed graph: well past the H200's 60 MB L2
# candidate GEMV tiles (BN, BK, pipeline stages, warps) tried by --tune on the 14336 x 4096
# single-token case; the fastest is then used for every case of that type
TUNE = [(2, 512, 1, 4), (4, 256, 1, 4), (4, 512, 1, 4), (2, 1024, 1, 4), (1, 512, 1, 4),
        (2, 512, 1, 2), (1, 1024, 1, 2), (2, 512, 3, 4)]


# ---- cases --------------------------------------------------------------------------------------


def cases(types: list[str], tokens: list[int], full: set[str],
          table: dict[str, tuple] | None = None) -> list[tuple]:
    """(type, shape name, M, GEMV tile) to run: every shape for the types in `full`, the big
    single matrix for the rest; tiles from `table` (None: formats.py's)."""
    out = []
    for t in types:
        shapes = list(MODEL_SHAPES) if t in full else [BIG]
        for s in shapes:
            for m in tokens:
                out.append((t, s, m, (table or {}).get(t)))
    return out


def tune_cases(types: list[str], tiles: list[tuple] = TUNE) -> list[tuple]:
    return [(t, BIG, 1, c) for t in types for c in tiles]


_DRAWN: dict[tuple, torch.Tensor] = {}


def _weights(qt: QType, n: int, k: int, copies: int, valid: bool = True) -> list[torch.Tensor]:
    """`copies` distinct device buffers of random blocks (one draw per matrix, cloned). Only
    compiling (valid=False) takes random bytes, which is faster to draw."""
    if not valid:
        return [torch.randint(0, 256, (n, row_nbytes(qt, k)), dtype=torch.uint8, device="cuda")]
    key = (qt, n, k)
    if key not in _DRAWN:
        rng = np.random.default_rng(0)
        _DRAWN.clear()  # keep one matrix on the device at a time
        _DRAWN[key] = torch.from_numpy(random_rows(qt, n, k, rng, 0.02)).cuda()
    w = _DRAWN[key]
    return [w] + [w.clone() for _ in range(copies - 1)]


def _copies(nbytes: int) -> int:
    return int(min(256, max(3, math.ceil(ROTATE_BYTES / nbytes))))


def _graph_time(calls: list, rep_ms: int) -> float:
    """Median seconds per call: the calls are captured once in a CUDA graph, do_bench times
    replays."""
    import triton.testing

    for c in calls[:2]:
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
        for c in calls:
            c()
    torch.cuda.synchronize()
    ms = triton.testing.do_bench(g.replay, warmup=5, rep=rep_ms, return_mode="median")
    return ms / 1e3 / len(calls)


def run_case(case: tuple, rep_ms: int, timed: bool = True, dequant_min_m: int | None = None,
             gemv_max_m: int | None = None, split_k: int | None = None,
             mmq: bool = False, x8: int = 0) -> dict:
    """Run (and time) one (type, shape, M, gemv override) case; dequant_min_m, gemv_max_m,
    split_k: quant_matmul's (None: its default); mmq: moe_mmq.mmq_matmul instead (the integer
    tensor cores, x rounded to 8 bits); x8 = R: dense_x8.gemm_x8_tokens at R rows a program (x
    rounded to 8 bits, each row read once for every token; x's rounding in the time)."""
    from strata.kernels.gpu import quant_matmul
    from strata.kernels.gpu.dense_x8 import gemm_x8_tokens, tokens_tile
    from strata.kernels.gpu.moe_mmq import mmq_matmul

    name, shape, m, cfg = case
    qt = QType[name]
    n, k = (MODEL_SHAPES | DENSE_SHAPES)[shape]
    nbytes = n * row_nbytes(qt, k)
    ws = _weights(qt, n, k, _copies(nbytes) if timed else 1, valid=timed)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.float32)
    kw = {} if dequant_min_m is None else {"dequant_min_m": dequant_min_m}
    if gemv_max_m is not None:
        kw["gemv_max_m"] = gemv_max_m
    if split_k is not None:
        kw["split_k"] = split_k
    calls = [(lambda w=w: mmq_matmul(x, w, qt, out=y)) if mmq else
             (lambda w=w: gemm_x8_tokens(x, w, qt, tokens_tile(k, x8))) if x8 else
             (lambda w=w: quant_matmul(x, w, qt, out=y, base_tile=cfg, **kw)) for w in ws]
    if not timed:
        calls[0]()
        torch.cuda.synchronize()
        return {}
    sec = _graph_time(calls, rep_ms)
    moved = nbytes + x.numel() * 2 + y.numel() * 4
    return dict(type=name, shape=shape, n=n, k=k, tokens=m, gemv=cfg, gemv_max_m=gemv_max_m,
                split_k=split_k, us=sec * 1e6,
                gbs=moved / sec / 1e9, tflops=2 * m * n * k / sec / 1e12)


def cublas_row(shape: str, m: int, rep_ms: int) -> dict:
    n, k = MODEL_SHAPES[shape]
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
          for _ in range(_copies(n * k * 2))]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    sec = _graph_time([lambda w=w: torch.matmul(x, w.T, out=y) for w in ws], rep_ms)
    return dict(shape=shape, tokens=m, us=sec * 1e6, tflops=2 * m * n * k / sec / 1e12,
                gbs=(n * k * 2 + m * k * 2 + m * n * 2) / sec / 1e9)


def fused_gemm_row(name: str, m: int, rep_ms: int, timed: bool = True) -> dict:
    """The fused tensor-core kernel on the big matrix at m tokens, even where quant_matmul
    would dequantize to bf16 and call cuBLAS (matmul.DEQUANT_MIN_M)."""
    r = run_case((name, BIG, m, None), rep_ms, timed, dequant_min_m=1 << 30)
    return r | dict(kernel="fused tl.dot") if timed else r


def moe_decode(types: tuple[str, str, str], rep_ms: int, timed: bool = True) -> dict:
    """Qwen3-30B-A3B decode layer: 128 experts all resident, top-8, D=2048, F=768, one token
    (its tiles are moe.py's, not the dense GEMV table's)."""
    from strata.kernels.gpu import moe_forward

    e, topk, d, f = 128, 8, 2048, 768
    qg, qu, qd = (QType[t] for t in types)
    rng = np.random.default_rng(1)

    def slots(q: QType, rows: int, cols: int) -> torch.Tensor:
        one = torch.from_numpy(random_rows(q, rows, cols, rng, 0.02)).cuda()
        return one.unsqueeze(0).repeat(e, 1, 1)  # [E, rows, row_nbytes]: distinct copies

    gate, up, down = slots(qg, f, d), slots(qu, f, d), slots(qd, d, f)
    slot_of = torch.arange(e, dtype=torch.int32, device="cuda")
    x = torch.randn(1, d, device="cuda", dtype=torch.bfloat16)
    routes = [torch.from_numpy(rng.permutation(e)[:topk]).view(1, topk).cuda()
              for _ in range(32 if timed else 1)]  # 32 steps touch ~110 of the 128 experts
    wts = torch.softmax(torch.randn(1, topk, device="cuda"), -1)
    out = torch.zeros(1, d, device="cuda")

    def step(ids: torch.Tensor) -> None:
        moe_forward(x, ids, wts, slot_of, gate, up, down, (qg, qu, qd), d, f, out=out)

    step(routes[0])
    torch.cuda.synchronize()
    if not timed:
        return {}
    sec = _graph_time([lambda r=r: step(r) for r in routes], rep_ms)
    walls = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for r in routes:
            step(r)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t0) / len(routes))
    per_expert = 2 * f * row_nbytes(qg, d) + d * row_nbytes(qd, f)
    return dict(types=list(types), us_graph=sec * 1e6, us_eager=statistics.median(walls) * 1e6,
                weight_bytes=topk * per_expert, gbs=topk * per_expert / sec / 1e9)


# the routed-expert layers a pack can be timed at ("G/U/D@NAME"): (model, experts, top-k, D, F,
# layers, biased)
PROMPT_LAYERS = {"30b-a3b": ("30B-A3B", 128, 8, 2048, 768, 48, False),
                 "qwen3.6": ("Qwen3.6-35B-A3B", 256, 8, 2048, 512, 40, False),
                 "gpt-oss-20b": ("gpt-oss-20b", 32, 4, 2880, 2880, 24, True)}


def prompt_layer(types: tuple[str, ...]) -> tuple[str, int, int, int, int, int, bool]:
    """The prompt MoE layer a pack is timed at: (model, experts, top-k, D, F, layers, biased):
    the layer named by the pack's 4th element (PROMPT_LAYERS) where it has one, else
    gpt-oss-20b's (32 experts, top-4, D = F = 2880, biases and the clamped SwiGLU) for an
    all-MXFP4 pack and Qwen3-30B-A3B's (128, top-8, 2048, 768) for the others."""
    if len(types) > 3:
        return PROMPT_LAYERS[types[3]]
    if all(t == "MXFP4" for t in types):
        return PROMPT_LAYERS["gpt-oss-20b"]
    return PROMPT_LAYERS["30b-a3b"]


def moe_layer_args(types: tuple[str, ...], tokens: int) -> tuple:
    """A pack's MoE layer (prompt_layer) on the GPU with every expert resident, each its own
    copy of one random expert's bytes, and `tokens` tokens routed to random distinct top-k:
    (x, ids, wts, slot_of, gate, up, down, out, kw), kw the biases and clamped SwiGLU of a
    biased layer for moe_forward."""
    _, e, topk, d, f, _, biased = prompt_layer(types)
    qg, qu, qd = (QType[t] for t in types[:3])
    rng = np.random.default_rng(2)

    def slots(q: QType, rows: int, cols: int) -> torch.Tensor:
        one = torch.from_numpy(random_rows(q, rows, cols, rng, 0.02)).cuda()
        return one.unsqueeze(0).repeat(e, 1, 1)

    gate, up, down = slots(qg, f, d), slots(qu, f, d), slots(qd, d, f)
    slot_of = torch.arange(e, dtype=torch.int32, device="cuda")
    ids = torch.rand(tokens, e, device="cuda").argsort(1)[:, :topk]
    wts = torch.softmax(torch.randn(tokens, topk, device="cuda"), -1)
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    out = torch.zeros(tokens, d, device="cuda")
    kw = dict(bias=tuple(torch.randn(e, n, device="cuda") for n in (f, f, d)),
              act="swiglu_oai") if biased else {}
    return x, ids, wts, slot_of, gate, up, down, out, kw


def moe_prompt(types: tuple[str, str, str], tokens: int, path: str, rep_ms: int,
               timed: bool = True) -> dict:
    """The MoE layer of a prompt chunk or a batched step (prompt_layer: Qwen3-30B-A3B's, or
    gpt-oss-20b's for MXFP4), every expert resident, random distinct top-k, `tokens` tokens,
    through moe_forward on `path` (moe.MOE_PATHS: the per-pair kernels with x rounded to 8 bits,
    as the engine's decode steps run them; the tl.dot kernels; the grouped bf16 GEMMs; the
    integer tensor-core kernels, moe_mmq.py, 8-bit x too). Timed eagerly (do_bench
    median: launches, allocations and the bf16 dequantize included). TFLOP/s counts the useful
    2·3·T·K·D·F."""
    from strata.kernels.gpu import moe as moe_mod

    model, e, topk, d, f, layers, biased = prompt_layer(types)
    qg, qu, qd = (QType[t] for t in types[:3])
    x, ids, wts, slot_of, gate, up, down, out, kw = moe_layer_args(types, tokens)

    def call() -> None:
        if path.startswith("mmq:"):  # the MMQ kernels at a tile of their own (BMxBNxWARPS)
            from strata.kernels.gpu.moe_mmq import moe_forward_mmq

            tile = tuple(int(v) for v in path[4:].split("x"))
            moe_forward_mmq(x, ids, wts, slot_of, gate, up, down, (qg, qu, qd), out, tile=tile,
                            **kw)
        elif path.startswith("pairs"):  # "pairs-pm": the pair-major grid (moe.pair_major);
            # "pairs-once[:R[:BB]]": the expert-once kernels (moe_once.py) where the types have
            # them, R rows a program, BB blocks a step of the gate/up (8: its rows held; 4: each
            # pair reads them again, from L1) and BB / 2 of the downs
            # "pairs-group:MT:R": moe_once's groups of MT pairs of one expert (gate/up and
            # down), R rows a program
            once = path.startswith("pairs-once")
            tiles = {"pair_major": (int(path == "pairs-pm"),), "once": (int(once),)}
            if path.startswith("pairs-group:"):
                tiles["group"] = tuple(int(v) for v in path.split(":")[1:3])
            elif ":" in path:
                r, bb = (int(v) for v in (path.split(":")[1:] + ["8"])[:2])
                half = max(1, bb // 2)
                tiles |= {"gate_up_q8": (r, bb, 1), "down_q8": (r, half, 1),
                          "down_q6k_q8": (r, half, 1)}
            moe_mod.moe_forward(x, ids, wts, slot_of, gate, up, down, (qg, qu, qd), d, f,
                                out=out, path="pairs", x8=True, tiles=tiles, **kw)
        else:
            moe_mod.moe_forward(x, ids, wts, slot_of, gate, up, down, (qg, qu, qd), d, f,
                                out=out, path=path, **kw)

    call()
    torch.cuda.synchronize()
    if not timed:
        return {}
    import triton.testing

    sec = triton.testing.do_bench(call, warmup=5, rep=rep_ms, return_mode="median") / 1e3
    return dict(types=list(types), model=model, tokens=tokens, path=path,
                us=sec * 1e6, tflops=2 * 3 * tokens * topk * d * f / sec / 1e12,
                tok_s_all_layers=tokens / (layers * sec))


def prompt_paths(tokens: int, types: tuple[str, str, str],
                 mmq_tiles: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The paths timed at a token count: the per-pair kernels up to 64 tokens (past that each
    pair's own read of its expert is far from what the others cost), beside them the
    expert-once kernels; the integer tensor-core
    kernels (moe_mmq.py) for the types they compute (MXFP4 too, whatever tuning.MMQ_MXFP4),
    at their default tile and at each of mmq_tiles ("mmq:BMxBNxWARPS")."""
    from strata.kernels.gpu.moe_mmq import mmq_kernel_types

    _, _, _, d, f, _, biased = prompt_layer(types)
    paths = (("pairs", "pairs-pm", "pairs-once", "pairs-once:1", "pairs-once:2",
              "pairs-once:4:4", "pairs-once:2:4", "pairs-group:2:2", "pairs-group:2:4",
              "pairs-group:4:1", "tl.dot", "grouped") if tokens <= 64
             else ("tl.dot", "grouped"))
    qt = tuple(QType[q] for q in types[:3])
    act = "swiglu_oai" if biased else "swiglu"
    if not mmq_kernel_types(qt, d, f, object() if biased else None, act):
        return paths
    return paths + ("mmq",) + tuple(f"mmq:{t}" for t in mmq_tiles)


def moe_prompt_rows(report: dict, rep_ms: int, packs: list[tuple[str, str, str]],
                    tokens: list[int], mmq_tiles: tuple[str, ...] = ()) -> None:
    for types in packs:
        model, *_, layers, _ = prompt_layer(types)
        for t in tokens:
            took = {}
            for path in prompt_paths(t, types, mmq_tiles):
                r = moe_prompt(types, t, path, rep_ms)
                report["moe_prompt"].append(r)
                took[path] = r["us"]
                print(f"MoE {model} layer {'/'.join(types[:3])} T={t:5d} {path:12s}: "
                      f"{r['us']:9.1f} us {r['tflops']:6.1f} TFLOP/s "
                      f"({r['tok_s_all_layers']:7.0f} tok/s for {layers} layers, MoE only)",
                      flush=True)
            best = min(took, key=took.get)
            print(f"  fastest at T={t}: {best} (" + ", ".join(
                f"{p} {took[p] / took[best]:.2f}x" for p in took) + " its time)", flush=True)


# ---- parallel compile ---------------------------------------------------------------------------


def _compile_worker(job: tuple) -> str:
    kind, payload = job
    try:
        if kind == "case":
            run_case(payload, 0, timed=False)
        elif kind == "fused":
            fused_gemm_row(payload, 4096, 0, timed=False)
        elif kind == "moe_prompt":
            moe_prompt(payload[2], payload[0], payload[1], 0, timed=False)
        else:
            moe_decode(payload, 0, timed=False)
        return ""
    except Exception as exc:  # noqa: BLE001 (reported, the timed pass shows it again)
        return f"{kind} {payload}: {type(exc).__name__}: {exc}"[:300]


def precompile(jobs: list[tuple], workers: int) -> None:
    import multiprocessing as mp

    t0 = time.time()
    with mp.get_context("spawn").Pool(workers) as pool:
        errors = [e for e in pool.imap_unordered(_compile_worker, jobs) if e]
    print(f"compiled {len(jobs)} cases with {workers} processes in {time.time() - t0:.0f} s"
          + (f", {len(errors)} errors:\n  " + "\n  ".join(errors[:10]) if errors else ""),
          flush=True)


def dense_batch_rows(report: dict, args: argparse.Namespace) -> None:
    """The batched decode step's dense matmuls: each shape and type at B tokens on the FMA
    GEMV (token groups of four), on the tensor-core kernel with K split as gemm_split says and
    unsplit, on the integer tensor cores (moe_mmq.mmq_matmul, Q4_K and Q6_K) and on 8-bit x
    with each row read once for all the tokens (dense_x8.gemm_x8_tokens; at one token the
    one-token x8 GEMV's rival), graph replays."""
    types = args.types.split(",") if args.types else DENSE_TYPES
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else DENSE_TOKENS
    report["dense_batch"] = []
    print(f"{'type':6s} {'shape':14s} {'B':>3s} {'FMA us':>8s} {'tl.dot us':>9s} "
          f"{'unsplit':>8s} {'MMQ us':>8s} {'x8 r1/2/4 us':>20s} {'FMA GB/s':>8s}", flush=True)
    for t in types:
        for shape in DENSE_SHAPES:
            for m in tokens:
                fma = run_case((t, shape, m, None), args.rep_ms, gemv_max_m=1 << 30)
                dot = run_case((t, shape, m, None), args.rep_ms, gemv_max_m=0)
                one = run_case((t, shape, m, None), args.rep_ms, gemv_max_m=0, split_k=1)
                mmq = (run_case((t, shape, m, None), args.rep_ms, mmq=True)
                       if t in ("Q4_K", "Q6_K") else {"us": float("nan")})
                x8 = [run_case((t, shape, m, None), args.rep_ms, x8=r)
                      if t in ("Q4_K", "Q6_K") else {"us": float("nan")} for r in (1, 2, 4)]
                report["dense_batch"].append(dict(fma=fma, dot=dot, unsplit=one, mmq=mmq, x8=x8))
                rows = "/".join(f"{v['us']:.1f}" for v in x8)
                print(f"{t:6s} {shape:14s} {m:3d} {fma['us']:8.1f} {dot['us']:9.1f} "
                      f"{one['us']:8.1f} {mmq['us']:8.1f} {rows:>20s} {fma['gbs']:8.0f}",
                      flush=True)


# ---- report -------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", default=None,
                    help=f"types, comma-separated ({','.join(ALL_TYPES)}; --dense-batch: "
                    f"{','.join(DENSE_TYPES)})")
    ap.add_argument("--full", default=",".join(PRIORITY), help="types run on every shape")
    ap.add_argument("--tokens", default=None,
                    help=f"token counts ({','.join(map(str, TOKENS))}; --dense-batch: "
                    f"{','.join(map(str, DENSE_TOKENS))})")
    ap.add_argument("--tune", action="store_true", help="also time the GEMV tile candidates")
    ap.add_argument("--tiles", default="", help="GEMV tiles to tune, e.g. 2x512x1x4,4x256x1x4")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1))
    ap.add_argument("--rep-ms", type=int, default=25)
    ap.add_argument("--out", default="bench_kernels.json")
    ap.add_argument("--moe-prompt-only", action="store_true",
                    help="only the 30B-A3B MoE layer by tokens, on each of its paths")
    ap.add_argument("--moe-prompt-tokens", default=",".join(map(str, MOE_PROMPT_TOKENS)),
                    help="the prompt MoE layer's token counts")
    ap.add_argument("--moe-prompt-types", default=",".join("/".join(p) for p in MOE_PROMPT_TYPES),
                    help="its packs, gate/up/down each, e.g. Q4_K/Q4_K/Q6_K, and the layer's shape "
                    "after @ where not the type's own: Q4_K/Q4_K/Q6_K@qwen3.6")
    ap.add_argument("--dense-batch", action="store_true",
                    help="only the 30B-A3B attention and head shapes at 1-16 tokens (--tokens), "
                    "Q4_K and Q6_K (--types), on the FMA GEMV against the tensor-core kernel")
    ap.add_argument("--mmq-tiles", default="", metavar="TILES",
                    help="the MMQ kernels also at these tiles, e.g. 32x64x4,64x64x8 (BMxBNxWARPS)")
    args = ap.parse_args()
    mmq_tiles = tuple(t for t in args.mmq_tiles.split(",") if t)
    ptokens = [int(t) for t in args.moe_prompt_tokens.split(",")]
    packs = [tuple(p.split("@")[0].split("/")) + tuple(p.split("@")[1:2])
             for p in args.moe_prompt_types.split(",")]
    for pack in packs:
        if len(pack) < 3 or any(t not in QType.__members__ for t in pack[:3]) or (
                len(pack) > 3 and pack[3] not in PROMPT_LAYERS):
            ap.error(f"--moe-prompt-types: {'/'.join(pack)!r} is not GATE/UP/DOWN of GGUF types "
                     f"with an optional @LAYER of {sorted(PROMPT_LAYERS)}")
    types = args.types.split(",") if args.types else ALL_TYPES
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else TOKENS
    full = set(args.full.split(","))
    moes = [("Q4_K", "Q4_K", "Q6_K"), ("Q4_K", "Q4_K", "Q4_K"), ("IQ2_XS", "IQ2_XS", "IQ3_XXS")]
    from strata.bench.ceilings import hbm_copy_gbs
    from strata.kernels.gpu import formats

    report: dict = dict(device=torch.cuda.get_device_name(), rows=[], cublas=[], tune=[],
                        moe=[], fused_gemm=[], moe_prompt=[])
    prompt_jobs = [("moe_prompt", (t, path, p)) for p in packs for t in ptokens
                   for path in prompt_paths(t, p, mmq_tiles)]
    if args.dense_batch:
        dense_batch_rows(report, args)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        return
    if args.moe_prompt_only:
        if args.workers > 1:
            precompile(prompt_jobs, args.workers)
        moe_prompt_rows(report, args.rep_ms, packs, ptokens, mmq_tiles)
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        return
    table = {t: formats.FORMATS[QType[t]].gemv for t in types}
    if args.tune:  # time the GEMV tile candidates first, then use the fastest per type
        tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",") if t]
        tune = tune_cases(types, tiles or TUNE)
        if args.workers > 1:
            precompile([("case", c) for c in tune], args.workers)
        best: dict[str, tuple] = {}
        for c in tune:
            r = run_case(c, args.rep_ms)
            report["tune"].append(r)
            if c[0] not in best or r["us"] < best[c[0]][1]:
                best[c[0]] = (c[3], r["us"])
            print(f"tune {c[0]:8s} gemv {c[3]}: {r['us']:8.1f} us {r['gbs']:7.0f} GB/s",
                  flush=True)
        table |= {t: cfg for t, (cfg, _) in best.items()}
    report["gemv_table"] = table
    todo = cases(types, tokens, full, table)
    if args.workers > 1:
        precompile([("case", c) for c in todo] + [("moe", m) for m in moes]
                   + [("fused", t) for t in FUSED_GEMM if t in types] + prompt_jobs,
                   args.workers)
    hbm = hbm_copy_gbs()
    report["hbm_copy_gbs"] = hbm
    print(f"{torch.cuda.get_device_name()}: HBM copy {hbm:.0f} GB/s (read + write)", flush=True)
    cub = {}
    for shape in dict.fromkeys(c[1] for c in todo):
        for m in tokens:
            r = cublas_row(shape, m, args.rep_ms)
            cub[(shape, m)] = r
            report["cublas"].append(r)
    print(f"\n{'type':8s} {'shape':28s} {'M':>5s} {'us':>9s} {'GB/s':>7s} {'%HBM':>5s} "
          f"{'TFLOP/s':>8s} {'cuBLAS':>7s} {'%cuBLAS':>7s}")
    for c in todo:
        try:
            r = run_case(c, args.rep_ms)
        except Exception as exc:  # noqa: BLE001 (a failing case is reported, the rest run)
            report["rows"].append(dict(type=c[0], shape=c[1], tokens=c[2], error=str(exc)[:300]))
            print(f"{c[0]:8s} {c[1]:28s} {c[2]:5d} ERROR {exc}"[:200], flush=True)
            continue
        ref = cub[(c[1], c[2])]
        r |= dict(pct_hbm=100 * r["gbs"] / hbm, cublas_tflops=ref["tflops"],
                  pct_cublas=100 * r["tflops"] / ref["tflops"])
        report["rows"].append(r)
        print(f"{c[0]:8s} {c[1]:28s} {c[2]:5d} {r['us']:9.1f} {r['gbs']:7.0f} "
              f"{r['pct_hbm']:5.1f} {r['tflops']:8.2f} {ref['tflops']:7.1f} "
              f"{r['pct_cublas']:7.1f}", flush=True)
    for t in [t for t in FUSED_GEMM if t in types and 4096 in tokens]:
        r = fused_gemm_row(t, 4096, args.rep_ms)
        ref = cub[(BIG, 4096)]
        r |= dict(pct_cublas=100 * r["tflops"] / ref["tflops"])
        report["fused_gemm"].append(r)
        print(f"fused tl.dot GEMM {t:8s} M=4096: {r['us']:9.1f} us {r['tflops']:7.1f} TFLOP/s "
              f"{r['pct_cublas']:5.1f}% of cuBLAS", flush=True)
    for mt in moes:
        r = moe_decode(mt, args.rep_ms)
        report["moe"].append(r)
        print(f"MoE 30B-A3B decode layer {'/'.join(mt)}: {r['us_graph']:.1f} us (graph), "
              f"{r['us_eager']:.1f} us eager, {r['gbs']:.0f} GB/s of expert weights", flush=True)
    moe_prompt_rows(report, args.rep_ms, packs, ptokens, mmq_tiles)
    report["targets"] = targets(report)
    for k, v in report["targets"].items():
        print(f"target {k}: {v}")
    Path(args.out).write_text(json.dumps(report, indent=1, default=str))


def targets(report: dict) -> dict:
    hbm = report["hbm_copy_gbs"]
    out = {}
    for r in report["rows"]:
        if "error" in r or r["shape"] != BIG:
            continue
        if r["tokens"] == 1 and r["type"] in ("Q4_K", "IQ2_XS", "IQ3_XXS", "Q6_K"):
            out[f"GEMV 1 token {r['type']} >= 60% HBM"] = \
                f"{r['pct_hbm']:.1f}% ({r['gbs']:.0f} of {hbm:.0f} GB/s)"
        if r["tokens"] == 4096 and r["type"] in ("Q4_K", "Q6_K", "Q8_0", "IQ2_XS"):
            out[f"GEMM 4096 tokens {r['type']} >= 50% cuBLAS"] = \
                f"{r['pct_cublas']:.1f}% ({r['tflops']:.0f} of {r['cublas_tflops']:.0f} TFLOP/s)"
    for r in report["moe"]:
        out[f"MoE decode {'/'.join(r['types'])} <= 30 us"] = \
            f"{r['us_graph']:.1f} us graph, {r['us_eager']:.1f} us eager"
    for r in report["moe_prompt"]:
        out[f"MoE prompt layer {'/'.join(r['types'])} {r['tokens']} tokens, {r['path']}"] = \
            f"{r['us']:.0f} us, {r['tflops']:.0f} TFLOP/s"
    return out


if __name__ == "__main__":
    main()
