#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# The GPU suite: what the GitHub GPU job runs and what a developer runs by hand on a GPU machine.
#
#   bash scripts/run_gpu_suite.sh [--wheels DIR] [--site DIR] [--results DIR] [--generate-golden]
#                                 [--skip-unit] [--skip-survey] [--skip-sanitizer]
#                                 [--skip-functional] [--skip-bench] [--quick-bench]
#                                 [--repeat-unit N] [--repeat-test NAME:N]
#                                 [--unit-paths "PATH..."] [--bench NAME]
#                                 [--megatron-lm DIR]
#
#   --wheels DIR       install the wheels in DIR (a megatron-core release, say) into a private
#                      site directory first, for machines without network access
#   --site DIR         a directory of installed packages put first on PYTHONPATH (another Triton,
#                      say: the GPU matrix runs the suite once per Triton this way)
#   --results DIR      where logs, JUnit XML, benchmark JSON/PNG and summary.md go (./results)
#   --generate-golden  write the functional cases' golden values for this machine instead of
#                      comparing with them
#   --skip-survey      leave out the survey of megatron-core's kernels for launch-to-launch races
#   --repeat-unit N    run the GPU unit tests N times in a row (a race shows as a flaky failure)
#   --repeat-test NAME:N  run the test function NAME N times among the others (tests/conftest.py):
#                      a rare race under the suite's load, shown gone
#   --unit-paths P     run only these test paths (default: tests/unit_tests), e.g. while iterating
#                      on one component: "tests/unit_tests/inference tests/unit_tests/testing"
#   --bench NAME       rope, inference, mla-serving, mla-engine or all (default; all but
#                      mla-engine, which runs only when named): which benchmarks to run
#   --megatron-lm DIR  also run megatron-core's own unit tests from this Megatron-LM checkout (at
#                      the installed release's tag) stock and with megatron_ext swapped in
#                      (scripts/run_megatron_core_tests.py; MEGATRON_LM_TEST_FILES picks files)
#
# Each step runs even when an earlier one failed; the exit code is non-zero if any failed. The
# last thing printed is a summary table (also written to RESULTS/summary.md), with the counts of
# launches and of launches whose bits differed from the relaunch tests and the race survey
# (RESULTS/relaunch: one JSON report per test, tables.md with every config).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

wheels="" site="" results="$repo/results" golden="" quick="" megatron_lm=""
repeat_unit=1 repeat_test="" unit_paths="tests/unit_tests" bench="all"
skip_unit="" skip_survey="" skip_san="" skip_func="" skip_bench=""
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift ;;
    --site) site=$(cd "$2" && pwd) || exit 2; shift ;;
    --results) results="$2"; shift ;;
    --generate-golden) golden="--generate-golden" ;;
    --skip-unit) skip_unit=1 ;;
    --skip-survey) skip_survey=1 ;;
    --skip-sanitizer) skip_san=1 ;;
    --skip-functional) skip_func=1 ;;
    --skip-bench) skip_bench=1 ;;
    --quick-bench) quick="--quick" ;;
    --repeat-unit) repeat_unit="$2"; shift ;;
    --repeat-test) repeat_test="--repeat-test=$2"; shift ;;
    --unit-paths) unit_paths="$2"; shift ;;
    --bench) bench="$2"; shift ;;
    --megatron-lm) megatron_lm="$2"; shift ;;
    -h|--help) sed -n '3,35p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$results"
results=$(cd "$results" && pwd)
# The relaunch tests and the race survey write their counts here (one JSON file each).
relaunch="$results/relaunch"
rm -rf "$relaunch"
mkdir -p "$relaunch"
export MEGATRON_EXT_REPORT_DIR="$relaunch"

if [ -n "$site" ]; then
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -n "$wheels" ]; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl \
    || { echo "could not install the wheels in $wheels" >&2; exit 2; }
  export PYTHONPATH="$site:$repo${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1

python3 - <<'PY' 2>&1 | tee "$results/environment.txt"
import platform, torch, triton
from megatron.core import package_info
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
print(f"python {platform.python_version()} | torch {torch.__version__} | triton {triton.__version__}"
      f" | megatron-core {package_info.__version__} | {gpu}")
PY

if ! python3 -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no CUDA device: the GPU suite needs one (CPU tests: see README)" >&2
  exit 2
fi

declare -a names statuses secs
failed=0
step() {  # step NAME LOGFILE CMD...
  local name=$1 log=$2; shift 2
  local t0=$SECONDS rc
  echo "=== $name: $*"
  "$@" > >(tee "$results/$log") 2>&1
  rc=$?
  names+=("$name"); secs+=($((SECONDS - t0)))
  if [ $rc -eq 0 ]; then statuses+=("pass"); else statuses+=("FAIL (rc=$rc)"); failed=1; fi
}

if [ -z "$skip_unit" ]; then
  # pytest-xdist, where installed, overlaps the Triton compiles of the many kernel configs
  # (GPU_SUITE_WORKERS processes, 6 by default).
  xdist=""
  python3 -c 'import xdist' 2>/dev/null && xdist="-n ${GPU_SUITE_WORKERS:-6}"
  for i in $(seq 1 "$repeat_unit"); do
    tag=""
    [ "$repeat_unit" -gt 1 ] && tag=" (run $i of $repeat_unit)"
    # shellcheck disable=SC2086
    step "GPU unit tests$tag" "unit$i.log" \
      python3 -m pytest $unit_paths -m gpu -q -rs -p no:cacheprovider $xdist $repeat_test \
        --junitxml="$results/unit$i.xml"
  done
fi

