#!/usr/bin/env bash
# Time to /ready of `jtp serve` with its default shape set on one H200, cold (empty compilation
# cache) then warm (the same cache), per model: scripts/serve_ready_time.py over random bf16
# weights drawn on the GPU from config.json alone (--load-format dummy: no weight file is read).
# Run from the repository root on the GPU machine: `OUT=dir MODELS="qwen3-8b" bash scripts/startup_h200.sh`
# (needs starlette and uvicorn: WHEELS=dir of their wheels is installed first when given).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -n "${WHEELS:-}" ]; then python3 -m pip install -q --no-deps "$WHEELS"/*.whl > /dev/null 2>&1; fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
python3 -c "import jax; print(jax.__version__, jax.devices())" >> "$OUT/gpu.txt" 2>&1
for preset in ${MODELS:-qwen3-8b qwen3.5-9b qwen3-30b-a3b}; do
  python3 scripts/make_random_checkpoint.py --preset "$preset" --out "/tmp/$preset" --config-only > /dev/null
  start=$(date +%s)
  timeout "${MODEL_SECONDS:-560}" python3 scripts/serve_ready_time.py --starts "${STARTS:-2}" --timeout "${START_SECONDS:-330}" \
    -- --model "/tmp/$preset" --load-format dummy > "$OUT/$preset.jsonl" 2> "$OUT/$preset.err"
  echo "$preset rc $? $(( $(date +%s) - start )) s" >> "$OUT/times.txt"
done
