#!/usr/bin/env bash
# GPU serving probe 3: the shipped switch interval (bf16 K=1), FP8 weights + KV at c=64 and c=1.
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .dev/spy/*.whl
export PYTHONPATH=.:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/q8 --generator jax > $R/ckpt.log 2>&1
echo "ckpt at $(( $(date +%s)-T0 ))s"
PORT=8011
start_server() {  # name, serve args...
  name=$1; shift
  STEP_LOG=$R/steps-$name.txt python3 .dev/serve_probe.py serve --model /tmp/q8 --served-model-name q --dtype bfloat16 \
    --max-num-seqs 64 --max-model-len 2048 --port $PORT --no-warmup "$@" > $R/server-$name.log 2>&1 &
  server=$!
  for i in $(seq 300); do kill -0 $server 2>/dev/null || break; curl -sf http://127.0.0.1:$PORT/ready >/dev/null && break; sleep 1; done
  echo "$name ready at $(( $(date +%s)-T0 ))s"
}
level() {  # name, concurrency, warm prompts
  name=$1 c=$2 w=$3
  n=$(( c == 1 ? 16 : c * 4 ))
  common=(--base-url http://127.0.0.1:$PORT --input-len 1024 --output-len 128 --max-concurrency $c --vocab-size 150000)
  python3 scripts/bench_serving.py "${common[@]}" --num-prompts $w --seed 1 > $R/warm-$name-c$c.txt 2>&1
  echo "MARK start $c $(python3 -c 'import time;print(time.monotonic())')" >> $R/marks-$name.txt
  python3 scripts/bench_serving.py "${common[@]}" --num-prompts $n --json-out $R/c$c-$name.json > $R/c$c-$name.txt 2>&1
  echo "MARK end $c $(python3 -c 'import time;print(time.monotonic())')" >> $R/marks-$name.txt
  echo "== $name c=$c"; grep -E 'Output token throughput|Median TTFT|Median TPOT|Queue|Prefill:|Decode:' $R/c$c-$name.txt
  echo "at $(( $(date +%s)-T0 ))s"
}
start_server bf16k1 --max-num-batched-tokens 2048
level bf16k1 64 128
kill $server; wait $server 2>/dev/null
start_server fp8k8 --max-num-batched-tokens 2048 --num-scheduler-steps 8 --quantization fp8 --kv-cache-dtype fp8
level fp8k8 64 192
level fp8k8 1 8
curl -s http://127.0.0.1:$PORT/metrics > $R/metrics-fp8k8.txt
kill $server; wait $server 2>/dev/null
cd $OUT && tar czf r.tgz r && rm -rf r
