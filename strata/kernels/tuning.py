"""Every tuned threshold and tile, in one place: why it has its value, and the record under bench/
it came from ("estimate" where nothing has timed the choice yet).

Frozen: tuples, ints and read-only mappings, never changed at run time. A benchmark that times
other values passes them to the launcher (quant_matmul's tile / base_tile / rows_tile /
dequant_min_m, moe_forward's tiles / grouped) instead of changing this table, or, for a whole
process, sets the switches and tiles through STRATA_TUNING (read once, at the end of this file,
before any module imports a name from here).

Tiles: FMA GEMV (BN rows, BK values a step, stages, warps); dp4a GEMV (R rows, BB blocks a step,
warps); run forms (rows a program, split, warps). Numbers: H200, Qwen3-30B-A3B shapes
(D 2048, F 768, E 128, K 8) unless a line says otherwise.
"""

from __future__ import annotations

import ast
import os
import re
from types import MappingProxyType

from gguf import GGMLQuantizationType as QType  # (strata.quant would import torch)

from strata.errors import StrataError

# ---- dense matmul (kernels/gpu/matmul.py, formats.py) -------------------------------------------

# up to this many tokens the FMA GEMV takes a dense matmul; past it the tensor-core kernel. Past
# 4 its cost grows with the tokens (compute-bound, 2 FLOP a weight a token; it runs them in
# programs of 4): on an H100, 30B-A3B shapes, FMA / tl.dot us at 8 tokens: Q4_K q 4096 x 2048
# 26.4 / 21.8, o 2048 x 4096 21.6 / 40.9, k/v 512 x 2048 6.8 / 21.5, head 151936 x 2048 855 /
# 311 (tl.dot without its split of K: flat from 1 to 16 tokens). bench/2026-11-29-h200-kernels.md,
# bench/2026-12-06-h100-serve-glue.md
GEMV_MAX_M = 4
# the tensor-core kernel's split of K (matmul.gemm_split): each program at least this many steps
# of BK (64) values. An estimate (bench: none)
GEMM_SPLIT_MIN_STEPS = 4
# a Q4_K / Q6_K matrix of at least this many rows, at GEMV_MAX_M < tokens < DEQUANT_MIN_M, on
# 8-bit activations (--kernels fused: the x8 matrices) goes to the integer tensor cores
# (moe_mmq.mmq_matmul: x rounded to 8 bits per 32 values, as the one-token x8 GEMVs round it)
# in place of the tl.dot kernel: the batched step's output head.
# On an H100, 30B-A3B's 151936 x 2048 head at 8 / 16 rows: Q4_K 157 / 187 us against tl.dot's
# 328 / 349, Q6_K 290 / 300 against 428 / 431; q, k/v and o lose on it (q Q4_K at 8: 20.6
# against 18.1 split). None: never. bench/2026-12-06-h100-mixed.md
DENSE_MMQ_MIN_N: int | None = 32768
# from this many tokens on, dequantize to bf16 then cuBLAS beats the fused tl.dot kernel (14336 x
# 4096: 2.8x at 512 tokens for Q4_K, 4.8x at 4096); needs an N x K bf16 scratch.
# bench/2026-11-29-h200-kernels.md
DEQUANT_MIN_M = 64
# the FMA GEMV tile of a type not in GEMV_TYPE_TILES: 2 rows x 512 values, no pipelining, won for
# every type in the first round (stages=3 slowed every type, the i-quants 10x).
# bench/2026-11-29-h200-kernels.md
GEMV_DEFAULT_TILE = (2, 512, 1, 4)
# per type, the fastest timed on 14336 x 4096, one token, in CUDA-graph replays: Q4_K 29.1 against
# 39.4 us, Q6_K 41.9 against 48.8 (the 151936-row head 222 against 250).
# bench/2026-11-30-h200-gathered-decode.md
GEMV_TYPE_TILES = MappingProxyType({
    QType.Q4_K: (2, 1024, 1, 4),
    QType.Q6_K: (1, 1024, 1, 2),
    QType.IQ2_XS: (1, 512, 1, 4),
    QType.IQ3_XXS: (1, 512, 1, 4),
})
# (GGML type, N, K) -> FMA tile used as is for one token of that shape: none has beaten the
# type's tile yet (scripts/bench_moe_decode.py times candidates through quant_matmul(tile=)).
# bench/2026-11-30-h200-gathered-decode.md
GEMV_TUNE: MappingProxyType[tuple[int, int, int], tuple[int, int, int, int]] = MappingProxyType({})
# (GGML type, N, K) -> (R, BK, stages, warps): one-token shapes on the rows kernel (R rows share
# each x tile); not faster on the 30B-A3B's shapes (bench/2026-11-30-h200-prefetch2.md); faster on
# gpt-oss's 2880-wide Q8_0 (H100, float32 x, graph replays over rotated copies): the 201,088-row
# output head 336.3 us against 405.4 with the type's FMA tile, q/k/v fused 13.0 against 14.3.
# bench/2026-12-06-h100-glue.md
GEMV_ROWS_TUNE: MappingProxyType[tuple[int, int, int], tuple[int, int, int, int]] = \
    MappingProxyType({(int(QType.Q8_0), 201088, 2880): (8, 512, 1, 2),
                      (int(QType.Q8_0), 5120, 2880): (2, 1024, 1, 2)})

# ---- one-token GEMVs on int8 activations (kernels/gpu/gemv_q8.py) -------------------------------

