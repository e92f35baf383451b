#!/usr/bin/env bash
# Run on the GPU machine, from the repo root: sets up, runs the CUDA tests of the fast paths, then
# the decode and prompt benchmarks on a synthetic Qwen3-30B-A3B (Q4_K_M, or the recipe QUANT
# names, e.g. IQ2_XS; PRESET names another synth preset, e.g. qwen3.6-35b-a3b or gpt-oss-20b,
# LAYERS fewer of its layers; ceilings measured in the same runs), then a correctness check of
# the fast paths on those shapes; results under $OUT.
#   STAGES="tests profile decode prompt check" bash scripts/gpu_bench.sh   (OUT defaults to ./out)
# Stages: tests (CUDA tests of the fast paths; TESTS= picks files), kernels
# (bench_moe_decode.py; KERNEL_ARGS added, e.g. "--gemv-only 14336x4096"), ncu (Nsight Compute
# on the GEMVs: gemv_once.py with GEMV_ONCE_ARGS, by default the dp4a and rows kernels too;
# NCU_EXTRA added to ncu's arguments, e.g. --metrics; NCU_KERNELS the -k filter, regex:gemv, e.g.
# regex:_q8_kernel with GEMV_ONCE_ARGS="--moe 1,8,16 --launches 1"), mapped
# (bench_mapped.py), overlap (bench_gather_overlap.py), attention (bench_attention.py: decode
# attention's split kernel variants at the 30B-A3B, gpt-oss-20b and qwen3.6-35b-a3b shapes by
# cache type, tokens and length; ATTN_ARGS added, e.g. "--caches f32 --tokens 1", or
# "--field sdpa,flex": torch's SDPA and FlexAttention on the same rows; then --mla, MLA's
# absorbed decode kernel against its torch form, MLA_ARGS added), profile
# (profile_decode.py at PROFILE_BUDGETS, each budget or budget:flags; PROFILE_TRACE=1 also
# Chrome traces), streaming (profile_prompt.py; HOST_ROUTING=1 also with --host-routing), ttft
# (profile_prompt.py on prompts of TTFT_LEN tokens, "128 512", every expert resident: wall time,
# kernels busy, the longest ops),
# decode (sweep over BUDGETS, DECODE_FLAGS added), share (decode at SHARE_BUDGET GiB, 2 by
# default, with --cpu-share N for each N of SHARES, 0 the baseline; N:T also --threads T; for
# each pool of SHARE_POOLS, default graph, as STRATA_CPU_SHARE_POOL; SHARE_ENV="VAR=value ..."
# in their environment, SHARE_FLAGS added;
# --prefetch is the engine's default, auto, unless SHARE_FLAGS gives it),
# cpu (the CPU share's one-token call by thread count, CPU_THREADS, under each
# OMP_WAIT_POLICY of CPU_POLICIES, CPU_ARGS added), prefetch (decode at 2 GiB with --prefetch N
# for each N of PREFETCHES; N:S also --cpu-share S),
# llamacpp (llama.cpp built for this GPU from .whl/llama.cpp-src.tgz, scripts/pack_llama_cpp.sh,
# in the background from the start, LLAMA_BUILD_TIMEOUT s at most; kept in .llama-build/ for the
# next call while the machine stays warm: test-backend-ops' one-token GEMV and 30B-A3B
# MUL_MAT_ID timings for LLAMA_TYPES, llama-bench on the synthetic model all on the GPU and with
# -ot exps=CPU, prompts of LLAMA_PROMPTS tokens (512; a list: 128,256,512), LLAMA_BENCH_FLAGS
# added), grouped (the 30B-A3B prompt MoE layer through the grouped and the tl.dot paths by
# token count, scripts/bench_kernels.py --moe-prompt-only, GROUPED_ARGS added, e.g.
# "--moe-prompt-tokens 64,128"),
# route (scripts/bench_norm_route.py: the fused decode routing by BLOCK_J, 128 and 256 experts),
# dense (scripts/bench_kernels.py --dense-batch: the 30B-A3B attention and head matmuls at 1-16
# tokens, a batched step's rows, on the FMA GEMV, the tensor-core kernel split and unsplit and
# moe_mmq.mmq_matmul (integer tensor cores); DENSE_ARGS added),
# compare (an older tree's strata bench beside this one's: COMPARE_TREE, COMPARE_SPECS,
# COMPARE_ORDER, COMPARE_NEW_FLAGS),
# matrix (llama-bench's matrix, MATRIX_P prompts, MATRIX_N decode tokens at MATRIX_D depths, from
# strata bench and from llama-bench -fa 1 at each of MATRIX_BUDGETS, -ncmoe fitted to the budget,
# peaks from nvidia-smi: scripts/llama_side_by_side.py writes $OUT/matrix.md), serve (strata
# serve at SERVE_BUDGETS loaded by strata bench-serve with SERVE_CLIENTS clients; SPY=1 then
# samples the engine process with py-spy, carried as a wheel in .whl/, under 1 and SPY_CLIENTS),
# prompt (PROMPT_BUDGETS x PROMPT_LEN, budget[:expert cache], PROMPT_FLAGS added), check (the
# logits of the offload runtime at each of CHECK_BUDGETS against everything on the device, float32
# kernels, the last 16 tokens as decode steps; CHECK_FLAGS added to the offload side), spec
# (strata bench-spec at each of SPEC_BUDGETS, 4 by default: --spec SPEC_T (4) windows whose
# drafts replay the greedy answer, SPEC_ACCEPT drafts accepted a window (3,0), against plain
# decode; SPEC_FLAGS added; each of SPEC_VARIANTS (";"-separated flag sets) in turn; #29's
# target on PRESET=qwen3.6-35b-a3b), demospec (the trained demo model through strata generate
# on CUDA, a code and a prose prompt, greedy and sampled, without and with --spec 4 --draft
# ngram: acceptance and tok/s).
# Results: $OUT/machine.txt and $OUT/results.tgz (every other file, packed at exit); with
# TCACHE=1 also $OUT/tcache.tgz, the kernels Triton built in this run (its cache entries), which a
# later run reads when carried as .tcache/*.tgz (every one there; the i-quant run forms take
# 10-100 s each to build; a file over 16 MiB does not come back).
# PYTEST_N=N runs the tests in N processes (pytest-xdist): meant for the kernel test files, whose
# time is building kernels (tests/test_gemv_q8.py: 39 in 192 s at N 14). The whole list in 14
# processes was cut at 400-540 s with 153-202 of about 250 done, none failed (runs 108-110;
# likely its CPU-pool tests, each starting a pool of the machine's cores less one): run it in one
# process, after the kernel files at PYTEST_N with TCACHE=1 on the same machine (run 115: 248
# passed in 127 s with run 114's kernels built). TEST_TIMEOUT: the tests' limit in s (400).
# WARM=N builds the kernels stage's kernels in N processes first (bench_moe_decode.py --warm).
# LLAMA=0: no llama.cpp build (the matrix stage then runs Strata's side alone). LLAMA_PACK=1: the
# built binaries come back as $OUT/llama-bin.txz.* (15 MB parts, with ggml-python's wheel in
# results.tgz), for a later call to carry as .lbin/ (and .whl/) instead of building again; where
# the parts and the tree pass a call's size, carry some parts in one call (STAGES=none) and the
# rest in the next while the machine is warm (kept in /tmp/lbin there).
# TUNING: strata.kernels.tuning's switches and tiles for every stage (tests and benchmarks), as
# STRATA_TUNING, e.g. TUNING="ROUTE_SORT_MIN_EXPERTS=1,NORM_ROUTE_MAX_EXPERTS=256,SHARED_X8=True";
# with RETEST_DEFAULTS=1 the tests that failed under it run again without it (RETEST_TIMEOUT s).
# BENCH_THREADS: the CPU pool's --threads in strata bench / bench-spec / serve (the cores less one:
# the engine's own choice counts this script's background builds as busy cores).
# Carried in .whl/: the gguf wheel, the uvicorn and starlette wheels (strata serve; the GPU
# machine has neither), and ggml-python's sdist (built here for the CPU miss path, in the
# background while the tests run).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
STAGES=${STAGES:-"tests profile decode prompt check"}
BUDGETS=${BUDGETS:-"2,10,40"}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p $TRITON_CACHE_DIR
for c in .tcache/*.tgz; do [[ -f $c ]] && tar xzf "$c" -C $TRITON_CACHE_DIR; done
touch /tmp/tcache.mark  # (what is newer than this was built here)
# everything but machine.txt goes back in one archive (a run returns a few files at most)
pack() { (cd "$OUT" && ls | grep -vx -e machine.txt -e results.tgz -e 'llama-bin\.txz\..*' >/tmp/packed \
  && tar czf results.tgz -T /tmp/packed && xargs rm -f </tmp/packed)
  [[ -n ${TCACHE:-} ]] && (cd $TRITON_CACHE_DIR && find . -mindepth 1 -maxdepth 1 -newer \
    /tmp/tcache.mark | tar czf "$OUT/tcache.tgz" -T -); }
trap pack EXIT
export PYTHONUNBUFFERED=1
[[ -n ${TUNING:-} ]] && export STRATA_TUNING=$TUNING
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  .whl/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit ${STRATA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  [[ -n ${STRATA_TUNING:-} ]] && echo "STRATA_TUNING $STRATA_TUNING"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  lscpu | grep -E "^Model name|^CPU\(s\)"; free -g | head -2
} 2>&1 | tee "$OUT/machine.txt"
# (a wheel an earlier call built, LLAMA_PACK=1, carried in .whl/, was installed above)
if ls .whl/ggml_python-*.tar.gz >/dev/null 2>&1 && ! ls .whl/ggml_python-*.whl >/dev/null 2>&1 \
    && which gcc g++ >/dev/null; then
  ( t0=$(date +%s)
    ls /tmp/ggwhl/*.whl >/dev/null 2>&1 || CMAKE_BUILD_PARALLEL_LEVEL=16 nice -n 10 timeout 400 python3 -m pip wheel -q --no-deps \
      --no-build-isolation --no-index -w /tmp/ggwhl .whl/ggml_python-*.tar.gz >/tmp/ggml.log 2>&1 \
      && python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/ggwhl/*.whl
    echo "ggml-python built in $(( $(date +%s) - t0 )) s" >>/tmp/ggml.log
    [[ -n ${LLAMA_PACK:-} ]] && cp /tmp/ggwhl/*.whl "$OUT/" 2>/dev/null ) &
  GGML_PID=$!
fi
export PYTHONPATH="$PWD:$PYTHONPATH"
LB=$PWD/.llama-build  # llama.cpp's CUDA build (llamacpp stage), kept while the machine stays warm
# a build an earlier call packed (LLAMA_PACK=1: $OUT/llama-bin.txz.*, carried back as .lbin/).
# The parts (~41 MiB) and the tree (~30 MiB) pass a call's 64 MiB together: carry some parts in
# one call and the rest in the next on the same warm machine; each call keeps what it brought
# in /tmp/lbin, and the build is unpacked once every part is there
if ls .lbin/llama-bin.txz.* >/dev/null 2>&1; then mkdir -p /tmp/lbin && cp .lbin/llama-bin.txz.* /tmp/lbin/; fi
if ls /tmp/lbin/llama-bin.txz.* >/dev/null 2>&1 && [[ ! -x $LB/bin/llama-bench ]]; then
  mkdir -p "$LB"
  if cat /tmp/lbin/llama-bin.txz.* | tar xJf - -C "$LB" 2>/dev/null; then
    echo "llama.cpp: the carried build ($(cat "$LB/SOURCE.txt" 2>/dev/null))"
  else  # (a part still to come: nothing half unpacked is left to run)
    rm -rf "$LB/bin"; echo "llama.cpp: parts carried so far: $(cd /tmp/lbin && echo llama-bin.txz.*)"
  fi
fi
# (for llama.cpp's programs alone: ggml-python loading this build's libggml-cpu.so aborts)
LLENV=(env "LD_LIBRARY_PATH=$LB/bin:$LB/cublas-lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
if [[ ${LLAMA:-1} != 0 && $STAGES =~ llamacpp|matrix|llamabuild &&
      ! ( -x $LB/bin/test-backend-ops && -x $LB/bin/llama-bench ) ]]; then
  if [[ -f .whl/llama.cpp-src.tgz ]]; then
    # (scripts/build_llama_cpp.sh: a build cut short goes on in the next call)
    nice -n 10 bash scripts/build_llama_cpp.sh .whl/llama.cpp-src.tgz "$LB" >/tmp/llama-build.log 2>&1 &
    LLAMA_PID=$!
  else
    echo "llamacpp: no .whl/llama.cpp-src.tgz (scripts/pack_llama_cpp.sh makes it)"
  fi
fi
QUANT=${QUANT:-Q4_K_M}  # the synthetic model's recipe (strata synth --quant)
PRESET=${PRESET:-30b-a3b}  # any strata synth preset: qwen3.6-35b-a3b, gpt-oss-20b, glm-4.5-air, ...
LAYERS=${LAYERS:-}  # strata synth --layers N (a real shape's widths with fewer layers)
M=/tmp/$PRESET${LAYERS:+-${LAYERS}l}-$QUANT.gguf
if [[ ! -f $M || -n ${RESYNTH:-} ]] && [[ $STAGES == *decode* || $STAGES == *prompt* ||
      $STAGES == *check* || $STAGES == *profile* || $STAGES == *streaming* ||
      $STAGES == *share* || $STAGES == *prefetch* || $STAGES == *llamacpp* ||
      $STAGES == *ttft* || $STAGES == *matrix* || $STAGES == *serve* ||
      $STAGES == *compare* || " $STAGES " == *" spec "* ]]; then
  ( t0=$(date +%s); timeout ${SYNTH_TIMEOUT:-500} python3 -m strata synth $M --preset $PRESET ${LAYERS:+--layers $LAYERS} --quant $QUANT --force \
      >/tmp/synth.log 2>&1; echo "synth took $(( $(date +%s) - t0 )) s" >>/tmp/synth.log ) &
  SYNTH_PID=$!
fi
for spec in ${SYNTH_MORE:-}; do  # preset[:quant] each: synthesized beside M, for a later call
  p=${spec%%:*}; q=$QUANT; [[ $spec == *:* ]] && q=${spec##*:}
  [[ -f /tmp/$p-$q.gguf ]] && continue
  ( t0=$(date +%s); nice -n 10 timeout ${SYNTH_TIMEOUT:-500} python3 -m strata synth /tmp/$p-$q.gguf --preset $p --quant $q \
      --force >/tmp/synth-$p.log 2>&1; echo "synth $p $q took $(( $(date +%s) - t0 )) s" >>/tmp/synth-$p.log ) &
  MORE_PIDS+=" $!"
done
if [[ $STAGES == *tests* ]]; then
  echo "== CUDA tests: decode step, decode ops, MoE kernels, grouped prompt MoE, ring, offload, prompt"
  # (in N processes each gets its share of torch's threads; -v names each test as it ends, so
  # a run cut by the timeout, or whose workers hang at teardown, still says what failed: the
  # summary at the end never printed in one such run)
  tenv=(); [[ -n ${PYTEST_N:-} ]] && tenv=(OMP_NUM_THREADS=$(( ($(nproc) + PYTEST_N - 1) / PYTEST_N )))
  pytest=(python3 -m pytest -v -p no:cacheprovider -m cuda ${PYTEST_N:+-n $PYTEST_N} -rfE)
  env "${tenv[@]}" timeout -s INT -k 30 ${TEST_TIMEOUT:-400} "${pytest[@]}" \
    --junitxml="$OUT/junit.xml" --durations=15 ${TESTS:-tests/test_decode_ops.py \
    tests/test_decode_step.py tests/test_moe_grouped.py tests/test_offload.py \
    tests/test_prompt.py tests/test_ring.py tests/test_kernels_gpu.py::test_moe_forward \
    tests/test_kernels_gpu.py::test_misses_gathered_from_mapped_host_records \
    tests/test_cpu_share.py tests/test_prefetch.py tests/test_gemv_q8.py tests/test_lend.py \
    tests/test_kv_q8.py tests/test_spec.py tests/test_arch_qwen35.py tests/test_arch_gpt_oss.py \
    tests/test_moe_mmq.py tests/test_batch_server.py \
    tests/test_arch_glm4moe.py tests/test_arch_deepseek2.py tests/test_reference.py \
    tests/test_batched_step.py tests/test_paged_attention.py tests/test_latent_ops.py \
    tests/test_constrain.py tests/test_chunk_graph.py tests/test_dense_draft.py \
    tests/test_window_graph.py \
    tests/test_cli.py::test_generate_on_a_named_cuda_device} \
    2>&1 \
    | tee "$OUT/pytest.txt" | grep -E "passed|failed|Error|FAIL" | tail -25
  # each failed test's name from -v's lines, whether or not pytest's summary printed
  grep -oE "(FAILED|ERROR) tests/[^ ]+" "$OUT/pytest.txt" | sort -u >"$OUT/failed.txt"
  [[ -s $OUT/failed.txt ]] && { echo "failed or in error ($(wc -l <"$OUT/failed.txt")):"; cat "$OUT/failed.txt"; }
  if [[ -n ${STRATA_TUNING:-} && -n ${RETEST_DEFAULTS:-} && -s $OUT/failed.txt ]]; then
    # (RETEST_DEFAULTS=1: whether a failure is TUNING's or the tree's, in the same call)
    echo "== the failed tests again without STRATA_TUNING"
    # shellcheck disable=SC2046  # (one test id a word)
    env -u STRATA_TUNING "${tenv[@]}" timeout -s INT -k 30 ${RETEST_TIMEOUT:-120} "${pytest[@]}" \
      $(sed 's/^[A-Z]* //' "$OUT/failed.txt") 2>&1 \
      | tee "$OUT/pytest_defaults.txt" | grep -oE "(PASSED|FAILED|ERROR) tests/[^ ]+" | sort -u
  fi
fi
[[ -n ${SYNTH_PID:-} ]] && { wait $SYNTH_PID; tail -2 /tmp/synth.log; }
[[ -n ${GGML_PID:-} ]] && { wait $GGML_PID; tail -1 /tmp/ggml.log;
  python3 -c 'import ggml; print("ggml importable")' 2>&1 | tail -1; }
# the CPU pool's threads in the timed runs: the engine's own choice leaves out the cores the load
# average says are busy, and a llama.cpp build or a synth beside a run (this script starts both
# in the background) once left it one thread (bench/2026-12-06-h100-mmq-compare.md)
THREADS=(--threads "${BENCH_THREADS:-$(( $(nproc) - 1 ))}")
bench() {  # name, then strata bench arguments
  local name=$1; shift
  timeout 300 python3 -m strata bench $M --device cuda "${THREADS[@]}" "$@" --json "$OUT/$name.json" 2>&1 \
    | grep -vE "^strata:  +(dense|KV|workspace|staging|cache slots|host arena|left)" \
    | tee "$OUT/$name.txt"
}
if [[ $STAGES == *kernels* ]]; then
  echo "== decode kernels: MoE layer and GEMV launch choices"
  timeout 420 python3 scripts/bench_moe_decode.py --json "$OUT/decode_kernels.json" \
    ${WARM:+--warm $WARM} ${KERNEL_ARGS:-} 2>&1 | tee "$OUT/decode_kernels.txt" | tail -120
fi
if [[ $STAGES == *route* ]]; then  # the fused norm + router + top-k by the rank step's width
  echo "== decode routing: norm_route at 128 and 256 experts, by BLOCK_J"
  timeout 200 python3 scripts/bench_norm_route.py --json "$OUT/norm_route.json" 2>&1 | tail -20
fi
if [[ $STAGES == *dense* ]]; then  # a batched step's dense matmuls by path and rows
  echo "== dense matmuls at 1-16 tokens: FMA GEMV, tl.dot split and unsplit, MMQ"
  timeout 300 python3 scripts/bench_kernels.py --dense-batch --out "$OUT/dense_batch.json" \
    ${DENSE_ARGS:-} 2>&1 | tee "$OUT/dense_batch.txt" | tail -45
fi
if [[ $STAGES == *grouped* ]]; then  # the prompt MoE layer's two paths by token count
  echo "== prompt MoE layer, 30B-A3B: grouped (bf16 + grouped GEMM) against tl.dot, by tokens"
  timeout 500 python3 scripts/bench_kernels.py --moe-prompt-only --workers "$(nproc)" \
    --out "$OUT/moe_prompt.json" ${GROUPED_ARGS:-} 2>&1 | tee "$OUT/moe_prompt.txt" | tail -40
fi
if [[ $STAGES == *ncu* ]]; then  # hardware counters of the one-token GEMVs (where ncu can read them)
  echo "== Nsight Compute: the one-token GEMVs, 14336 x 4096 Q4_K and Q6_K, FMA and dp4a"
  NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
  if [[ -n $NCU ]]; then
    timeout 300 "$NCU" --clock-control none -k ${NCU_KERNELS:-regex:gemv} -c 24 --section SpeedOfLight \
      --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
      --section LaunchStats --section SchedulerStats ${NCU_EXTRA:-} python3 scripts/gemv_once.py \
      ${GEMV_ONCE_ARGS:---q8 --rows 2,1024,1,2} \
      >"$OUT/ncu_gemv.txt" 2>&1
    grep -E "^  [_a-z].*\(|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|ERR|rror" \
      "$OUT/ncu_gemv.txt" | head -80
  else
    echo "ncu not found"
  fi
fi
if [[ $STAGES == *overlap* ]]; then
  echo "== a gather from the mapped arena beside compute on another stream"
  timeout 120 python3 scripts/bench_gather_overlap.py --json "$OUT/gather_overlap.json" 2>&1 | tail -8
fi
if [[ $STAGES == *attention* ]]; then
  echo "== decode attention: split kernel variants by shape, cache type, tokens and length"
  timeout 300 python3 scripts/bench_attention.py --json "$OUT/attention.json" ${ATTN_ARGS:-} \
    2>&1 | tee "$OUT/attention.txt" | tail -80
  echo "== MLA decode attention: the split kernel (exact, tf32) against the torch form"
  timeout 200 python3 scripts/bench_attention.py --mla --json "$OUT/attention_mla.json" \
    ${MLA_ARGS:-} 2>&1 | tee "$OUT/attention_mla.txt" | tail -40
fi
if [[ $STAGES == *mapped* ]]; then
  echo "== decode MoE layer reading experts from the mapped host arena"
  timeout 200 python3 scripts/bench_mapped.py --json "$OUT/mapped.json" 2>&1 | tail -20
fi
if [[ $STAGES == *profile* ]]; then
  for spec in ${PROFILE_BUDGETS:-40 10}; do  # budget, or budget:flags (--prefetch=2,--cpu-share=1)
    b=${spec%%:*}; flags=(); [[ $spec == *:* ]] && IFS=, read -ra flags <<<"${spec#*:}"
    name=${spec//[:,=-]/_}
    echo "== decode profile at --vram-budget $b ${flags[*]}"
    timeout 240 python3 scripts/profile_decode.py $M --vram-budget $b "${flags[@]}" \
      --json "$OUT/profile_$name.json" ${PROFILE_TRACE:+--trace "$OUT/trace_$name.json"} \
      2>&1 | grep -v "^strata:  " | head -60
  done
fi
if [[ $STAGES == *streaming* ]]; then
  echo "== copy engine and compute while an 8K prompt streams every expert (6 GiB, no cache)"
  timeout 200 python3 scripts/profile_prompt.py $M --vram-budget 6 --expert-cache 0 \
    --prompt-len 8192 --json "$OUT/streaming.json" 2>&1 | grep -v "^strata:  " | tail -3
  if [[ -n ${HOST_ROUTING:-} ]]; then  # the same with the routing read on the host per layer
    timeout 200 python3 scripts/profile_prompt.py $M --vram-budget 6 --expert-cache 0 \
      --prompt-len 8192 --host-routing --json "$OUT/streaming_host.json" 2>&1 \
      | grep -v "^strata:  " | tail -3
  fi
fi
if [[ $STAGES == *ttft* ]]; then  # where a short prompt's time goes, every expert resident
  for n in ${TTFT_LEN:-128 512}; do
    echo "== a $n-token prompt at 40 GiB: wall time, kernels busy, the longest ops"
    timeout 200 python3 scripts/profile_prompt.py $M --vram-budget 40 --prompt-len $n --top 20 \
      --json "$OUT/ttft_$n.json" 2>&1 | grep -v "^strata:  " | tail -22
  done
fi
if [[ " $STAGES " == *" spec "* ]]; then  # verify windows of a forced acceptance against plain decode
  # SPEC_VARIANTS: flag sets run in turn at each budget, separated by ";" (e.g. ";--prefetch 0":
  # the default, then without the windows' prefetch)
  IFS=';' read -ra variants <<<"${SPEC_VARIANTS:-}"; [[ ${#variants[@]} -eq 0 ]] && variants=("")
  for b in ${SPEC_BUDGETS:-4}; do
    v=0
    for extra in "${variants[@]}"; do
      v=$((v + 1))
      echo "== bench-spec at $b GiB: --spec ${SPEC_T:-4}, accepted a window ${SPEC_ACCEPT:-3,0} $extra"
      # shellcheck disable=SC2086  # (the variant's flags split into words)
      timeout 400 python3 -m strata bench-spec $M --vram-budget $b --spec ${SPEC_T:-4} \
        "${THREADS[@]}" --accept ${SPEC_ACCEPT:-3,0} -n 64 -r 3 --json "$OUT/spec_${b}_$v.json" \
        ${SPEC_FLAGS:-} $extra 2>&1 | grep -v "^strata:  " | tail -8
    done
  done
fi
if [[ $STAGES == *decode* ]]; then
  echo "== decode, VRAM sweep $BUDGETS"
  bench decode --sweep-vram "$BUDGETS" --prompt-len 128 --gen-len 64 --runs 2 \
    --plot "$OUT/sweep.png" ${DECODE_FLAGS:-}
fi
if [[ $STAGES == *cpu* ]]; then  # the CPU share's one-token call, by threads and OpenMP's wait
  for pol in ${CPU_POLICIES:-default ACTIVE PASSIVE}; do
    echo "== the CPU share's call (one token, 1-2 experts), OMP_WAIT_POLICY $pol"
    ( [[ $pol != default ]] && export OMP_WAIT_POLICY=$pol
      timeout 200 python3 scripts/bench_cpu_experts.py --share --threads ${CPU_THREADS:-1,2,4,8,15} \
        ${CPU_ARGS:-} --json "$OUT/cpu_share_call_$pol.json" 2>&1 | grep "^share call" )
  done
fi
if [[ $STAGES == *share* ]]; then  # both links at SHARE_BUDGET (2) GiB: the CPU takes a token's last N misses
  for pool in ${SHARE_POOLS:-graph}; do  # STRATA_CPU_SHARE_POOL: graph, token
   for spec in ${SHARES:-1 2 3}; do  # N (0: off, the baseline), or N:T for T threads in the CPU pool
    n=${spec%%:*}; thr=(); [[ $spec == *:* ]] && thr=(--threads "${spec##*:}")
    echo "== decode at --vram-budget ${SHARE_BUDGET:-2} with --cpu-share $n ${thr[*]} ($pool pool)"
    ( [[ -n ${SHARE_ENV:-} ]] && export ${SHARE_ENV}
      export STRATA_CPU_SHARE_POOL=$pool
      bench "share_${pool}_${spec/:/_t}" --vram-budget "${SHARE_BUDGET:-2}" --prompt-len 128 --gen-len 64 \
        --runs 2 --cpu-share "$n" "${thr[@]}" ${SHARE_FLAGS:-} )
   done
  done
fi
if [[ $STAGES == *prefetch* ]]; then  # the next layer's likely experts copied ahead, at 2 GiB
  for spec in ${PREFETCHES:-0 1 2 4}; do  # N, or N:S with --cpu-share S too
    n=${spec%%:*}; share=(); [[ $spec == *:* ]] && share=(--cpu-share "${spec##*:}")
    echo "== decode at --vram-budget 2 with --prefetch $n ${share[*]}"
    bench "prefetch_${spec/:/_s}" --vram-budget 2 --prompt-len 128 --gen-len 64 --runs 2 \
      --prefetch "$n" "${share[@]}"
  done
fi
if [[ $STAGES == *prompt* ]]; then
  # budget[:expert cache]: 40 = all resident; 10; 6:0 = every expert streamed from host RAM
  for spec in ${PROMPT_BUDGETS:-40 6:0}; do
    b=${spec%%:*}; cache=auto; [[ $spec == *:* ]] && cache=${spec##*:}
    for n in ${PROMPT_LEN:-8192}; do
      echo "== prompt $n tokens at --vram-budget $b --expert-cache $cache"
      bench "prompt_${n}_${b}_$cache" --vram-budget $b --expert-cache $cache --ctx $n \
        --prompt-len $n --gen-len 0 --runs 1 ${PROMPT_FLAGS:-}
    done
  done
fi
if [[ $STAGES =~ llamacpp|matrix|llamabuild && -n ${LLAMA_PID:-} ]]; then
  wait $LLAMA_PID; tail -1 /tmp/llama-build.log; cp /tmp/llama-build.log "$OUT/llamacpp_build.txt"
fi
if [[ -n ${LLAMA_PACK:-} && -x $LB/bin/llama-bench ]]; then
  # the binaries and their libraries, in parts a call can bring back (16 MiB a file), for a
  # later call to carry as .lbin/ instead of building again (~9 minutes)
  cp "$LB/llama.cpp/SOURCE.txt" "$LB/SOURCE.txt" 2>/dev/null
  (cd "$LB" && strip bin/llama-bench bin/test-backend-ops bin/*.so* 2>/dev/null;
   tar cf - bin/llama-bench bin/test-backend-ops bin/*.so* SOURCE.txt $(ls -d cublas-lib 2>/dev/null) \
     | xz -T0 -6 | split -b 15M -d - "$OUT/llama-bin.txz.")
  ls -l "$OUT"/llama-bin.txz.*
fi
if [[ $STAGES == *llamacpp* && -x $LB/bin/test-backend-ops ]]; then
  # llama.cpp on the same GPU: test-backend-ops times each op over the same weights again and
  # again (so a matrix that fits the 60 MB L2 is read from there: an upper bound on its speed
  # from HBM); the one-token GEMV on 4096 x 14336 and the 30B-A3B expert matrices (MUL_MAT_ID,
  # 128 experts, 8 used, 768 x 2048), then llama-bench on the synthetic model, all layers on the
  # GPU and with the experts on the CPU (-ot exps=CPU, llama.cpp's way to run a MoE model larger
  # than the GPU)
  echo "== llama.cpp: $(cat "$LB/llama.cpp/SOURCE.txt")"
  types=${LLAMA_TYPES:-"iq2_xs|iq3_xxs|q4_K|q6_K|q8_0"}
  "${LLENV[@]}" "$LB/bin/test-backend-ops" perf -b CUDA0 -o MUL_MAT \
    -p "type_a=($types),type_b=f32,m=4096,n=1,k=14336," 2>&1 | tee "$OUT/llamacpp_mul_mat.txt" \
    | grep -E "MUL_MAT|us/run" | tail -12
  "${LLENV[@]}" "$LB/bin/test-backend-ops" perf -b CUDA0 -o MUL_MAT_ID \
    -p "type_a=($types),type_b=f32,n_mats=128,n_used=8,b=[^,]*,m=768,n=1,k=2048," 2>&1 \
    | tee "$OUT/llamacpp_mul_mat_id.txt" | grep -E "MUL_MAT|us/run" | tail -12
fi
if [[ $STAGES == *llamacpp* && -x $LB/bin/llama-bench ]]; then
  for ot in "" "exps=CPU"; do
    echo "== llama-bench $QUANT ${ot:+-ot $ot}"
    timeout 300 "${LLENV[@]}" "$LB/bin/llama-bench" -m $M -ngl 99 -fa 1 -p "${LLAMA_PROMPTS:-512}" -n 128 -r 3 \
      ${ot:+-ot "$ot"} ${LLAMA_BENCH_FLAGS:-} 2>&1 | tee -a "$OUT/llama_bench.txt" | grep -E "^\|" | tail -8
  done
fi
if [[ $STAGES == *matrix* ]]; then
  # llama-bench's matrix from both engines on the same file at the same VRAM, in this call:
  # Strata at --vram-budget B, llama.cpp (-fa 1) with -ncmoe chosen to fit B (estimated, then
  # raised once when nvidia-smi's peak passes B); each side's peak from nvidia-smi samples
  P=${MATRIX_P:-128,512,2048,8192}; D=${MATRIX_D:-0,4096,16384,32768}; NG=${MATRIX_N:-64}
  ctx=$(( $(tr , '\n' <<<"$P" | sort -n | tail -1) + $(tr , '\n' <<<"$D" | sort -n | tail -1) + NG ))
  smi() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$1" & }
  for b in ${MATRIX_BUDGETS:-2 4 10 all}; do
    flags=(); [[ $b != all ]] && flags=(--vram-budget "$b")
    echo "== matrix at ${b} GiB: strata bench -p $P -n $NG -d $D"
    smi "$OUT/smi_strata_$b.txt"; SMI=$!
    timeout 540 python3 -m strata bench $M --device cuda "${THREADS[@]}" -p "$P" -n "$NG" -d "$D" -r 3 \
      --ctx "$ctx" "${flags[@]}" ${MATRIX_FLAGS:-} --json "$OUT/matrix_strata_$b.json" \
      >"$OUT/matrix_strata_$b.log" 2>&1
    grep -E "^\|" "$OUT/matrix_strata_$b.log" | tee "$OUT/matrix_strata_$b.txt"
    [[ -f $OUT/matrix_strata_$b.json ]] || { echo "strata bench failed:"; tail -25 "$OUT/matrix_strata_$b.log"; }
    kill $SMI; sp=$(python3 scripts/llama_side_by_side.py peak "$OUT/smi_strata_$b.txt")
    echo "Strata's VRAM peak (nvidia-smi): $sp MiB"
    if [[ -x $LB/bin/llama-bench ]]; then
      n=0; over=0
      for try in 1 2; do
        [[ $b != all ]] && n=$(python3 scripts/llama_side_by_side.py ncmoe $M --budget "$b" \
          --ctx "$ctx" --over "$over")
        echo "== matrix at ${b} GiB: llama-bench -fa 1 -ncmoe $n"
        smi "$OUT/smi_llama_$b.txt"; SMI=$!
        timeout 540 "${LLENV[@]}" "$LB/bin/llama-bench" -m $M -ngl 99 -fa 1 -ncmoe "$n" -p "$P" -n "$NG" \
          -d "$D" -r 3 -o json >"$OUT/matrix_llama_$b.json" 2>"$OUT/matrix_llama_$b.err"
        kill $SMI; lp=$(python3 scripts/llama_side_by_side.py peak "$OUT/smi_llama_$b.txt")
        [[ $b == all ]] && break
        over=$(python3 -c "print(max(0, $lp - $b * 1024))")
        python3 -c "import sys; sys.exit($lp <= $b * 1024)" || break
        echo "llama.cpp peaked at $lp MiB, over $b GiB: again with more experts on the CPU"
      done
      [[ -f $OUT/matrix_strata_$b.json ]] && python3 scripts/llama_side_by_side.py table "$OUT/matrix_strata_$b.json" \
        "$OUT/matrix_llama_$b.json" --label "$QUANT at $b GiB" --strata-peak "$sp" \
        --llama-peak "$lp" ${n:+--ncmoe $n} | tee -a "$OUT/matrix.md"
    fi
  done
fi
if [[ $STAGES == *serve* ]]; then
  # strata serve with SERVE_CLIENTS concurrent clients (strata bench-serve) at each budget
  for b in ${SERVE_BUDGETS:-10 all}; do
    flags=(); [[ $b != all ]] && flags=(--vram-budget "$b")
    echo "== serve at ${b} GiB: bench-serve -c ${SERVE_CLIENTS:-1,4,8,16}"
    python3 -m strata serve $M --device cuda --port 18080 --batch 16 --queue 256 "${THREADS[@]}" "${flags[@]}" \
      ${SERVE_FLAGS:-} >"$OUT/serve_$b.log" 2>&1 &
    SRV=$!
    for _ in $(seq 240); do  # (a server that died at start is said at once, not waited for)
      curl -sf localhost:18080/health >/dev/null && break
      kill -0 $SRV 2>/dev/null || { echo "serve at ${b} GiB exited:"; tail -3 "$OUT/serve_$b.log"; break; }
      sleep 1
    done
    timeout 500 python3 -m strata bench-serve --url http://127.0.0.1:18080 \
      -c "${SERVE_CLIENTS:-1,4,8,16}" --prompt-len "${SERVE_PROMPT:-128}" \
      --output-len "${SERVE_OUTPUT:-64}" --json "$OUT/serve_$b.json" 2>&1 | tee "$OUT/serve_$b.txt"
    if [[ -n ${SPY:-} ]] && command -v py-spy >/dev/null; then
      # where the engine process's time goes while serving 1 and SPY_CLIENTS clients: py-spy's
      # stacks (raw, one line a stack with its sample count; --gil: only what holds the GIL too)
      ENG=$(pgrep -P $SRV -f spawn_main | head -1)  # (not the resource tracker)
      for c in 1 ${SPY_CLIENTS:-8}; do
        curl -s localhost:18080/metrics | grep -E "^strata_forward_(passes|seconds)_total" \
          >"$OUT/spy_${b}_c${c}_metrics_before.txt"
        py-spy record --pid "$ENG" --idle -r 250 -d "${SPY_S:-12}" -f raw --threads \
          -o "$OUT/spy_${b}_c$c.txt" >"$OUT/spy_${b}_c$c.log" 2>&1 &
        SP=$!
        timeout 120 python3 -m strata bench-serve --url http://127.0.0.1:18080 -c $c \
          --prompt-len "${SERVE_PROMPT:-128}" --output-len 256 --requests $(( c * 3 )) \
          >"$OUT/spy_${b}_c${c}_serve.txt" 2>&1
        wait $SP; tail -1 "$OUT/spy_${b}_c$c.log"
        # the engine's own step time (sampling included) against the ITL the clients saw
        curl -s localhost:18080/metrics | grep -E "^strata_forward_(passes|seconds)_total" \
          | paste "$OUT/spy_${b}_c${c}_metrics_before.txt" - | awk '{d[NR]=$4-$2} END {
          printf "engine steps %d, %.2f ms a step\n", d[1], 1000*d[2]/d[1]}'
        grep -E "^\| [0-9]" "$OUT/spy_${b}_c${c}_serve.txt"
      done
    fi
    kill $SRV; wait $SRV 2>/dev/null
  done
fi
for pid in ${MORE_PIDS:-}; do wait $pid; done
for spec in ${SYNTH_MORE:-}; do tail -1 /tmp/synth-${spec%%:*}.log 2>/dev/null; done
if [[ $STAGES == *compare* ]]; then
  # an older tree beside this one on the same file, in turn (COMPARE_TREE: its strata/ and
  # pyproject.toml, e.g. `git archive 35815b5 strata pyproject.toml | tar -x -C .old`, carried);
  # each of COMPARE_SPECS is budget:prompt:gen (budget "all": no --vram-budget; OLD/NEW, e.g.
  # 10/10.6, gives each side its own: the old plan left the CUDA context out of its budget, so
  # the same device memory needs a larger budget on this side);
  # COMPARE_NEW_FLAGS goes to this tree's side only (e.g. "--decode-input greedy": an older
  # tree without that flag decoded each step's argmax)
  for spec in ${COMPARE_SPECS:-2:512:64 10:512:64 all:512:64 all:8192:0 6:8192:0}; do
    IFS=: read -r b np ng <<<"$spec"
    b_old=${b%%/*}; b_new=${b##*/}
    # COMPARE_ORDER: the sides in turn, e.g. "old new new old" (drift on the machine between
    # runs then falls on both); each run writes its own JSON (…_<side>_<spec>_<i>.json)
    i=0
    for side in ${COMPARE_ORDER:-old new}; do
      i=$((i + 1))
      # (this tree's --kv-type auto keeps f16 on CUDA; the older tree's cache is f32)
      dir=$PWD; extra=(--kv-type f32 ${COMPARE_NEW_FLAGS:-}); bs=$b_new
      [[ $side == old ]] && { dir=$(cd "${COMPARE_TREE:-.old}" && pwd); extra=(); bs=$b_old; }
      flags=(); [[ $bs != all ]] && flags=(--vram-budget "$bs")
      echo "== compare ($side tree): --vram-budget $bs --prompt-len $np --gen-len $ng"
      run=compare_${side}_${bs}_${np}_${ng}_$i
      nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 \
        >"$OUT/smi_$run.txt" &
      SMI=$!
      (cd "$dir" && PYTHONPATH="$dir:/tmp/site" timeout 300 python3 -m strata bench $M \
        --device cuda "${flags[@]}" --prompt-len "$np" --gen-len "$ng" --runs 2 \
        "${extra[@]}" --json "$OUT/$run.json" 2>&1 | grep -E "tok/s|VRAM|hit|^\| " | tail -6)
      kill $SMI
      echo "nvidia-smi peak: $(python3 scripts/llama_side_by_side.py peak "$OUT/smi_$run.txt") MiB"
    done
  done
