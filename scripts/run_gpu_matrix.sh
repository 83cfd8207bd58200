#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# The GPU suite over a matrix of Triton releases and megatron-core releases: the kernels' bits must
# follow megatron-core's as each Triton compiles them (fusions/mla_rope/pairing.py), so every
# supported Triton is a row of its own.
#
#   bash scripts/run_gpu_matrix.sh --wheels "DIR..." [--tritons "NAME=SITE..."] [--results DIR]
#                                  [--unit-paths "PATH..."] [--jobs N] [--bench] [--sanitizer]
#
#   --wheels DIRS      one directory of wheels per megatron-core release (run_gpu_suite --wheels)
#   --tritons LIST     NAME=SITE pairs, SITE a directory holding that Triton installed (pip
#                      --target); NAME=image uses the environment's own (default: image=)
#   --results DIR      one folder per row below it, and summary.md (./results/matrix)
#   --unit-paths P     the GPU unit tests to run per row (default: the kernel tests)
#   --jobs N           rows of unit tests run at once (they share the GPU; default 3)
#   --bench            then, one row at a time, the quick RoPE benchmark per row
#   --sanitizer        then compute-sanitizer memcheck and racecheck of the RoPE kernels per Triton
#
# Rows of one Triton run one megatron-core release after another, so the second reuses the first's
# compiled kernels (the two releases ship the same kernel file). Prints a table last.
set -uo pipefail
cd "$(dirname "$0")/.."
wheels="" tritons="image=" results="results/matrix" jobs=3 bench="" san=""
paths="tests/unit_tests/fusions tests/unit_tests/determinism"
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift ;;
    --tritons) tritons="$2"; shift ;;
    --results) results="$2"; shift ;;
    --unit-paths) paths="$2"; shift ;;
    --jobs) jobs="$2"; shift ;;
    --bench) bench=1 ;;
    --sanitizer) san=1 ;;
    -h|--help) sed -n '3,20p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$wheels" ] || { echo "--wheels is required" >&2; exit 2; }
mkdir -p "$results"

suite() {  # suite NAME SITE WHEELS OUT ARGS...
  local name=$1 site=$2 whl=$3 out=$4; shift 4
  bash scripts/run_gpu_suite.sh ${site:+--site "$site"} --wheels "$whl" --results "$out" "$@" \
    > "$out.log" 2>&1
}

row_name() { echo "triton-$1_mcore-$(basename "$2" | sed 's/^megatron-core-//')"; }

unit_rows() {  # one Triton: every megatron-core release, in turn
  local name=$1 site=$2
  for whl in $wheels; do
    suite "$name" "$site" "$whl" "$results/$(row_name "$name" "$whl")" --unit-paths "$paths" \
      --skip-survey --skip-functional --skip-bench --skip-sanitizer
  done
}

running=0
for spec in $tritons; do
  unit_rows "${spec%%=*}" "${spec#*=}" &
  running=$((running + 1))
  if [ "$running" -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
done
wait

if [ -n "$bench" ] || [ -n "$san" ]; then
  for spec in $tritons; do
    name=${spec%%=*} site=${spec#*=}
    for whl in $wheels; do
      out="$results/$(row_name "$name" "$whl")-bench"
      if [ -n "$bench" ]; then
        suite "$name" "$site" "$whl" "$out" --skip-unit --skip-survey --skip-functional \
          --skip-sanitizer --bench rope --quick-bench
      fi
    done
    if [ -n "$san" ]; then
      whl=${wheels##* }
      suite "$name" "$site" "$whl" "$results/$(row_name "$name" "$whl")-sanitizer" \
        --skip-unit --skip-survey --skip-functional --skip-bench
    fi
  done
fi

{
  echo "| row | step | result | seconds |"
  echo "| --- | --- | --- | --- |"
  for summary in "$results"/*/summary.md; do
    row=$(basename "$(dirname "$summary")")
    sed '/^###/q' "$summary" | grep -E '^\| ' | grep -vE '^\| (step|---)' | sed "s/^|/| $row |/"
  done
  for log in "$results"/*/unit1.log; do
    [ -f "$log" ] || continue
    echo "$(basename "$(dirname "$log")"): $(grep -E '[0-9]+ (passed|failed)' "$log" | tail -n 1)"
  done
} > "$results/summary.md"
cat "$results/summary.md"
grep -q 'FAIL' "$results/summary.md" && exit 1
exit 0