# spread forms, the fastest timed (runs 78, 82, 92): 14336 x 4096 Q4_K 12.4 us, Q6_K 27.2,
# IQ2_XS 19.4, IQ3_XXS 23.0 (55.6 / 61.1 on float32 x); Q6_K head 151936 x 2048 122.7 us.
# bench/2026-11-30-h200-int8-activations.md, bench/2026-11-30-h200-iquants.md
GEMV_X8_TILE = MappingProxyType({QType.Q4_K: (4, 8, 1), QType.Q6_K: (2, 4, 1),
                                 QType.IQ2_XS: (4, 8, 1), QType.IQ3_XXS: (4, 8, 1)})
# run forms by the runs of 8 blocks a row, most runs first: (runs, (rows, split, warps)); run 102:
# 151936 x 2048 Q6_K 78.7 us at rows 8 split 1 against 120.4 spread; 14336 x 4096 Q6_K 17.4 us
# at rows 4 split 2. bench/2026-12-01-h200.md, bench/2026-12-01-h200-iq-run.md
GEMV_X8_RUN = ((2, (4, 2, 1)), (1, (8, 1, 1)))
# QuantTensor.x8 from this many rows on (the output head, not the attention projections): rounding
# x is one more launch (~1.2 us a graph) that a short GEMV would not win back; an estimate, timed
# from 14336 rows (bench/2026-11-30-h200-iquants.md). On an H100 (graph replays, rounding
# included, bench/2026-12-07-h100-launches.md), Q4_K 8192 x 2048: 8-bit 7.23 against FMA 11.18
# us; 4096 x 2048: 6.16 / 7.02; 2048 x 4096: 6.58 / 6.29; 512 x 2048: 4.34 / 3.02. 4096 would
# gain ~0.9 us a 4096-row GEMV: not yet tried end to end
X8_MIN_ROWS = 8192
# --kernels fused: a dense matmul of 2 to DENSE_X8_MAX_T tokens (a batched step's) over Q4_K or Q6_K
# rows rounds x to 8 bits and reads each row once for every token (dense_x8.gemm_x8_tokens:
# DENSE_X8_ROWS rows a program, the row's blocks held in registers) instead of the tensor-core
# kernel with its split of K. 0: never. Off: on the H200 the batched step of 8 / 16 spent 2.15
# / 3.88 ms in its Q4_K kernel against 2.17 / 2.18 (+ 0.39 / 0.40 of split sums) for the
# tensor-core kernel on the H100. bench/2026-12-06-h200-once.md
DENSE_X8_MAX_T = 0
DENSE_X8_ROWS = 4

# ---- the token embedding (model/weights.py, kernels/gpu/host_rows.py) --------------------------

# on CUDA, an untied token embedding stays in pinned host memory and the device reads a token's
# row over PCIe (one 0.3-8 KB row a token, inside the graphs): its VRAM (Qwen3.6-35B-A3B 286 MB,
# gpt-oss-20b 326 MB at their packs' types) goes to expert cache slots, as llama.cpp keeps it on
# the CPU. Planned at 4 GiB: Qwen3.6's decode slots 541 -> 700, gpt-oss-20b's 56 -> 93 (its
# prompt chunks 512 -> 1024 tokens). The row's read over PCIe is not timed (bench: none)
EMBED_ON_HOST = True

# ---- MoE layer (kernels/gpu/moe.py, moe_grouped.py) ---------------------------------------------

