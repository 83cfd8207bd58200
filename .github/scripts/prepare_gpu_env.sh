#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# Prepares a self-hosted GPU runner for one job of .github/workflows/gpu-tests.yml.
#
# Runner contract: the runner image provides `python<X.Y>` for each Python version of the GPU
# matrix, each with a CUDA build of torch and triton already installed (e.g. a CUDA PyTorch
# container), and the NVIDIA driver. Nothing here installs torch: pip must never swap the image's
# CUDA torch for another build.
#
# What it does:
#   1. creates a virtual environment from python<X.Y> with --system-site-packages, so the image's
#      torch and triton stay visible while everything installed here stays inside the job;
#   2. checks that torch sees at least --min-gpus CUDA devices;
#   3. puts the megatron-core wheel of --mcore into --wheels-dir/megatron-core-<version>/
#      (downloaded from PyPI, unless a matching wheel is already there: offline runners can be
#      pre-seeded) and installs it into the environment;
#   4. with --transformer-engine VERSION, installs Transformer Engine the way
#      scripts/transformer_engine_offline.sh does (its torch extension built against the image's
#      torch release; the build is kept in --te-cache, default ~/.cache/megatron_ext/te); with
#      --flashinfer VERSION, FlashInfer's MLA decode the way scripts/flashinfer_offline.sh does
#      (the parts kept in ~/.cache/megatron_ext/flashinfer, the site in <venv>/flashinfer);
#   5. with --also-mcore VERSION (repeatable), puts that megatron-core release's wheel beside the
#      first in --wheels-dir/megatron-core-<version>/ without installing it (for
#      scripts/run_gpu_matrix.sh, which installs each release into a private site per row); with
#      --triton VERSION, installs that Triton release into <venv>/triton-<version> (pip --target,
#      no dependencies; a wheel already in --wheels-dir/triton-<version>/ is used offline), which
#      the job puts first on PYTHONPATH through run_gpu_matrix.sh's --tritons NAME=SITE;
#   6. with --server, installs the `server` extra of pyproject.toml (megatron-core 0.19's
#      OpenAI-compatible server's Quart/Hypercorn/ZMQ dependencies and the openai client), with
#      torch pinned to the image's so that pip cannot replace it;
#   7. on GitHub Actions, puts the environment first on PATH for the following steps and exports
#      MEGATRON_CORE_WHEELS (the folder holding the wheel, for `run_gpu_suite.sh --wheels`; with
#      --also-mcore, the folders of every release, space-separated, for `run_gpu_matrix.sh
#      --wheels`), TRITON_SITE (with --triton) and PYTHONPATH (the checkout, so megatron_ext
#      imports from it, Transformer Engine's and FlashInfer's sites).
#
# Usage:
#   bash .github/scripts/prepare_gpu_env.sh --python 3.12 --mcore 0.16.1 [--min-gpus 1]
#       [--venv DIR] [--wheels-dir DIR] [--transformer-engine VERSION] [--te-cache DIR]
#       [--flashinfer VERSION] [--server] [--also-mcore VERSION]... [--triton VERSION]
set -euo pipefail
cd "$(dirname "$0")/../.."

py_version=""
mcore=""
min_gpus=1
tmp="${RUNNER_TEMP:-${TMPDIR:-/tmp}}"
venv=""
wheels_root="$tmp/megatron-core-wheels"
te_version=""
te_cache="${HOME:-$tmp}/.cache/megatron_ext/te"
fi_version=""
server=""
also_mcore=()
triton_version=""

while (($#)); do
    case "$1" in
        --python) py_version="$2"; shift 2 ;;
        --mcore) mcore="$2"; shift 2 ;;
        --min-gpus) min_gpus="$2"; shift 2 ;;
        --venv) venv="$2"; shift 2 ;;
        --wheels-dir) wheels_root="$2"; shift 2 ;;
        --transformer-engine) te_version="$2"; shift 2 ;;
        --te-cache) te_cache="$2"; shift 2 ;;
        --flashinfer) fi_version="$2"; shift 2 ;;
        --server) server=1; shift ;;
        --also-mcore) also_mcore+=("$2"); shift 2 ;;
        --triton) triton_version="$2"; shift 2 ;;
        -h | --help) sed -n '3,41p' "$0"; exit 0 ;;
        *) echo "prepare_gpu_env.sh: unknown argument '$1'" >&2; exit 2 ;;
    esac
