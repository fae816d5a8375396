#!/usr/bin/env bash
# The GPU run of pareprop, from the source tree, in at most 8 minutes in all (docs/gpu.md).
#
#   benchmarks/gpu.sh OUTDIR              on a CUDA machine, <= 480 s
#   benchmarks/gpu.sh --dry-run OUTDIR    the same steps on the CPU with tiny models, <= 480 s
#
# Needs torch, timm, torchvision, pytest (no registry access; pareprop is used from ./src via
# PYTHONPATH). Steps, in this order, each under `timeout` within its allowance, each printing
# its log when it ends; every part fails alone, with what it measured written down (docs/gpu.md,
# "Every part fails alone"):
#   1. largest    the real largest batch under a 40 GiB cap beside the planned one
#                 (benchmarks/real_largest_batch.py): Rev-ViT-B (1 GiB chunks) against timm's
#                 ViT-B checkpointed, Rev-Swin-T (transitions checkpointed, 1 GiB chunks)
#                 against timm's Swin-T checkpointed, then timm's ViT-B plain; the JSON is
#                 rewritten after every step, cases not started within 3/4 of the allowance
#                 are skipped (--time-limit)                        -> OUTDIR/largest.{log,json}
#   2. small      the small-batch regime (benchmarks/small_batch.py): Rev-ViT-L and Rev-Swin-B
#                 at batch 8-32 (the targets' range), every engine with and without CUDA
#                 graphs (--graphs; the dry run says "not run (no CUDA)") and timm's
#                 checkpointed model, interleaved, CUDA events, the fallback's choice; each
#                 engine fails alone, its error in its row; batch sizes not started within 3/4
#                 of the allowance are skipped (--time-limit)        -> OUTDIR/small.{log,json}
#   3. profile    PaReprop's two streams, busy and overlapped, from one trace; a kernel table
#                 of Rev-ViT-B (autograd) against timm's ViT-B (benchmarks/profile_steps.py)
#                                                                    -> OUTDIR/profile.{log,json}
#   4. tests      python -m pytest -m gpu, one process per GPU test file (a broken CUDA
#                 context stays in its file)  -> OUTDIR/gpu_tests.log, gpu_tests_FILE.log
#   5. controls   the tests that can catch a dropped wait (CONTROL_TESTS), once per
#                 cross-stream wait of PaReprop's schedule with that wait dropped
#                 (tests/conftest.py PAREPROP_DROP_WAIT): each must fail -> OUTDIR/controls.log
# No stream sanitizer runs: TORCH_CUDA_SANITIZER forgets a pointer when its memory is freed, so
# it cannot see the lifetime races the waits exist for; the controls test them directly.
#
# Time: the limit counts from the script's start. Every step gets its planned share of what is
# left (what a step does not use goes to the later ones, in proportion), minus GRACE for
# `timeout -k`, so even a step that ignores SIGTERM is killed inside its allowance;
# SUMMARY_RESERVE seconds stay for the summary. Inside the tests and controls steps each part
# may use what is left of the step but FLOOR seconds for each part after it.
# GPU_SH_TOTAL_S=N sets the limit to N seconds instead (a shorter rehearsal; the script's tests).
# The summary is printed last and kept in OUTDIR/summary.txt.
# Exit status: 0 when every step ran (a control that is not caught is reported, not a failure
# of the run), 1 otherwise, 2 for bad usage.

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
export PYTHONUNBUFFERED=1  # a step killed at its allowance leaves a log complete up to then
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
cd "$ROOT" || exit 2

GRACE=5           # `timeout -k`: seconds between SIGTERM and SIGKILL, inside the allowance
SUMMARY_RESERVE=10
MIN_STAGE=10      # a step with less than this is skipped
FLOOR=15          # seconds kept for each later test file or control: a start and a few tests
                  # (the dry run keeps more: a start takes longer on a busy CPU)