# up to this many tokens each pair reads its expert itself (decode, short verify windows); past
# it, pairs are grouped by expert onto tensor cores. bench/2026-11-29-h200-kernels.md
DECODE_MAX_T = 4
# a decode step's calls without miss rows (every pair's expert resident: the batched step of up
# to 16 sequences, its hits), and a verify window's hits, up to this many tokens take the per-pair
# kernels too (8-bit x, rounded as a decode step's; 213 us at 8 tokens on the H100 against MMQ's
# 393, bench/2026-12-06-h100-mmq-compare.md). The
# 30B-A3B layer, all resident, eager: per pair / tl.dot / grouped at 8 tokens 191 / 575 / 1208
# us, 16: 212 / 649 / 803, 32: 393 / 770 / 1105, 64: 748 / 974 / 1162, 128: tl.dot 1044,
# grouped 1191 (Q4_K / Q4_K / Q6_K; IQ2_XS / IQ3_XXS per pair 209-752 us against 802-1635
# grouped). Served, a batched step of 8 took 38 ms on the tl.dot kernels. Prompt chunks do not
# take them (on them a chunk padded to its graph's bucket moved the logits past test_chunk_graph's
# bound against the same chunk run eagerly); they take MMQ_PROMPT's kernels.
# bench/2026-12-02-h200-serve-pairs.md
PAIRS_MAX_T = 64
# the x8 per-pair kernels' grid goes pair-major (one row tile of every pair in flight together,
# so a batch's pairs of one expert share its rows' reads in L2) from this many pairs: 3.7-8.5%
# less kernel time at 64 and 128 pairs of the 30B-A3B layer under ncu, 2-3% more at 8.
# bench/2026-12-06-h100-compare.md
PAIR_MAJOR_MIN_PAIRS = 64
# from this many pairs a call on the x8 per-pair kernels without miss rows (a batched step's)
# takes moe_once.py's kernels instead, Q4_K gate/up and Q4_K / Q6_K down: a program per (rows,
# expert) reading the expert once for all its pairs (tiles["once"] overrides). None: never.
# Off: on the H200 the batched step of 8 / 16 spent 5.48 / 10.26 ms in the once gate/up kernel
# (rows 4 a program, the rows held in registers) against 2.19 / 3.96 ms for the per-pair one on
# the H100; its time grew with the pairs, as the per-pair kernels' does.
# bench/2026-12-06-h200-once.md
MOE_ONCE_MIN_PAIRS: int | None = None
# (MT, R): from MOE_GROUP_MIN_PAIRS pairs such calls take moe_once.py's group kernels instead
# (groups of MT pairs of one expert, the tokens a tensor axis beside R rows a program; Q4_K
# gate/up, Q4_K / Q6_K down); None: never (tiles["group"] overrides). Off: on the H200 the
# 30B-A3B's batched step of 8 / 16 took 9.96 / 13.97 ms per pair, 14.11 / 22.57 with (2, 2) and
# 13.55 / 20.11 with (2, 4). bench/2026-12-07-h200-group.md
MOE_GROUP: tuple[int, int] | None = None
MOE_GROUP_MIN_PAIRS = 16
# --kernels fused: calls that would take tl.dot (a prompt chunk, a verify window past DECODE_MAX_T,
# below the grouped path) run on the integer tensor-core kernels (moe_mmq.py: x and h rounded to
# 8 bits per 32 values, as llama.cpp's MMQ) where the types allow (Q4_K gate/up, Q4_K / Q6_K
# down). The 30B-A3B layer, all resident, eager, on an H100: mmq / tl.dot / grouped at 8 tokens
# 393 / 594 / 840 us, 32: 635 / 865 / 1191, 128: 700 / 996 / 1341, 512: 1712 / 1872 / 1419 (the
# grouped path from 256 tokens here). End to end, 8 of its layers, all resident, prompt graphs:
# pp128 20,968 against 15,715 tok/s (1.33x). bench/2026-12-06-h100-mmq-compare.md
MMQ_PROMPT = True
# from this many tokens per expert on average (T·K / E) a prompt chunk takes the grouped bf16 path
# (dequantize once, torch._grouped_mm): at 16 tokens on 14336 x 4096 the fused kernel took 95.7 us
# (Q4_K; 464 IQ2_XS) against ~70 estimated for bf16 (33.7 cuBLAS + ~36 writing the copy); from
# 512 tokens bf16 measured 3-5x faster (docs/kernels.md). Qwen3-30B-A3B switches at 256 tokens.
# An estimate, not a measured crossover (scripts/bench_kernels.py --moe-prompt-only times both).
# bench/2026-11-30-h200-offload.md
GROUPED_MIN_TOKENS = 16
# where MMQ_PROMPT's kernels take the layer, from 32: the 30B-A3B layer (128 experts, top 8) on
# an H100, mmq / grouped at 8, 16, 24, 32 tokens per expert (128, 256, 384, 512 tokens): 703 /
# 1340, 1035 / 1386, 1373 / 1413, 1686 / 1428 us. bench/2026-12-06-h100-matrix.md
MMQ_GROUPED_MIN_TOKENS = 32
# the MMQ kernels' tile (BM tokens, BN rows, warps), and the wider one from MMQ_WIDE_MIN tokens
# per expert on average (T·K / E). Layers on an H100, eager, 16x64x4 / 32x64x4 us: Qwen3.6-35B-A3B
# (256 experts, top 8) at 128 tokens (4 an expert) 783 / 857, 512 (16) 1383 / 1126; 30B-A3B (128,
# top 8) at 128 (8) 556 / 691, 512 (32) 1257 / 1130. 16x128x4 and 32x64x8 lost everywhere.
# bench/2026-12-06-h100-serve-glue.md
MMQ_TILE = (16, 64, 4)
MMQ_TILE_WIDE = (32, 64, 4)
MMQ_WIDE_MIN = 16
# the same kernels for MXFP4 experts (gpt-oss, biases and the clamped SwiGLU: moe_mmq._mxfp4_dot,
# an int8 dot of x with twice the E2M1 values a 32-value block, times 2^(e-128) dx). Off: on an
# H100 gpt-oss-20b's layer, eager, mmq / grouped at 128 tokens 1,959-1,966 / 2,044-2,428 us, at
# 512 4,279-4,286 / 2,184-2,193; end to end (prompt graphs) pp128 2,429 on against 2,536 tok/s
# off, pp256 4,840 / 4,855, pp512 equal. bench/2026-12-07-h100-models.md. Since then the kernels
# read a block's bytes once (both nibbles joined; gate/up 208 -> 140 registers at 16x64x4 on
# sm_90): not yet timed.
MMQ_MXFP4 = False
# MXFP4 experts (gpt-oss) dequantized for the grouped path by a kernel of their own
# (moe_grouped._dequant_mxfp4_slots_kernel): this many 32-value blocks a program, each block's 16
# bytes read once and its values stored as two runs of 16; None: the tile kernel every type
# shares, which reads each byte once for its low and once for its high nibble, a value at a time.
# That kernel took 31.4 ms of gpt-oss-20b's 79 ms 512-token prompt on an H100 (its table gather
# since removed, bench/2026-12-07-h100-models.md). This one not yet timed: bench none.
MXFP4_DEQUANT_BLOCKS: int | None = 64
# MXFP4 rows in the tl.dot group kernels (prompt chunks below the grouped path) through
# skeletons.mxfp4_dot_span: a step's blocks read once, both nibbles decoded and joined, x loaded
# in the matching column order; False: the tile every type shares (each byte read once per
# nibble). Tested under the interpreter, not yet timed (the tile's form: gpt-oss-20b's layer on
# an H100 2,319-2,364 us at 128 tokens, 2,976 at 512; bench/2026-12-07-h100-models.md).
MXFP4_DOT_SPAN = True
# i-quant experts, from 8: IQ2_XS / IQ3_XXS's tl.dot tiles took 6273 us at 8 tokens per expert
# against the grouped path's 1741 (3.6x; 5.2x at 16). Not timed below 8.
# bench/2026-12-06-h100-matrix.md
IQ_GROUPED_MIN_TOKENS = 8
# bf16 expert weights the grouped path dequantizes at a time: one whole Qwen3-30B-A3B layer (128 x
# 3 x 768 x 2048 x 2 bytes = 1.125 GiB) in one batch; larger layers in batches of experts (4 for
# Qwen3-235B-A22B's 4.5 GiB). Sized, not timed (bench: none; memory_plan caps it at an eighth of
# the budget; the path itself: bench/2026-11-30-h200-offload.md)
GROUPED_SCRATCH_BYTES = 1280 << 20
# float32-activation decode tiles (BN, BK, stages, warps): gate and up in one K loop; the down
# split over pairs (42.8 against 46.8 us for one CTA per token).
# bench/2026-11-30-h200-gathered-decode.md
GATE_UP_TILE = (1, 512, 1, 2)
DOWN_TILE = (4, 256, 1, 4)
# x8 decode (R, BB, warps): Q4_K gate/up and Q4_K / Q6_K down on dp4a.
# bench/2026-11-30-h200-int8-activations.md
GATE_UP_Q8_TILE = (4, 8, 1)
DOWN_Q8_TILE = (4, 4, 1)
DOWN_Q6K_Q8_TILE = (4, 4, 1)
# x8 decode, IQ2_XS / IQ3_XXS gate/up and down (medians of 5 rounds: 27.8 / 28.5 us against 57.5 /
# 58.3 on float32); the down's BB 1 leaves its loads unmasked (28.8 / 29.6 at (4, 4, 1)); the run
# form of the gate/up timed slower (33-37 us against 28-31), so off. bench/2026-12-01-h200-iq-run.md
GATE_UP_IQ_TILE = (4, 4, 1)
DOWN_IQ_TILE = (8, 1, 1)
# x8 decode, MXFP4 gate/up and down with biases (gpt-oss) on dp4a (gemv_q8.mxfp4_spread_dot),
# (R, BB, warps): gpt-oss-20b's MoE decode layer on an H100 51.5 us (1,027 GB/s) against the
# float32 kernels' 131.9 us at their best tiles (8 same-tile pairs tried: 51.5-67.9 us; (8, 8, 2)
# 51.7, the SASS-count pick (8, 4, 1) 61.6). bench/2026-12-06-h100-mx8.md
MXFP4_X8 = True
GATE_UP_MX8_TILE = (4, 16, 2)
DOWN_MX8_TILE = (4, 16, 2)
# gather_misses: int32 words a program, 16 KB in flight each; not timed against others (bench:
# none; the copy's program count was: PREFETCH_PROGRAMS)
GATHER_BLOCK = 4096