done
if [[ -z "$py_version" || -z "$mcore" ]]; then
    echo "prepare_gpu_env.sh: --python and --mcore are required" >&2
    exit 2
fi
venv="${venv:-$tmp/megatron-ext-py$py_version-mcore$mcore}"
wheels="$wheels_root/megatron-core-$mcore"

base_python="python$py_version"
if ! command -v "$base_python" >/dev/null 2>&1; then
    echo "prepare_gpu_env.sh: $base_python is not on this runner (see the runner contract above)" >&2
    exit 1
fi

echo "== virtual environment $venv (from $(command -v "$base_python"))"
rm -rf "$venv"
"$base_python" -m venv --system-site-packages "$venv"
python="$venv/bin/python"
# --system-site-packages only reaches the base interpreter's site-packages. Images often install
# torch into a virtual environment of their own: make its site-packages visible too (after the
# job environment's own, so what this job installs wins).
"$base_python" -c 'import site; print("\n".join(site.getsitepackages()))' \
    >"$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/runner_image.pth"

echo "== CUDA devices (need at least $min_gpus)"
"$python" - "$min_gpus" <<'PY'
import sys

import torch
import triton

need = int(sys.argv[1])
count = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
for index in range(count):
    print(f"  cuda:{index} {torch.cuda.get_device_name(index)}")
if count < need:
    sys.exit(f"found {count} CUDA device(s), this job needs {need}")
PY

