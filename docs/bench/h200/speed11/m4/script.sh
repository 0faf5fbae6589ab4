#!/usr/bin/env bash
# m4: causal conv without a materialised [state | inputs] copy, U and W without a concatenated rhs:
# gpu_check qwen3.5-0.8b, Qwen3.5-9B prefill this tree vs base (HEAD before the change); 8B bf16 B=64 at 128 keys
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=.:/tmp/site
W=/tmp/m4; mkdir -p $W
pack() { tar czf $OUT/m4.tgz -C /tmp m4; }
here=$(pwd)
for p in qwen3-8b qwen3.5-9b; do python3 scripts/make_random_checkpoint.py --preset $p --out /tmp/ck/$p --config-only >/dev/null; done
t0=$(date +%s); el() { echo "[$(( $(date +%s)-t0 ))s] $*"; }
el gpu_check
timeout 150 python3 scripts/gpu_check.py --out $W/gpu_check.json --tp 1 --presets qwen3.5-0.8b > $W/gpu_check.log 2>&1
grep -E "PASS|FAIL|passed" $W/gpu_check.log | cut -c1-200; pack
P="--model /tmp/ck/qwen3.5-9b --load-format dummy --batch-sizes 1 --context 1024 --decode-steps 16 --prefill-len 2048 --prefill-requests 4 --prefill-runs 2 --max-seconds 90"
el q9b-new
timeout 130 python3 scripts/bench.py $P --json $W/q9b-prefill-new.json --markdown $W/q9b-prefill-new.md > $W/q9b-prefill-new.log 2>&1
grep -E "prefill|TTFT|compilation" $W/q9b-prefill-new.md | cut -c1-120; pack
el q9b-base
(cd .dev/base && PYTHONPATH=$here/.dev/base:/tmp/site timeout 130 python3 scripts/bench.py $P --json $W/q9b-prefill-base.json --markdown $W/q9b-prefill-base.md > $W/q9b-prefill-base.log 2>&1)
grep -E "prefill|TTFT|compilation" $W/q9b-prefill-base.md | cut -c1-120; pack
B="--model /tmp/ck/qwen3-8b --load-format dummy --context 1024 --num-scheduler-steps 8 --decode-steps 32 --prefill-len 256 --prefill-requests 1 --prefill-runs 1 --max-seconds 40 --batch-sizes 64"
for keys in 128 64; do
  el q8b-bf16-keys$keys
  JTP_ATTN_DECODE_KEYS=$keys timeout 75 python3 scripts/bench.py $B --json $W/q8b-bf16-keys$keys.json --markdown $W/q8b-bf16-keys$keys.md > $W/q8b-bf16-keys$keys.log 2>&1
  grep -E "decode B=" $W/q8b-bf16-keys$keys.md | grep -v "ms/dispatch" | cut -c1-120; pack
done
el done