# the fused residual add + RMS norm + router + top-k (decode_ops.norm_route) for routers of up to
# this many experts; past it the three launches: on an H100, 4.95 against 6.57 us at 128 experts
# (Qwen3-30B-A3B), 17.2 against 9.5 at 256 (Qwen3.5/3.6-MoE: the last program's [256, 256] rank
# comparison, whatever its BLOCK_J of 8-64). bench/2026-12-06-h100-matrix.md
NORM_ROUTE_MAX_EXPERTS = 128
# routers of at least this many experts pick their top k by a bitonic top-k (tl.topk over int64
# keys: value bits above, id below; decode_kernels._route_row_sorted) instead of the [E, E] rank
# comparison, in route_topk and norm_route; None: never. Timed on an H100: the fused route at 256
# experts 17.72 -> 5.49 us (three launches: 9.74), at 128 5.07 -> 4.97; Qwen3.6's decode with it
# and NORM_ROUTE_MAX_EXPERTS 256 293.8 -> 338.2 tok/s (bench/2026-12-07-h100-launches.md). Off
# still: a CUDA test run with it on had 13 failures it did not name; its ids on a GPU are to be
# checked first (bench_norm_route.py now does)
ROUTE_SORT_MIN_EXPERTS: int | None = None
# a decode token's shared expert (qwen2moe / qwen35moe / glm4moe / deepseek2; SharedExpert in
# model/parts/ffn.py) on the 8-bit-activation kernels where the weights are loaded for them
# (--kernels fused): Qwen3.6's profile put its float32 FMA gate/up at 6.1 us and its down at 3.1
# us a layer (bench/2026-12-07-h200-group.md), one pair on the per-pair grid. Timed on an H100
# (bench/2026-12-07-h100-launches.md): Qwen3.6 decode 338.2 -> 350.5 tok/s beside the sorted
# fused route, 293.8 -> 285.0 without it (one run each). Off until both are understood and the
# CUDA tests with it on are named
SHARED_X8 = False

# ---- decode attention (kernels/gpu/decode_ops.py) -----------------------------------------------