if [ -n "$megatron_lm" ]; then
  # shellcheck disable=SC2086
  step "megatron-core's unit tests, stock vs megatron_ext" megatron_core_tests.log \
    python3 scripts/run_megatron_core_tests.py --megatron-lm "$megatron_lm" \
      --out "$results/megatron_core_tests" ${MEGATRON_LM_TEST_FILES:+--files $MEGATRON_LM_TEST_FILES}
fi

if [ -z "$skip_survey" ]; then
  # Observations of megatron-core's kernels (its query backward races); fails only on an error.
  survey_quick=""
  if [ -n "$quick" ]; then survey_quick="--quick"; fi
  step "megatron-core race survey" race_survey.log \
    python3 -m tests.unit_tests.fusions.mla_rope.survey_megatron_core_races --out "$relaunch" \
      $survey_quick
fi

if [ -z "$skip_func" ]; then
  # Cases that need more GPUs than this machine has are listed as NOT RUN, not failed.
  step "functional cases" functional.log \
    python3 tests/functional_tests/python_test_utils/run_functional_case.py \
      tests/functional_tests/test_cases --out "$results/functional" --allow-missing-hardware $golden
fi

if [ -z "$skip_bench" ]; then
  if [ "$bench" = all ] || [ "$bench" = rope ]; then
    step "benchmark rope" bench_rope.log python3 -m megatron_ext.bench rope --out "$results" $quick
  fi
  if [ "$bench" = all ] || [ "$bench" = inference ]; then
    step "benchmark inference" bench_inference.log \
      python3 -m megatron_ext.bench inference --out "$results" $quick
  fi
  if [ "$bench" = all ] || [ "$bench" = mla-serving ]; then
    step "benchmark mla-serving" bench_mla_serving.log \
      python3 -m megatron_ext.bench mla-serving --out "$results" $quick
  fi
  if [ "$bench" = mla-engine ]; then
    step "benchmark mla-engine" bench_mla_engine.log \
      python3 -m megatron_ext.bench mla-engine --out "$results" $quick
  fi
fi

if [ -z "$skip_san" ]; then
  if command -v compute-sanitizer >/dev/null 2>&1; then
    step "compute-sanitizer memcheck" sanitizer_memcheck.log \
      compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m tests.unit_tests.fusions.sanitize_mla_rope
    # racecheck instruments every shared-memory access and is far slower: fewer shapes.
    step "compute-sanitizer racecheck" sanitizer_racecheck.log \
      compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 -m tests.unit_tests.fusions.sanitize_mla_rope --quick
    for tool in memcheck racecheck; do
      step "compute-sanitizer $tool, top-k draw" "sanitizer_top_k_$tool.log" \
        compute-sanitizer --tool "$tool" --error-exitcode 1 \
          python3 tests/unit_tests/fusions/sanitize_top_k_sampling.py
    done
    step "compute-sanitizer memcheck, MLA latent cache" sanitizer_mla_latent_cache_memcheck.log \
      compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 -m tests.unit_tests.fusions.sanitize_mla_latent_cache
    step "compute-sanitizer racecheck, MLA latent cache" sanitizer_mla_latent_cache_racecheck.log \
      compute-sanitizer --tool racecheck --error-exitcode 1 \
        python3 -m tests.unit_tests.fusions.sanitize_mla_latent_cache --quick
    # Whole engine steps: megatron-core's dynamic engine with both flags (its context, the
    # projections, every kernel of a step) on the functional case's model, with chunked prefill
    # (64-token steps) and a cache of 10 blocks that pauses and evicts requests; memcheck only
    # (racecheck of every torch kernel would take far longer). torch's caching allocator stays
    # on: the context captures CUDA graphs, and a capture cannot cudaMalloc (without the cache,
    # the first capture fails with cudaErrorStreamCaptureUnsupported). Writes past a tensor into
    # pooled memory are the guard-region tests' part.
    step "compute-sanitizer memcheck, MLA dynamic engine steps" sanitizer_mla_dynamic_steps.log \
      compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 tests/functional_tests/test_cases/gpt/mla_dynamic_inference/run_case.py \
          --dtypes bfloat16 --num-requests 8 --prompt-length 4 90 --generate-length 1 12 \
          --max-tokens 64 --kv-blocks 10 --paused-kv-blocks 2 \
          --out "$results/sanitizer_mla_dynamic_steps"
  else
    names+=("compute-sanitizer"); statuses+=("not run: compute-sanitizer not found"); secs+=(0)
  fi
fi

{
  echo "## megatron_ext GPU suite"
  echo
  echo "\`$(cat "$results/environment.txt" | tail -n 1)\`"
  echo
  echo "| step | result | seconds |"
  echo "| --- | --- | --- |"
  for i in "${!names[@]}"; do echo "| ${names[$i]} | ${statuses[$i]} | ${secs[$i]} |"; done
  if compgen -G "$relaunch/*.json" >/dev/null; then
    echo; echo "### Relaunched kernels"; echo
    python3 -m tests.unit_tests.fusions.mla_rope.survey_megatron_core_races --summarize "$relaunch"
  fi
  if [ -f "$results/functional/summary.md" ]; then echo; cat "$results/functional/summary.md"; fi
  if [ -f "$results/megatron_core_tests.log" ]; then
    echo; sed -n '/^| test file/,$p' "$results/megatron_core_tests.log"
  fi
  for log in bench_rope.log bench_inference.log bench_mla_serving.log bench_mla_engine.log; do
    if [ -f "$results/$log" ]; then
      echo; echo '```'; sed -n '/^=== table/,$p' "$results/$log" | tail -n +2; echo '```'
    fi
  done
} > "$results/summary.md"
echo
cat "$results/summary.md"
exit $failed
