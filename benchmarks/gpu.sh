#!/usr/bin/env bash
# The GPU figures of docs/gpu.md in one command (issue 18, part 5); sized for about 8 minutes on an
# H200-class GPU:
#   1. the ME-layer scan against a plain forward, bundled model, bf16   (bench_me_layer.py)
#   2. batched activation patching against transformer_lens.patching    (bench_patching.py)
#   3. the battery on the bundled model                                 (me-interp run)
#   4. the battery on Gemma-3-270m                                      (me-interp run)
#   5. the scan of a config-built Llama-3.1-8B-shaped model, with its memory peak
#                                                                       (bench_scaling.py --point)
# then writes the table between the <!-- gpu-table --> markers of docs/gpu.md (gpu_table.py).
#
#   benchmarks/gpu.sh [--out DIR] [--doc FILE]     # on a GPU (writes docs/gpu.md by default)
#   benchmarks/gpu.sh --cpu [--out DIR]            # the same steps on the CPU with tiny sizes and
#                                                  # constructed models; the table goes to
#                                                  # DIR/gpu_table.md only, unless --doc is given
# A failing step is recorded (its log in DIR/<step>.log) and the others still run; the exit status
# is that of the table writer.
set -uo pipefail

cd "$(dirname "$0")/.."
MODE=gpu
OUT=runs/gpu
DOC=
DOC_SET=0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) MODE=cpu ;;
    --out) OUT="$2"; shift ;;
    --doc) DOC="$2"; DOC_SET=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "gpu.sh: unknown argument $1 (use --cpu, --out DIR, --doc FILE)" >&2; exit 2 ;;
  esac
  shift
done
PY=${PYTHON:-python}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} HF_DATASETS_OFFLINE=${HF_DATASETS_OFFLINE:-1}

if [ "$MODE" = gpu ]; then
  [ "$DOC_SET" = 1 ] || DOC=docs/gpu.md
  DEV=cuda DT=bfloat16
  ME_ARGS=(--repeats 15 --n-prompts 12 --n-tokens 16)
  PATCH_ARGS=(--n-prompts 16 --n-tokens 64 --layers 4 12 20 29 --positions 0 1 8 32 63 --tl-cells 8)
  BATTERY_MODELS=(bundled gemma-3-270m)
  POINT=(--d-model 4096 --n-layers 32 --d-mlp 14336 --heads 32 --kv-heads 8 --vocab 128256
         --prompts 8 --tokens 512 --repeats 2)
  if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu.sh: no CUDA device here; run with --cpu for the CPU smoke run" >&2
    exit 2
  fi
else
  DEV=cpu DT=float32
  ME_ARGS=(--model synthetic:planted --repeats 3 --n-prompts 4 --n-tokens 6)
  PATCH_ARGS=(--model synthetic:planted --n-prompts 4 --n-tokens 8)
  BATTERY_MODELS=(synthetic:planted synthetic:planted-gemma3)  # prompts in their word vocabulary
  POINT=(--d-model 64 --n-layers 2 --heads 4 --kv-heads 2 --vocab 256 --prompts 2 --tokens 16
         --repeats 2)
fi

mkdir -p "$OUT"
: > "$OUT/steps.tsv"
BATTERY_ARGS=()
if [ "$MODE" = cpu ]; then
  "$PY" -c "from me_interp import synthetic; print('\n'.join(synthetic.planted_prompts(16, 10)))" \
    > "$OUT/prompts.txt"
  BATTERY_ARGS=(--prompts "$OUT/prompts.txt")
fi
"$PY" - "$OUT/env.json" "$MODE" "$DEV" <<'EOF'
import json, subprocess, sys, time
import torch
path, mode, dev = sys.argv[1:]
name = torch.cuda.get_device_name() if dev == "cuda" else "CPU (--cpu smoke run, tiny sizes)"
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
json.dump({"mode": mode, "device": name, "torch": torch.__version__, "commit": commit or None,
           "date": time.strftime("%Y-%m-%d %H:%M %Z")}, open(path, "w"))
EOF

step() {  # step NAME COMMAND...: run it, log it, record its wall time and exit status
  local name=$1; shift
  local t0 t1 rc
  t0=$(date +%s%N)
  echo "== $name: $*" >&2
  "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  t1=$(date +%s%N)
  printf '%s\t%s\t%s\n' "$name" "$(awk "BEGIN { print ($t1 - $t0) / 1e9 }")" "$rc" >> "$OUT/steps.tsv"
  [ $rc = 0 ] || echo "   $name failed (exit $rc): see $OUT/$name.log" >&2
}

step me_layer "$PY" benchmarks/bench_me_layer.py "${ME_ARGS[@]}" --device "$DEV" --dtype "$DT" \
  --json "$OUT/me_layer.json"
step patching "$PY" benchmarks/bench_patching.py "${PATCH_ARGS[@]}" --device "$DEV" \
  --json "$OUT/patching.json"
keys=(bundled gemma)
for i in 0 1; do
  model=${BATTERY_MODELS[$i]}
  margs=()
  [ "$model" = bundled ] || margs=(--model "$model")
  step "battery_${keys[$i]}" "$PY" -m me_interp run "${margs[@]}" "${BATTERY_ARGS[@]}" \
    --device "$DEV" --dtype "$DT" \
    --out "$OUT/battery_${keys[$i]}" --fresh --quiet
done
step scan_8b "$PY" benchmarks/bench_scaling.py --point scan "${POINT[@]}" --device "$DEV" \
  --dtype "$DT" --json "$OUT/scan_8b.json"

if [ -n "$DOC" ]; then
  "$PY" benchmarks/gpu_table.py "$OUT" --doc "$DOC"
else
  "$PY" benchmarks/gpu_table.py "$OUT"
fi
