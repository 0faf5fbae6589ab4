#!/usr/bin/env bash
# GPU serving probe: jtp serve (Qwen3-8B random, bf16) at c=64 1024/128 with a step log and py-spy.
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .dev/spy/*.whl
export PYTHONPATH=.:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt
python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/q8 --generator jax > $R/ckpt.log 2>&1
echo "ckpt at $(( $(date +%s)-T0 ))s"
PORT=8011
run_level() {  # name, serve args...
  name=$1; shift
  STEP_LOG=$R/steps-$name.txt python3 .dev/serve_probe.py serve --model /tmp/q8 --served-model-name q --dtype bfloat16 \
    --max-num-seqs 64 --max-model-len 2048 --port $PORT --no-warmup "$@" > $R/server-$name.log 2>&1 &
  server=$!
  for i in $(seq 300); do kill -0 $server 2>/dev/null || break; curl -sf http://127.0.0.1:$PORT/ready >/dev/null && break; sleep 1; done
  echo "$name ready at $(( $(date +%s)-T0 ))s"
  common=(--base-url http://127.0.0.1:$PORT --input-len 1024 --output-len 128 --max-concurrency 64 --vocab-size 150000)
  python3 scripts/bench_serving.py "${common[@]}" --num-prompts 128 --seed 1 > $R/warm-$name.txt 2>&1
  echo "MARK timed $(python3 -c 'import time;print(time.monotonic())')" >> $R/steps-$name.txt
  py-spy record --pid $server --threads --nonblocking -r 100 -f raw -o $R/spy-$name.txt -d 30 > $R/spy-$name.log 2>&1 &
  spy=$!
  python3 scripts/bench_serving.py "${common[@]}" --num-prompts 256 --json-out $R/c64-$name.json > $R/c64-$name.txt 2>&1
  echo "MARK end $(python3 -c 'import time;print(time.monotonic())')" >> $R/steps-$name.txt
  cat $R/c64-$name.txt
  kill -INT $spy 2>/dev/null; sleep 2; kill $server; wait $server 2>/dev/null
  echo "$name done at $(( $(date +%s)-T0 ))s"
}
run_level k1 --max-num-batched-tokens 2048
[ $(( $(date +%s)-T0 )) -lt 330 ] && run_level k1b8k --max-num-batched-tokens 8192
cd $OUT && tar czf r.tgz r && rm -rf r
