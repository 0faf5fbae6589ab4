#!/usr/bin/env bash
# Issue 50's GPU figures at DEFAULT flags (docs/bench/gpu-defaults.md): `jtp serve --model DIR
# --load-format dummy` and nothing else, Qwen3-8B shapes, random bf16 weights drawn on the GPU.
#   1. a cold start (empty compilation cache) timed to /ready, its start-up lines kept;
#   2. scripts/bench_serving.py at 128/1024 c=1, 128/1024 c=64 and 1024/128 c=64, no untimed pass,
#      with jtp:compilations read at /ready and after the last load (NO_BENCH=1 skips it);
#   3. a warm start (the same cache: every program from jtp's executable store), then one with the
#      store emptied (XLA's cache answers, the store is written again) and one more from the store;
#      each start answers the same greedy completion, compared with the cold start's;
#   4. Qwen3-30B-A3B bf16 cold to /ready (its KV pool line kept);
#   5. COLD_STARTS more cold starts of Qwen3-8B, each with an empty cache.
# Run from the repository root on the GPU machine: `OUT=dir WHEELS=.whl bash scripts/defaults_gpu.sh`.
set -uo pipefail
server=
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out}
PORT=8011
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl > /dev/null 2>&1; export PYTHONPATH=.:/tmp/site; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
for preset in qwen3-8b qwen3-30b-a3b; do
  python3 scripts/make_random_checkpoint.py --preset "$preset" --out "/tmp/$preset" --config-only > /dev/null
done
export JTP_COMPILATION_CACHE=/tmp/jtp-cache
rm -rf "$JTP_COMPILATION_CACHE"

compilations() { curl -s http://127.0.0.1:$PORT/metrics | awk '/^jtp:compilations_total/ {s += $2} END {print s + 0}'; }
greedy() {  # 24 greedy tokens after a fixed token prompt
  curl -s http://127.0.0.1:$PORT/v1/completions -H 'Content-Type: application/json' \
    -d '{"prompt": [9707, 11, 1879, 13, 576, 3974, 13876, 38835], "max_tokens": 24, "temperature": 0}' |
    python3 -c "import json, sys; print(json.dumps(json.load(sys.stdin)['choices'][0]['text']))"
}
serve_until_ready() {  # $1: label, $2: model dir, $3: log file; notes seconds to /ready, leaves $server running
  local t0=$(date +%s.%N)
  python3 -m jtp.entrypoints.cli serve --model "$2" --load-format dummy --port $PORT > "$3" 2>&1 &
  server=$!
  for i in $(seq 3000); do
    kill -0 $server 2>/dev/null || { echo "$1 exited: $(tail -3 "$3")" | tee -a "$OUT/times.txt"; return 1; }
    curl -sf http://127.0.0.1:$PORT/ready > /dev/null && break
    sleep 0.1
  done
  local ready=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")
  echo "$1 ready_s $ready compilations $(compilations) greedy $(greedy)" | tee -a "$OUT/times.txt"
  grep "warm-up: [0-9]" "$3" | tail -1 >> "$OUT/times.txt"
}
stop() { kill -TERM $server 2>/dev/null; wait $server 2>/dev/null; }
trap 'kill $server 2>/dev/null || true' EXIT
bench() {  # name input output concurrency prompts
  python3 scripts/bench_serving.py --base-url http://127.0.0.1:$PORT --input-len $2 --output-len $3 \
    --max-concurrency $4 --num-prompts $5 --vocab-size 150000 --seed 7 --json-out "$OUT/$1.json" > "$OUT/$1.txt" 2>&1
  echo "$1 rc $? compilations $(compilations)" | tee -a "$OUT/times.txt"
}

serve_until_ready qwen3-8b-cold /tmp/qwen3-8b "$OUT/serve-8b-cold.log"
if [ -z "${NO_BENCH:-}" ]; then
  bench c1-128-1024 128 1024 1 4
  bench c64-128-1024 128 1024 64 128
  bench c64-1024-128 1024 128 64 256
fi
stop
serve_until_ready qwen3-8b-warm /tmp/qwen3-8b "$OUT/serve-8b-warm.log"; stop
rm -rf "$JTP_COMPILATION_CACHE/jtp-executables"
serve_until_ready qwen3-8b-warm-xla-cache /tmp/qwen3-8b "$OUT/serve-8b-warm-xla.log"; stop
serve_until_ready qwen3-8b-warm-again /tmp/qwen3-8b "$OUT/serve-8b-warm-again.log"; stop
serve_until_ready qwen3-30b-a3b-cold /tmp/qwen3-30b-a3b "$OUT/serve-30b-cold.log"; stop
for n in $(seq ${COLD_STARTS:-0}); do
  rm -rf "$JTP_COMPILATION_CACHE"
  serve_until_ready qwen3-8b-cold-$n /tmp/qwen3-8b "$OUT/serve-8b-cold-$n.log"; stop
done
cd "$OUT" && tar czf logs.tgz *.log *.txt *.json 2>/dev/null; rm -f *.log *.json c*.txt
