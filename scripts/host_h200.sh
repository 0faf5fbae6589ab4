#!/usr/bin/env bash
# Host work per decode step on one H200 (issue 23's targets), on random weights drawn on the GPU
# (--load-format dummy: config.json only, nothing downloaded or written but the config).
# Run from the repository root on the GPU machine: `OUT=dir bash scripts/host_h200.sh [TREE]`,
# TREE a checkout of the code to measure (default: this one), so two versions run on one machine.
set -uo pipefail
TREE=${1:-.}
export PYTHONUNBUFFERED=1 PYTHONPATH=$TREE JTP_COMPILATION_CACHE=""
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
for spec in ${PRESETS:-qwen3-0.6b:1,64 qwen3-8b:1,8,64 qwen3.5-9b:1,64 qwen3-30b-a3b:1,64}; do
  preset=${spec%%:*} batches=${spec#*:}
  python3 "$TREE/scripts/make_random_checkpoint.py" --preset "$preset" --out "/tmp/$preset" --config-only > /dev/null
  timeout ${BENCH_SECONDS:-170} python3 "$TREE/scripts/bench.py" --model "/tmp/$preset" --load-format dummy \
    --batch-sizes "$batches" --context 1024 --prefill-len 2048 --prefill-runs 1 --prefill-requests 2 \
    --max-seconds 150 --json "$OUT/$preset.json" --markdown "$OUT/$preset.md" > "$OUT/$preset.log" 2>&1 \
    || echo "exit $?" >> "$OUT/$preset.log"
done
