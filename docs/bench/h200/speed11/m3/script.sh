#!/usr/bin/env bash
# m3: final code: 8B bf16 / fp8 KV / FP8+fp8 KV; W8A8 at every row count (patched copy); profiles FP8 B=64, 9B prefill
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
W=/tmp/m3; mkdir -p $W
pack() { tar czf $OUT/m3.tgz -C /tmp m3; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $W/gpu.txt
for p in qwen3-8b qwen3.5-9b; do python3 scripts/make_random_checkpoint.py --preset $p --out /tmp/ck/$p --config-only >/dev/null; done
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 ))s] $*"; }
B="--model /tmp/ck/qwen3-8b --load-format dummy --context 1024 --num-scheduler-steps 8 --decode-steps 32 --prefill-len 256 --prefill-requests 1 --prefill-runs 1 --max-seconds 60"
run() { name=$1; shift; el $name; timeout 150 python3 scripts/bench.py $B "$@" --json $W/$name.json --markdown $W/$name.md > $W/$name.log 2>&1; grep -E "decode B=|compilation" $W/$name.md | grep -v "ms/dispatch" | cut -c1-140; pack; }
run q8b-bf16 --batch-sizes 1,64
run q8b-kvfp8 --kv-cache-dtype fp8 --batch-sizes 64
run q8b-fp8-kvfp8 --quantization fp8 --kv-cache-dtype fp8 --batch-sizes 1,64
el profile-b64
timeout 150 python3 scripts/profile_step.py --model /tmp/ck/qwen3-8b --load-format dummy --batch 64 --steps 8 --top 40 \
  --quantization fp8 --kv-cache-dtype fp8 --json $W/prof-fp8-kvfp8-b64.json --markdown $W/prof-fp8-kvfp8-b64.md > $W/prof-b64.log 2>&1
head -c 1800 $W/prof-fp8-kvfp8-b64.md; pack
el w8a8-everywhere
rm -rf /tmp/w8 && mkdir /tmp/w8 && cp -r jtp scripts /tmp/w8/ && sed -i 's/^W8A8_MIN_ROWS = .*/W8A8_MIN_ROWS = 1/' /tmp/w8/jtp/models/layers.py
grep -n "^W8A8_MIN_ROWS" /tmp/w8/jtp/models/layers.py
(cd /tmp/w8 && PYTHONPATH=/tmp/w8:/tmp/site timeout 120 python3 scripts/bench.py $B --quantization fp8 --kv-cache-dtype fp8 --batch-sizes 1 \
  --json $W/q8b-fp8-kvfp8-w8a8all.json --markdown $W/q8b-fp8-kvfp8-w8a8all.md > $W/q8b-fp8-kvfp8-w8a8all.log 2>&1)
grep -E "decode B=" $W/q8b-fp8-kvfp8-w8a8all.md | grep -v "ms/dispatch" | cut -c1-140; pack
el profile-9b-prefill
timeout 130 python3 scripts/profile_step.py --model /tmp/ck/qwen3.5-9b --load-format dummy --prefill --batch 2 --context 2048 --top 40 \
  --json $W/prof-q9b-prefill.json --markdown $W/prof-q9b-prefill.md > $W/prof-q9b.log 2>&1
head -c 2500 $W/prof-q9b-prefill.md; pack
el done
