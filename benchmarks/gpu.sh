#!/usr/bin/env bash
# The GPU run of pareprop, from the source tree, in at most 9 minutes in all (docs/gpu.md).
#
#   benchmarks/gpu.sh OUTDIR              on a CUDA machine, <= 540 s
#   benchmarks/gpu.sh --dry-run OUTDIR    the same steps on the CPU with tiny models, <= 380 s
#
# Needs torch, timm, torchvision, pytest, matplotlib (no registry access; pareprop is used from
# ./src via PYTHONPATH). Steps, in this order, each under `timeout` within its allowance:
#   1. tests      python -m pytest -m gpu                              -> OUTDIR/gpu_tests.log
#   2. sanitizer  the same under TORCH_CUDA_SANITIZER=1 (torch's CUDA stream sanitizer, which
#                 needs a CUDA device: without one the tests run without it)
#                                                                      -> OUTDIR/gpu_tests_sanitizer.log
#   3. sweeps     bf16, doubling batch sizes, each engine until out of memory, baselines first,
#                 one `pareprop bench` call per engine (benchmarks/gpu_sweep.py):
#                   OUTDIR/vit   Rev-ViT-B     rev_vit_base_patch16_224 vs vit_base_patch16_224
#                   OUTDIR/mvit  Rev-MViTv2-B  rev_mvitv2_base vs mvitv2_base
#                   OUTDIR/swin  Rev-Swin-T    rev_swin_tiny vs swin_tiny_patch4_window7_224
#                   OUTDIR/text  Rev-RoBERTa-B rev_roberta_base vs text_encoder_base, seq 512
#                 each with OUTDIR/NAME.log and OUTDIR/NAME/ENGINE/results.{json,jsonl,csv};
#                 ViT, MViTv2 and Swin (the dry run: ViT) also run reversible and pareprop with
#                 chunked branches (--chunk-bytes 1GiB; records in ENGINE_chunked/ name the size)
#   4. summary    benchmarks/gpu_summary.py, printed last       -> OUTDIR/summary.txt
#
# Time: every step gets its planned share of what is left (what a step does not use goes to
# the later ones, in proportion), minus GRACE for `timeout -k`, so even a step that ignores
# SIGTERM is killed inside its allowance; SUMMARY_RESERVE seconds stay for the summary.
# GPU_SH_TOTAL_S=N sets the limit to N seconds instead (a shorter rehearsal; the script's tests).
# Exit status: 0 when every step and every configuration ran (out-of-memory and time-skipped
# configurations included), 1 otherwise, 2 for bad usage.

set -u
DRY=0
if [[ ${1:-} == --dry-run ]]; then
  DRY=1
  shift
