#!/usr/bin/env bash
# m2: float16 dots for float8 pages: attention sweep, 8B benches (bf16 / fp8 W / fp8 KV / both), gpu_check --fp8
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
W=/tmp/m2; mkdir -p $W
pack() { tar czf $OUT/m2.tgz -C /tmp m2; }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $W/gpu.txt
git log -1 --format=%H > $W/rev.txt 2>/dev/null; git status --short >> $W/rev.txt 2>/dev/null
python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/ck/qwen3-8b --config-only >/dev/null
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 ))s] $*"; }
el attn
timeout 180 python3 scripts/attention_check.py --kv-dtype fp8 --cases 0,1,2 --decode-sweep --max-seconds 150 --reps 10 \
  --json $W/attn-fp8.json > $W/attn-fp8.md 2> $W/attn-fp8.log; tail -6 $W/attn-fp8.md; pack
timeout 60 python3 scripts/attention_check.py --cases 2 --quick --reps 10 --json $W/attn-bf16.json > $W/attn-bf16.md 2> $W/attn-bf16.log; tail -3 $W/attn-bf16.md; pack
B="--model /tmp/ck/qwen3-8b --load-format dummy --context 1024 --num-scheduler-steps 8 --decode-steps 32 --prefill-len 256 --prefill-requests 1 --prefill-runs 1 --max-seconds 60"
run() { name=$1; shift; el $name; timeout 150 python3 scripts/bench.py $B "$@" --json $W/$name.json --markdown $W/$name.md > $W/$name.log 2>&1; grep -E "decode B=|compilation" $W/$name.md | grep -v "ms/dispatch" | cut -c1-140; pack; }
run q8b-bf16 --batch-sizes 1,64
run q8b-kvfp8 --kv-cache-dtype fp8 --batch-sizes 64
run q8b-fp8 --quantization fp8 --batch-sizes 64
run q8b-fp8-kvfp8 --quantization fp8 --kv-cache-dtype fp8 --batch-sizes 1,64
el gpu_check
timeout 200 python3 scripts/gpu_check.py --out $W/gpu_check.json --tp 1 --fp8 --presets qwen3-0.6b > $W/gpu_check.log 2>&1
grep -E "PASS|FAIL|passed" $W/gpu_check.log | cut -c1-230; pack
el done
