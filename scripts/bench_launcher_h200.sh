#!/usr/bin/env bash
# The launcher on two H200s (nvidia-h200-x2), random Qwen3-8B weights at the real shapes.
# Run from the repository root on the GPU machine: `OUT=dir bash scripts/bench_launcher_h200.sh`.
#  1. parity: tests/staggered.py (a staggered batch through the engine's real step), float32, greedy:
#     2 processes x 1 GPU at tp=2 through the launcher against one process at tp=2.
#  2. speed: scripts/bench.py decode (B = 1, 8, 64) and prefill, bf16, one process at tp=2 and then
#     2 processes x 1 GPU through the launcher (each alone on the machine).
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}  # appended: tools may sit in /tmp/site
export JTP_COMPILATION_CACHE=""
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" || true
[ -d /tmp/q8 ] || python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/q8 --generator jax

common=(--model /tmp/q8 --tp 2 --batch-sizes 1,8,64 --context 1024 --prefill-len 2048 --max-seconds 150)
for stage in "${@:-all}"; do
case "$stage" in
all|parity|parity-exact)
  # parity: XLA's defaults (float32 dots in TF32, GEMM algorithms autotuned per process).
  # parity-exact: full float32 dots and no autotuning, so both runs compile the same arithmetic.
  tag=$stage; [ "$stage" = all ] && tag=parity
  if [ "$tag" = parity-exact ]; then
    export XLA_FLAGS="--xla_gpu_autotune_level=0" JAX_DEFAULT_MATMUL_PRECISION=highest
  fi
  python3 tests/staggered.py '{"model": "/tmp/q8", "tensor_parallel_size": 2, "dtype": "float32"}' \
    > "$OUT/$tag-1proc.json" 2> "$OUT/$tag-1proc.log"
  python3 tests/staggered.py '{"model": "/tmp/q8", "tensor_parallel_size": 2, "dtype": "float32", "num_processes": 2}' \
    > "$OUT/$tag-2proc.json" 2> "$OUT/$tag-2proc.log"
  if cmp -s <(tail -1 "$OUT/$tag-1proc.json") <(tail -1 "$OUT/$tag-2proc.json"); then
    echo "$tag: identical greedy tokens" | tee "$OUT/$tag.txt"
  else
    echo "$tag: DIFFERENT tokens" | tee "$OUT/$tag.txt"
  fi
  unset XLA_FLAGS JAX_DEFAULT_MATMUL_PRECISION
  ;;&
all|speed|speed1)
  python3 scripts/bench.py "${common[@]}" --json "$OUT/tp2-1proc.json" --markdown "$OUT/tp2-1proc.md" \
    > "$OUT/tp2-1proc.log" 2>&1 || tail -20 "$OUT/tp2-1proc.log"
  ;;&
all|speed|speed2)
  python3 scripts/bench.py "${common[@]}" --num-processes 2 --json "$OUT/tp2-2proc.json" \
    --markdown "$OUT/tp2-2proc.md" > "$OUT/tp2-2proc.log" 2>&1 || tail -20 "$OUT/tp2-2proc.log"
  ;;
esac
done
