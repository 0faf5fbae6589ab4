#!/usr/bin/env bash
# GPU serving probe 2: GIL switch interval treatments.
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .dev/spy/*.whl
export PYTHONPATH=.:/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/q8 --generator jax > $R/ckpt.log 2>&1
echo "ckpt at $(( $(date +%s)-T0 ))s"
PORT=8011
run_level() {  # name, switch, concurrency, spy(0/1), serve args...
  name=$1 sw=$2 c=$3 spy=$4; shift 4
  SWITCH=$sw STEP_LOG=$R/steps-$name.txt python3 .dev/serve_probe.py serve --model /tmp/q8 --served-model-name q --dtype bfloat16 \
    --max-num-seqs 64 --max-model-len 2048 --port $PORT --no-warmup "$@" > $R/server-$name.log 2>&1 &
  server=$!
  for i in $(seq 300); do kill -0 $server 2>/dev/null || break; curl -sf http://127.0.0.1:$PORT/ready >/dev/null && break; sleep 1; done
  n=$(( c == 1 ? 16 : c * 4 ))
  common=(--base-url http://127.0.0.1:$PORT --input-len 1024 --output-len 128 --max-concurrency $c --vocab-size 150000)
  python3 scripts/bench_serving.py "${common[@]}" --num-prompts $(( c == 1 ? 8 : 128 )) --seed 1 > $R/warm-$name.txt 2>&1
  if [ $spy = 1 ]; then py-spy record --pid $server --threads --gil --nonblocking -r 200 -f raw -o $R/spy-$name.txt -d 20 > $R/spy-$name.log 2>&1 & fi
  python3 scripts/bench_serving.py "${common[@]}" --num-prompts $n --json-out $R/c$c-$name.json > $R/c$c-$name.txt 2>&1
  echo "MARK end $(python3 -c 'import time;print(time.monotonic())')" >> $R/steps-$name.txt
  echo "== $name (switch ${sw:-default}, c=$c, $*)"; grep -E 'Output token throughput|Median TTFT|Median TPOT|Queue|Prefill:|Decode:' $R/c$c-$name.txt
  pkill -INT py-spy 2>/dev/null; sleep 1; kill $server; wait $server 2>/dev/null
  echo "$name done at $(( $(date +%s)-T0 ))s"
}
run_level sw2k1 0.0002 64 1 --max-num-batched-tokens 2048
run_level sw10k1 0.001 64 0 --max-num-batched-tokens 2048
run_level basek8 "" 64 0 --max-num-batched-tokens 2048 --num-scheduler-steps 8
run_level sw2k8 0.0002 64 0 --max-num-batched-tokens 2048 --num-scheduler-steps 8
[ $(( $(date +%s)-T0 )) -lt 480 ] && run_level sw2k8c1 0.0002 1 0 --max-num-batched-tokens 2048 --num-scheduler-steps 8
cd $OUT && tar czf r.tgz r && rm -rf r
