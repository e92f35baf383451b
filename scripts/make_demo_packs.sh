#!/usr/bin/env bash
# The demo model's community-style packs, made by llama.cpp's own tools
# (scripts/build_llama_tools.sh) from the F32 export (scripts/export_demo_gguf.py):
# an importance matrix from llama-imatrix over calibration text, then llama-quantize.
#   bash scripts/make_demo_packs.sh out/demo/strata-demo-F32.gguf out/corpus/calibration.txt
set -euo pipefail
f32=${1:?"usage: scripts/make_demo_packs.sh MODEL-F32.gguf CALIBRATION.txt"}
cal=${2:?"usage: scripts/make_demo_packs.sh MODEL-F32.gguf CALIBRATION.txt"}
bin=${LLAMA_BIN:-.llama-build/cpu/bin}
dir=$(dirname "$f32")
base=$(basename "$f32" -F32.gguf)
threads=${THREADS:-$(nproc)}
"$bin/llama-imatrix" -m "$f32" -f "$cal" -o "$dir/$base.imatrix.gguf" -c 512 --chunks "${CHUNKS:-200}" \
  -t "$threads" --no-ppl 2>&1 | grep -E "compute_imatrix|save|chunks" || true
for q in ${TYPES:-Q8_0 Q4_K_M IQ3_XXS IQ2_XS}; do
  "$bin/llama-quantize" --imatrix "$dir/$base.imatrix.gguf" "$f32" "$dir/$base-$q.gguf" "$q" "$threads" \
    2>&1 | grep -E "model size|quant size|fallback" || true
done
ls -l "$dir"/"$base"-*.gguf
