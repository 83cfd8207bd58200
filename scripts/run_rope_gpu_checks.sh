#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# The MLA RoPE part of the GPU suite, for iterating on the kernels and their launch path:
# the GPU unit tests of megatron_ext/fusions and megatron_ext/transformer, then the RoPE benchmark.
#
#   bash scripts/run_rope_gpu_checks.sh [--results DIR] [--quick-bench] [--skip-tests]
#                                       [--skip-bench]
#
# Logs go to DIR (./results/rope by default); the benchmark table is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."

results="results/rope" quick="" skip_tests="" skip_bench=""
while [ $# -gt 0 ]; do
  case "$1" in
    --results) results="$2"; shift ;;
    --quick-bench) quick="--quick" ;;
    --skip-tests) skip_tests=1 ;;
    --skip-bench) skip_bench=1 ;;
    -h|--help) sed -n '3,10p' "$0"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$results"
export PYTHONUNBUFFERED=1
failed=0

python3 -c 'import platform, torch, triton; from megatron.core import package_info as p; print(
    f"python {platform.python_version()} | torch {torch.__version__} | triton {triton.__version__}"
    f" | megatron-core {p.__version__} | {torch.cuda.get_device_name()}")' \
  2>&1 | tee "$results/environment.txt"

if [ -z "$skip_tests" ]; then
  xdist=""
  python3 -c 'import xdist' 2>/dev/null && xdist="-n 4"
  python3 -m pytest tests/unit_tests/fusions tests/unit_tests/transformer -m gpu -q -rs \
    -p no:cacheprovider $xdist --junitxml="$results/unit.xml" > "$results/unit.log" 2>&1 \
    || failed=1
  tail -n 25 "$results/unit.log"
fi

if [ -z "$skip_bench" ]; then
  python3 -m megatron_ext.bench rope --out "$results" $quick > "$results/bench_rope.log" 2>&1 \
    || failed=1
  echo
  sed -n '/^=== table/,$p' "$results/bench_rope.log"
  grep -q '^=== table' "$results/bench_rope.log" || tail -n 30 "$results/bench_rope.log"
fi
exit $failed
