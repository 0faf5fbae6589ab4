#!/usr/bin/env bash
# Issues 27 and 28 on one H200 (docs/bench/h200-speed3.md): random weights at the real shapes, drawn
# on the GPU from config.json alone. Run from the repository root on the GPU machine:
#   OUT=dir bash scripts/speed3_h200.sh sweep     # FP8 decode kernel kinds per projection -> /tmp/fp8-table.json
#   OUT=dir BASE=dir bash scripts/speed3_h200.sh bench [presets]  # bench.py, bf16 and FP8, this tree (and BASE's), REPEAT processes each
#   OUT=dir bash scripts/speed3_h200.sh profile [presets]         # profile_step.py at B=1, bf16 and FP8
#   OUT=dir bash scripts/speed3_h200.sh check [presets]           # gpu_check.py --fp8 at tp 1
#   OUT=dir bash scripts/speed3_h200.sh attention [presets]       # decode (SIZES, default B=1) at 8, 16 and 32 attention K splits, STAGES
#   OUT=dir bash scripts/speed3_h200.sh attn-sweep                # decode attention kernel configs at B=1, 8, 64
#   OUT=dir bash scripts/speed3_h200.sh loop [presets]            # multi-step decode (K steps a dispatch) under VARIANTS of XLA's graphs
#   OUT=dir VARIANTS="base s16:JTP_ATTN_DECODE_SPLITS=16 ..." bash scripts/speed3_h200.sh knobs [presets]
#                                                                 # decode (K=${K:-8}) under each variant's environment
#                                                                 # (name:VAR=v,VAR=v; a value may hold no comma or space: one XLA flag a variant)
# BASE: an older checkout's jtp/ and scripts/ (git archive REV jtp scripts), measured the same way.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
here=$(pwd)
checkpoint() { [ -f "/tmp/ck/$1/config.json" ] || PYTHONPATH=$here python3 scripts/make_random_checkpoint.py --preset "$1" --out "/tmp/ck/$1" --config-only >/dev/null; }
case "${1:-sweep}" in
sweep)
  PYTHONPATH=. timeout ${RUN_SECONDS:-420} python3 scripts/fp8_kernel_bench.py --preset qwen3-8b --rows ${ROWS:-1,16,64} --sweep \
    --json "$OUT/kernels.json" --table /tmp/fp8-table.json > "$OUT/kernels.md" 2> "$OUT/kernels.log"
  cp /tmp/fp8-table.json "$OUT/" ; grep -v "^|" "$OUT/kernels.log" | tail -5
  ;;
bench)
  for preset in ${2:-qwen3-8b}; do
    checkpoint "$preset"
    for tree in . ${BASE:-}; do
      tag=$([ "$tree" = . ] && echo new || echo base)
      sizes=$([ "$tree" = . ] && echo "${SIZES:-1,8,64}" || echo "${BASE_SIZES:-${SIZES:-1,8,64}}")
      args="--model /tmp/ck/$preset --load-format dummy --batch-sizes $sizes --context 1024 --decode-steps 16
            --prefill-len 2048 --prefill-requests 2 --prefill-runs 1 --max-seconds ${MAX_SECONDS:-100}"
      for q in ${QUANT:-bf16 fp8}; do
        extra=$([ "$q" = fp8 ] && echo "--quantization fp8" || true)
        table=${TABLE:-/tmp/fp8-table.json}; [ -f "$table" ] || table=
        for r in $(seq ${REPEAT:-1}); do  # REPEAT > 1: separate processes (a lone request's step is host-bound, per process)
          name=$preset-$q-$tag$([ "${REPEAT:-1}" = 1 ] || echo "-$r")
          (cd "$tree" && JTP_FP8_DECODE_TABLE=$table PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout ${RUN_SECONDS:-200} python3 scripts/bench.py \
            $args $extra --json "$OUT/$name.json" --markdown "$OUT/$name.md" > "$OUT/$name.log" 2>&1)
          echo "== $name"; grep -E "decode B=|prefill" "$OUT/$name.md" | grep -v attention | cut -c1-110
        done
      done
    done
  done
  ;;
profile)
  for preset in ${2:-qwen3-8b}; do
    checkpoint "$preset"
    for q in ${QUANT:-bf16 fp8}; do
      extra=$([ "$q" = fp8 ] && echo "--quantization fp8" || true)
      name=profile-$preset-$q-k${K:-1}  # K: decode steps per dispatch (the device loop)
      PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout 200 python3 scripts/profile_step.py --model "/tmp/ck/$preset" \
        --load-format dummy --batch ${BATCH:-1} --steps 12 --num-scheduler-steps ${K:-1} --top 30 $extra \
        --json "$OUT/$name.json" --markdown "$OUT/$name.md" > "$OUT/$name.log" 2>&1
      echo "== $name"; head -c 1500 "$OUT/$name.md"
    done
  done
  ;;
