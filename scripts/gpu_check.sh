#!/usr/bin/env bash
# Every CUDA path of the project, checked in one command on a GPU machine (within 9 minutes):
#
#   bash scripts/gpu_check.sh [OUTDIR]          # from the repository root; OUTDIR defaults to $OUT (the device
#                                               # tool's folder that comes back), else ./gpu_check_out
#
# Needs the machine's Python with torch (PYTHON, default python3) and .gpu_bundle/ (GPU_BUNDLE), which
# scripts/gpu_bundle.sh builds where there is network: its wheels are installed with
# `pip install --no-deps --target /tmp/site` (GPU_CHECK_SITE) and its etcd is put on PATH. Then, in this order
# (a step gets at most what is left of GPU_CHECK_BUDGET_S, 540 s, so a slow run loses the last steps first):
#   tests       pytest -m cuda over the test files with CUDA tests (the S3 params only if moto is there)
#   checkpoint  bench/checkpoint_bench.py --device cuda --state-gib 1 --repeats 2 --no-s3 (the figures of the H100
#               runs: blocking, stall, write and load against dd)
#   stall       bench/checkpoint_bench.py --device cuda --parts stall --repeats 2 --no-s3: issue 29's size, 3 GiB of
#               MLP + AdamW state and the benchmark's own step (36 ms on an H200): the next steps' stall after a
#               save (device-side and straight to the host), the warmed first save against its second
#   overhead    bench/loop_overhead_bench.py --device cuda --rounds 1 --steps 300 --state-gib 1.5
#               --save-every 0,50,absorbed: plain DDP and the elastic loop, without snapshots, with one every 50
#               steps (as measured before) and every K steps, the shortest interval the disk absorbs
#               (bench/_disk.py: state / interval <= 0.8 x dd), which issue 29's >= 0.95 goal is about
#   live        bench/gpu_live_check.py: torchrun on NCCL at world size 1, recovery=live, the worker SIGKILLed
# Each step runs under `timeout`; a summary table follows, then issue 29's goals as measured, with summary.json
# and each step's output in OUTDIR.
# GPU_CHECK_STEPS=stall,overhead runs only the steps named (the install always runs): a second run within the
# session's device time, for a step that failed or needs a second measurement.
# Exit status: 0 all passed (or skipped), 1 a step failed, 2 no CUDA device.
# GPU_CHECK_ALLOW_CPU=1 runs it without CUDA (a dry run of the plumbing: gloo, the CPU forms, tiny sizes).
set -u
cd "$(dirname "$0")/.." || exit 1
REPO=$(pwd)
PY=${PYTHON:-python3}
BUNDLE=${GPU_BUNDLE:-.gpu_bundle}
SITE=${GPU_CHECK_SITE:-/tmp/site}
BUDGET=${GPU_CHECK_BUDGET_S:-540}
TOOL="$PY $REPO/scripts/gpu_check_tool.py"
START=$(date +%s)

env -u PYTHONPATH "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)' 2>/dev/null
probe=$?
if [ "$probe" = 0 ]; then
  DEVICE=cuda
elif [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ] && [ "$probe" = 3 ]; then
  DEVICE=cpu
  echo "gpu_check: no CUDA device: a CPU dry run (GPU_CHECK_ALLOW_CPU=1): gloo, tiny sizes; the CUDA tests skip" >&2
else
  why="torch.cuda.is_available() is False"
  if [ "$probe" != 3 ]; then why="$PY cannot import torch"; fi
  echo "gpu_check: no CUDA device ($why); nothing checked. GPU_CHECK_ALLOW_CPU=1 makes a CPU dry run" >&2
  exit 2
fi
OUT=$(d=${1:-${OUT:-gpu_check_out}} && mkdir -p "$d" && cd "$d" && pwd)  # the device tool's $OUT comes back

: >"$OUT/steps.tsv"
record() {  # step status seconds figure [result file]
  printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5:-}" >>"$OUT/steps.tsv"
  echo "gpu_check: $1: $2 ($3 s) $4"
}
# run STEP CAP CMD...: CMD under timeout (CAP seconds, or what is left of the budget); its output in OUT/STEP.log
run() {
  local step=$1 cap=$2 left t0
  shift 2
  left=$((BUDGET - ($(date +%s) - START)))
  if [ "$left" -lt "$cap" ]; then cap=$left; fi
  if [ "$cap" -lt 10 ]; then echo "gpu_check: $step: no time left" >"$OUT/$step.log"; RC=124; ELAPSED=0; return; fi
  echo "gpu_check: $step (at most ${cap} s): $*"
  t0=$(date +%s%N)
  timeout --kill-after=10 "$cap" "$@" >"$OUT/$step.log" 2>&1
  RC=$?
  t0=$((($(date +%s%N) - t0) / 100000000))  # tenths of a second
  ELAPSED="$((t0 / 10)).$((t0 % 10))"
  if [ "$RC" = 124 ] || [ "$RC" = 137 ]; then echo "timed out after ${cap} s" >>"$OUT/$step.log"; fi
}
failed_figure() { echo "exit $RC$([ "$RC" = 124 ] && echo ' (timed out)'): $(tail -n 1 "$OUT/$1.log" | cut -c1-100)"; }
# wanted STEP: whether GPU_CHECK_STEPS (comma-separated; empty: all) names STEP; a step left out is recorded SKIP
STEPS=${GPU_CHECK_STEPS:-}
wanted() {
  if [ -z "$STEPS" ] || [[ ",$STEPS," == *",$1,"* ]]; then return 0; fi
  record "$1" SKIP 0 "not in GPU_CHECK_STEPS=$STEPS"
  return 1
}