declare -A PLAN   # planned seconds; the allowance scales them to what is left
if ((DRY)); then
  TOTAL=${GPU_SH_TOTAL_S:-480}
  # Measured on the 2-core machine at load 9-11 (2026-12-05): largest 31-60 s, small 25-75,
  # profile 20-37; a pytest start takes 20-40 s there: tests start three, controls one
  # (without CUDA the others would skip the same tests). Caps, not costs: an idle machine
  # takes half as long.
  PLAN=([largest]=90 [small]=100 [profile]=60 [tests]=140 [controls]=70)
  FLOOR=30
  DEVICE=(--device cpu)
  # A cap the tiny models fill at a few dozen images; the planned batches from
  # `pareprop.largest_batch(MODEL, ENGINE, 24 * 2**20, amp="bf16", img_size=32, device="cpu",
  # depth=1, ...)`.
  LARGEST=(--cap 24MiB --img-size 32 --steps 2
           --case rev_vit_tiny_patch4_32 reversible 39 --chunk-bytes 2MiB --depth 1
           --case vit_tiny_patch16_224 checkpointed 202 --depth 1)
  SMALL=(--img-size 32 --batch-sizes 2 --warmup 1 --rounds 1 --graphs
         --pair rev_vit_tiny_patch4_32 vit_tiny_patch16_224)
  PROFILE=(--img-size 32 --depth 2 --overlap rev_vit_tiny_patch4_32 2
           --kernels rev_vit_tiny_patch4_32 vit_tiny_patch16_224 2 --top 5)
else
  TOTAL=${GPU_SH_TOTAL_S:-480}
  # Shares (docs/gpu.md, "Time") of the 460 s left after about 10 s for the environment and
  # 10 s for the summary:
  #   largest 100: five cases of up to six steps each (a full-size step at the largest batch
  #     takes 1-3 s, the build a few more: about 60 s in all); a case cut short keeps its
  #     steps, and the case no target needs (plain) runs last.
  #   small 100: batches 8-32 only (the targets are at 32 and below), eight engines each; what
  #     is not started within 3/4 of it is skipped, what ran is written per batch.
  #   profile 40: two models built, warmed up and traced, a chrome trace written and read.
  #   tests 115: the last run took 39 s for 25 tests; now 51+, the 23+ graphed ones each
  #     train two models through a capture, one process per file (a start each).
  #   controls 105: five waits, each a start and its tests until the first failure of the
  #     eager ones and of the graphed ones; one that is not caught runs them all. Tests and
  #     controls come last and also get what the earlier steps leave.
  PLAN=([largest]=100 [small]=100 [profile]=40 [tests]=115 [controls]=105)
  DEVICE=(--device cuda)
  # Planned on the CPU at the commit that last changed the planner or these models (fake
  # tensors, nothing allocated; 5 minutes for Rev-ViT-B): `pareprop.largest_batch(MODEL,
  # ENGINE, 40 * 2**30, amp="bf16", img_size=224, ...)`, in BENCHMARKS.md ("Real largest
  # batch under a cap").
  # The cases in the order of what the targets need: plain ViT-B (no target) last.
  LARGEST=(--cap 40GiB --img-size 224 --trace-oom
           --case rev_vit_base_patch16_224 reversible 9313 --chunk-bytes 1GiB
           --case vit_base_patch16_224 checkpointed 2767
           --case rev_swin_tiny reversible 4914 --chunk-bytes 1GiB --grad-checkpointing
           --case swin_tiny_patch4_window7_224 checkpointed 2340
           --case vit_base_patch16_224 plain 608)
  SMALL=(--batch-sizes 8 16 32 --graphs
         --pair rev_vit_large_patch16_224 vit_large_patch16_224
         --pair rev_swin_base swin_base_patch4_window7_224)
  PROFILE=(--overlap rev_vit_large_patch16_224 32
           --kernels rev_vit_base_patch16_224 vit_base_patch16_224 128)
fi
if ! [[ $TOTAL =~ ^[0-9]+$ ]] || ((TOTAL <= SUMMARY_RESERVE)); then
  echo "benchmarks/gpu.sh: expected GPU_SH_TOTAL_S to be whole seconds above" \
    "$SUMMARY_RESERVE, got '$TOTAL'" >&2
  exit 2
fi
ORDER=(largest small profile tests controls)
DEADLINE=$((SECONDS + TOTAL))  # from the start: the environment step counts too
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