# keys per split at least (one BLOCK_N step for hd 128): with 128, a 192-key step kept 4-8 CTAs
# busy for 14 us a layer; 32 took the split kernel from 14.1 to 8.1 us.
# bench/2026-11-30-h200-gathered-decode.md
ATTN_MIN_CHUNK = 32
# Hkv·S aimed at by one sequence's split kernel: one wave on a 132-SM H100 / H200 (the tf32
# tile's shared memory leaves one CTA an SM). The 30B-A3B shape (Hkv 4), f16 rows, one token,
# on an H100, us at 16K / 32K rows: S 16 28.5 / 50.7, **32 19.9 / 31.7**, 64 (256 CTAs, the
# earlier estimate) 22.1 / 34.0, 128 26.7 / 40.0, 256 37.6 / 52.2. Other shapes, caches and
# cards with fewer SMs: not measured. bench/2026-12-07-h100-attention-demospec.md
ATTN_TARGET_CTAS = 128
# B·Hkv·S aimed at by the paged kernel of a batched step: ~2 CTAs an SM; an estimate (bench: none)
PAGED_TARGET_CTAS = 256
# query rows per split CTA: tl.dot's smallest tile; 32 rows spilled in the offline sm_90a builds
# (docs/kernels.md; bench: none)
ATTN_BLOCK_M = 16
# split kernel variants (decode_ops.ATTN_VARIANTS): "ieee" tl.dot in exact float32 (the first
# kernel, FMA-emulated), "fma" no dot (broadcast products and sums on the CUDA cores, exact
# float32), "tf32" tl.dot on TF32 tensor cores (--kernels fused only). The pick per case:
# (T·G <= ATTN_FEW_ROWS, --kernels fused, cache "f32" | "half" | "q8_0") -> variant.
ATTN_FEW_ROWS = 32
# Measured on the H200 (bench/2026-12-02-h200-kv-attention.md: 30B-A3B, gpt-oss-20b and
# qwen3.6-35b-a3b shapes, every cache type, T 1 and 4 at G 8, 512 / 4096 / 16384 rows): exact
# mode's fma beat ieee in every case up to T·G 32 (30B-A3B f16 at 16K: T 1 44.2 us against
# 121.2, T 4 197.1 against 229.0); fused mode's tf32 was the fastest but in 3 of 72 cases
# (q8_0 at 512 rows, T 1: within 1.1 us of fma). T·G above 32 was not measured.
ATTN_VARIANT = MappingProxyType({
    # 30B-A3B f32 T 1: 7.7 / 19.2 / 47.9 us against ieee's 11.4 / 33.6 / 104.6 (512 / 4K / 16K)
    (True, False, "f32"): "fma",
    # f16 T 1: 7.7 / 17.8 / 44.2 us against 11.8 / 38.3 / 121.2; T 4: 10.5 / 56.4 / 197.1
    # against 12.8 / 66.3 / 229.0
    (True, False, "half"): "fma",
    # q8_0 T 1: 10.2 / 29.7 / 94.5 us against 15.6 / 50.1 / 173.2
    (True, False, "q8_0"): "fma",
    # f32 T 1: 7.2 / 18.1 / 29.7 us (55% of the copy ceiling at 16K); T 4: 7.7 / 22.9 / 44.9
    (True, True, "f32"): "tf32",
    # f16 T 1: 6.9 / 12.6 / 20.5 us; T 4 at 16K: 29.7 against fma's 197.1
    (True, True, "half"): "tf32",
    # q8_0 T 1: 10.9 / 21.8 / 61.7 us against fma's 10.2 / 29.7 / 94.5
    (True, True, "q8_0"): "tf32",
    # T·G > 32: exact mode keeps the first kernel, the exact form known to fit there (not
    # measured against fma beyond 32 rows)
    (False, False, "f32"): "ieee",
    (False, False, "half"): "ieee",
    (False, False, "q8_0"): "ieee",
    # many rows over tensor cores: tf32 led by 3-7x at 32 rows (not measured beyond)
    (False, True, "f32"): "tf32",
    (False, True, "half"): "tf32",
    (False, True, "q8_0"): "tf32",
})
# fma: (elements of its [BLOCK_M, BLOCK_N, BLOCK_D] accumulator: BLOCK_N = this / (BLOCK_M ·
# BLOCK_D), 4..64, 16 keys at 8 rows of hd 128; DC, d's piece a key load spreads over DC/4
# lanes, at most BLOCK_D; stages; warps). In the sm_90 build as launched (ints of 1 constant,
# multiples of 16 and pointers marked aligned), 30B-A3B f32 T 1: DC 128 (all 32 lanes along d)
# 128 registers, 16 KiB, no spills, 326 warp-instructions a key in its loop; DC 64: 169-213
# registers, 612-630 a key; DC 16: 4 keys a step at most without spills, 1212 a key (the
# first kernel, ieee: 215; tf32: 53). tests/test_decode_ops.py checks every model shape it
# launches. bench: none yet
ATTN_FMA_TILE = (8 * 16 * 128, 128, 2, 8)
# tf32: (key bytes a step / BLOCK_D: BLOCK_N = 8192 // BLOCK_D, 64 keys at hd 128), stages,
# warps: 3 stages of 64 f32 K+V rows fit in 144 KiB of shared memory without spills (234
# registers) in the sm_90 build. bench: none yet
ATTN_TF32_TILE = (8192, 3, 8)

# MLA's absorbed decode (kernels/gpu/latent_ops.py): (heads a CTA, tl.dot's rows; rows a step;
# stages; warps) of the exact float32 kernel (False) and the TF32 one (True, --kernels fused).
# In the sm_90 build at DeepSeek-V3's shape (H 128, L 512, R 64) over f32, f16 and bf16 rows,
# one sequence or paged: exact (16, 16, 1, 8) 110-119 registers, 72 KiB shared, no spills;
# with 32 rows a step or 2 stages it spilled (4-8 stores over f32 and bf16 at 32 rows, over
# 2000 with a bf16 cache and 2 stages: the FMA-emulated dot's layouts); TF32 (16, 32, 2, 8)
# 162-234 registers, 74-172 KiB, no spills. tests/test_latent_ops.py checks both builds.
# bench: none yet (scripts/bench_attention.py --mla times them against the torch form)
MLA_TILES = MappingProxyType({False: (16, 16, 1, 8), True: (16, 32, 2, 8)})
# tokens x head blocks x splits aimed at: ~1 CTA per SM of an H200 (132) when every split is
# live; each live split writes [H, L] float32 partials (256 KiB a split at DeepSeek-V3's 128
# heads), so fewer, longer splits than the GQA kernels' ATTN_TARGET_CTAS. An estimate (bench:
# none)
MLA_TARGET_CTAS = 128

# ---- the CPU share and the mailbox (kernels/gpu/mailbox.py, kernels/cpu, experts/cpu_share.py) --

