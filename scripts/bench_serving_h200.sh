#!/usr/bin/env bash
# The serving results in docs/bench/h200-serving.md: `jtp serve` with Qwen3-8B random weights (bf16,
# real shapes, nothing downloaded) on one H200, loaded through the OpenAI API by
# scripts/bench_serving.py at concurrency 1, 8 and 64, 1024 prompt / 128 output tokens.
# Run from the repository root on the GPU machine: `OUT=dir bash scripts/bench_serving_h200.sh`.
# SERVE_ARGS adds `jtp serve` options (e.g. "--num-scheduler-steps 8"); LEVELS picks the concurrencies.
#
# The server starts with --no-warmup (warming every step shape of an 8B model takes minutes); each
# concurrency level first runs the same load untimed twice (other prompts of the same lengths), so the
# timed pass meets (almost) no compile and no cached prefix. Needs starlette, uvicorn and pydantic
# (with pydantic-core, annotated-types, typing-inspection) installed or carried as wheels.
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}
PORT=8011
mkdir -p "$OUT"
python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/q8 --generator jax
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" || true
python3 -m jtp.entrypoints.cli serve --model /tmp/q8 --served-model-name qwen3-8b-random --dtype bfloat16 \
  --max-num-seqs 64 --max-num-batched-tokens 2048 --max-model-len 2048 --port $PORT --no-warmup ${SERVE_ARGS:-} \
  > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for i in $(seq 600); do  # wait for readiness, not past the server's death
  kill -0 $server 2>/dev/null || { echo "the server exited:"; tail -20 "$OUT/server.log"; exit 1; }
  curl -sf http://127.0.0.1:$PORT/ready > /dev/null && break
  sleep 1
done
for c in ${LEVELS:-1 8 64}; do
  n=$(( c == 1 ? 16 : c * 4 ))
  common=(--base-url http://127.0.0.1:$PORT --input-len 1024 --output-len 128 --max-concurrency $c --vocab-size 150000)
  # untimed, twice: compiles the shapes (one pass can miss a chunk length the timed pass meets; the bench
  # counts and names any compile inside the timed pass); other prompts (seeds), so it meets no cached prefix
  for seed in 1 2; do python3 scripts/bench_serving.py "${common[@]}" --num-prompts $n --seed $seed > /dev/null; done
  python3 scripts/bench_serving.py "${common[@]}" --num-prompts $n --json-out "$OUT/serving-c$c.json" | tee "$OUT/serving-c$c.txt"
done
curl -s http://127.0.0.1:$PORT/metrics > "$OUT/metrics.txt" || true
