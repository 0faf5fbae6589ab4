#!/usr/bin/env bash
# gpu_check after the float8 page conversion change (2b4e60c): qwen3-0.6b, float32/bf16 vs transformers, FP8 checks
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
W=/tmp/gc; mkdir -p $W
nvidia-smi --query-gpu=name,memory.total --format=csv > $W/gpu.txt
git log -1 --format=%H > $W/rev.txt 2>/dev/null; git status --short >> $W/rev.txt 2>/dev/null
t0=$(date +%s)
timeout ${GC_TIMEOUT:-150} python3 scripts/gpu_check.py --out $W/gpu_check.json --tp 1 --fp8 --presets qwen3-0.6b > $W/gpu_check.log 2>&1
echo "rc=$? wall=$(( $(date +%s)-t0 ))s" >> $W/gpu_check.log
grep -E "PASS|FAIL|passed|rc=" $W/gpu_check.log | cut -c1-260
tar czf $OUT/gc.tgz -C /tmp gc
