#!/usr/bin/env bash
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/q8 --generator jax > $R/ckpt.log 2>&1
PORT=8011
STEP_LOG=$R/steps-fp8k8.txt python3 .dev/serve_probe.py serve --model /tmp/q8 --served-model-name q --dtype bfloat16 \
    --max-num-seqs 64 --max-model-len 2048 --port $PORT --no-warmup --max-num-batched-tokens 2048 --num-scheduler-steps 8 \
    --quantization fp8 --kv-cache-dtype fp8 > $R/server-fp8k8.log 2>&1 &
server=$!
for i in $(seq 300); do kill -0 $server 2>/dev/null || break; curl -sf http://127.0.0.1:$PORT/ready >/dev/null && break; sleep 1; done
echo "ready at $(( $(date +%s)-T0 ))s"
common=(--base-url http://127.0.0.1:$PORT --input-len 1024 --output-len 128 --max-concurrency 64 --vocab-size 150000)
for s in 1 2; do python3 scripts/bench_serving.py "${common[@]}" --num-prompts 256 --seed $s > $R/warm$s.txt 2>&1; echo "warm $s at $(( $(date +%s)-T0 ))s"; done
echo "MARK start $(python3 -c 'import time;print(time.monotonic())')" >> $R/marks.txt
python3 scripts/bench_serving.py "${common[@]}" --num-prompts 256 --json-out $R/c64-fp8k8.json > $R/c64-fp8k8.txt 2>&1
echo "MARK end $(python3 -c 'import time;print(time.monotonic())')" >> $R/marks.txt
cat $R/c64-fp8k8.txt
curl -s http://127.0.0.1:$PORT/metrics > $R/metrics.txt
kill $server; wait $server 2>/dev/null
echo "done at $(( $(date +%s)-T0 ))s"
cd $OUT && tar czf r.tgz r && rm -rf r
