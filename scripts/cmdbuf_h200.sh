#!/usr/bin/env bash
# The jitted step's host cost against XLA's command-buffer (CUDA graph) settings, on one H200:
# scripts/profile_step.py per model and XLA_FLAGS variant (random bf16 weights drawn on the GPU).
# Run from the repository root on the GPU machine: `OUT=dir bash scripts/cmdbuf_h200.sh`;
# MODELS="preset:batch ...", ORDER="variant[+sync] ..." (+sync: profile_step.py --sync).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. JTP_COMPILATION_CACHE=""
OUT=${OUT:-out}
mkdir -p "$OUT"
declare -A VARIANTS=(
  [default]=""
  [skip_temp]="--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
  [skip_profiled]="--xla_gpu_command_buffer_update_mode=SKIP_PROFILED"
  [cc_skip_profiled]="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION --xla_gpu_graph_min_graph_size=1 --xla_gpu_command_buffer_update_mode=SKIP_PROFILED"
)
for spec in ${MODELS:-qwen3-0.6b:1 qwen3-8b:64}; do
  preset=${spec%%:*} batch=${spec#*:}
  python3 scripts/make_random_checkpoint.py --preset "$preset" --out "/tmp/$preset" --config-only > /dev/null
  for v in ${ORDER:-default skip_temp skip_profiled cc_skip_profiled}; do
    sync=${v#*+}; v=${v%+*}; [ "$sync" = sync ] || sync=""
    name="$preset-b$batch-$v${sync:+-sync}"
    start=$(date +%s)
    XLA_FLAGS="${VARIANTS[$v]}" timeout ${RUN_SECONDS:-150} python3 scripts/profile_step.py --model "/tmp/$preset" \
      --load-format dummy --batch "$batch" --steps ${STEPS:-12} --top 40 ${sync:+--sync} --out "/tmp/prof-$name" \
      --json "$OUT/$name.json" --markdown "$OUT/$name.md" > "$OUT/$name.log" 2>&1 || echo "exit $?" >> "$OUT/$name.log"
    echo "$name $(( $(date +%s) - start )) s $(grep -o '"tokens_sha256": "[0-9a-f]*"' "$OUT/$name.json" 2>/dev/null)" >> "$OUT/times.txt"
  done
done
