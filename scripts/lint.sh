#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# The repository's style and lint gate: the pre-commit hooks of .pre-commit-config.yaml over every
# tracked file, with the tools the `lint` extra pins (pyproject.toml) and nothing downloaded:
#   black --check, isort --check-only, ruff check   over megatron_ext tests examples scripts
#   check-yaml, trailing whitespace, one final newline
#   bash -n                                          over the shell scripts (syntax only)
#   actionlint                                       over .github/workflows, when installed
# .ci/run and the GitHub workflows run this script, so CI and `pre-commit run --all-files` agree.
#
# Usage:
#   bash scripts/lint.sh          check; exits non-zero if any hook reports a problem (the
#                                 whitespace hooks also fix what they report)
#   bash scripts/lint.sh --fix    rewrite files with isort, black and `ruff check --fix`, then check
#
# Install the pinned tools with `pip install -e ".[lint]"`. actionlint is optional here: the
# GitHub CPU workflow installs it and sets REQUIRE_ACTIONLINT=1, which makes its absence an error.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

fix=0
case "${1:-}" in
    "") ;;
    --fix) fix=1 ;;
    -h | --help)
        sed -n '3,18p' "$0"
        exit 0
        ;;
    *)
        echo "lint.sh: unknown argument '$1' (use --fix or nothing)" >&2
        exit 2
        ;;
esac

python="${PYTHON:-python}"
for module in black isort ruff pre_commit pre_commit_hooks; do
    if ! "$python" -c "import $module" >/dev/null 2>&1; then
        echo "lint.sh: '$python' cannot import $module; install the pinned tools with" >&2
        echo '         python -m pip install -e ".[lint]"' >&2
        exit 2
    fi
done
# The hooks run the tools by name (language: system): the ones installed beside this Python.
PATH="$(dirname "$("$python" -c 'import sys; print(sys.executable)')"):$PATH"
export PATH

if ((fix)); then
    paths=()
    for p in megatron_ext tests examples scripts; do
        [[ -e "$p" ]] && paths+=("$p")
    done
    "$python" -m isort --quiet "${paths[@]}"
    "$python" -m black --quiet "${paths[@]}"
    "$python" -m ruff check --fix --quiet "${paths[@]}"
fi

if ! "$python" -m pre_commit run --all-files --show-diff-on-failure --color never; then
    echo "lint.sh: FAILED (the hooks above)" >&2
    ((fix)) || echo "lint.sh: 'bash scripts/lint.sh --fix' applies black, isort and ruff fixes" >&2
    exit 1
fi
echo "lint.sh: all checks passed"
