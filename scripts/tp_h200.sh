#!/usr/bin/env bash
# Issue 15 on 4 or 8 H200s (nvidia-h200-x4 / -x8), random weights at real shapes, nothing downloaded.
# Run from the repository root on the GPU machine: `OUT=dir TPS="1 2 4 8" bash scripts/tp_h200.sh STAGE...`
#   check     scripts/gpu_check.py: float32 greedy tokens at tp=4,8 == tp=1 (dense and hybrid) and the
#             compiled decode step's collectives counted; float32 / bf16 logprobs against transformers
#   scaling   scripts/bench.py at each tp in $TPS for Qwen3-8B and Qwen3-32B (decode B=1, 64; prefill),
#             then scripts/tp_scaling.py: speed-up and efficiency per doubling (--load-format dummy:
#             the weights are drawn on the GPUs, so no 64 GB checkpoint is written first)
#   235b      Qwen3-235B-A22B (~470 GB bf16: more than two H200s and than the disk) at the largest tp in
#             $TPS, tensor- then expert-parallel experts: decode B=1, 64, prefill, time to ready
#   launcher  one process per GPU (tests/staggered.py, float32, exact dots) against one process
# Keep NVLink multicast off: the machine sets NCCL_NVLS_ENABLE=0; do not override it.
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}
TPS=${TPS:-1 2 4 8}
MAX_TP=$(echo $TPS | tr ' ' '\n' | sort -n | tail -1)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" || true
bench=(--batch-sizes 1,64 --context 1024 --prefill-len 2048 --num-scheduler-steps 8 --max-seconds 240)
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(check scaling 235b launcher)
for stage in "${stages[@]}"; do
case "$stage" in
check)
  tps=$(echo $TPS | tr ' ' '\n' | awk '$1 > 2' | paste -sd, -)
  python3 scripts/gpu_check.py --out "$OUT/check" --tp "${tps:-$MAX_TP}" --presets qwen3-0.6b,qwen3.5-0.8b \
    --checkpoints /tmp/gpu_check > "$OUT/check.log" 2>&1 || true
  tail -12 "$OUT/check.log"
  ;;
scaling)
  for preset in qwen3-8b qwen3-32b; do
    python3 scripts/make_random_checkpoint.py --preset $preset --out /tmp/$preset --config-only > /dev/null
    for tp in $TPS; do
      python3 scripts/bench.py --model /tmp/$preset --load-format dummy --tp $tp "${bench[@]}" \
        --json "$OUT/$preset-tp$tp.json" --markdown "$OUT/$preset-tp$tp.md" > "$OUT/$preset-tp$tp.log" 2>&1 \
        || tail -20 "$OUT/$preset-tp$tp.log"
    done
    python3 scripts/tp_scaling.py "$OUT"/$preset-tp*.json --markdown "$OUT/$preset-scaling.md" --json "$OUT/$preset-scaling.json"
  done
  ;;
235b)
  python3 scripts/make_random_checkpoint.py --preset qwen3-235b-a22b --out /tmp/q235 --config-only > /dev/null
  # Time to ready: weights drawn on the GPUs, then the first request (which compiles its shapes;
  # warming up every bucket of a 94-layer model is left out here), cold and warm compilation cache.
  python3 scripts/startup_time.py --model /tmp/q235 --load-format dummy --tensor-parallel-size $MAX_TP \
    --dtype bfloat16 --no-warmup > "$OUT/qwen3-235b-a22b-ready.json" 2> "$OUT/qwen3-235b-a22b-ready.log" || true
  for ep in "" --enable-expert-parallel; do
    tag=tp$MAX_TP${ep:+-ep}
    python3 scripts/bench.py --model /tmp/q235 --load-format dummy --tp $MAX_TP $ep "${bench[@]}" \
      --json "$OUT/qwen3-235b-a22b-$tag.json" --markdown "$OUT/qwen3-235b-a22b-$tag.md" \
      > "$OUT/qwen3-235b-a22b-$tag.log" 2>&1 || tail -20 "$OUT/qwen3-235b-a22b-$tag.log"
  done
  ;;
launcher)
  python3 scripts/make_random_checkpoint.py --preset qwen3-0.6b --out /tmp/q06 --config-only > /dev/null
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" JAX_DEFAULT_MATMUL_PRECISION=highest
  args='"model": "/tmp/q06", "load_format": "dummy", "dtype": "float32", "tensor_parallel_size": '$MAX_TP
  python3 tests/staggered.py "{$args}" > "$OUT/launcher-1proc.json" 2> "$OUT/launcher-1proc.log"
  python3 tests/staggered.py "{$args, \"num_processes\": $MAX_TP}" > "$OUT/launcher-${MAX_TP}proc.json" \
    2> "$OUT/launcher-${MAX_TP}proc.log"
  if cmp -s <(tail -1 "$OUT/launcher-1proc.json") <(tail -1 "$OUT/launcher-${MAX_TP}proc.json"); then
    echo "launcher: $MAX_TP processes x 1 GPU give one process's greedy tokens" | tee "$OUT/launcher.txt"
  else
    echo "launcher: DIFFERENT tokens" | tee "$OUT/launcher.txt"
  fi
  unset XLA_FLAGS JAX_DEFAULT_MATMUL_PRECISION
  ;;
*) echo "unknown stage $stage (check, scaling, 235b, launcher)" >&2; exit 2 ;;
esac
done
