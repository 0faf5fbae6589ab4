#!/usr/bin/env bash
# GPU speed II on an H200 machine, one call: multi-step decode's effect on the host-bound case
# (Qwen3-0.6B; B = 1 and 64), one dispatch per decode step (--num-scheduler-steps 1) against four
# (the default), then scripts/gpu_check.py on the Qwen3 and Qwen3.5 families at real shapes (float32
# and bfloat16 logprobs vs transformers on the same GPU; tp=2 == tp=1 when two GPUs are there).
# Run from the repository root on the GPU machine: `OUT=dir bash scripts/gpu_speed_h200.sh`.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} JTP_COMPILATION_CACHE="" NCCL_NVLS_ENABLE=0
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1 || true
TP=$(python3 -c 'import jax; print(min(2, jax.device_count()))')
python3 scripts/make_random_checkpoint.py --preset qwen3-0.6b --out /tmp/ck/qwen3-0.6b --generator jax > "$OUT/checkpoint.log" 2>&1
for k in 1 4; do
  timeout 75 python3 scripts/bench.py --model /tmp/ck/qwen3-0.6b --batch-sizes 1,64 --context 256 --prefill-len 512 \
    --decode-steps 24 --num-scheduler-steps $k --max-seconds 60 --json "$OUT/bench-qwen3-0.6b-k$k.json" \
    --markdown "$OUT/bench-qwen3-0.6b-k$k.md" > "$OUT/bench-qwen3-0.6b-k$k.log" 2>&1 || echo "exit $?" >> "$OUT/bench-qwen3-0.6b-k$k.log"
done
timeout ${GPU_CHECK_SECONDS:-150} python3 scripts/gpu_check.py --out "$OUT" --tp $TP --checkpoints /tmp/ck \
  --tokens 16 --prompt-lengths 5,37,130 > "$OUT/gpu_check.log" 2>&1
echo "gpu_check exit $?" >> "$OUT/gpu_check.log"
