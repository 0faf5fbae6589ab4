#!/usr/bin/env bash
# m1: FP8 KV attention sweep, 8B benches (fp8 KV, FP8 W + fp8 KV, bf16), profile FP8 B=64
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
W=/tmp/m1; mkdir -p $W
pack() { tar czf $OUT/m1.tgz -C /tmp m1; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $W/gpu.txt
python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/ck/qwen3-8b --config-only >/dev/null
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 ))s] $*"; }
el attn
timeout 170 python3 scripts/attention_check.py --kv-dtype fp8 --cases 0,2 --decode-sweep --max-seconds 140 --reps 10 \
  --json $W/attn-fp8.json > $W/attn-fp8.md 2> $W/attn-fp8.log; tail -5 $W/attn-fp8.md; pack
B="--model /tmp/ck/qwen3-8b --load-format dummy --context 1024 --num-scheduler-steps 8 --decode-steps 32 --prefill-len 256 --prefill-requests 1 --prefill-runs 1 --max-seconds 60"
run() { name=$1; shift; el $name; timeout 150 python3 scripts/bench.py $B "$@" --json $W/$name.json --markdown $W/$name.md > $W/$name.log 2>&1; grep -E "decode B=|compilation" $W/$name.md | grep -v "ms/dispatch" | cut -c1-140; pack; }
run q8b-kvfp8 --kv-cache-dtype fp8 --batch-sizes 64
run q8b-fp8-kvfp8 --quantization fp8 --kv-cache-dtype fp8 --batch-sizes 1,64
run q8b-bf16 --batch-sizes 64
el profile
timeout 150 python3 scripts/profile_step.py --model /tmp/ck/qwen3-8b --load-format dummy --batch 64 --steps 8 --top 40 \
  --quantization fp8 --kv-cache-dtype fp8 --json $W/prof-fp8-kvfp8-b64.json --markdown $W/prof-fp8-kvfp8-b64.md > $W/prof.log 2>&1
head -c 2500 $W/prof-fp8-kvfp8-b64.md; pack
el done
