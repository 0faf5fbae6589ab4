#!/usr/bin/env bash
set -uo pipefail
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
python3 scripts/make_random_checkpoint.py --preset qwen3.5-9b --out /tmp/ck/qwen3.5-9b --config-only > /dev/null 2>&1
python3 .dev/prec_check.py > $R/prec.txt 2>&1; cat $R/prec.txt | grep -v Warning | tail -6
echo "at $(( $(date +%s)-T0 ))s"
for p in highest tf32x3 bf16x3; do
  [ $(( $(date +%s)-T0 )) -gt 420 ] && break
  JTP_DELTA_CHUNK_PRECISION=$p timeout 170 python3 scripts/bench.py --model /tmp/ck/qwen3.5-9b --load-format dummy --batch-sizes 1 --context 1024 \
    --decode-steps 16 --prefill-len 2048 --prefill-requests 4 --prefill-runs 2 --max-seconds 90 --json $R/bench-$p.json > $R/bench-$p.txt 2>&1
  echo "== $p at $(( $(date +%s)-T0 ))s"; grep -i -E 'prefill|tok/s' $R/bench-$p.txt | head -8
done
cd $OUT && tar czf r.tgz r && rm -rf r
