#!/usr/bin/env bash
# The MoE results in docs/bench/h200-moe.md, on random weights at real shapes (nothing is downloaded).
# Run from the repository root on the GPU machine: `OUT=dir bash scripts/moe_h200.sh kernel|qwen3-30b-a3b|...`.
# kernel: the grouped-matmul kernel vs lax.ragged_dot per projection and per MoE layer, with a tile sweep.
# any other argument: that MoE preset, all layers, through scripts/bench.py (decode B=1, 8, 64; prefill 2048).
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out}
mkdir -p "$OUT"
case "${1:-kernel}" in
kernel)
  python3 scripts/moe_kernel_bench.py --preset qwen3-30b-a3b --tokens 1,8,64,2048 --sweep \
    --json "$OUT/kernel-qwen3-30b-a3b.json" 2> "$OUT/kernel-sweep.log"
  python3 scripts/moe_kernel_bench.py --preset qwen3.5-35b-a3b --tokens 1,64,2048 --json "$OUT/kernel-qwen3.5-35b-a3b.json"
  ;;
*)
  # config.json only: the weights are drawn on the GPUs (--load-format dummy), so qwen3-next-80b-a3b
  # (160 GB) needs no disk, only two GPUs: BENCH_ARGS="--tp 2" (and --enable-expert-parallel for EP).
  python3 scripts/make_random_checkpoint.py --preset "$1" --out "/tmp/$1" --config-only
  python3 scripts/bench.py --model "/tmp/$1" --load-format dummy --batch-sizes 1,8,64 --context 1024 \
    --prefill-len 2048 --max-seconds 300 --json "$OUT/$1.json" --markdown "$OUT/$1.md" ${BENCH_ARGS:-}
  ;;
esac
