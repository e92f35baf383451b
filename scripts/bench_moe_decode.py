"""Time the one-token kernels of a decode step on the GPU, with the launch choices to pick from:
the Qwen3-30B-A3B MoE layer (moe_forward tiles=: the tiles of the gate/up and down kernels) and
the dense GEMVs of that model and of a 14336 x 4096 matrix (quant_matmul tile=), against float32
cuBLAS on the same shapes and the HBM copy ceiling; the rows kernel on the same shapes
(quant_matmul rows_tile=: R rows a program sharing each x tile), with x float32 as the
decode step has it and rounded to bf16 (half the x bytes; the FMA kernel's default tile is timed
on bf16 x too); for Q4_K, Q6_K, IQ2_XS and IQ3_XXS also the int8-activation GEMVs (gemv_q8.py:
x rounded to 8 bits, one dp4a per 4 weights, a row's blocks spread across the threads, rows
sharing x's words), by tile, also with --gemv-only; and the MoE layer with activations rounded
to 8 bits (moe_forward x8), for Q4_K gate/up with a Q4_K or Q6_K down and for i-quant layers.

    python scripts/bench_moe_decode.py [--json F] [--layer 30b|235b] [--gemv-only TEXT]
        [--moe-only] [--q8-only] [--packs TEXT] [--variants TEXT] [--repeat N] [--warm N]
        [--same-weights]

--warm N first builds every kernel the run will time in N processes at once (each one takes
every N-th case, through Triton's cache on disk), then times them all in this one: the
i-quant run forms take 10-100 s each to build, one after another otherwise.

--layer 235b times the MoE layers at Qwen3-235B-A22B's expert shape (D 4096, F 1536) instead of
30B-A3B's (D 2048, F 768); both route 8 of 128 experts. --layer gptoss: gpt-oss-20b's (D = F =
2880, 4 of 32 experts, MXFP4 with biases and the clamped SwiGLU), its float32-activation pairs
kernels by tile (rows of 2880 values: 1530-byte rows of 17-byte blocks, k_step's steps) and its
8-bit-activation kernels (moe_forward x8 with the "gate_up_mx8" / "down_mx8" tiles) by tile.

Every figure is the median over CUDA-graph replays of 16 calls, each call on its own copy of the
weights (rotated so that the L2 cannot hold them; the MoE layer's 8 experts change every call).
--same-weights gives the GEMVs one copy, read again every call (from the 60 MB L2 where the
matrix fits), as llama.cpp's test-backend-ops times its ops: to compare with its figures
(gpu_bench.sh's llamacpp stage), never with HBM. The shape 4096x14336 is test-backend-ops' own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.bench.ceilings import hbm_copy_gbs  # noqa: E402
from strata.bench.graph_timing import graph_seconds  # noqa: E402
from strata.experts.layout import ExpertLayout  # noqa: E402
from strata.kernels.gpu import matmul as mm  # noqa: E402
from strata.kernels.gpu import moe as moe_mod  # noqa: E402
from strata.quant import QType, random_rows, row_nbytes  # noqa: E402

E, K, D, F = 128, 8, 2048, 768  # the MoE layer's shape (--layer 235b: D 4096, F 1536)
LAYERS = {"30b": (2048, 768), "235b": (4096, 1536), "gptoss": (2880, 2880)}
EXPERTS = {"gptoss": (32, 4)}  # (E, K) where not 128 / 8
CALLS = 16
SAME_WEIGHTS = False  # (--same-weights)


def moe_layer(qdown: QType, rng: np.random.Generator, dev: torch.device,
              qgu: QType = QType.Q4_K) -> dict:
    lay = ExpertLayout(0, (int(qgu), int(qgu), int(qdown)), D, F)
    rec = torch.empty(E, lay.stride, dtype=torch.uint8)
    for part, (q, n, k) in zip(lay.views(rec), ((qgu, F, D), (qgu, F, D),
                                                (qdown, D, F)), strict=True):
        part[:] = torch.from_numpy(random_rows(q, E * n, k, rng, 0.02)).view(E, n, -1)
    slots = rec.to(dev)
    perm = np.concatenate([rng.permutation(E) for _ in range(2)])
    ids = [torch.tensor(perm[i * K:(i + 1) * K][None], device=dev) for i in range(CALLS)]
    bias = None
    if qgu == QType.MXFP4:  # gpt-oss: every expert's biases (the kernels' BIAS, OAI)
        bias = tuple(0.02 * torch.randn(E, n, device=dev) for n in (F, F, D))
    return dict(lay=lay, slots=slots, ids=ids, x=torch.randn(1, D, device=dev),
                wts=torch.full((1, K), 1.0 / K, device=dev),
                table=torch.arange(E, dtype=torch.int32, device=dev),
                out=torch.zeros(1, D, device=dev), bias=bias)


def time_moe(layer: dict, tune: dict) -> float:
    """tune: moe_forward's tiles (moe.TILE_KEYS), and "x8": moe_forward's x8."""
    lay = layer["lay"]
    tiles = {k: v for k, v in tune.items() if k != "x8"}
    g, u, d = lay.views(layer["slots"])
    oai = {} if layer["bias"] is None else {"bias": layer["bias"], "act": "swiglu_oai"}
    return graph_seconds(lambda i: moe_mod.moe_forward(
        layer["x"], layer["ids"][i], layer["wts"], layer["table"], g, u, d, lay.qtypes, D,
        F, out=layer["out"], x8=tune.get("x8", False), tiles=tiles, **oai))


def weight_copies(q: QType, n: int, k: int, rng: np.random.Generator,
                  dev: torch.device) -> list:
    """Copies of one random [n, k] matrix of q to rotate through (256 MiB or CALLS of them, at
    least 2), so L2 never holds the next call's weights."""
    one = torch.from_numpy(random_rows(q, n, k, rng, 0.02)).to(dev)
    if SAME_WEIGHTS:
        return [one]
    count = max(2, min(CALLS, (256 << 20) // one.numel() + 1))
    return [one] + [one.clone() for _ in range(count - 1)]


def time_gemv(q: QType, n: int, k: int, tile: tuple | None, rng: np.random.Generator,
              dev: torch.device, copies: list | None = None, rows: bool = False,
              xdtype: torch.dtype = torch.float32) -> tuple[float, list]:
    """tile: the shared skeleton's (BN, BK, stages, warps), None: its default; with rows, the
    rows kernel's (R, BK, stages, warps)."""
    if copies is None:
        copies = weight_copies(q, n, k, rng, dev)
    x = torch.randn(1, k, device=dev).to(xdtype)
    out = torch.empty(1, n, device=dev)
    kw = {"rows_tile" if rows else "tile": tile} if tile is not None else {}
    t = graph_seconds(lambda i: mm.quant_matmul(x, copies[i % len(copies)], q, out=out, **kw),
                      CALLS)
    return t, copies


# gemv_q4k_spread's (rows, blocks, warps, ld.global.cg)
SPREAD_TILES = [(1, 4, 1, False), (1, 4, 1, True), (2, 4, 1, False), (4, 4, 1, False),
                (2, 4, 1, True), (4, 4, 1, True), (1, 8, 1, False), (2, 8, 1, False),
                (4, 8, 1, False), (4, 8, 1, True), (2, 16, 2, False), (4, 16, 2, False),
                (8, 4, 1, False), (1, 2, 1, False)]


def time_gemv_q8(q: QType, n: int, k: int, copies: list, tile: tuple, dev: torch.device,
                 quantize: bool = True) -> float:
    """The type's int8-activation GEMV (gemv_q8.py: a row's blocks spread across the threads)
    on the rotated copies of Q4_K, Q6_K, IQ2_XS or IQ3_XXS rows, tile (rows, blocks, warps,
    ld.global.cg (Q4_K)), or ("run", rows, split, warps[, halves]): the run form (gemv_q6k_run,
    gemv_iq_run, with halves its option);
    quantize False: x rounded once, outside the time (the GEMV alone)."""
    from strata.kernels.gpu.gemv_q8 import (
        gemv_iq_run,
        gemv_iq_spread,
        gemv_q4k_spread,
        gemv_q6k_run,
        gemv_q6k_spread,
        quantize_x,
    )

    x = torch.randn(k, device=dev)
    out = torch.empty(n, device=dev)
    once = quantize_x(x)
    run = tile[0] == "run"
    r, bb, warps, cg = (tile[1:4] + (len(tile) > 4 and tile[4],)) if run else tile

    def call(i: int) -> None:
        xq, dx, xs4 = quantize_x(x) if quantize else once
        if run and q == QType.Q6_K:
            gemv_q6k_run(xq, dx, copies[i % len(copies)], n, k, out=out, rows=r, warps=warps,
                         split=bb)
        elif run:
            gemv_iq_run(xq, dx, copies[i % len(copies)], n, k, q, out=out, rows=r, warps=warps,
                        split=bb, halves=cg)
        elif q == QType.Q6_K:
            gemv_q6k_spread(xq, dx, copies[i % len(copies)], n, k, out=out, bb=bb, warps=warps,
                            rows=r)
        elif q in (QType.IQ2_XS, QType.IQ3_XXS):
            gemv_iq_spread(xq, dx, copies[i % len(copies)], n, k, q, out=out, bb=bb, warps=warps,
                           rows=r)
        else:
            gemv_q4k_spread(xq, xs4, copies[i % len(copies)], n, k, out=out, bb=bb, warps=warps,
                            rows=r, cg=cg)

    return graph_seconds(call, CALLS)


def warm(n: int) -> None:
    """Run this script's cases in n processes at once, each every n-th, so that Triton's cache
    on disk holds every kernel before the timed pass (their output dropped but for failures)."""
    import subprocess

    args = [v for v in sys.argv[1:] if not v.startswith(("--warm=", "--json="))]
    for flag in ("--warm", "--json"):  # (as "--flag value")
        if flag in args:
            i = args.index(flag)
            del args[i:i + 2]
    procs = [subprocess.Popen([sys.executable, __file__, *args, "--shard", f"{i}/{n}"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(n)]
    for p in procs:
        out, _ = p.communicate()
        bad = [line for line in out.splitlines() if "failed" in line or "Error" in line]
        print("\n".join(bad[-5:]) or f"warm process {procs.index(p)}: built", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--gemv-only", default=None, metavar="TEXT",
                    help="only the GEMVs whose shape name contains TEXT (e.g. 14336x4096) or "
                    "of the type TEXT names (e.g. Q6_K; several: comma-separated; moe among "
                    "them: the MoE layer too), no MoE layer")
    ap.add_argument("--moe-only", action="store_true", help="the MoE layer only, no GEMVs")
    ap.add_argument("--q8-only", action="store_true",
                    help="of the GEMVs only the int8-activation ones (gemv_q8.py), not the "
                    "float32-activation tiles")
    ap.add_argument("--packs", default=None, metavar="TEXT",
                    help="only the MoE layers whose pack name contains TEXT (comma-separated: "
                    "any of them; e.g. IQ: the i-quant packs)")
    ap.add_argument("--variants", default=None, metavar="TEXT",
                    help="only the MoE layer variants whose name contains TEXT ('|' between "
                    "several: any of them; spaces ignored, e.g. 'default|down_iq(8,2,1)')")
    ap.add_argument("--repeat", type=int, default=1, metavar="N",
                    help="time the MoE layer variants in N rounds, each round all of them, and "
                    "keep each one's median")
    ap.add_argument("--warm", type=int, default=0, metavar="N",
                    help="build the kernels first in N processes at once (their timings "
                    "dropped), then time every case here")
    ap.add_argument("--same-weights", action="store_true",
                    help="the GEMVs read one copy of the weights every call (L2 where it fits: "
                    "test-backend-ops' way, to compare with llama.cpp's figures)")
    ap.add_argument("--shard", default=None, metavar="I/N", help=argparse.SUPPRESS)
    ap.add_argument("--layer", default="30b", choices=sorted(LAYERS),
                    help="the MoE layer's expert shape: Qwen3-30B-A3B's or Qwen3-235B-A22B's")
    a = ap.parse_args()
    if a.warm > 1:
        warm(a.warm)
    shard, shards = map(int, a.shard.split("/")) if a.shard else (0, 1)
    cases = iter(range(1 << 30))

    def mine() -> bool:  # the next case is this process's to time (all of them but in --warm)
        return next(cases) % shards == shard
    global D, F, E, K, SAME_WEIGHTS  # noqa: PLW0603 (the helpers read these from here)
    D, F = LAYERS[a.layer]
    E, K = EXPERTS.get(a.layer, (E, K))
    SAME_WEIGHTS = a.same_weights
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    res: dict = {"hbm_copy_GBs": hbm_copy_gbs(), "layer": {"d_model": D, "d_expert": F}, "moe": {},
                 "gemv": {}, "same_weights": SAME_WEIGHTS}
    if SAME_WEIGHTS:
        print("--same-weights: the GEMVs read one copy of their weights every call, from the L2 "
              "where it fits (60 MB): their % of HBM copy is no measure of HBM")

    def save() -> None:  # after each part, so a run cut short keeps what it timed
        if a.json:
            Path(a.json).write_text(json.dumps(res, indent=1))

    print(f"HBM copy {res['hbm_copy_GBs']:.0f} GB/s")
    variants = {"default tiles": {}}
    for gu in [(1, 1024, 1, 2), (2, 1024, 1, 4), (1, 512, 1, 2), (2, 512, 1, 4)]:
        variants[f"gate_up {gu}"] = {"gate_up": gu}
    for dn in [(2, 256, 1, 4), (4, 256, 1, 4), (8, 256, 1, 4), (4, 256, 1, 2), (8, 256, 1, 8)]:
        variants[f"down_pairs {dn}"] = {"down_pairs": dn}
    # x rounded to 8 bits for the Q4_K gate/up (moe_forward x8: gemv_q8._gate_up_q8_kernel),
    # by its (R rows, BB blocks a step, warps)
    variants["x8, default tiles"] = {"x8": True}
    for gq in [(2, 8, 1), (8, 8, 1), (4, 4, 1), (8, 8, 2), (16, 8, 4)]:
        variants[f"x8, gate_up_q8 {gq}"] = {"x8": True, "gate_up_q8": gq}
    for dn in [(8, 256, 1, 4), (4, 256, 1, 2)]:  # (a Q6_K down keeps the FMA kernel)
        variants[f"x8, down_pairs {dn}"] = {"x8": True, "down_pairs": dn}
    for dq in [(2, 4, 1), (8, 4, 1), (4, 8, 1), (8, 8, 2)]:  # (h rounded too)
        variants[f"x8, down_q8 {dq}"] = {"x8": True, "down_q8": dq, "down_q6k_q8": dq}
    for dq in [(1, 4, 1), (4, 4, 1), (1, 2, 1)]:
        variants[f"x8, down_q6k_q8 {dq}"] = {"x8": True, "down_q6k_q8": dq}
    # i-quant packs: IQ2_XS or IQ3_XXS gate and up with an IQ3_XXS down, float32 activations
    # against x8 (gemv_q8._gate_up_iq_kernel, _down_iq_kernel) by (R, BB, warps)
    iq_variants = {"default tiles": {}, "x8, default tiles": {"x8": True}}
    for gq in [(2, 8, 1), (8, 8, 1), (4, 4, 1), (8, 4, 1), (2, 4, 1)]:
        iq_variants[f"x8, gate_up_iq {gq}"] = {"x8": True, "gate_up_iq": gq}
    # (BB 1: every step's block in the row of 3 (30B-A3B's d_expert 768), so no masks)
    for dq in [(2, 4, 1), (8, 4, 1), (4, 2, 1), (8, 2, 1), (4, 8, 1), (8, 1, 1), (16, 1, 2)]:
        iq_variants[f"x8, down_iq {dq}"] = {"x8": True, "down_iq": dq}
    # the gate/up in the run form (iq_run_dot; d_model a multiple of 2048), (rows, split, warps):
    # (each takes 50-100 s to build)
    for gr in ((8, 1, 1), (4, 1, 1)) if D // 2048 == 1 else ((4, 2, 1),):
        iq_variants[f"x8, gate_up_iq_run {gr}"] = {"x8": True, "gate_up_iq_run": gr}
    packs = [(QType.Q4_K, QType.Q6_K, variants), (QType.Q4_K, QType.Q4_K, variants),
             (QType.IQ2_XS, QType.IQ3_XXS, iq_variants),
             (QType.IQ3_XXS, QType.IQ3_XXS, iq_variants)]
    if a.layer == "gptoss":  # MXFP4 on the FMA pairs kernels: (BN, BK, stages, warps)
        mx_variants = {"default tiles": {}}
        for gu in [(1, 1024, 1, 4), (2, 1024, 1, 4), (1, 256, 1, 1), (2, 512, 1, 2),
                   (4, 512, 1, 4), (2, 256, 1, 2), (1, 512, 1, 4), (4, 256, 1, 4)]:
            mx_variants[f"gate_up {gu}"] = {"gate_up": gu}
        for dn in [(2, 512, 1, 4), (4, 512, 1, 4), (8, 512, 1, 8), (1, 1024, 1, 4),
                   (2, 1024, 1, 4), (8, 256, 1, 4), (2, 256, 1, 2), (1, 512, 1, 2)]:
            mx_variants[f"down_pairs {dn}"] = {"down_pairs": dn}
        # x and h rounded to 8 bits (gemv_q8.mxfp4_spread_dot, dp4a; off in the engine until
        # timed: tuning.MXFP4_X8), by (R rows, BB blocks a step, warps)
        for gq, dq in [((8, 4, 1), (8, 4, 1)), ((8, 8, 2), (8, 8, 2)), ((16, 4, 2), (16, 4, 2)),
                       ((4, 8, 1), (4, 8, 1)), ((2, 8, 2), (2, 8, 2)), ((16, 8, 4), (16, 8, 4)),
                       ((4, 16, 2), (4, 16, 2)), ((8, 4, 1), (16, 4, 2))]:
            mx_variants[f"x8, gate_up_mx8 {gq} down_mx8 {dq}"] = {
                "x8": True, "gate_up_mx8": gq, "down_mx8": dq}
        packs = [(QType.MXFP4, QType.MXFP4, mx_variants)]
    moe = a.gemv_only is None or "moe" in a.gemv_only.split(",")
    for qgu, qdown, tunes in packs if moe else ():
        # (a Q4_K gate/up layer keeps the key earlier runs recorded: its down's type)
        pack = qdown.name if qgu == QType.Q4_K else f"{qgu.name}/{qdown.name}"
        if a.packs and not any(t in f"{qgu.name}/{qdown.name}" for t in a.packs.split(",")):
            continue
        layer = moe_layer(qdown, rng, dev, qgu)
        nbytes = K * layer["lay"].nbytes
        # (--repeat: the variants timed round after round, so a drift in the machine's state
        # falls on all of them alike; the median of the rounds kept)
        times: dict = {}
        for _ in range(a.repeat):
            for name, tune in tunes.items():
                if (a.variants and not any(v.replace(" ", "") in name.replace(" ", "")
                                           for v in a.variants.split("|"))
                        or not mine() or times.get(name) is False):
                    continue
                try:
                    times.setdefault(name, []).append(time_moe(layer, tune))
                except Exception as e:  # noqa: BLE001 (a tile that does not compile: say so)
                    print(f"moe layer {pack} {name}: failed ({type(e).__name__}: "
                          f"{str(e)[:120]})")
                    times[name] = False
        for name, ts in times.items():
            if ts is False:
                continue
            t = float(np.median(ts))
            res["moe"][f"{pack} {name}"] = t * 1e6
            spread = (f" (median of {len(ts)} rounds, {min(ts) * 1e6:.1f}-{max(ts) * 1e6:.1f})"
                      if len(ts) > 1 else "")
            print(f"moe layer ({qgu.name} gate/up, {qdown.name} down) {name}: "
                  f"{t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s{spread}")
    save()
    shapes = [(QType.Q4_K, 4096, 2048, "q_proj"), (QType.Q4_K, 512, 2048, "k_proj"),
              (QType.Q6_K, 512, 2048, "v_proj"), (QType.Q4_K, 2048, 4096, "o_proj"),
              (QType.Q6_K, 151936, 2048, "lm_head"), (QType.Q4_K, 14336, 4096, "14336x4096"),
              (QType.Q6_K, 14336, 4096, "14336x4096"), (QType.IQ2_XS, 14336, 4096, "14336x4096"),
              (QType.IQ3_XXS, 14336, 4096, "14336x4096"),
              # (four times the rows: whether more waves of programs overlap one's loads with
              # another's compute, as the output head's 151936 rows suggest for Q6_K; timed
              # only when --gemv-only names the shape)
              (QType.IQ2_XS, 57344, 4096, "57344x4096"), (QType.IQ3_XXS, 57344, 4096, "57344x4096"),
              # (llama.cpp test-backend-ops' one-token MUL_MAT: 4096 rows of 14336; also only
              # when named)
              *[(q, 4096, 14336, "4096x14336") for q in
                (QType.Q4_K, QType.Q6_K, QType.IQ2_XS, QType.IQ3_XXS)]]
    # (BN, BK, stages, warps); the last five carry more weight bytes per CTA step (more rows
    # or more warps on a row block): whether bytes in flight per SM is what bounds the GEMV
    tiles = [None, (1, 1024, 1, 2), (1, 2048, 1, 4), (2, 2048, 1, 4), (2, 1024, 1, 4),
             (4, 1024, 1, 4), (1, 4096, 1, 8), (2, 512, 1, 4), (4, 512, 1, 4),
             (4, 1024, 1, 8), (8, 512, 1, 8), (8, 256, 1, 4), (2, 1024, 1, 2), (4, 2048, 1, 8)]
    # the rows kernel's (R, BK, stages, warps): the first five give a thread 16 values of each
    # row a step, the next two 8 (fewer registers), the last is the second one pipelined
    rows_tiles = [(2, 1024, 1, 2), (4, 1024, 1, 2), (8, 1024, 1, 2), (4, 2048, 1, 4),
                  (4, 512, 1, 1), (8, 512, 1, 2), (4, 1024, 1, 4), (4, 1024, 2, 2)]
    if a.layer == "gptoss":  # its dense matrices (the synthetic MXFP4 pack's Q8_0): q/k/v
        # fused, o, the output head (201,088 rows: ~615 MB a token, the step's largest read)
        shapes = [(QType.Q8_0, 5120, 2880, "gptoss qkv"), (QType.Q8_0, 2880, 4096, "gptoss o"),
                  (QType.Q8_0, 201088, 2880, "gptoss output")]
    runs = [(t, False, torch.float32) for t in tiles] + [(None, False, torch.bfloat16)]
    runs += [(t, True, xd) for t in rows_tiles for xd in (torch.float32, torch.bfloat16)]
    picks = [g for g in (a.gemv_only or "").split(",") if g]  # shape names and type names
    named_only = ("57344x4096", "4096x14336")  # (timed only when --gemv-only names them)

    def wanted(q: QType, what: str) -> bool:
        return any(g in what for g in picks) or (
            what not in named_only and (a.gemv_only is None or q.name in picks))

    for q, n, k, what in [s for s in shapes if not a.moe_only and wanted(s[0], s[3])]:
        nbytes = n * row_nbytes(q, k)
        copies = weight_copies(q, n, k, rng, dev) if a.q8_only else None
        for tile, rows, xdtype in [r for r in runs if (r[0] is None or r[0][1] <= k)
                                   and not a.q8_only]:
            key = (f"{q.name} {n}x{k} {'rows ' if rows else ''}{tile or 'default'}"
                   f"{' x bf16' if xdtype == torch.bfloat16 else ''}")
            if not mine():
                continue
            try:
                t, copies = time_gemv(q, n, k, tile, rng, dev, copies, rows, xdtype)
            except Exception as e:  # noqa: BLE001 (a tile that does not compile: say so)
                print(f"gemv {key}: failed ({type(e).__name__}: {str(e)[:120]})")
                continue
            res["gemv"][key] = t * 1e6
            print(f"gemv {what} {key}: {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s "
                  f"({100 * nbytes / t / 1e9 / res['hbm_copy_GBs']:.0f}% of HBM copy)")
        if q in (QType.Q4_K, QType.Q6_K, QType.IQ2_XS, QType.IQ3_XXS) and k % 256 == 0:
            # int8 activations (gemv_q8.py): a row's blocks spread across the threads, by
            # (rows, blocks, warps, ld.global.cg); x rounded outside the time, or inside
            tiles = SPREAD_TILES if q == QType.Q4_K else [
                (1, 8, 1, False), (2, 8, 1, False), (1, 4, 1, False), (2, 4, 1, False),
                (4, 4, 1, False), (1, 16, 2, False), (4, 8, 1, False), (8, 4, 1, False)]
            q8 = [(f"q8 spread (R {r}, BB {bb}, warps {wp}{', cg' if cg else ''}), GEMV alone",
                   (r, bb, wp, cg), False) for r, bb, wp, cg in tiles]
            if q != QType.Q4_K and k % 2048 == 0:  # the run form: rows a program, split
                run_tiles = ((8, 1, 1), (16, 1, 2), (4, 2, 1), (8, 2, 2), (2, 4, 1), (4, 4, 2))
                if q != QType.Q6_K:  # (the i-quants' take 10-20 s each to build; with True:
                    # each run's blocks in two programs, gemv_iq_run's halves. 14336 rows are
                    # 27 warps an SM whatever the tile; halves makes 54, which one-warp
                    # programs cannot be: an SM holds 32 programs at most, so programs of 2
                    # and 4 warps too (ptxas gives those 32-40 registers a thread, not 66-70))
                    run_tiles = ((8, 1, 1), (4, 2, 1), (4, 2, 1, True), (8, 2, 2),
                                 (8, 2, 2, True), (16, 2, 4, True))
                q8 += [(f"q8 run (RL {r}{f', S {sp}' if sp > 1 else ''}, warps {wp}"
                        f"{', halves' if h else ''}), GEMV alone", ("run", r, sp, wp, *h), False)
                       for r, sp, wp, *h in run_tiles if sp <= k // 2048]
            q8 += [(f"q8 spread {tiles[0][:3]}, x rounded inside", tiles[0], True)]
            for name, tile, qx in q8:
                key = f"{q.name} {n}x{k} {name}"
                if not mine():
                    continue
                try:
                    t = time_gemv_q8(q, n, k, copies, tile, dev, qx)
                except Exception as e:  # noqa: BLE001 (a variant that does not compile)
                    print(f"gemv {key}: failed ({type(e).__name__}: {str(e)[:120]})")
                    continue
                res["gemv"][key] = t * 1e6
                print(f"gemv {what} {key}: {t * 1e6:.1f} us, {nbytes / t / 1e9:.0f} GB/s "
                      f"({100 * nbytes / t / 1e9 / res['hbm_copy_GBs']:.0f}% of HBM copy)"
                      + (", x rounded to 8 bits inside the time" if qx else ""))
        save()
        # float32 cuBLAS on the same shape (the dense f32 route)
        if n * k * 4 <= (1 << 30) and mine():
            wf = [torch.randn(n, k, device=dev) for _ in range(max(2, (256 << 20) // (n * k * 4)
                                                                   + 1))]
            x = torch.randn(1, k, device=dev)
            t = graph_seconds(lambda i, wf=wf, x=x: x @ wf[i % len(wf)].T)
            res["gemv"][f"F32 cuBLAS {n}x{k}"] = t * 1e6
            print(f"gemv {what} F32 cuBLAS {n}x{k}: {t * 1e6:.1f} us, "
                  f"{n * k * 4 / t / 1e9:.0f} GB/s")
    save()


if __name__ == "__main__":
    main()
