#!/usr/bin/env bash
# The demo model on a CUDA machine: expert-cache hit rate and decode speed by policy and cache
# size while it generates from real prompts (its own text: sampled, seed 1), and the
# teacher-forced sweep of scripts/cache_sweep.py on held-out text (on the host's cores).
#   OUT=out/demo-sweep bash scripts/gpu_demo_sweep.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/demo-sweep}
mkdir -p "$OUT"
PY=${PY:-python3}
M=${MODEL:-strata/demo/strata-demo-Q4_K_M.gguf}
export PYTHONUNBUFFERED=1
( $PY scripts/cache_sweep.py "$M" --text "${HELDOUT:-out/devtrain/heldout.txt}" \
    --profile-text "${PROFILE_TEXT:-out/devtrain/profile.txt}" --slots ${SWEEP_SLOTS:-10,20,40,60} \
    --docs ${DOCS:-16} --tokens ${TOKENS:-256} --json "$OUT/cache_sweep.json" \
    > "$OUT/cache_sweep.txt" 2>&1 ) &
sweep=$!
$PY -m strata profile "$M" --device cuda --prompts "${PROFILE_TEXT:-out/devtrain/profile.txt}" \
  --out /tmp/demo.profile.json 2>&1 | tail -1
prompts=("The command line" "To configure the network interface, edit" "def read_config(path):"
         "The Linux kernel schedules")
for slots in ${SLOTS:-10 20 40 60}; do
  for policy in lru lfu profile; do
    for p in "${prompts[@]:0:${NPROMPTS:-4}}"; do
      $PY -m strata generate "$M" --device cuda --expert-cache "$slots" --cache-policy $policy \
        --expert-profile /tmp/demo.profile.json --prompt "$p" -n ${GEN:-200} --seed 1 --stats \
        2>&1 >/dev/null | grep -E "hit rate|generated" | sed "s/^/$slots $policy: /"
    done
  done
done 2>&1 | tee "$OUT/generate.txt"
wait $sweep
cat "$OUT/cache_sweep.txt" | tail -8
