#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# On a GPU machine without megatron-core installed: for each megatron-core wheel given, install it
# into a private directory, then run the inference GPU unit tests, the functional case (off/on
# bitwise) and `python -m megatron_ext.bench inference`. Logs go to $OUT (default ./gpu_check).
#   bash gpu_check.sh WHEEL_0_16 [WHEEL_0_19]
set -uo pipefail
OUT=${OUT:-$PWD/gpu_check}
mkdir -p "$OUT"
ROOT=$(cd "$(dirname "$0")/../../../../.." && pwd)
BENCH_ARGS=${BENCH_ARGS:-""}
for wheel in "$@"; do
  tag=$(basename "$wheel" | sed -E 's/megatron_core-([0-9.]+)-.*/\1/')
  site=/tmp/site-$tag
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheel"
  export PYTHONPATH=$site:$ROOT PYTHONUNBUFFERED=1
  (cd "$ROOT" && timeout 50 python3 -m pytest -q -m gpu tests/unit_tests/inference \
      tests/unit_tests/testing -p no:cacheprovider) >"$OUT/gpu_tests_$tag.log" 2>&1
  echo "[$tag] gpu tests: rc=$? $(tail -1 "$OUT/gpu_tests_$tag.log")"
  (cd "$ROOT" && timeout 70 python3 \
      tests/functional_tests/test_cases/gpt/inference_static_active_slices/run_case.py \
      --out "$OUT/functional_$tag") >"$OUT/functional_$tag.log" 2>&1
  echo "[$tag] functional: rc=$? $(tail -1 "$OUT/functional_$tag.log")"
  # shellcheck disable=SC2086
  (cd "$ROOT" && timeout 150 python3 -m megatron_ext.bench inference --out "$OUT/bench_$tag" \
      $BENCH_ARGS) >"$OUT/bench_$tag.log" 2>&1
  echo "[$tag] bench: rc=$?"
  grep -v "Warning\|warnings.warn" "$OUT/bench_$tag.log" | tail -30
done
