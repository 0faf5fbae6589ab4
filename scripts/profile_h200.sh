#!/usr/bin/env bash
# Where a decode step's time goes on one H200 (docs/bench/h200-profile.md): scripts/profile_step.py
# on random weights at the real shapes (bf16, nothing downloaded).
# Run from the repository root on the GPU machine: `OUT=dir bash scripts/profile_h200.sh`.
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} JTP_COMPILATION_CACHE=""
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 scripts/make_random_checkpoint.py --preset qwen3-0.6b --out /tmp/q06 --generator jax > /dev/null
python3 scripts/profile_step.py --model /tmp/q06 --batch 1 --out /tmp/prof-q06-b1 \
  --json "$OUT/qwen3-0.6b-b1.json" --markdown "$OUT/qwen3-0.6b-b1.md" > /dev/null 2> "$OUT/qwen3-0.6b-b1.log"
python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/q8 --generator jax > /dev/null
for B in 1 64; do
  python3 scripts/profile_step.py --model /tmp/q8 --batch $B --out /tmp/prof-q8-b$B \
    --json "$OUT/qwen3-8b-b$B.json" --markdown "$OUT/qwen3-8b-b$B.md" > /dev/null 2> "$OUT/qwen3-8b-b$B.log"
done
python3 scripts/make_random_checkpoint.py --preset qwen3.5-9b --out /tmp/h9 --generator jax > /dev/null
python3 scripts/profile_step.py --model /tmp/h9 --batch 1 --out /tmp/prof-h9-b1 \
  --json "$OUT/qwen3.5-9b-b1.json" --markdown "$OUT/qwen3.5-9b-b1.md" > /dev/null 2> "$OUT/qwen3.5-9b-b1.log"
