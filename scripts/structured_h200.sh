#!/usr/bin/env bash
# What structured outputs cost the batch (docs/bench/h200-structured.md): `jtp serve` with Qwen3-8B shapes
# (random weights drawn on the GPU, default flags but the prefix cache off, and warm-up) on one H200, loaded by
# scripts/bench_serving.py at concurrency 8, 1024 prompt / 128 output tokens, with 0, half and all of
# the requests under a JSON schema (--structured-fraction); then one sampled json_schema chat checked.
# Random checkpoints carry a word-level placeholder tokenizer llguidance cannot read: TOKENIZER=dir
# gives a byte-level BPE tokenizer (the demo checkpoint's) that scripts/synthetic_bpe_tokenizer.py grows
# to the model's 151,936 tokens, so the masks have their real width and the grammar a real-size trie.
# Run from the repository root on the GPU machine: `OUT=dir TOKENIZER=dir bash scripts/structured_h200.sh`.
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-out}
PORT=8012
mkdir -p "$OUT"
python3 scripts/make_random_checkpoint.py --preset qwen3-8b --out /tmp/q8s --config-only > /dev/null
python3 scripts/synthetic_bpe_tokenizer.py --base "$TOKENIZER" --vocab-size 151936 --out /tmp/q8s
# No prefix caching: runs of one seed send the same prompts, which a warm cache would not prefill.
python3 -m jtp.entrypoints.cli serve --model /tmp/q8s --load-format dummy --port $PORT --no-enable-prefix-caching \
  > "$OUT/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
for i in $(seq 600); do
  kill -0 $server 2>/dev/null || { echo "the server exited:"; tail -20 "$OUT/server.log"; exit 1; }
  curl -sf http://127.0.0.1:$PORT/ready > /dev/null && break
  sleep 1
done
compilations() { curl -s http://127.0.0.1:$PORT/metrics | awk '/^jtp:compilations_total/ {print $2}'; }
echo "compilations at ready: $(compilations)" | tee "$OUT/compilations.txt"
for f in 0 0.5 1; do
  for pass in 1 2; do
    python3 scripts/bench_serving.py --base-url http://127.0.0.1:$PORT --input-len 1024 --output-len 128 \
      --max-concurrency 8 --num-prompts 32 --vocab-size 150000 --structured-fraction $f --seed $pass \
      --json-out "$OUT/structured-f$f-p$pass.json" | tee "$OUT/structured-f$f-p$pass.txt" || true  # a failure is in the json
  done
done
python3 - "$PORT" > "$OUT/json-check.txt" <<'PY'
import json, sys, urllib.request
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
          "n": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["name", "n"], "additionalProperties": False}
ok = 0
for seed in range(8):
    body = {"messages": [{"role": "user", "content": "x"}], "temperature": 1.0, "seed": seed, "max_tokens": 64,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}}}
    req = urllib.request.Request(f"http://127.0.0.1:{sys.argv[1]}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    text = json.load(urllib.request.urlopen(req))["choices"][0]["message"]["content"]
    value = json.loads(text)
    ok += set(value) == {"name", "n"} and len(value["name"]) <= 16 and 0 <= value["n"] <= 999
    print(repr(text))
print(f"{ok}/8 valid")
PY
echo "compilations at the end: $(compilations)" | tee -a "$OUT/compilations.txt"
