#!/usr/bin/env bash
# Run on the GPU machine, from the repo root: sets up, runs the GPU tests and the reference checks
# with --device cuda, measures the machine's ceilings, and writes everything under $OUT.
#   bash scripts/gpu_check.sh            (OUT defaults to ./out)
# Needs python3 with torch (CUDA), transformers, tokenizers, jinja2, numpy. Wheels of anything
# missing (gguf) may be put in .whl/; they are installed into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit ${STRATA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nproc; free -g | head -2
} 2>&1 | tee "$OUT/machine.txt"
echo "== ceilings"
python3 -m strata.bench.ceilings | tee "$OUT/ceilings.json"
echo "== GPU tests (pytest -m cuda) and the reference tests on the CPU of this machine"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_quant.py tests/test_reference.py \
  tests/test_offload.py tests/test_gguf_errors.py 2>&1 \
  | tee "$OUT/pytest.txt" | tail -15
echo "== strata logits --device cuda against transformers"
timeout 300 python3 scripts/reference_check.py --device cuda --out "$OUT/reference_check.json" \
  2>&1 | tee "$OUT/reference_check.txt"
echo "== decode speed, Qwen3-30B-A3B widths cut to 8 layers, Q4_K_M"
M=/tmp/q30-8l.gguf
timeout 200 python3 -m strata synth $M --preset 30b-a3b --layers 8 --quant Q4_K_M --force 2>&1 | tail -2
for flags in "--offload off" "--vram-budget 4" "--vram-budget 2 --miss cpu" \
             "--vram-budget 2 --miss dma" "--vram-budget 2"; do
  echo "-- $flags"
  timeout 120 python3 -m strata generate $M --device cuda $flags -n 48 --temperature 0 \
    --prompt "The history of the world" --stats 2>&1 >/dev/null | grep -E "loaded|hit rate|cache slots|miss links"
done 2>&1 | tee "$OUT/decode_speed.txt"
