#!/usr/bin/env bash
# Run on the GPU machine, from the repo root: the offload tests on CUDA, then the decode and prompt
# benchmarks on a synthetic Qwen3-30B-A3B Q4_K_M, then a correctness check of the fast paths on
# those shapes; results under $OUT. Steps are ordered by priority, each with its own time limit.
#   bash scripts/gpu_bench.sh            (OUT defaults to ./out)
# Carried in .whl/: the gguf wheel, and ggml-python's sdist (built here for the CPU miss path).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
  .whl/*.whl && export PYTHONPATH=/tmp/site
if ls .whl/ggml_python-*.tar.gz >/dev/null 2>&1 && which gcc g++ >/dev/null; then
  t0=$(date +%s)
  CMAKE_BUILD_PARALLEL_LEVEL=16 timeout 120 python3 -m pip wheel -q --no-deps \
    --no-build-isolation --no-index -w /tmp/ggwhl .whl/ggml_python-*.tar.gz >/dev/null 2>&1 \
    && python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/ggwhl/*.whl
  echo "== ggml-python: $(python3 -c 'import ggml; print("built")' 2>&1 | tail -1) in $(( $(date +%s) - t0 )) s"
fi
export PYTHONPATH="$PWD:$PYTHONPATH"
echo "== offload and prompt tests on CUDA (fused kernels in the hit path)"
timeout 150 python3 -m pytest -q -p no:cacheprovider -k cuda tests/test_offload.py \
  tests/test_prompt.py 2>&1 | tee "$OUT/pytest.txt" | tail -4
M=/tmp/q30.gguf
t0=$(date +%s)
timeout 150 python3 -m strata synth $M --preset 30b-a3b --quant Q4_K_M --force 2>&1 | tail -2
echo "== synth took $(( $(date +%s) - t0 )) s"
echo "== decode, VRAM sweep"
timeout 200 python3 -m strata bench $M --device cuda --sweep-vram 2,10,40 --prompt-len 128 \
  --gen-len 32 --runs 1 --json "$OUT/decode.json" --plot "$OUT/sweep.png" 2>&1 \
  | grep -v "^strata:  " | tee "$OUT/decode.txt"
for b in 40 2; do
  echo "== prompt 8192 tokens at --vram-budget $b"
  timeout 100 python3 -m strata bench $M --device cuda --vram-budget $b --ctx 8192 \
    --prompt-len 8192 --gen-len 0 --runs 1 --json "$OUT/prompt_$b.json" 2>&1 \
    | grep -v "^strata:  " | tee "$OUT/prompt_$b.txt"
done
echo "== check: reference path against the offload runtime at 10 GiB"
timeout 100 python3 -m strata check $M --a "--device cuda --offload off" \
  --b "--device cuda --vram-budget 10" --prompt-len 32 2>&1 | tee "$OUT/check.txt" | tail -4
