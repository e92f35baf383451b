"""Instructions and global loads per weight in the K loop of the one-token Q4_K and Q6_K GEMV
kernels, counted in their sm_90 SASS without a GPU: Triton compiles each for sm_90 with its
bundled ptxas, nvdisasm lists the cubin, and the longest loop (a label and the backward branch
to it) is one thread's K step; cuobjdump gives its registers. Pointers and row bytes get the
16-byte divisibility they have at launch (so loads vectorize as they do there). Counts, not
times: the kernel benchmark times them.

Per kernel and tile, one line: registers; instructions per weight; the step's global loads
(LDG) by width in bits (U8 / U16: one or two bytes); loads and bytes a thread requests through
L1 per byte of weights the step streams from HBM (bytes that several lanes of a warp read, as
block headers and, in the FMA kernel, x, count once per lane); shared-memory ops and barriers in
the loop (layout conversions), if any. For the FMA and rows kernels with x float32 (as the
decode step has it) and bfloat16. The dp4a run forms and i-quant spread forms as built where
every step is in the row (EVEN: loads unmasked, as at 14336 x 4096).

    python scripts/sass_count.py
    python scripts/sass_count.py --llama-cpp MMVQ_OBJECT

The first also counts the decode MoE kernels at their default tiles: instructions a thread step
and the SHFL and shared-memory ops in it (sums or layout conversions across lanes).

The second counts llama.cpp's one-token IQ2_XS and IQ3_XXS GEMVs (ggml-cuda's mul_mat_vec_q) in
its sm_90 build the same way: MMVQ_OBJECT is scripts/build_llama_cpp.sh's
.llama-build/ggml/src/ggml-cuda/CMakeFiles/ggml-cuda.dir/mmvq.cu.o (or any such build's).
"""

