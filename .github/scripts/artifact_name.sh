#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# Prints an upload-artifact name made from its arguments: joined with '-', with every character
# that artifact names may not contain ('/', '\', ':', '<', '>', '|', '*', '?', '"', spaces) turned
# into '_'. With GITHUB_ENV set, also exports it as ARTIFACT_NAME for the following steps.
#
# Usage: bash .github/scripts/artifact_name.sh functional mcore0.16.1 gpt/some_case
set -euo pipefail

name="$(
    IFS=-
    echo "$*"
)"
name="${name//[\/\\:<>|*?\" ]/_}"
echo "$name"
if [[ -n "${GITHUB_ENV:-}" ]]; then
    echo "ARTIFACT_NAME=$name" >>"$GITHUB_ENV"
fi
