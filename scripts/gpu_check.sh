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
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nproc; free -g | head -2
} 2>&1 | tee "$OUT/machine.txt"
echo "== ceilings"
python3 -m strata.bench.ceilings | tee "$OUT/ceilings.json"
echo "== GPU tests (pytest -m cuda) and the reference tests on the CPU of this machine"
python3 -m pytest -q -p no:cacheprovider tests/test_quant.py tests/test_reference.py 2>&1 \
  | tee "$OUT/pytest.txt" | tail -15
echo "== strata logits --device cuda against transformers"
python3 scripts/reference_check.py --device cuda --out "$OUT/reference_check.json" \
  2>&1 | tee "$OUT/reference_check.txt"
