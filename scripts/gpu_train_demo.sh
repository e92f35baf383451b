#!/usr/bin/env bash
# Train the demo model on a CUDA machine in one call (scripts/train_demo_model.py).
# Needs out/devtrain/{train.txt.xz,heldout.txt.xz,tokenizer.json} (scripts/build_demo_corpus.py,
# then `train_demo_model.py tokenizer`, then xz). Writes the log and the packed bf16 weights to
# $DEST (default out/demo-run); the checkpoint stays in .train/run, so a second call with a
# larger STOP resumes on the same schedule.
#   BUDGET=7.5 STOP=7.5 DEST=$OUT bash scripts/gpu_train_demo.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BUDGET=${BUDGET:-7.5}  # minutes of training in the whole schedule
STOP=${STOP:-$BUDGET}  # minutes of training in this call
DEST=${DEST:-out/demo-run}
PY=${PY:-python3}
mkdir -p .train/corpus "$DEST"
for f in train heldout; do
  [ -s .train/corpus/$f.txt ] || xz -dc out/devtrain/$f.txt.xz > .train/corpus/$f.txt
done
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader || true
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=true
$PY scripts/train_demo_model.py train --corpus .train/corpus --tokenizer out/devtrain/tokenizer.json \
  --out .train/run --budget-minutes "$BUDGET" --stop-minutes "$STOP" 2>&1 | tee "$DEST/train.log"
cp .train/run/log.jsonl "$DEST/"
$PY scripts/train_demo_model.py pack --out .train/run --dest "$DEST/w"
