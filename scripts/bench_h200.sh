#!/usr/bin/env bash
# The H200 results in docs/bench/h200.md, on random weights at real shapes (nothing is downloaded).
# Run from the repository root on the GPU machine: `OUT=dir bash scripts/bench_h200.sh part1|part2`.
# part1: attention kernel check + Qwen3-8B (with HF transformers eager on the same weights).
# part2: a Qwen3.5 hybrid shape, Qwen3-0.6B (with HF), cold vs warm start.
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out}
mkdir -p "$OUT"
case "${1:-part1}" in
part1)
  python3 scripts/attention_check.py --quick --json "$OUT/attention-check.json" --max-seconds 60
  python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/q8 --generator jax
  python3 scripts/bench.py --model /tmp/q8 --batch-sizes 1,8,64,256 --context 1024 --prefill-len 2048 \
    --hf --hf-timeout 150 --max-seconds 330 --json "$OUT/qwen3-8b.json" --markdown "$OUT/qwen3-8b.md"
  ;;
part2)
  python3 scripts/make_random_checkpoint.py --preset qwen3.5-9b --out /tmp/h9 --generator jax
  python3 scripts/bench.py --model /tmp/h9 --batch-sizes 1,8,64 --context 1024 --prefill-len 2048 \
    --max-seconds 170 --json "$OUT/qwen3.5-9b.json" --markdown "$OUT/qwen3.5-9b.md"
  python3 scripts/make_random_checkpoint.py --preset qwen3-0.6b --out /tmp/q06 --generator jax
  python3 scripts/bench.py --model /tmp/q06 --batch-sizes 1,8,64,256 --context 1024 --prefill-len 2048 \
    --hf --hf-timeout 90 --max-seconds 150 --json "$OUT/qwen3-0.6b.json" --markdown "$OUT/qwen3-0.6b.md"
  python3 scripts/startup_time.py --model /tmp/q06 --dtype bfloat16 --no-warmup > "$OUT/startup-qwen3-0.6b.json"
  ;;
esac