# part_limit END LATER: seconds the next part of a step may use, up to END (in $SECONDS), so
# that each of the LATER parts after it still has FLOOR seconds.
part_limit() {
  local a=$(($1 - SECONDS - $2 * FLOOR))
  ((a < 0)) && a=0
  echo "$a"
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

# script STEP NOTE SCRIPT ARGS...: a benchmark script with its JSON record, its log printed.
# The largest and small steps also get --time-limit, 3/4 of their allowance: they start no case
# or batch size after that, so the last one they run can end inside the allowance (what they
# finished is in their JSON either way).
script() {
  local step=$1 note=$2 path=$3 a limit=()
  shift 3
  a=$(allowance "$step")
  [[ $step == small || $step == largest ]] && limit=(--time-limit "$((a * 3 / 4))")
  run_step "$step" "$a" "$note" "$OUT/$step.log" python "$path" "${DEVICE[@]}" \
    --json "$OUT/$step.json" ${limit[@]+"${limit[@]}"} "$@"
  cat "$OUT/$step.log" 2>/dev/null | grep -v '^USDT\|^ERROR:.*gpuGetDeviceCount'
}
script largest "real largest batch under a cap" benchmarks/real_largest_batch.py "${LARGEST[@]}"
script small "small-batch step times" benchmarks/small_batch.py "${SMALL[@]}"
script profile "streams and kernels" benchmarks/profile_steps.py "${PROFILE[@]}"

PYTEST=(python -m pytest -m gpu -p no:cacheprovider)

# tests: one pytest process per GPU test file, lightest first, the graphed tests last; each may
# use what is left of the step but FLOOR seconds per file after it. gpu_tests.log has one line
# per file, gpu_tests_NAME.log its output (-v: a file cut at its limit still shows which tests
# passed; --durations: what to budget next time).
GPU_TEST_FILES=(tests/test_pareprop_gpu.py tests/test_engine_gpu.py)
for f in $(grep -l 'pytest.mark.gpu' tests/test_*.py | sort); do
  [[ " ${GPU_TEST_FILES[*]} " == *" $f "* ]] || GPU_TEST_FILES+=("$f")
done
gpu_tests() {
  local end=$((SECONDS + $1)) i=0 n=${#GPU_TEST_FILES[@]} f name a rc worst=0
  for f in "${GPU_TEST_FILES[@]}"; do
    i=$((i + 1))
    name=$(basename "$f" .py)
    a=$(part_limit "$end" $((n - i)))
    if ((a < 2 * GRACE)); then
      echo "$f: not run (only ${a} s left)"
      worst=1
      continue
    fi
    timeout -k "$GRACE" "$((a - GRACE))" "${PYTEST[@]}" -v --durations=10 "$f" \
      >"$OUT/gpu_tests_$name.log" 2>&1
    rc=$?
    if ((rc == 124 || rc == 137)); then
      echo "$f: timed out after $((a - GRACE)) s ($(grep -c ' PASSED' "$OUT/gpu_tests_$name.log") passed by then)"
    else
      echo "$f: $(tail -n 1 "$OUT/gpu_tests_$name.log" | tr -d '=' | sed 's/^ *//; s/ *$//')"
    fi
    ((rc != 0 && rc != 5)) && worst=$rc  # 5: nothing collected
  done
  return "$worst"
}
a=$(allowance tests)
if ((a >= MIN_STAGE)); then
  t0=$SECONDS
  echo "== tests (up to ${a} s, log: $OUT/gpu_tests.log)"
  gpu_tests "$((a - GRACE))" | tee "$OUT/gpu_tests.log"
  step_done tests "${PIPESTATUS[0]}" "$t0" "${#GPU_TEST_FILES[@]} files"
else
  step_done tests skipped "$SECONDS" "only ${a} s left"
fi

# controls: each cross-stream wait of the PaReprop schedule dropped in turn; the tests that can
# catch a dropped wait must then fail, eager and captured as CUDA graphs alike (tests/conftest.py
# skips the rest of a group, eager or graphed, after its first failure). CONTROL_TESTS, in this
# order: the lane tests, each built to catch one wait (CATCHER), then the slowed blocks of the
# engine tests and the graphed PaReprop tests; -k keeps their PaReprop cases and leaves out
# the tests that start processes (warn, fsdp, ddp) or compile. Without CUDA they skip, so
# nothing can be caught: the dry run says so, after one start (the others would skip alike).
# A control that is not caught names the test built
# for it and whether the tests reached the wait at all (tests/conftest.py counts the drops).
CONTROL_TESTS=(tests/test_pareprop_gpu.py
               tests/test_engine_gpu.py::test_slowed_blocks_give_autograd_gradients
               tests/test_cuda_graphs_gpu.py)
CONTROL_SELECT="pareprop and not warn and not fsdp and not ddp and not compile"
declare -A CATCHER=(
  [recover-after-recover]=test_recover_waits_for_the_slowed_recomputation_above
  [recover-after-grads]=test_lifetime_guard_keeps_memory_a_slowed_reader_still_needs
  [grads-after-grads]=test_grads_wait_for_the_slowed_gradients_above
  [bottom-grads-after-grads]=test_grads_wait_for_the_slowed_gradients_above
  [join]=test_final_join_waits_for_block_0_on_the_side_lane)
controls() {
  local end=$((SECONDS + $1)) i=0 n name a rc log waits dropped reached eager graphed no_cuda=0
  # _Lanes.WAITS read from the source, not imported: no torch import to wait for
  waits=$(python -c 'import ast
tree = ast.parse(open("src/pareprop/engine/lanes.py").read())
found = [ast.literal_eval(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign)
         and [getattr(t, "id", None) for t in n.targets] == ["WAITS"]]
print(" ".join(found[0]))') || return 1
  n=$(wc -w <<<"$waits")
  for name in $waits; do
    i=$((i + 1))
    log="$OUT/control_$name.log"
    a=$(part_limit "$end" $((HAS_CUDA ? n - i : 0)))  # without CUDA one start decides
    if ((no_cuda)); then  # the same tests would skip again: no start spent on them
      echo "control $name: not run (the GPU tests skip without a CUDA device, as above)"
      continue
    fi
    if ((a < 2 * GRACE)); then
      echo "control $name: not run (only ${a} s left)"
      continue
    fi
    PAREPROP_DROP_WAIT=$name timeout -k 2 "$a" "${PYTEST[@]}" -q "${CONTROL_TESTS[@]}" \
      -k "$CONTROL_SELECT" >"$log" 2>&1
    rc=$?
    dropped=$(grep -oE 'dropped [0-9]+ times' "$log" | grep -oE '[0-9]+')
    eager=$(grep '^FAILED ' "$log" | grep -v graph | head -n 1 | cut -d' ' -f2)
    graphed=$(grep '^FAILED ' "$log" | grep graph | head -n 1 | cut -d' ' -f2)
    if [[ -n $eager ]]; then
      echo "control $name: caught by $eager; under CUDA graphs ${graphed:+by }${graphed:-NOT caught}"
    elif [[ -n $graphed ]]; then
      echo "control $name: caught under CUDA graphs only, by $graphed; NOT by the eager tests" \
        "(the test built to catch it: ${CATCHER[$name]:-none yet})"
    elif ((rc == 124 || rc == 137)); then
      echo "control $name: not decided (timed out after $a s)"
    elif ! grep -qE '[0-9]+ passed' "$log" && grep -qE '[0-9]+ skipped' "$log"; then
      echo "control $name: not run (the GPU tests skipped: no CUDA device)"
      no_cuda=1
    elif grep -qE '[0-9]+ passed' "$log"; then
      reached="the wait was dropped ${dropped:-?} times"
      [[ $dropped == 0 ]] && reached="no test reached the wait"
      echo "control $name: NOT caught (the tests passed; $reached); the test built to catch" \
        "it: ${CATCHER[$name]:-none yet: write one (docs/gpu.md, \"Negative controls\")}"
    else  # errors (collection, fixtures): no test decided it
      echo "control $name: not decided ($(tail -n 1 "$log"))"
    fi
  done
}
a=$(allowance controls)
if ((a >= MIN_STAGE)); then
  t0=$SECONDS
  echo "== controls (up to ${a} s, log: $OUT/controls.log)"
  controls "$((a - GRACE))" | tee "$OUT/controls.log"
  step_done controls "${PIPESTATUS[0]}" "$t0" "one wait dropped at a time"
else
  step_done controls skipped "$SECONDS" "only ${a} s left"
fi

echo
{
echo "summary:"
grep -h 'real/planned\|/ .* checkpointed: real' "$OUT/largest.log" 2>/dev/null | sed 's/^ */  /'
grep -h 'failed: \|skipped (time limit)' "$OUT/largest.log" 2>/dev/null | sed 's/^ */  /'
grep -h 'reversible/autograd\|fallback chose\|with graphs\|CUDA graphs:\| failed: \|skipped (' \
  "$OUT/small.log" 2>/dev/null | sed 's/^ */  /' | head -40
grep -h 'both busy\|copies\|failed: ' "$OUT/profile.log" 2>/dev/null | sed 's/^ */  /'
sed 's/^/  gpu tests: /' "$OUT/gpu_tests.log" 2>/dev/null
sed 's/^/  /' "$OUT/controls.log" 2>/dev/null
echo "total: ${SECONDS} s (limit ${TOTAL} s); results in $OUT"
} | tee "$OUT/summary.txt"
exit "$FAILED"
