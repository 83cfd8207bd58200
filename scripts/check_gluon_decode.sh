#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# Everything the Gluon decode kernel must pass on a Hopper GPU before a ring, order or program
# order becomes the launcher's, for one variant, in one call; a summary table last.
#
#   bash scripts/check_gluon_decode.sh [--variant KT,B,ORDER,PB,HF] [--results DIR]
#                                      [--skip-sweep] [--skip-profile]
#
#   --variant   the kernel's key tile, buffers, consumer 0's order, P buffers and heads-first
#               (as scripts/sweep_gluon_decode.py names them; default: the launcher's own)
#   --results   where the logs go (./results/gluon_decode)
#
# Steps: the GPU tests (tests/unit_tests/fusions/mla_latent/test_decode_gluon_gpu.py), memcheck
# and racecheck of the Gluon cases (tests/unit_tests/fusions/sanitize_mla_latent_cache.py
# --gluon-only), racecheck of the partitions' handoff alone in five forms
# (scripts/racecheck_mbarrier_handoff.py),
# the sweep beside stage 1 and FlashInfer where installed (scripts/sweep_gluon_decode.py), the
# kernel's own timeline at 128 heads (scripts/trace_gluon_decode.py), and Nsight Compute on one
# 128-head launch (scripts/profile_gluon_decode.py). The variant is applied
# by setting the launch layer's constants before anything is planned, as the launcher would
# read them. Each step runs even when an earlier one failed; the exit code is non-zero if any did.
set -uo pipefail
cd "$(dirname "$0")/.."

variant="" results="results/gluon_decode" skip_sweep="" skip_profile=""
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) variant="$2"; shift ;;
    --results) results="$2"; shift ;;
    --skip-sweep) skip_sweep=1 ;;
    --skip-profile) skip_profile=1 ;;
    -h|--help) sed -n '3,21p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done

# The variant set on the launch layer (scripts/sweep_gluon_decode.py's apply_variant) in each
# step's process, checked before any step runs.
export CHECK_GLUON_VARIANT="$variant"
setup="import os, sys; sys.path.insert(0, 'scripts')"
if [ -n "$variant" ]; then
  setup="$setup; from sweep_gluon_decode import apply_variant"
  setup="$setup; apply_variant(os.environ['CHECK_GLUON_VARIANT'])"
  python3 -c "import os, sys; sys.path.insert(0, 'scripts')
from sweep_gluon_decode import parse_variant
try:
    parse_variant(os.environ['CHECK_GLUON_VARIANT'])
except ValueError as error:
    sys.exit(f'--variant: {error}')" || exit 2
fi
mkdir -p "$results"

summary=()
failed=0
step() {  # step NAME LOG COMMAND...
  local name="$1" log="$results/$2" start=$SECONDS
  shift 2
  "$@" >"$log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || failed=1
  summary+=("$(printf '| %-44s | %-6s | %5d s | %s |' "$name" \
    "$([ $rc -eq 0 ] && echo ok || echo FAILED)" $((SECONDS - start)) "$(tail -1 "$log" | cut -c1-60)")")
}

step "GPU tests" gpu_tests.log python3 -c "$setup
import sys, pytest
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider',
                      'tests/unit_tests/fusions/mla_latent/test_decode_gluon_gpu.py']))"
for tool in memcheck racecheck; do
  quick=""
  [ "$tool" = racecheck ] && quick=", '--quick'"
  step "compute-sanitizer $tool, Gluon cases" "sanitizer_$tool.log" \
    compute-sanitizer --tool "$tool" --error-exitcode 1 python3 -c "$setup
import sys
sys.argv = ['sanitize', '--gluon-only'$quick]
from tests.unit_tests.fusions import sanitize_mla_latent_cache
sys.exit(sanitize_mla_latent_cache.main())"
done
# The handoff alone, plain and with what the kernel adds to it, one at a time and all together:
# which form racecheck reports tells whose pattern the kernel's hazards are.
for form in "" --mma-rows --fence --third-partition "--mma-rows --fence --third-partition"; do
  name="${form:-plain}"
  # shellcheck disable=SC2086  # the form is a list of options
  step "compute-sanitizer racecheck, handoff ${name//--/}" \
    "racecheck_handoff$(echo "$name" | tr -d ' -').log" \
    compute-sanitizer --tool racecheck --error-exitcode 1 \
      python3 scripts/racecheck_mbarrier_handoff.py $form
done
if [ -z "$skip_sweep" ]; then
  step "sweep beside stage 1 and FlashInfer" sweep.log \
    python3 scripts/sweep_gluon_decode.py --out "$results/sweep.json" \
      --variants 32,4,1,1,1 64,2,3,1,1 ${variant:+"$variant"}
fi
step "timeline, 32 x 8k and 128 x 2k, 128 heads" trace.log \
  python3 scripts/trace_gluon_decode.py --shapes 32,8192,128 128,2048,128 \
    ${variant:+--variant "$variant"} --out "$results/trace.json"
if [ -z "$skip_profile" ]; then
  step "Nsight Compute, 128 x 2k, 128 heads" profile.log \
    python3 scripts/profile_gluon_decode.py --shape 128 2048 128 \
      ${variant:+--variant "$variant"} --out "$results/profile"
fi

if [ -z "$skip_sweep" ]; then
  sed -n '/GPU us per call/,$p' "$results/sweep.log"
fi
echo
echo "Gluon decode checks, variant ${variant:-as launched} (logs: $results)"
echo "| step | result | time | last line |"
echo "| --- | --- | ---: | --- |"
printf '%s\n' "${summary[@]}"
exit $failed