# 0. the bundle: wheels into SITE, etcd on PATH
rm -rf "$SITE" && mkdir -p "$SITE/bin"
export PY REPO BUNDLE SITE
# shellcheck disable=SC2016  # expanded by the inner bash
run install 60 bash -c 'env -u PYTHONPATH "$PY" "$REPO/scripts/gpu_check_tool.py" install "$BUNDLE" "$SITE" \
  && gunzip -c "$BUNDLE/etcd.gz" >"$SITE/bin/etcd" && chmod +x "$SITE/bin/etcd" && "$SITE/bin/etcd" --version | head -1'
if [ "$RC" = 0 ]; then
  record install PASS "$ELAPSED" "$(grep '^installed' "$OUT/install.log"); $(tail -n 1 "$OUT/install.log")"
else
  record install FAIL "$ELAPSED" "$(failed_figure install)"
fi
export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the working tree's code first; SITE: deps, entry points
export PATH="$SITE/bin:$PATH"
export PYTHONUNBUFFERED=1

# a. the CUDA tests
if wanted tests; then
mapfile -t files < <(grep -rlE 'pytest\.mark\.cuda|marks=.*\bcuda\b|^@cuda_only' tests --include='test_*.py' | sort)
select=(-m cuda)
if ! "$PY" -c 'import moto, s3fs' 2>/dev/null; then select=(-m cuda -k 'not s3'); fi
# -v and --durations: a step cut off by its cap still names the test it was in and the slow ones
run tests 200 "$PY" -m pytest -p no:cacheprovider -v -rs --durations=15 "${select[@]}" --junitxml="$OUT/tests.xml" \
  "${files[@]}"
counts=$([ -f "$OUT/tests.xml" ] && $TOOL junit "$OUT/tests.xml" || echo "no junit XML")
[ "${#select[@]}" -gt 2 ] && counts="$counts; S3 params deselected (no moto/s3fs in the bundle)"
if [ "$RC" != 0 ]; then record tests FAIL "$ELAPSED" "$counts; $(failed_figure tests)" "$OUT/tests.xml"
elif [[ $counts == 0\ passed* ]]; then
  if [ "$DEVICE" = cuda ]; then record tests FAIL "$ELAPSED" "nothing ran: $counts" "$OUT/tests.xml"
  else record tests SKIP "$ELAPSED" "no CUDA: $counts (${#files[@]} files)" "$OUT/tests.xml"; fi
else record tests PASS "$ELAPSED" "$counts (${#files[@]} files)" "$OUT/tests.xml"; fi
fi

# b. the benchmarks (on CPU: tiny sizes, the plumbing only): the checkpoint figures at 1 GiB as before, then issue
# 29's: the stall at 3 GiB (the benchmark's own step), the loop's rate at 1.5 GiB
if [ "$DEVICE" = cuda ]; then size=(--state-gib 1 --repeats 2); big=()
else size=(--state-gib 0.02 --repeats 2); big=(--state-gib 0.02); fi
if wanted checkpoint; then
run checkpoint 90 "$PY" bench/checkpoint_bench.py --device "$DEVICE" "${size[@]}" --no-s3 --out "$OUT/checkpoint.json"
if [ "$RC" = 0 ]; then
  record checkpoint PASS "$ELAPSED" "$($TOOL figure checkpoint "$OUT/checkpoint.json")" "$OUT/checkpoint.json"
else record checkpoint FAIL "$ELAPSED" "$(failed_figure checkpoint)"; fi
fi

if wanted stall; then
run stall 120 "$PY" bench/checkpoint_bench.py --device "$DEVICE" "${big[@]}" --parts stall --repeats 2 --no-s3 \
  --out "$OUT/stall.json"
if [ "$RC" = 0 ]; then record stall PASS "$ELAPSED" "$($TOOL figure checkpoint "$OUT/stall.json")" "$OUT/stall.json"
else record stall FAIL "$ELAPSED" "$(failed_figure stall)"; fi
fi

# one round: no snapshots, one every 50 steps, one every K (the shortest interval the disk absorbs); 1.5 GiB of state
if [ "$DEVICE" = cuda ]; then steps=(--steps 300 --state-gib 1.5 --save-every "0,50,absorbed")
else steps=(--steps 40 --warmup 5 --save-every "0,20,absorbed"); fi
if wanted overhead; then
run overhead 240 "$PY" bench/loop_overhead_bench.py --device "$DEVICE" --rounds 1 "${steps[@]}" \
  --json "$OUT/loop_overhead.json"
if [ "$RC" = 0 ]; then
  record overhead PASS "$ELAPSED" "$($TOOL figure overhead "$OUT/loop_overhead.json")" "$OUT/loop_overhead.json"
else record overhead FAIL "$ELAPSED" "$(failed_figure overhead)"; fi
fi

# c. live recovery under torchrun, a worker SIGKILLed (on CPU: gloo)
if wanted live; then
run live 90 "$PY" bench/gpu_live_check.py --device "$DEVICE" --timeout 75 --json "$OUT/live.json"
if [ "$RC" = 0 ]; then record live PASS "$ELAPSED" "$($TOOL figure live "$OUT/live.json")" "$OUT/live.json"
else record live FAIL "$ELAPSED" "$(failed_figure live)" "$OUT/live.json"; fi
fi

echo "gpu_check: device $DEVICE, $("$PY" -c 'import torch; print("torch", torch.__version__, *([torch.cuda.get_device_name(0)]
  if torch.cuda.is_available() else []))' 2>/dev/null), $(($(date +%s) - START)) s in all"
$TOOL summary "$OUT"
