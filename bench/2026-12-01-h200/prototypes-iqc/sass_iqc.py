"""Without a GPU: compile the old (gemv_q8._gemv_iq_spread_kernel) and new (iqc._gemv_iqc_kernel)
IQ2_XS / IQ3_XXS GEMVs for sm_90 and count their SASS instructions by kind (loads: the table
gathers are LDG.E for int32 tables, LDG.E.U16 for iqc's int16 ones; a sign-extending
PRMT ..., 0x9910 would mean a 16-bit load sign-extended).

    .venv/bin/python bench/2026-12-01-h200/prototypes-iqc/sass_iqc.py [R BB]
"""
from __future__ import annotations

import collections
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[2])]

import triton  # noqa: E402
from iqc import _gemv_iqc_kernel  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from strata.kernels.gpu.gemv_q8 import _gemv_iq_spread_kernel  # noqa: E402

KINDS = ("LDG", "PRMT", "IDP", "POPC", "LOP3", "SHF", "IMAD", "FFMA", "FADD", "FMUL")


def sass(fn, consts: dict, t0: str, t1: str) -> str:
    types = {"xq": "*i8", "dx": "*fp32", "w": "*u8", "y": "*fp32", "t0": t0, "t1": t1}
    sig = {a: types.get(a, "constexpr" if a in consts else "i32") for a in fn.arg_names}
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 1}).asm["sass"]


def main() -> None:
    r, bb = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (4, 8)
    forms = [("old IQ2_XS", _gemv_iq_spread_kernel, {"IQ3": False}, "*i32", "*i32"),
             ("new iq2xs", _gemv_iqc_kernel, {"FORM": 0}, "*i16", "*i32"),
             ("new iq2xs_ssel", _gemv_iqc_kernel, {"FORM": 1}, "*i16", "*i32"),
             ("old IQ3_XXS", _gemv_iq_spread_kernel, {"IQ3": True}, "*i32", "*i32"),
             ("new iq3xxs", _gemv_iqc_kernel, {"FORM": 2}, "*i16", "*i16")]
    print(f"sm_90 SASS, R {r}, BB {bb}, 1 warp (a thread: {r} rows x 8 groups of a quarter)")
    for name, fn, consts, t0, t1 in forms:
        s = sass(fn, dict(consts, R=r, BB=bb), t0, t1)
        ops = collections.Counter(m.group(1) for m in re.finditer(
            r"\b((?:" + "|".join(KINDS) + r")[.\w]*)", s))
        total = sum(ops.values())
        sext = len(re.findall(r"PRMT R\d+, R\d+, 0x9910", s))
        print(f"{name}: {dict(sorted(ops.items()))}; counted {total}; sign-extending PRMT {sext}")


if __name__ == "__main__":
    main()
