#!/usr/bin/env bash
# Prefix caching on one H200: time to first token of each turn of multi-turn chats, with
# `jtp serve --enable-prefix-caching` against `--no-enable-prefix-caching`, for Qwen3-8B and the
# Qwen3.5-9B hybrid (random weights at the real shapes, bf16, nothing downloaded).
# Run from the repository root on the GPU machine: `OUT=dir bash scripts/bench_prefix_h200.sh`.
#
# Shapes, each 3 conversations one at a time (concurrency 1, so TTFT is the prefill alone):
#   prefix-<model>-<on|off>        5 turns of 1500-token user turns, 32-token answers: turn 5
#                                  resends ~6k tokens of history plus 1.5k new ones (~7.7k).
#   prefix-short-<model>-<on|off>  a 7500-token first turn, then a 64-token follow-up: the cached
#                                  follow-up prefills ~0.1k tokens where the uncached one prefills
#                                  ~7.6k. (In the 5-turn shape a cached turn still prefills its
#                                  1.5k new tokens, which bounds its TTFT ratio near 7.7k/1.5k ~ 5.)
# Prompts are `--words placeholder` (t<id> words: one distinct token each for the placeholder
# tokenizer of make_random_checkpoint.py, which reads every English word as the same token, so
# English prompts would all share one prefix), and the untimed warm pass of each shape uses
# another seed, so the timed pass compiles (almost) nothing and finds none of its prompts cached.
# Each server runs alone, stopped (kill, wait) before the next starts.
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}  # appended: tools may sit in /tmp/site
OUT=${OUT:-out}
PORT=8012
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" || true

server=
stop_server() {
  if [ -n "$server" ]; then kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true; fi
  server=
}
trap stop_server EXIT

start_server() {  # model dir, served name, on|off, log file
  local flag=--enable-prefix-caching
  [ "$3" = on ] || flag=--no-enable-prefix-caching
  # The hybrid's DeltaNet prefill pads every row of a step to the longest (rows are tied to the
  # token bucket): at 16 rows x 2048 tokens its temporaries outgrow what a 0.9 KV pool leaves
  # (17.7 GiB, out of memory). Concurrency 1 needs few rows; smaller pool leaves headroom.
  local rows=16 mem=0.9
  case "$2" in qwen3.5*) rows=4 mem=0.75 ;; esac
  python3 -m jtp.entrypoints.cli serve --model "$1" --served-model-name "$2" --dtype bfloat16 $flag \
    --max-model-len 16384 --max-num-batched-tokens 2048 --max-num-seqs $rows --gpu-memory-utilization $mem \
    --port $PORT --no-warmup \
    > "$4" 2>&1 &
  server=$!
  for i in $(seq 600); do  # wait for readiness, not past the server's death
    kill -0 $server 2>/dev/null || { echo "the server exited:"; tail -20 "$4"; server=; return 1; }
    curl -sf http://127.0.0.1:$PORT/ready > /dev/null && return 0
    sleep 1
  done
  echo "the server was not ready after 600 s"; return 1
}

bench() {  # name, then bench_serving.py arguments: an untimed warm pass (seed 1), then the timed one
  local name=$1; shift
  local common=(--base-url http://127.0.0.1:$PORT --endpoint /v1/chat/completions --max-concurrency 1
                --num-prompts 3 --output-len 32 --words placeholder --vocab-size 150000 "$@")
  python3 scripts/bench_serving.py "${common[@]}" --seed 1 > /dev/null || echo "warm pass of $name failed"
  python3 scripts/bench_serving.py "${common[@]}" --json-out "$OUT/$name.json" | tee "$OUT/$name.txt" \
    || echo "timed pass of $name failed"
}

for model in ${MODELS:-qwen3-8b qwen3.5-9b}; do  # MODELS=qwen3-8b: one model per call
  dir=/tmp/ckpt-$model
  [ -f $dir/config.json ] || python3 scripts/make_random_checkpoint.py --preset $model --out $dir --generator jax
  for cache in on off; do
    echo "=== $model, prefix caching $cache"
    if start_server $dir $model-random $cache "$OUT/server-$model-$cache.log"; then
      bench prefix-$model-$cache --multi-turn 5 --input-len 1500
      bench prefix-short-$model-$cache --multi-turn 2 --input-len 7500 --follow-up-len 64
    fi
    stop_server
  done
done

# The comparison: per model and shape, TTFT of turn 1 (nothing to reuse: on ~ off) and of the last
# turn, cache off against on, and the share of prompt tokens the server reports as cached.
python3 - "$OUT" <<'EOF' | tee "$OUT/prefix-summary.txt"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
print(f"{'model / shape':<26}{'turn':>5}{'ctx tok':>9}{'off ms':>10}{'on ms':>10}{'off/on':>8}{'cached':>8}")
for model in ("qwen3-8b", "qwen3.5-9b"):
    for shape in ("prefix", "prefix-short"):
        runs = {}
        for cache in ("on", "off"):
            path = out / f"{shape}-{model}-{cache}.json"
            runs[cache] = json.loads(path.read_text())["summary"] if path.exists() else None
        label = f"{model} {'5 turns' if shape == 'prefix' else 'short follow-up'}"
        if not all(runs.values()):
            print(f"{label:<26}  missing: {', '.join(c for c, s in runs.items() if not s)}")
            continue
        on = {t["turn"]: t for t in runs["on"]["ttft_by_turn"]}
        off = {t["turn"]: t for t in runs["off"]["ttft_by_turn"]}
        for turn in sorted({1, max(on)} & set(off)):
            a, b = off[turn]["mean_ttft_ms"], on[turn]["mean_ttft_ms"]
            print(f"{label:<26}{turn:>5}{on[turn]['mean_prompt_tokens']:>9.0f}{a:>10.1f}{b:>10.1f}"
                  f"{a / b:>7.1f}x{100 * on[turn]['mean_cached_tokens'] / on[turn]['mean_prompt_tokens']:>7.0f}%")
EOF