fi
if (($# != 1)); then
  echo "usage: benchmarks/gpu.sh [--dry-run] OUTDIR" >&2
  exit 2
fi
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH="$ROOT/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$ROOT" || exit 2

GRACE=5           # `timeout -k`: seconds between SIGTERM and SIGKILL, inside the allowance
SUMMARY_RESERVE=15
MIN_STAGE=10      # a step with less than this is skipped
declare -A PLAN   # planned seconds; the allowance scales them to what is left
if ((DRY)); then
  TOTAL=${GPU_SH_TOTAL_S:-380}
  PLAN=([tests]=30 [sanitizer]=30 [vit]=75 [mvit]=60 [swin]=90 [text]=40)
  # Chunked runs in the ViT sweep only: they exercise the same code, and the CPU is slow.
  # 256 KiB: small enough that the tiny models' branches split in a few chunks.
  VIT_CHUNKED=(--chunk-bytes 256KiB)
  MVIT_CHUNKED=()
  SWIN_CHUNKED=()
  COMMON=(--device cpu --amp bf16 --warmup 1 --iters 2 --no-activation-bytes --quiet)
  VIT=(rev_vit_tiny_patch4_32 vit_tiny_patch16_224 --img-size 32 --depths 2 --batch-sizes 2 4)
  MVIT=(rev_mvitv2_tiny_32 mvitv2_tiny --img-size 32 --batch-sizes 2 4)
  SWIN=(rev_swin_tiny_32 swin_tiny_patch4_window7_224 --img-size 32 --batch-sizes 2 4)
  TEXT=(rev_roberta_small text_encoder_small --seq-len 32 --depths 2 --batch-sizes 2 4)
else
  TOTAL=${GPU_SH_TOTAL_S:-540}
  # The sanitizer's tests took 51 s on an H200 (2026-12-04), plus the interpreter's start.
  PLAN=([tests]=60 [sanitizer]=75 [vit]=100 [mvit]=105 [swin]=100 [text]=70)
  # Chunked branches at the size BENCHMARKS.md plans the largest batches at.
  VIT_CHUNKED=(--chunk-bytes 1GiB)
  MVIT_CHUNKED=(--chunk-bytes 1GiB)
  SWIN_CHUNKED=(--chunk-bytes 1GiB)
  # No plan and no float64 gradient check per configuration: on the first GPU run (2026-12-04)
  # they took most of each engine's share on the host, so only 2 of 6 batch sizes ran. The GPU
  # tests check the gradients; `pareprop plan` plans.
  COMMON=(--device cuda --amp bf16 --warmup 2 --iters 4 --no-activation-bytes --no-plan
          --no-grad-check --quiet)
  # Batch sizes: from where the GPU is busy to past the standard model's memory limit (an
  # estimate for an 80-140 GiB device; an engine stops at its first out-of-memory).
  VIT=(rev_vit_base_patch16_224 vit_base_patch16_224 --batch-sizes 128 256 512 1024 2048 4096)
  MVIT=(rev_mvitv2_base mvitv2_base --batch-sizes 64 128 256 512 1024 2048 4096)
  SWIN=(rev_swin_tiny swin_tiny_patch4_window7_224 --batch-sizes 256 512 1024 2048 4096 8192)
  TEXT=(rev_roberta_base text_encoder_base --seq-len 512 --batch-sizes 32 64 128 256 512 1024 2048)
fi
if ! [[ $TOTAL =~ ^[0-9]+$ ]] || ((TOTAL <= SUMMARY_RESERVE)); then
  echo "benchmarks/gpu.sh: expected GPU_SH_TOTAL_S to be whole seconds above" \
    "$SUMMARY_RESERVE, got '$TOTAL'" >&2
  exit 2
fi
ORDER=(tests sanitizer vit mvit swin text)
DEADLINE=$((SECONDS + TOTAL))
FAILED=0
: >"$OUT/steps.tsv"

# allowance STEP: seconds STEP may use, its planned share of what is left for it and later steps.
allowance() {
  local left=$((DEADLINE - SECONDS - SUMMARY_RESERVE)) rest=0 seen=0 s
  for s in "${ORDER[@]}"; do
    [[ $s == "$1" ]] && seen=1
    ((seen)) && rest=$((rest + PLAN[$s]))
  done
  ((left < 0)) && left=0
  echo $((left * PLAN[$1] / rest))
}

# step_done STEP STATUS STARTED NOTE: one line of OUTDIR/steps.tsv.
step_done() {
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$((SECONDS - $3))" "$4" >>"$OUT/steps.tsv"
  [[ $2 == 0 || $2 == skipped ]] || FAILED=1
  echo "$1: exit status $2 after $((SECONDS - $3)) s${4:+ ($4)}"
}

# run_step STEP SECONDS NOTE LOG COMMAND...: COMMAND under `timeout`, killed within SECONDS.
run_step() {
  local step=$1 a=$2 note=$3 log=$4 t0=$SECONDS
  shift 4
  if ((a < MIN_STAGE)); then
    step_done "$step" skipped "$t0" "only ${a} s left"
    return
  fi
  echo "== $step (up to ${a} s, log: $log)"
  timeout -k "$GRACE" "$((a - GRACE))" "$@" >"$log" 2>&1
  local rc=$?
  step_done "$step" "$rc" "$t0" "$note"
}

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  ((DRY)) && echo "dry run: the GPU script's steps on the CPU with tiny models"
  timeout 60 python - <<'EOF'
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device:", p.name, f"{p.total_memory / 2**30:.0f} GiB")
    print("cuda_available: yes")
else:
    print("device: no CUDA device visible")
    print("cuda_available: no")
EOF
  git -C "$ROOT" rev-parse --short HEAD 2>/dev/null | sed 's/^/commit: /'
} | tee "$OUT/environment.txt"
if grep -q '^cuda_available: yes' "$OUT/environment.txt"; then HAS_CUDA=1; else HAS_CUDA=0; fi
if ((!DRY && !HAS_CUDA)); then
  echo "benchmarks/gpu.sh: no CUDA device visible; for the CPU rehearsal run" \
    "benchmarks/gpu.sh --dry-run OUTDIR" >&2
  exit 2
fi

PYTEST=(python -m pytest -m gpu -q -p no:cacheprovider)
run_step tests "$(allowance tests)" "" "$OUT/gpu_tests.log" "${PYTEST[@]}"
tail -n 1 "$OUT/gpu_tests.log" 2>/dev/null
if ((HAS_CUDA)); then
  run_step sanitizer "$(allowance sanitizer)" "TORCH_CUDA_SANITIZER=1" \
    "$OUT/gpu_tests_sanitizer.log" env TORCH_CUDA_SANITIZER=1 "${PYTEST[@]}"
else
  # The sanitizer asks for the current CUDA stream on every operator, CPU ones included: with
  # no CUDA device even `import pareprop` fails under it. Run the step, without it.
  run_step sanitizer "$(allowance sanitizer)" "no CUDA device: ran without TORCH_CUDA_SANITIZER" \
    "$OUT/gpu_tests_sanitizer.log" "${PYTEST[@]}"
fi
tail -n 1 "$OUT/gpu_tests_sanitizer.log" 2>/dev/null

# sweep NAME LABEL MODEL BASELINE [DRIVER_ARGS...] -- BENCH_ARGS...: one model against its
# standard model.
sweep() {
  local name=$1 label=$2 model=$3 baseline=$4 a driver=()
  shift 4
  while (($#)) && [[ $1 != -- ]]; do
    driver+=("$1")
    shift
  done
  shift
  a=$(allowance "$name")
  # The driver stops itself 3 s before `timeout` would, to write what it measured.
  run_step "$name" "$a" "$label" "$OUT/$name.log" python benchmarks/gpu_sweep.py --out "$OUT/$name" \
    --budget "$((a - GRACE - 3 > 1 ? a - GRACE - 3 : 1))" --label "$label" --model "$model" \
    --baseline "$baseline" "${driver[@]}" -- "${COMMON[@]}" "$@"
}
sweep vit Rev-ViT-B "${VIT[@]:0:2}" "${VIT_CHUNKED[@]}" -- "${VIT[@]:2}"
sweep mvit Rev-MViTv2-B "${MVIT[@]:0:2}" "${MVIT_CHUNKED[@]}" -- "${MVIT[@]:2}"
sweep swin Rev-Swin-T "${SWIN[@]:0:2}" "${SWIN_CHUNKED[@]}" -- "${SWIN[@]:2}"
sweep text Rev-RoBERTa-B "${TEXT[@]:0:2}" -- "${TEXT[@]:2}"

echo
left=$((DEADLINE - SECONDS))
((left < 5)) && left=5
timeout -k 1 "$((left - 1))" python benchmarks/gpu_summary.py "$OUT" || FAILED=1
echo
echo "total: ${SECONDS} s (limit ${TOTAL} s); results in $OUT"
exit "$FAILED"
