"""Instructions and global loads per weight in the K loop of the one-token Q4_K and Q6_K GEMV
kernels, counted in their sm_90 SASS without a GPU: Triton compiles each for sm_90 with its
bundled ptxas, nvdisasm lists the cubin, and the longest loop (a label and the backward branch
to it) is one thread's K step; cuobjdump gives its registers. Pointers and row bytes get the
16-byte divisibility they have at launch (so loads vectorize as they do there). Counts, not
times: the kernel benchmark times them.

For the FMA and lanes kernels also a second line, from the TTGIR: how the lanes of a warp
split over the tile (S x rows x groups), the distinct x bytes a warp reads a step, and an
estimate of L1 wavefronts: for each global load of the K step, the 128-byte lines one warp's
lanes touch in each load instruction (lanes asking for one address share it), summed over the
step and divided by the weight bytes the warp streams (x, the per-value weight bytes, the
per-group header fields; K = 4096). Lines, not measured wavefronts.

Per kernel and tile, one line: registers; instructions per weight; the step's global loads
(LDG) by width in bits (U8 / U16: one or two bytes); loads and bytes a thread requests through
L1 per byte of weights the step streams from HBM (bytes that several lanes of a warp read, as
block headers and, in the FMA kernel, x, count once per lane); shared-memory ops and barriers in
the loop (layout conversions), if any. For the FMA, rows and lanes kernels with x float32 (as
the decode step has it) and bfloat16.

    python scripts/sass_count.py [--kernels fma,rows,lanes,dp4a]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from strata.kernels.gpu import gemv_q8  # noqa: E402
from strata.kernels.gpu import matmul as mm  # noqa: E402
from strata.kernels.gpu.formats import kernel_format  # noqa: E402
from strata.quant import QType  # noqa: E402

ALIGNED = [["tt.divisibility", 16]]
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
LDG_BYTES = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}  # else 4


def compile_sm90(fn, signature: dict, constexprs: dict, aligned: tuple[int, ...],  # noqa: ANN001
                 warps: int) -> tuple[list[str], int]:
    """(SASS lines, registers a thread) of fn built for sm_90."""
    sass, regs, _ = compile_sm90_ir(fn, signature, constexprs, aligned, warps)
    return sass, regs


def compile_sm90_ir(fn, signature: dict, constexprs: dict,  # noqa: ANN001
                    aligned: tuple[int, ...], warps: int) -> tuple[list[str], int, str]:
    """compile_sm90, with the TTGIR (the register layouts Triton picked) as well."""
    k = triton.compile(ASTSource(fn, signature, constexprs=constexprs,
                                 attrs={(i,): ALIGNED for i in aligned}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        sass = subprocess.run([str(TOOLS / "nvdisasm"), "-c", f.name], capture_output=True,
                              text=True, check=True).stdout.splitlines()
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)
    return sass, int(re.search(r"REG:(\d+)", usage).group(1)), k.asm["ttgir"]


def longest_loop(sass: list[str]) -> list[str]:
    """The instructions of the longest loop: from a label to the last backward branch to it."""
    labels: dict[str, int] = {}
    best: list[str] = []
    for i, line in enumerate(sass):
        if m := re.match(r"^(\.L_x_\d+):", line):
            labels[m.group(1)] = i
        if (m := re.search(r"BRA `\((\.L_x_\d+)\)", line)) and labels.get(m.group(1), i) < i:
            body = [x for x in sass[labels[m.group(1)]:i + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
            best = max(best, body, key=len)
    return best


def opcodes(body: list[str]) -> list[str]:
    """The opcode with its modifiers (LDG.E.128, FFMA, ...) of each instruction, predicate off."""
    ops = []
    for line in body:
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops.append(m.group(1))
    return ops


def describe(name: str, sass: list[str], regs: int, weights: float, weight_bytes: float) -> str:
    """One line for a kernel: instructions and loads of its K step (one thread's), per weight and
    per byte of weights (`weights` values, `weight_bytes` bytes of them a thread step)."""
    ops = opcodes(longest_loop(sass))
    ldg = Counter(op.split(".")[-1] if op.split(".")[-1] in LDG_BYTES else "32"
                  for op in ops if op.startswith("LDG"))
    order = ["128", "64", "32", "U16", "S16", "U8", "S8"]
    loads = " ".join(f"{ldg[w]}x{w}" for w in order if ldg[w])
    n_ldg = sum(ldg.values())
    nbytes = sum(LDG_BYTES.get(w, 4) * c for w, c in ldg.items())
    shared = sum(op.startswith(("LDS", "STS", "BAR")) for op in ops)
    return (f"{name}: {regs} registers; {len(ops)} instructions a thread step, {weights:.0f} "
            f"weights: {len(ops) / weights:.2f} a weight; loads {loads} = {n_ldg} ({nbytes} B) "
            f"for {weight_bytes:g} weight bytes: {n_ldg / weight_bytes:.2f} loads and "
            f"{nbytes / weight_bytes:.1f} B a weight byte"
            + (f"; {shared} shared-memory ops and barriers" if shared else ""))


# ---- register layouts and L1 lines, from the TTGIR ---------------------------------------------

_BLOCKED = re.compile(r"^#(blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], "
                      r"threadsPerWarp = \[([\d, ]+)\], warpsPerCTA = \[([\d, ]+)\], "
                      r"order = \[([\d, ]+)\]")
_LOAD = re.compile(r"tt\.load %\S+ (?:, [^:]*)?: tensor<([\dx]+)x!tt\.ptr<(\w+)>, #(blocked\d*)>")
ELEM_BYTES = {"i8": 1, "i16": 2, "f16": 2, "bf16": 2, "i32": 4, "f32": 4, "i64": 8}


def loop_loads(ttgir: str) -> tuple[list[tuple[tuple[int, ...], str, tuple]],
                                    list[tuple[int, ...]]]:
    """The K loop's global loads as (shape, element type, layout: sizePerThread, threadsPerWarp,
    warpsPerCTA, order), in program order, and the shapes of its layout conversions."""
    layouts = {}
    for line in ttgir.splitlines():
        if m := _BLOCKED.match(line):
            layouts[m.group(1)] = tuple(tuple(int(v) for v in m.group(i).split(","))
                                        for i in range(2, 6))
    body = ttgir.split("scf.for", 1)[1].split("scf.yield", 1)[0]
    loads = [(tuple(int(v) for v in m.group(1).split("x")), m.group(2), layouts[m.group(3)])
             for m in _LOAD.finditer(body)]
    converts = [tuple(int(v) for v in m.group(1).split("x"))
                for m in re.finditer(r"ttg\.convert_layout %\S+ : tensor<([\dx]+)x\w+,", body)]
    return loads, converts


def lanes_text(layout: tuple, rows_dim: int, groups_dim: int) -> str:
    """How the lanes and warps of a layout split over (S, rows, groups)."""
    _, tpw, wpc, _ = layout
    return (f"lanes S x rows x groups {tpw[2]} x {tpw[rows_dim]} x {tpw[groups_dim]}, "
            f"warps rows x groups {wpc[rows_dim]} x {wpc[groups_dim]}")


def warp_lines(shape: tuple[int, ...], layout: tuple, addr, elem: int,  # noqa: ANN001
               vec: int) -> tuple[int, set]:
    """(L1 lines, distinct bytes) of one load of `shape` in `layout` by warp 0: each thread's
    elements (`elem` bytes each) along the last dim go in vectors of `vec` elements, one load
    instruction per vector (instructions whose lanes ask for the same addresses counted once,
    as the compiler merges them); each instruction costs the 128-byte lines its lanes touch.
    addr(coords) -> byte address of an element."""
    spt, tpw, wpc, order = layout
    rank = len(shape)
    lanes = []
    for lane in range(32):
        c, rest = [0] * rank, lane
        for d in order:
            c[d], rest = rest % tpw[d], rest // tpw[d]
        lanes.append(c)

    def held(d: int, lc: int) -> list[int]:  # a thread's coordinates along d
        tile = spt[d] * tpw[d] * wpc[d]
        return [(r * tile + lc * spt[d] + e) % shape[d]
                for r in range(max(1, shape[d] // tile)) for e in range(spt[d])]

    per_lane = [[held(d, c[d]) for d in range(rank)] for c in lanes]
    n_last = len(per_lane[0][-1])
    vec = max(1, min(vec, spt[-1]))
    seen, lines, touched = set(), 0, set()
    for idx in itertools.product(*[range(len(h)) for h in per_lane[0][:-1]]):
        for v0 in range(0, n_last, vec):
            starts = tuple(addr(tuple(h[i] for h, i in zip(pl[:-1], idx, strict=True))
                                + (pl[-1][v0],)) for pl in per_lane)
            if starts in seen:
                continue
            seen.add(starts)
            nbytes = vec * elem
            lines += len({b // 128 for a in starts for b in (a, a + nbytes - 1)})
            touched.update(b for a in starts for b in range(a, a + nbytes))
    return lines, touched


def _q4k(rb: int) -> list:
    """Q4_K fields in load order: (element type, last dim S?, byte address of (row, g, s),
    vector bytes); 144-byte blocks of 8 groups (sub-blocks of 32); headers d | dmin | scales."""
    blk = lambda r, g: r * rb + (g // 8) * 144  # noqa: E731
    return [("i64", False, lambda r, g, s: blk(r, g), 8),  # WIDE header
            ("i64", False, lambda r, g, s: blk(r, g) + 8, 8),
            ("i8", False, lambda r, g, s: blk(r, g) + 4 + g % 4, 1),  # byte-wise header
            ("i8", False, lambda r, g, s: blk(r, g) + 8 + g % 4, 1),
            ("i8", False, lambda r, g, s: blk(r, g) + 12 + g % 4, 1),
            ("f16", False, lambda r, g, s: blk(r, g), 2),
            ("f16", False, lambda r, g, s: blk(r, g) + 2, 2),
            ("i8", True, lambda r, g, s: blk(r, g) + 16 + ((g % 8) // 2) * 32 + s, 16)]


def _q6k(rb: int) -> list:
    """Q6_K fields in load order; 210-byte blocks of 16 groups (2-aligned: u16 reads)."""
    blk = lambda r, g: r * rb + (g // 16) * 210  # noqa: E731
    return [("f16", False, lambda r, g, s: blk(r, g) + 208, 2),
            ("i8", False, lambda r, g, s: blk(r, g) + 192 + g % 16, 1),
            ("i8", True, lambda r, g, s: blk(r, g) + 128 + ((g % 16) // 8) * 32
             + (g % 2) * 16 + s, 2),  # qh
            ("i8", True, lambda r, g, s: blk(r, g) + ((g % 16) // 8) * 64 + (g % 4) * 16 + s, 2)]


FIELDS = {QType.Q4_K: _q4k, QType.Q6_K: _q6k}


def l1_lines(ttgir: str, q: QType, s: int, rows_dim: int, groups_dim: int,
             weights_a_thread: float, k: int = 4096) -> str:
    """The layout of the step's tile and its L1 lines a weight byte (x / weight values /
    headers), for one warp's share of a K step."""
    fmt = kernel_format(q)
    rb = k // fmt.block * fmt.block_bytes
    fields = FIELDS[q](rb)
    loads, converts = loop_loads(ttgir)
    x_lines = w_lines = h_lines = 0
    tile_layout, x_bytes = None, 0
    for shape, ty, layout in loads:
        elem = ELEM_BYTES[ty]
        if ty in ("f32", "bf16"):  # x: x[g * S + s]
            tile_layout = layout
            n, touched = warp_lines(shape, layout, lambda c, e=elem: e * (c[groups_dim] * s + c[2]),
                                    elem, 16 // elem)
            x_lines += n
            x_bytes += len(touched)
            continue
        per_value = shape[2] > 1
        i = next(j for j, f in enumerate(fields) if f[0] == ty and f[1] == per_value)
        _, _, fn, vec = fields.pop(i)
        n, _ = warp_lines(shape, layout, lambda c, fn=fn: fn(c[rows_dim], c[groups_dim], c[2]),
                          elem, max(1, vec // elem))
        if per_value:
            w_lines += n
        else:
            h_lines += n
    wbytes = 32 * weights_a_thread * fmt.block_bytes / fmt.block
    total = x_lines + w_lines + h_lines
    return (f"    {lanes_text(tile_layout, rows_dim, groups_dim)}; x a warp-step {x_bytes} B; "
            f"L1 lines a weight byte {total / wbytes:.3f} (x {x_lines / wbytes:.3f}, weights "
            f"{w_lines / wbytes:.3f}, headers {h_lines / wbytes:.3f}); {len(converts)} layout "
            f"conversions in the loop")


FMA_SIG = {"x": "*fp32", "w": "*u8", "y": "*fp32", "tab": "*fp32", "tab2": "*fp32", "M": "i32",
           "N": "i32", "K": "i32", "row_bytes": "i32", "stride_xm": "i32", "stride_ym": "i32",
           "QT": "constexpr", "S": "constexpr", "BM": "constexpr", "BN": "constexpr",
           "BK": "constexpr", "EVEN_K": "constexpr", "STAGES": "constexpr"}
ROWS_SIG = {"x": "*fp32", "w": "*u8", "y": "*fp32", "tab": "*fp32", "tab2": "*fp32", "N": "i32",
            "K": "i32", "row_bytes": "i32", "QT": "constexpr", "S": "constexpr",
            "R": "constexpr", "BK": "constexpr", "EVEN_K": "constexpr", "STAGES": "constexpr",
            "WIDE": "constexpr"}
# (R, BK, stages, warps) of the rows kernel: the unpipelined ones scripts/bench_moe_decode.py
# times
ROWS_TILES = [(2, 1024, 1, 2), (4, 1024, 1, 2), (8, 1024, 1, 2), (4, 2048, 1, 4),
              (4, 512, 1, 1), (8, 512, 1, 2), (4, 1024, 1, 4)]
FMA_MORE_ROWS = [(4, 512, 1, 4), (8, 256, 1, 4)]  # FMA tiles with 4 and 8 rows, 16 weights a thread
LANES_SIG = {"x": "*fp32", "w": "*u8", "y": "*fp32", "tab": "*fp32", "tab2": "*fp32", "N": "i32",
             "K": "i32", "row_bytes": "i32", "QT": "constexpr", "S": "constexpr",
             "BN": "constexpr", "BK": "constexpr", "EVEN_K": "constexpr", "STAGES": "constexpr",
             "WIDE": "constexpr", "GROUPS_FIRST": "constexpr"}
# (BN, BK, stages, warps) of the lanes kernel: BN 4 and 8, BK 256-1024, 2 and 4 warps (a thread
# holds BN * BK / (32 * warps) weights: 16 for 4 x 512 x 4 warps and 8 x 256 x 4 warps, as the
# FMA kernel's tuned Q4_K tile), then two in the [G, BN, S] order (GROUPS_FIRST)
LANES_TILES = [(bn, bk, 1, w) for bn in (4, 8) for bk in (256, 512, 1024) for w in (2, 4)]
LANES_GROUPS_FIRST_TILES = [(4, 512, 1, 4), (8, 1024, 1, 4)]


def lanes_lines(q: QType, xt: str, tile: tuple[int, int, int, int], groups_first: bool) -> str:
    """The lanes kernel's SASS line and layout line for one tile (rows 8-aligned: WIDE)."""
    fmt = kernel_format(q)
    bn, bk, stages, warps = tile
    sass, regs, ttgir = compile_sm90_ir(
        mm._gemv_lanes_kernel, {**LANES_SIG, "x": f"*{xt}"},
        {"QT": int(q), "S": fmt.group, "BN": bn, "BK": bk, "EVEN_K": True, "STAGES": stages,
         "WIDE": True, "GROUPS_FIRST": groups_first}, (0, 1, 2, 3, 4, 7), warps)
    per = bn * bk / (32 * warps)
    order = ", [G, BN, S]" if groups_first else ""
    rows_dim, groups_dim = (1, 0) if groups_first else (0, 1)
    return (describe(f"lanes GEMV (matmul.py{order}) {q.name} BN {bn} BK {bk} warps {warps}, "
                     f"x {xt}", sass, regs, per, per * fmt.block_bytes / fmt.block) + "\n"
            + l1_lines(ttgir, q, fmt.group, rows_dim, groups_dim, per))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernels", default="fma,rows,lanes,dp4a",
                    help="which kernels to count (comma-separated: fma, rows, lanes, dp4a)")
    kernels = ap.parse_args().kernels.split(",")
    for q in (QType.Q4_K, QType.Q6_K):
        fmt = kernel_format(q)
        per_byte = fmt.block_bytes / fmt.block
        for xt in ("fp32", "bf16"):
            # the type's tuned tile, then two with more rows (across the lanes: see lanes)
            for bn, bk, stages, warps in (fmt.gemv, *FMA_MORE_ROWS) if "fma" in kernels else ():
                sass, regs, ttgir = compile_sm90_ir(
                    mm._gemv_kernel, {**FMA_SIG, "x": f"*{xt}"},
                    {"QT": int(q), "S": fmt.group, "BM": 1, "BN": bn, "BK": bk,
                     "EVEN_K": True, "STAGES": stages}, (0, 1, 2, 3, 4, 8), warps)
                per = bn * bk / (32 * warps)
                print(describe(f"FMA GEMV (matmul.py) {q.name} BN {bn} BK {bk} warps {warps}, "
                               f"x {xt}", sass, regs, per, per * per_byte))
                print(l1_lines(ttgir, q, fmt.group, 0, 1, per))
            for r, bk, stages, warps in ROWS_TILES if "rows" in kernels else ():
                sass, regs = compile_sm90(
                    mm._gemv_rows_kernel, {**ROWS_SIG, "x": f"*{xt}"},
                    {"QT": int(q), "S": fmt.group, "R": r, "BK": bk, "EVEN_K": True,
                     "STAGES": stages, "WIDE": True}, (0, 1, 2, 3, 4, 7), warps)
                per = r * bk / (32 * warps)
                print(describe(f"rows GEMV (matmul.py) {q.name} R {r} BK {bk} warps {warps}, "
                               f"x {xt}", sass, regs, per, per * per_byte))
            if "lanes" in kernels:
                for tile in LANES_TILES:
                    print(lanes_lines(q, xt, tile, False))
                for tile in LANES_GROUPS_FIRST_TILES:
                    print(lanes_lines(q, xt, tile, True))
    if "dp4a" not in kernels:
        return
    q8_sig = {"xq": "*i8", "dx": "*fp32", "sx": "*fp32", "w": "*u8", "y": "*fp32", "N": "i32",
              "K": "i32", "row_bytes": "i32", "BN": "constexpr", "STAGES": "constexpr"}
    q6_sig = {"xq": "*i8", "dx": "*fp32", "sx16": "*fp32",
              **{a: t for a, t in q8_sig.items() if a not in ("xq", "dx", "sx")}}
    for q, fn, sig in ((QType.Q4_K, gemv_q8._gemv_q4k_kernel, q8_sig),
                       (QType.Q6_K, gemv_q8._gemv_q6k_kernel, q6_sig)):
        fmt = kernel_format(q)
        for bn, warps in ((4, 2), (8, 1), (16, 1), (16, 2), (32, 2), (32, 4)):
            sass, regs = compile_sm90(fn, sig, {"BN": bn, "STAGES": 1}, (0, 1, 2, 3, 4, 7),
                                      warps)
            per = bn * 256 / (32 * warps)
            print(describe(f"dp4a GEMV (gemv_q8.py) {q.name} BN {bn} warps {warps}", sass, regs,
                           per, per * fmt.block_bytes / fmt.block))


if __name__ == "__main__":
    main()
