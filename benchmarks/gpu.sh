#!/usr/bin/env bash
# GPU benchmark for pareprop, from the source tree, in at most 8 minutes in all.
#
#   benchmarks/gpu.sh OUTDIR
#
# Needs: a CUDA GPU; torch, timm, torchvision, pytest, matplotlib installed (no registry access,
# pareprop is used from ./src via PYTHONPATH). Steps, each under a `timeout` guard:
#   1. the GPU tests (python -m pytest -m gpu -q)               -> OUTDIR/gpu_tests.log
#   2. sweeps of reversible models against their timm / torch baselines, bf16 autocast, batch
#      sizes doubling up to the memory limit (out-of-memory recorded, larger batches skipped):
#        OUTDIR/vit   rev_vit_base_patch16_224 vs vit_base_patch16_224
#        OUTDIR/mvit  rev_mvitv2_base          vs mvitv2_base
#        OUTDIR/swin  rev_swin_tiny            vs swin_tiny_patch4_window7_224   (if registered)
#        OUTDIR/text  rev_roberta_base         vs text_encoder_base, seq 512     (if registered)
#      each with results.json, results.csv, results.jsonl, PNG plots and its own log.
#   3. a short table, printed last: best throughput and largest batch per engine,
#      PaReprop/Reprop throughput ratio, largest batch against the standard model's.
# Every sweep also stops starting configurations after its --time-budget, so what it measured
# is written even when the budget is short; `timeout` is the hard stop behind that.

set -u
OUT=${1:?usage: benchmarks/gpu.sh OUTDIR}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT"

TOTAL=480          # seconds for everything, this script included
SUMMARY_RESERVE=20 # kept back for the final table
DEADLINE=$((SECONDS + TOTAL))

# stage_time PLANNED LATER: seconds this stage may use, leaving LATER seconds for later stages.
stage_time() {
  local left=$((DEADLINE - SECONDS - SUMMARY_RESERVE - $2))
  local t=$1
  ((left < t)) && t=$left
  ((t < 0)) && t=0
  echo "$t"
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  python - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", p.name, f"{p.total_memory / 2**30:.0f} GiB")
else:
    print("device: no CUDA device visible")
EOF
  git -C "$ROOT" rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /'
} | tee "$OUT/environment.txt"

echo "== GPU tests"
T=$(stage_time 90 330)
timeout -k 10 "$T" python -m pytest -m gpu -q -p no:cacheprovider >"$OUT/gpu_tests.log" 2>&1
echo "gpu tests: exit status $? (log: $OUT/gpu_tests.log)"
tail -n 3 "$OUT/gpu_tests.log"

registered() {  # registered NAME -> success if pareprop's registry has NAME
  python -c "import sys, pareprop; sys.exit(0 if pareprop.is_model('$1') else 1)" 2>/dev/null
}

# sweep NAME PLANNED LATER ARGS...: one `pareprop bench` run into OUT/NAME.
sweep() {
  local name=$1 planned=$2 later=$3
  shift 3
  local t
  t=$(stage_time "$planned" "$later")
  if ((t < 20)); then
    echo "== $name: skipped, no time left"
    return
  fi
  echo "== $name (up to ${t}s)"
  timeout -k 10 "$t" python -m pareprop bench --device cuda --amp bf16 --warmup 2 --iters 5 \
    --time-budget $((t - 30)) --quiet --out "$OUT/$name" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit status $? (log: $OUT/$name.log)"
}

ENGINES=(reversible pareprop autograd plain checkpointed)
sweep vit 110 230 --models rev_vit_base_patch16_224 vit_base_patch16_224 \
  --engines "${ENGINES[@]}" --batch-sizes 32 64 128 256 512 1024 2048
sweep mvit 110 120 --models rev_mvitv2_base mvitv2_base \
  --engines "${ENGINES[@]}" --batch-sizes 32 64 128 256 512 1024
if registered rev_swin_tiny; then
  sweep swin 70 50 --models rev_swin_tiny swin_tiny_patch4_window7_224 \
    --engines reversible pareprop autograd plain --batch-sizes 32 64 128 256 512 1024
fi
if registered rev_roberta_base && registered text_encoder_base; then
  sweep text 50 0 --models rev_roberta_base text_encoder_base --seq-len 512 \
    --engines reversible pareprop autograd plain --batch-sizes 8 16 32 64 128 256
fi

echo
echo "== summary ($OUT)"
timeout -k 5 "$SUMMARY_RESERVE" python - "$OUT" <<'EOF'
import json, os, sys
from pareprop.bench import format_summary

out = sys.argv[1]
baselines = {
    "rev_vit_base_patch16_224": "vit_base_patch16_224",
    "rev_mvitv2_base": "mvitv2_base",
    "rev_swin_tiny": "swin_tiny_patch4_window7_224",
    "rev_roberta_base": "text_encoder_base",
}
for name in ("vit", "mvit", "swin", "text"):
    path, stream = (os.path.join(out, name, f) for f in ("results.json", "results.jsonl"))
    if os.path.exists(path):
        records = json.load(open(path))
    elif os.path.exists(stream):  # killed before the end: what was measured
        records = [json.loads(line) for line in open(stream) if line.strip()]
    else:
        continue
    if records:
        print(f"-- {name} ({len(records)} configurations)")
        print(format_summary(records, baselines))
        print()
EOF
echo "total: ${SECONDS}s"