# polls of done[l] before a take gives up: seconds at PCIe latency, far past any real share.
# bench/2026-11-30-h200-cpu-share.md
TAKE_LIMIT = 4_000_000
# the share's own pool at most, unless --threads says: two pairs on 8 threads beat PCIe alone
# (43.6-46.8 tok/s against 40.6-40.9); 4 threads 18.8-44.1, 12 and 15 threads 16.7-37.6.
# bench/2026-11-30-h200-prefetch.md
SHARE_THREADS = 8
# microseconds an idle token-pool worker spins before it sleeps: a decode step's next layer
# comes within it; not timed against others (bench: none; the pool itself:
# bench/2026-11-30-h200-lend.md)
SPIN_US = 2000
# ggml expert graphs: slots one weight tensor may span (beyond, one-expert groups), graphs kept
# (decode needs ~1 per count of missed experts and quant mix) and their buffers' bytes: bounds,
# not timed (bench: none; the ggml path itself: bench/2026-11-29-cpu-experts.md)
GGML_MAX_SLOTS = 1024
GGML_CACHE_GRAPHS = 64
GGML_CACHE_BYTES = 256 << 20
# float32 weights the torch CPU path dequantizes at once: 1-2 Qwen3-30B experts; larger batches
# measured slower (the temporaries fall out of cache; no record keeps those timings, bench: none;
# the torch path itself: bench/2026-11-29-cpu-experts.md)
TORCH_BATCH_BYTES = 32 << 20

# ---- engine and experts (engine/*, experts/offload.py, model/transformer.py) ---------------------

# VRAM kept out of the plan: activations, allocator slack, kernels' own buffers; a bound, not
# timed (bench: none; the plan on the GPU: bench/2026-11-29-h200-offload.md)
PLAN_MARGIN = 256 << 20
# a CUDA process's own VRAM, outside torch's allocator (the context, cuBLAS's, cuDNN's and the
# kernels' modules): counted in a --vram-budget so that nvidia-smi's figure stays inside it. The
# process showed 531 MiB before its first model tensor (llama.cpp's 527 MiB), and nvidia-smi's
# peak less torch's reserved peak was 789 MiB at 4 GiB and 915 MiB at 10 GiB once the kernels
# had loaded (bench/2026-12-02-h200-matrix-serve.md, bench/2026-12-02-h200-prompt-graphs.md)
CUDA_CONTEXT = 960 << 20
# the smallest KV cache a plan accepts (tokens): a floor for a useful context (bench: none)
MIN_KV_TOKENS = 256
# without --ctx the plan takes the model's context where its KV cache fits in 1 / KV_SHARE of the
# room the fixed parts leave (the rest for expert cache slots), and at least DEFAULT_CTX tokens
# where those fit (a policy, not a timing: bench none)
KV_SHARE = 4
DEFAULT_CTX = 4096
# strata serve: prompt tokens a step may add while other sequences decode in it (their next
# token waits for the whole step): prompts advance in chunks of at most this many tokens between
# the others' tokens, oldest first, as vLLM's chunked prefill bounds a step's tokens (a mixed
# batched step takes fewer: the rows MIXED_STEP_ROWS leaves beside the decoders). A policy
# (bench: none; the cost of a 512-token chunk on the H200: bench/2026-12-02-h200-kv-attention.md)
PREFILL_WHILE_DECODING = 512
# rows of the largest batched step over a pool without recurrent state (strata serve --batch N):
# while some sequences decode, a step carries each one's token and the oldest prompt's next
# tokens, up to this many rows in all, so a prompt advances inside the decoders' own pass (their
# expert reads shared) instead of holding their next token for a chunk of its own, as vLLM's
# mixed steps do. The step's sizes past the pool's slots are powers of two up to it (a prompt's
# last few tokens pad to the next). A policy, an estimate (bench: none)
MIXED_STEP_ROWS = 32
# rows of the served prompts' scratch cache (strata serve --batch N on CUDA): a prompt up to this
# long runs its chunks on the prompt graphs over a plain cache, its rows then copied into the
# paged pool (the graphs refuse a paged cache; eagerly a 128-token prompt took ~100 ms against
# ~40 for its graph). A policy: 2048 rows of Qwen3-30B-A3B at f16 are 192 MiB of the budget
# (bench: none; the eager and graphed prompts: bench/2026-12-02-h200-serve-pairs.md)
PREFILL_SCRATCH_ROWS = 2048
# the ring with what it borrows: at most this many of the largest records.
# bench/2026-11-30-h200-prompt-streaming.md
BORROW_RECORDS = 512
# programs of the decode prefetch's copy (each looping over its blocks): a program per block held
# every SM's loads behind PCIe (the next layer's attention 80-100 us instead of 8); 581 / 599 /
# 705 / 633 us with 8 / 16 / 32 / 64 (scripts/bench_gather_overlap.py).
# bench/2026-11-30-h200-prefetch.md
PREFETCH_PROGRAMS = 16
# a layer streams every uncached expert of a chunk (routing on the device) while its chunks route
# to at least this fraction of them: 72% took 0.65 s streamed against 1.31 s copying the routed
# ones with host syncs; the host path pays below about a third.
# bench/2026-11-30-h200-prompt-streaming.md
ROUTED_MIN = 0.4
# --kernels MODE -> the most tokens a pass runs on the fused kernels: every pass (fused), decode
# sizes only (exact: the FMA kernels' float32 sums, up to DECODE_MAX_T tokens), none (off).
# Modes, not timings (bench: none; the kernels: bench/2026-11-29-h200-kernels.md)
FUSED_MAX_T = MappingProxyType({"fused": 1 << 30, "exact": 4, "off": 0})
# longer segments (prompt chunks) may attend on bf16 flash attention under --kernels fused.
# bench/2026-11-30-h200-offload.md
BF16_ATTENTION_MIN_T = 4

