#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# Appends a Markdown file (e.g. the GPU suite's summary.md with its benchmark table) to the GitHub
# job summary, under an optional heading. A missing file is reported in the summary rather than
# failing the step: the step runs `if: always()`, after a suite that may have stopped early.
#
# Usage: bash .github/scripts/append_step_summary.sh FILE [HEADING]
set -euo pipefail

file="${1:?usage: append_step_summary.sh FILE [HEADING]}"
heading="${2:-}"
summary="${GITHUB_STEP_SUMMARY:-/dev/stdout}"

{
    if [[ -n "$heading" ]]; then
        printf '## %s\n\n' "$heading"
    fi
    if [[ -s "$file" ]]; then
        cat "$file"
        printf '\n'
    else
        printf '_%s was not written (the run stopped before its summary; see the log)._\n\n' "$file"
    fi
} >>"$summary"