fi
if [[ $STAGES == *demospec* ]]; then
  # #29 on the trained demo model (strata/demo): n-gram windows on a code and a prose prompt,
  # greedy and sampled (T 0.7, seeds 1-3), each without then with --spec 4, DEMOSPEC_N tokens
  # (each prompt first run unrecorded, greedy with windows, as long as the recorded runs: the
  # machine's first generate builds the kernels, the windows' sizes among them; a 32-token one
  # left some sizes' builds to the first recorded run)
  for text in "def fibonacci(n):" "The old lighthouse keeper climbed"; do
    python3 -m strata generate --device cuda --prompt "$text" -n "${DEMOSPEC_N:-256}" --spec 4 \
      --draft ngram >/dev/null 2>&1
  done
  for p in code prose; do
    text="def fibonacci(n):"; [[ $p == prose ]] && text="The old lighthouse keeper climbed"
    for ts in 0:1 0.7:1 0.7:2 0.7:3; do
      for flags in "" "--spec 4 --draft ngram"; do
        echo "== demo model, $p prompt, temperature ${ts%%:*} seed ${ts##*:}, ${flags:-no spec}" \
          | tee -a "$OUT/demospec.txt"
        timeout 120 python3 -m strata generate --device cuda --prompt "$text" \
          -n "${DEMOSPEC_N:-256}" --temperature "${ts%%:*}" --seed "${ts##*:}" --stats $flags 2>&1 \
          | grep -E "^strata: (loaded|spec:)|^prompt graphs|^decode step" | tee -a "$OUT/demospec.txt"
      done
    done
  done
fi
if [[ $STAGES == *check* ]]; then  # float32-exact kernels on both sides: KL < 1e-4 expected
  for b in ${CHECK_BUDGETS:-2 10}; do
    echo "== check: everything on the device against the offload runtime at $b GiB (--kernels exact)"
    timeout 200 python3 -m strata check $M --a "--device cuda --offload off --kernels exact" \
      --b "--device cuda --vram-budget $b --kernels exact ${CHECK_FLAGS:-}" --prompt-len 48 \
      --decode 16 2>&1 | tee "$OUT/check_$b.txt" | tail -3
  done
fi