# prompt chunks of one sequence replayed from CUDA graphs (engine/chunk_graph.py): a chunk runs in
# the smallest of these buckets that holds it, padded after its real tokens. Powers of two from
# 16 (the smallest tl.dot tile: a shorter chunk costs its launches, not its rows) to the plan's
# largest chunk, so padding at most doubles a chunk's rows; the memory plan keeps the buckets
# whose graph pool fits what it leaves (a policy, not a timing: bench none)
PROMPT_GRAPH_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
# verify windows (engine/spec.py) of up to this many tokens run from CUDA graphs too, one graph
# per window size (engine/chunk_graph.py): the smallest bucket's size, so a window's pass never
# outgrows the prompt graphs' pool; a longer window (--spec past 15) runs eagerly (a policy, not
# a timing: bench none)
WINDOW_GRAPH_MAX = 16

# --prefetch auto on CUDA decode steps (where the cache is small: prefetch_pays):
# at 2 GiB (30B-A3B, H200, LRU, before lent slots) 2 gave 42.8-45.1 tok/s against 40.6-40.9
# without, 1 gave 42.2 and 3-4 42.8-43.4 (bench/2026-11-30-h200-prefetch2.md); with LFU and lent
# slots 4 gave 66.2 against 61.9 for 2 on one machine (3: 63.7 on another), and 104.3 at 4 GiB
# against 99.3 (bench/2026-11-30-h200-lfu.md)
AUTO_PREFETCH = 4

# ---- speculative decoding (engine/drafters.py, engine/spec.py) ----------------------------------

# n-gram drafts (prompt lookup): the longest suffix of the context, from NGRAM_MAX tokens down to
# NGRAM_MIN, matched at its latest earlier place proposes the tokens that followed it there. A
# 1-token match fires on nearly every step of prose (any repeated token) and is mostly wrong:
# each wrong window costs a pass of T+1 tokens on the CPU for one token; suffixes past 4 tokens
# rarely find a match a shorter one misses (estimate; the demo model's numbers: docs/spec.md)
NGRAM_MAX = 4
NGRAM_MIN = 2
# adaptive windows: the acceptance of drafted tokens, a running mean with this weight per window;
# below SPEC_OFF_ACCEPT no windows run for SPEC_OFF_STEPS decode steps, then one probe window
# (twice as long after each probe in a row that accepts nothing, up to SPEC_OFF_MAX)
# (a drafted token accepted 1 time in 4 pays for itself only where a window of T+1 tokens costs
# well under 1.25 decode steps: estimate)
SPEC_ACCEPT_WEIGHT = 0.25
SPEC_OFF_ACCEPT = 0.25
SPEC_OFF_STEPS = 16
# ... and likewise while a window's seconds per token (running mean, the same weight) exceed a
# plain decode step's by this factor: a window reads the union of its tokens' experts, which on
# a CPU can cost more than the tokens it gains (the demo model reads 12 of 16 experts a layer for
# 5 tokens, 4 for one); 1.1 leaves room for the measured noise (estimate)
SPEC_SLOWER = 1.1
# each time windows turn off for being slower, the next time they stay off twice as long, up to
# this many steps: a probe window can cost many plain steps (the demo model on the CPU offload
# runtime: one window of 5 tokens took as long as 16 plain steps, streamed and computed in
# float32), so probes grow rare where windows never pay
SPEC_OFF_MAX = 1024
# ... and at least as long as keeps what the windows cost beyond plain steps to this share of the
# pause (at most 4x the doubling pause a verdict): windows that cost 20 plain steps for 4 tokens
# (the 35B hybrid at 4 GiB on an H100 whose CPU pool had one thread:
# bench/2026-12-06-h100-mmq-compare.md) pause 64, 128, 256, 320 steps, not 16, 32, 64, 128. The -5%
# bound of #29 (policy)
SPEC_PROBE_SHARE = 0.05
# a new sequence's first window has 1 draft (then one more after each window accepted whole)
# where a full window is known to cost more than this many plain decode steps: a first window
# with nothing accepted then costs one window of 2 tokens, not one of T+1 (the CPU's tiny model:
# a window of 5 tokens ~3 plain steps; policy)
SPEC_START_STEPS = 2.0

# ---- hybrid linear attention (model/parts/delta_net.py) -----------------------------------------

# tokens a chunk of the chunked gated delta rule: its [Hv, C, C] triangular solve stays small
# while the sequential steps over a prompt drop C-fold; 64 is the chunk of fla's
# chunk_gated_delta_rule and of transformers' torch reference (estimate: not timed here)
DELTA_CHUNK = 64
# prompts through flash-linear-attention's chunked gated delta rule where fla-core is installed
# (delta_ops.fla_rule), else the torch solve and chunk_scan below: the scan took 82 of 196 ms of
# Qwen3.6-35B-A3B's 512-token prompt on the H100 (2.7 ms a layer: its float32 "ieee" dots run
# on FMA units, one program per head and 32 value columns). bench/2026-12-06-h100-matrix.md
DELTA_FLA = True
# one decode token's Gated DeltaNet step (kernels/gpu/delta_ops.py): value columns of S a program
# (each program holds S[:, BV] of one head: dk x BV floats) and its warps; channels a program of
# the conv step. Estimates: not timed yet.
DELTA_STEP_TILE = (32, 4)
CONV_STEP_BLOCK = 512
# state columns a program of the chunked rule's scan over chunks (delta_ops.chunk_scan): S[:, 32]
# of a 128-dim head is 16 KiB of registers; tl.dot wants at least 16 (estimate: not timed yet)
CHUNK_SCAN_BV = 32
# its loop's software pipeline: Triton's default of 3 stages needs 256 KiB of shared memory at
# dk 128, chunk 64 (qwen3.6's heads), over the H200's 227 KiB a block (the launch failed there:
# bench/2026-12-01-h200-matrix.md); 2 stages take 136 KiB, 1 takes 56 KiB (sm_90 compiles)
CHUNK_SCAN_STAGES = 2