shopt -s nullglob
# wheel_of NAME VERSION DIR: DIR's wheel of NAME==VERSION, downloaded there unless it is there.
wheel_of() {
    local name=$1 version=$2 dir=$3 file
    file=${name//-/_}
    mkdir -p "$dir"
    local found=("$dir"/"$file"-"$version"-*.whl)
    if ((${#found[@]} == 0)); then
        "$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$dir" \
            "$name==$version" >&2
        found=("$dir"/"$file"-"$version"-*.whl)
    fi
    if ((${#found[@]} == 0)); then
        echo "prepare_gpu_env.sh: no $name $version wheel for Python $py_version" >&2
        exit 1
    fi
    printf '%s\n' "${found[@]}"
}

echo "== megatron-core $mcore wheel in $wheels"
mapfile -t found < <(wheel_of megatron-core "$mcore" "$wheels")
((${#found[@]})) || exit 1
all_wheels="$wheels"
for extra in "${also_mcore[@]}"; do
    echo "== megatron-core $extra wheel in $wheels_root/megatron-core-$extra (not installed)"
    mapfile -t extra_found < <(wheel_of megatron-core "$extra" "$wheels_root/megatron-core-$extra")
    ((${#extra_found[@]})) || exit 1
    all_wheels="$all_wheels $wheels_root/megatron-core-$extra"
done

echo "== installing megatron-core $mcore; megatron_ext from the checkout (PYTHONPATH)"
# --no-deps --no-index: torch, numpy and packaging come from the image (see the runner contract),
# and nothing here needs the network once the wheel is there. megatron_ext is imported from the
# checkout, as scripts/run_gpu_suite.sh does, so no build backend has to be fetched either.
"$python" -m pip install --quiet --no-deps --no-index "${found[@]}"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$python" -c \
    'import megatron.core, megatron_ext; print("megatron-core", megatron.core.__version__)'

# pytest-xdist lets scripts/run_gpu_suite.sh overlap the Triton compiles of the many kernel
# configs (a few minutes per Triton otherwise); optional: without it the suite runs in one process.
if ! "$python" -c 'import xdist' 2>/dev/null; then
    echo "== pytest-xdist (optional)"
    xdist=("$wheels"/pytest_xdist-*.whl "$wheels"/execnet-*.whl)
    if ((${#xdist[@]} < 2)); then
        "$python" -m pip download --quiet --no-deps --only-binary=:all: --dest "$wheels" \
            pytest-xdist execnet || true
        xdist=("$wheels"/pytest_xdist-*.whl "$wheels"/execnet-*.whl)
    fi
    if ((${#xdist[@]} >= 2)) && "$python" -m pip install --quiet --no-deps --no-index "${xdist[@]}"; then
        "$python" -c 'import xdist; print("pytest-xdist", xdist.__version__)' || true
    else
        echo "pytest-xdist not installed: the GPU suite runs in one process"
    fi
fi

te_site=""
if [[ -n "$te_version" ]]; then
    torch_version=$("$python" -c 'import torch; print(torch.__version__.split("+")[0])')
    # "-b2": bundles with TE's imports beside it and no local version on the extension; an
    # older cached bundle would be refused by install.
    te_out="$te_cache/te-$te_version-torch-$torch_version-py$py_version-b2"
    te_site="$venv/transformer-engine"
    echo "== Transformer Engine $te_version for torch $torch_version ($te_out)"
    if [[ ! -f "$te_out/parts/SHA256SUMS" ]]; then
        bash scripts/transformer_engine_offline.sh prepare --out "$te_out" \
            --torch "$torch_version" --te "$te_version" --python "$base_python"
    fi
    PATH="$venv/bin:$PATH" bash scripts/transformer_engine_offline.sh install \
        --parts "$te_out/parts" --target "$te_site"
    PYTHONPATH="$te_site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONPATH
fi

if [[ -n "$fi_version" ]]; then
    fi_out="${HOME:-$tmp}/.cache/megatron_ext/flashinfer/flashinfer-$fi_version-py$py_version"
    echo "== FlashInfer $fi_version ($fi_out)"
    if [[ ! -f "$fi_out/parts/SHA256SUMS" ]]; then
        PATH="$venv/bin:$PATH" bash scripts/flashinfer_offline.sh prepare --out "$fi_out" \
            --flashinfer "$fi_version" --python-version "$py_version"
    fi
    PATH="$venv/bin:$PATH" bash scripts/flashinfer_offline.sh install \
        --parts "$fi_out/parts" --target "$venv/flashinfer"
    PYTHONPATH="$venv/flashinfer:$PWD${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONPATH
fi

triton_site=""
if [[ -n "$triton_version" ]]; then
    triton_site="$venv/triton-$triton_version"
    echo "== Triton $triton_version in $triton_site (first on PYTHONPATH only where a step puts it)"
    mapfile -t triton_wheel < <(wheel_of triton "$triton_version" "$wheels_root/triton-$triton_version")
    ((${#triton_wheel[@]})) || exit 1
    "$python" -m pip install --quiet --no-deps --no-index --no-compile --target "$triton_site" \
        "${triton_wheel[@]}"
    PYTHONPATH="$triton_site" "$python" -c 'import triton; print("triton", triton.__version__)'
fi

if [[ -n "$server" ]]; then
    echo "== the server extra"
    mapfile -t server_reqs < <("$python" -c 'import tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["server"]))')
    torch_pin=$("$python" -c 'import torch; print(torch.__version__)')
    "$python" -m pip install --quiet "${server_reqs[@]}" "torch==$torch_pin"
fi

if [[ -n "${GITHUB_PATH:-}" ]]; then
    echo "$venv/bin" >>"$GITHUB_PATH"
fi
if [[ -n "${GITHUB_ENV:-}" ]]; then
    echo "MEGATRON_CORE_WHEELS=$all_wheels" >>"$GITHUB_ENV"
    echo "TRITON_SITE=$triton_site" >>"$GITHUB_ENV"
    echo "PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}" >>"$GITHUB_ENV"
fi