from __future__ import annotations

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
    k = triton.compile(ASTSource(fn, signature, constexprs=constexprs,
                                 attrs={(i,): ALIGNED for i in aligned}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    try:
        sass, usage = disassemble(f.name)
    finally:
        os.unlink(f.name)
    return sass, int(re.search(r"REG:(\d+)", usage).group(1))


def disassemble(cubin: str) -> tuple[list[str], str]:
    """(SASS lines, cuobjdump's resource usage: registers of each function) of a cubin file."""
    sass = subprocess.run([str(TOOLS / "nvdisasm"), "-c", cubin], capture_output=True,
                          text=True, check=True).stdout.splitlines()
    usage = subprocess.run([str(TOOLS / "cuobjdump"), "--dump-resource-usage", cubin],
                           capture_output=True, text=True, check=True).stdout
    return sass, usage


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
    return (f"{name}: {regs} registers; {len(ops)} instructions a thread step, {weights:.0f} "
            f"weights: {len(ops) / weights:.2f} a weight; loads {loads} = {n_ldg} ({nbytes} B) "
            f"for {weight_bytes:g} weight bytes: {n_ldg / weight_bytes:.2f} loads and "
            f"{nbytes / weight_bytes:.1f} B a weight byte" + crossings(ops))


def crossings(ops: list[str]) -> str:
    """"; N SHFL; M shared-memory ops and barriers" for a loop's ops, where there are any: the
    values it moves between lanes (a sum across lanes, a layout conversion), each SHFL, LDS or
    STS a quarter of an SM's issue rate or less."""
    shfl = sum(op.startswith("SHFL") for op in ops)
    shared = sum(op.startswith(("LDS", "STS", "BAR")) for op in ops)
    return ((f"; {shfl} SHFL" if shfl else "")
            + (f"; {shared} shared-memory ops and barriers" if shared else ""))


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


def main() -> None:
    for q in (QType.Q4_K, QType.Q6_K):
        fmt = kernel_format(q)
        per_byte = fmt.block_bytes / fmt.block
        for xt in ("fp32", "bf16"):
            bn, bk, stages, warps = fmt.gemv  # the type's tuned tile
            sass, regs = compile_sm90(
                mm._gemv_kernel, {**FMA_SIG, "x": f"*{xt}"},
                {"QT": int(q), "S": fmt.group, "BM": 1, "BN": bn, "BK": bk, "EVEN_K": True,
                 "STAGES": stages}, (0, 1, 2, 3, 4, 8), warps)
            per = bn * bk / (32 * warps)
            print(describe(f"FMA GEMV (matmul.py) {q.name} BN {bn} BK {bk} warps {warps}, x {xt}",
                           sass, regs, per, per * per_byte))
            for r, bk, stages, warps in ROWS_TILES:
                sass, regs = compile_sm90(
                    mm._gemv_rows_kernel, {**ROWS_SIG, "x": f"*{xt}"},
                    {"QT": int(q), "S": fmt.group, "R": r, "BK": bk, "EVEN_K": True,
                     "STAGES": stages, "WIDE": True}, (0, 1, 2, 3, 4, 7), warps)
                per = r * bk / (32 * warps)
                print(describe(f"rows GEMV (matmul.py) {q.name} R {r} BK {bk} warps {warps}, "
                               f"x {xt}", sass, regs, per, per * per_byte))
    spread_sig = {"xq": "*i8", "xs4": "*fp32", "w": "*u8", "y": "*fp32", "N": "i32", "K": "i32",
                  "row_bytes": "i32", "R": "constexpr", "BB": "constexpr", "CG": "constexpr"}
    for r, bb in ((1, 4), (1, 8), (1, 16), (2, 8), (4, 8), (2, 16), (4, 16)):
        # a thread: one sub-block pair of a block of each of R rows, 64 R weights, 36 R bytes
        warps = max(1, bb * 4 // 32)
        sass, regs = compile_sm90(gemv_q8._gemv_q4k_spread_kernel, spread_sig,
                                  {"R": r, "BB": bb, "CG": False}, (0, 1, 2, 3, 6), warps)
        print(describe(f"dp4a spread GEMV (gemv_q8.py) Q4_K R {r} BB {bb} warps {warps}", sass,
                       regs, 64 * r, 36 * r))
    q6_sig = {"xq": "*i8", "dx": "*fp32", "w": "*u8", "y": "*fp32", "N": "i32", "K": "i32",
              "row_bytes": "i32", "R": "constexpr", "BB": "constexpr"}
    for r, bb in ((1, 8), (2, 8), (1, 16)):  # a thread: 64 values of a block of each row
        warps = max(1, bb * 4 // 32)
        sass, regs = compile_sm90(gemv_q8._gemv_q6k_spread_kernel, q6_sig, {"R": r, "BB": bb},
                                  (0, 1, 2, 3, 6), warps)
        print(describe(f"dp4a spread GEMV (gemv_q8.py) Q6_K R {r} BB {bb} warps {warps}", sass,
                       regs, 64 * r, 52.5 * r))
    for rl, sp, warps in ((8, 1, 1), (16, 1, 2), (4, 2, 1)):  # the run form: a thread, 8 blocks
        run_sig = {a: q6_sig.get(a, "constexpr") for a in gemv_q8._gemv_q6k_run_kernel.arg_names}
        sass, regs = compile_sm90(gemv_q8._gemv_q6k_run_kernel, run_sig,
                                  {"RL": rl, "S": sp, "EVEN": True}, (0, 1, 2, 3, 6), warps)
        print(describe(f"dp4a run GEMV (gemv_q8.py) Q6_K RL {rl} S {sp} warps {warps}", sass,
                       regs, 512, 420))
    iq_sig = {"xq": "*i8", "dx": "*fp32", "w": "*u8", "y": "*fp32", "N": "i32", "K": "i32",
              "row_bytes": "i32", "R": "constexpr", "BB": "constexpr"}  # (t0, t1: *i32)
    fn = gemv_q8._gemv_iq_spread_kernel
    sig = {a: iq_sig.get(a, "constexpr" if a in ("IQ3", "EVEN") else "*i32")
           for a in fn.arg_names}
    for name, iq3, nbytes in (("IQ2_XS", False, 18.5), ("IQ3_XXS", True, 24.5)):
        for r, bb in ((1, 8), (2, 8), (4, 8)):  # a thread: 64 values of a block of each row
            sass, regs = compile_sm90(fn, sig, {"IQ3": iq3, "R": r, "BB": bb, "EVEN": True},
                                      (0, 1, 2, 3, 4, 5, 8), 1)
            print(describe(f"dp4a spread GEMV (gemv_q8.py) {name} R {r} BB {bb} warps 1", sass,
                           regs, 64 * r, nbytes * r))
    fn = gemv_q8._gemv_iq_run_kernel
    sig = {a: iq_sig.get(a, "constexpr" if a in ("IQ3", "RL", "S", "EVEN", "HALVES") else "*i32")
           for a in fn.arg_names}
    for name, iq3, nbytes in (("IQ2_XS", False, 18.5), ("IQ3_XXS", True, 24.5)):
        for rl, sp in ((8, 1), (4, 2)):  # the run form: a thread, a quarter of 8 blocks
            sass, regs = compile_sm90(fn, sig, {"IQ3": iq3, "RL": rl, "S": sp, "EVEN": True,
                                                "HALVES": False}, (0, 1, 2, 3, 4, 5, 8), 1)
            print(describe(f"dp4a run GEMV (gemv_q8.py) {name} RL {rl} S {sp} warps 1", sass,
                           regs, 512, 8 * nbytes))

MOE_SIG = {"xq": "*i8", "xs4": "*fp32", "dx": "*fp32", "hq": "*i8", "hs4": "*fp32",
           "hdx": "*fp32", "ids": "*i32", "wts": "*fp32", "slot_of": "*i32", "gate": "*u8",
           "up": "*u8", "h": "*fp32", "mg": "*u8", "mu": "*u8", "down": "*u8", "part": "*fp32",
           "md": "*u8", "t0": "*i32", "t1": "*i32"}


def moe_kernels() -> None:
    """The decode MoE kernels at their default tiles (moe.py) for the 30B-A3B layer (d_model 2048,
    d_expert 768; one-token pairs, no miss rows; the i-quant ones built EVEN as there), each
    argument 16-divisible where it is at launch (pointers; record strides; the gate/up rows'
    bytes, and a Q4_K down's, not the other downs': 3 blocks of 210, 74 or 98 bytes): a thread
    step's instructions and what crosses lanes in it (where Triton lays a summed axis across
    lanes, each step pays SHFL or shared memory for it)."""
    from strata.experts.layout import ExpertLayout
    from strata.kernels.gpu import moe
    from strata.quant import row_nbytes

    d, f = 2048, 768
    for fn, tile, consts, (gq, dq) in (
            (gemv_q8._gate_up_q8_kernel, moe.GATE_UP_Q8_TILE, {}, (QType.Q4_K, QType.Q6_K)),
            (gemv_q8._down_q8_kernel, moe.DOWN_Q8_TILE, {}, (QType.Q4_K, QType.Q4_K)),
            (gemv_q8._down_q6k_q8_kernel, moe.DOWN_Q6K_Q8_TILE, {}, (QType.Q4_K, QType.Q6_K)),
            (gemv_q8._gate_up_iq_kernel, moe.GATE_UP_IQ_TILE,
             {"IQ3": False, "RUN": False, "EVEN": True}, (QType.IQ2_XS, QType.IQ3_XXS)),
            (gemv_q8._gate_up_iq_kernel, moe.GATE_UP_IQ_TILE,
             {"IQ3": True, "RUN": False, "EVEN": True}, (QType.IQ3_XXS, QType.IQ3_XXS)),
            (gemv_q8._down_iq_kernel, moe.DOWN_IQ_TILE, {"IQ3": False, "EVEN": True},
             (QType.IQ2_XS, QType.IQ2_XS)),
            (gemv_q8._down_iq_kernel, moe.DOWN_IQ_TILE, {"IQ3": True, "EVEN": True},
             (QType.IQ2_XS, QType.IQ3_XXS))):
        r, bb, warps = tile
        consts = {"TOPK": 8, "R": r, "BB": bb, "MISS": False, "HOST_FROM": 8, **consts}
        sig = {a: MOE_SIG.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
        stride = ExpertLayout(0, (int(gq), int(gq), int(dq)), d, f).stride
        down = "down" in fn.__name__
        ints = {"row_bytes": row_nbytes(int(dq), f) if down else row_nbytes(int(gq), d),
                **{a: stride for a in ("stride_gs", "stride_us", "stride_ds", "stride_ms")}}
        aligned = tuple(i for i, a in enumerate(fn.arg_names)
                        if a in MOE_SIG or ints.get(a, 1) % 16 == 0)
        sass, regs = compile_sm90(fn, sig, consts, aligned, warps)
        ops = opcodes(longest_loop(sass))
        what = f" {dq.name if down else gq.name}" if "IQ3" in consts else ""
        print(f"MoE {fn.__name__}{what} (R {r}, BB {bb}, warps {warps}): {regs} registers; "
              f"{len(ops)} instructions a thread step" + crossings(ops))


# llama.cpp's one-token GEMV (ggml-cuda's mul_mat_vec_q, one column, no fusion) for the
# i-quants: ggml_type number, weight bytes a weight (their dot products dp4a weights only; the
# K-quants' also dp4a x against 0x01010101 for the block minimums, so 4 weights an IDP would
# not hold for them)
LLAMA_CPP_TYPES = {"IQ2_XS": (17, 74 / 256), "IQ3_XXS": (18, 98 / 256)}


def llama_cpp(obj: str) -> None:
    """The same counts for llama.cpp's mul_mat_vec_q in `obj`, the mmvq.cu object of its sm_90
    build (scripts/build_llama_cpp.sh): every weight goes through one lane of one dp4a there,
    so a thread step holds 4 weights per IDP in it."""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([str(TOOLS / "cuobjdump"), "-xelf", "all", os.path.abspath(obj)], cwd=d,
                       capture_output=True, check=True)
        cubins = sorted(Path(d).glob("*sm_90*.cubin"))
        if not cubins:
            sys.exit(f"{obj}: no sm_90 machine code in it (build with CMAKE_CUDA_ARCHITECTURES=90)")
        for cubin in cubins:
            sass, usage = disassemble(str(cubin))
            starts = [i for i, line in enumerate(sass) if line.startswith("//----------")]
            for name, (t, per_weight) in LLAMA_CPP_TYPES.items():
                fn = f"_Z13mul_mat_vec_qIL9ggml_type{t}ELi1ELb0ELb0ELb0E"
                at = [i for i in starts if f".text.{fn}" in sass[i]]
                if not at:
                    print(f"llama.cpp mul_mat_vec_q {name}: not in {obj}")
                    continue
                end = min([i for i in starts if i > at[0]] + [len(sass)])
                body = sass[at[0]:end]
                weights = 4 * sum(op.startswith("IDP") for op in opcodes(longest_loop(body)))
                regs = int(re.search(rf"Function {fn}\S*:\s*REG:(\d+)", usage).group(1))
                print(describe(f"llama.cpp mul_mat_vec_q (mmvq.cu) {name}, 1 column", body, regs,
                               weights, weights * per_weight))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--llama-cpp"] and len(sys.argv) == 3:
        llama_cpp(sys.argv[2])
    elif sys.argv[1:]:
        sys.exit("usage: python scripts/sass_count.py [--llama-cpp MMVQ_OBJECT]")
    else:
        main()
        moe_kernels()