# ---- the reference path (experts/reference.py) ----------------------------------------------

# bytes of dequantized float32 experts the CPU's reference executor keeps (least recently used
# out): the demo model's (5 layers of 16 experts) all fit; its decode step on the 2-core CPU
# machine spent 78% of 34 ms dequantizing the routed experts again. Sized, not tuned (bench:
# bench/2026-12-02-cpu-reference-cache.md)
REFERENCE_CACHE_BYTES = 1 << 30
# a batch of 2 .. this many tokens (the batched decode of --batch) runs a layer's experts as two
# matmuls over all of them (ReferenceExperts' stacked layers) where the tokens route to more than
# half the layer's experts: on the 2-core CPU machine, 8 tokens over the tiny preset's 8 experts
# (7 routed on average) took 0.79 ms a layer against 1.24 one routed expert at a time, 4 tokens
# 0.50 against 0.64, 2 tokens (4 routed) 0.36 against 0.32 (minimum of 40 interleaved trials,
# 2 threads; on 1 thread the two forms cost the same).
# Past it the matmuls over unrouted pairs cost more than the reads they save; a prompt's tokens
# keep one expert at a time. bench/2026-12-06-cpu-serve.md
REFERENCE_DENSE_TOKENS = 16

# ---- one process's overrides ------------------------------------------------------------------

# STRATA_TUNING="NAME=VALUE,NAME=VALUE" sets switches and tiles of this table for one process, read
# here once, before any module imports a name from here: a switch timed end to end, or the CUDA
# tests run with it (scripts/gpu_bench.sh passes its TUNING as this). A value is of the name's
# own kind: True / False, an int, a float, a tuple of the same length (a tile), None where the
# name's annotation allows it; the tables (read-only mappings) are not set this way.
TUNING_ENV = "STRATA_TUNING"


def _same_kind(old: object, new: object) -> bool:
    if isinstance(old, tuple):
        return (isinstance(new, tuple) and len(new) == len(old)
                and all(_same_kind(a, b) for a, b in zip(old, new, strict=True)))
    if isinstance(old, bool) or isinstance(new, bool):
        return type(old) is type(new)
    if isinstance(old, float):
        return isinstance(new, (int, float))
    return type(old) is type(new)


def tuned_values() -> dict[str, object]:
    """{NAME: value} of this table's tuned constants (what STRATA_TUNING may name)."""
    return {k: v for k, v in globals().items() if k.isupper() and not k.startswith("_")
            and k not in ("TUNING_ENV", "OVERRIDES", "OVERRIDE_ERROR")}


def parse_overrides(text: str, table: dict[str, object] | None = None,
                    annotations: dict[str, str] | None = None) -> dict[str, object]:
    """{NAME: value} from STRATA_TUNING's text, each checked against the table's NAME (the kind
    of its value, or of its annotation: "int | None" takes either; by default this module's):
    a StrataError naming the variable, the entry and what it takes otherwise."""
    table = tuned_values() if table is None else table
    annotations = __annotations__ if annotations is None else annotations
    out: dict[str, object] = {}
    # (a tile's commas stay in its value: an entry starts at NAME=)
    for item in re.split(r",\s*(?=[A-Za-z_][A-Za-z0-9_]*\s*=)", text.strip()):
        name, eq, raw = (part.strip() for part in item.partition("="))
        if not eq or not name:
            raise StrataError(f"{TUNING_ENV}: {item!r} is not NAME=VALUE (entries joined by "
                              "commas)")
        if name not in table:
            raise StrataError(f"{TUNING_ENV}: {name} is not a tuned value of "
                              "strata.kernels.tuning (the names are its upper-case constants)")
        old = table[name]
        if isinstance(old, MappingProxyType):
            raise StrataError(f"{TUNING_ENV}: {name} is a table; a benchmark passes its tiles "
                              "to the launcher instead")
        try:
            new = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            raise StrataError(f"{TUNING_ENV}: {name}={raw}: not a value (True / False / None, a "
                              "number or a tuple)") from None
        kind = annotations.get(name, "")
        takes_none = "None" in kind
        takes_int = old is None and "int" in kind
        if not (_same_kind(old, new) or (new is None and takes_none)
                or (takes_int and type(new) is int)):
            want = {bool: "True or False", int: "an int", float: "a number"}.get(type(old), kind)
            if isinstance(old, tuple):
                want = f"a tuple of {len(old)} like {old}"
            raise StrataError(f"{TUNING_ENV}: {name}={raw}: {name} takes {want}")
        out[name] = new
    return out


# what STRATA_TUNING set in this process (the CLI says it in its first lines); text it could not
# read sets nothing and is kept here, raised by check_overrides (the CLI's one-line error, the
# tests' session start): an import does not fail on it
OVERRIDES: dict[str, object] = {}
OVERRIDE_ERROR: StrataError | None = None
if os.environ.get(TUNING_ENV, "").strip():
    try:
        OVERRIDES = parse_overrides(os.environ[TUNING_ENV])
    except StrataError as e:
        OVERRIDE_ERROR = e
    globals().update(OVERRIDES)


def check_overrides() -> None:
    """The StrataError STRATA_TUNING's text gave, if it gave one (nothing of it was applied)."""
    if OVERRIDE_ERROR is not None:
        raise OVERRIDE_ERROR
