#!/usr/bin/env bash
# Speculative decoding on an H200: what verifying k = 1..4 drafts costs against a plain decode step,
# at B = 1, 8 and 32, for one model (random bf16 weights at a real shape, made here first).
# Run from the repository root on the GPU machine: `OUT=dir PRESET=qwen3-8b bash scripts/verify_cost_h200.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} JTP_COMPILATION_CACHE="" NCCL_NVLS_ENABLE=0
OUT=${OUT:-out}
PRESET=${PRESET:-qwen3-8b}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu-$PRESET.txt" 2>&1 || true
python3 scripts/make_random_checkpoint.py --preset "$PRESET" --out "/tmp/ck/$PRESET" --generator jax > "$OUT/checkpoint-$PRESET.log" 2>&1
timeout "${SECONDS_LIMIT:-480}" python3 scripts/verify_cost.py --model "/tmp/ck/$PRESET" --batch-sizes 1,8,32 \
  --drafts 1,2,3,4 --context 1024 --steps 16 --warmup-steps 3 \
  --json "$OUT/verify-$PRESET.json" --markdown "$OUT/verify-$PRESET.md" > "$OUT/verify-$PRESET.log" 2>&1
echo "exit $?" >> "$OUT/verify-$PRESET.log"