attention)
  # The one-token attention is latency-bound (docs/bench/h200-speed3.md): more splits, fewer keys each.
  for preset in ${2:-qwen3-8b}; do
    checkpoint "$preset"
    for splits in ${SPLITS:-8 16 32}; do
      name=$preset-attn-s$splits-st${STAGES:-3}
      JTP_ATTN_DECODE_SPLITS=$splits JTP_ATTN_STAGES=${STAGES:-3} PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout ${RUN_SECONDS:-120} python3 scripts/bench.py \
        --model "/tmp/ck/$preset" --load-format dummy --batch-sizes ${SIZES:-1} --context 1024 --decode-steps 16 --max-seconds ${MAX_SECONDS:-20} \
        --json "$OUT/$name.json" --markdown "$OUT/$name.md" > "$OUT/$name.log" 2>&1
      echo "== $name"; grep -E "decode B=" "$OUT/$name.md" | cut -c1-120
    done
  done
  ;;
attn-sweep)
  PYTHONPATH=. timeout ${RUN_SECONDS:-420} python3 scripts/attention_check.py --cases 0,1,2 --decode-sweep \
    --max-seconds ${MAX_SECONDS:-360} --json "$OUT/attn-sweep.json" > "$OUT/attn-sweep.md" 2> "$OUT/attn-sweep.log"
  tail -8 "$OUT/attn-sweep.md"
  ;;
loop)
  # --num-scheduler-steps K runs K decode steps in one while loop, which the runner compiles with WHILE and
  # CONDITIONAL among XLA's command-buffer types (one CUDA graph). Variant = K, XLA_FLAGS (which take
  # precedence over the runner's choice), and a core pin or none: k<K>, k<K>pin, or one of the named flag sets.
  declare -A flags=([k8w]="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
    [k8wc]="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL,+CUSTOM_CALL --xla_gpu_graph_min_graph_size=1")
  for preset in ${2:-qwen3-0.6b qwen3-8b}; do
    checkpoint "$preset"
    i=0
    for v in ${VARIANTS:-k1 k8 k8w k8wc}; do  # a variant named twice runs in two processes
      i=$((i + 1))
      k=$(echo "$v" | sed -E 's/^k([0-9]+).*/\1/'); pin=$([[ $v == *pin* ]] && echo "taskset -c ${PIN_CORE:-3}" || true)
      name=$preset-loop-$i-$v${Q:+-$Q}  # Q=fp8: quantized at load
      XLA_FLAGS="${flags[$v]:-}${DUMP:+ --xla_dump_to=$OUT/dump-$name --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_steps.*}" \
        PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout ${RUN_SECONDS:-150} $pin python3 scripts/bench.py \
        --model "/tmp/ck/$preset" --load-format dummy --batch-sizes ${SIZES:-1,64} --context 1024 --decode-steps 16 \
        --num-scheduler-steps "$k" --prefill-len 256 --prefill-requests 1 --prefill-runs 1 --max-seconds ${MAX_SECONDS:-60} \
        ${Q:+--quantization $Q} --json "$OUT/$name.json" --markdown "$OUT/$name.md" > "$OUT/$name.log" 2>&1
      echo "== $name"; grep -E "decode B=" "$OUT/$name.md" | grep -v attention | cut -c1-110
    done
  done
  ;;
knobs)
  for preset in ${2:-qwen3-0.6b}; do
    checkpoint "$preset"
    for v in ${VARIANTS:-base}; do
      name=$preset-knobs-${v%%:*}
      assignments=$([[ $v == *:* ]] && echo "${v#*:}" | tr ',' ' ' || true)
      env $assignments PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout ${RUN_SECONDS:-120} python3 scripts/bench.py \
        --model "/tmp/ck/$preset" --load-format dummy --batch-sizes ${SIZES:-1} --context 1024 --decode-steps 16 \
        --num-scheduler-steps ${K:-8} --prefill-len 256 --prefill-requests 1 --prefill-runs 1 --max-seconds ${MAX_SECONDS:-20} \
        --json "$OUT/$name.json" --markdown "$OUT/$name.md" > "$OUT/$name.log" 2>&1
      echo "== $name ($assignments)"; grep -E "decode B=.*tokens/s" "$OUT/$name.md" | cut -c1-90
    done
  done
  ;;
check)
  PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} timeout ${RUN_SECONDS:-400} python3 scripts/gpu_check.py --out "$OUT/check" --tp 1 --fp8 \
    --presets "${2:-qwen3-0.6b}" --checkpoints /tmp/gpu_check > "$OUT/gpu_check.log" 2>&1
  echo "gpu_check exit $?"; grep -E "PASS|FAIL|ok|check" "$OUT/gpu_check.log" | tail -12
  ;;
esac
