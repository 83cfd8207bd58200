#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# Transformer Engine for a GPU machine without network access, in two steps.
#
#   bash scripts/transformer_engine_offline.sh prepare --out DIR --torch VERSION \
#        [--te 2.20.2] [--python python3.12] [--venv DIR] [--part-mib 56] [--jobs N]
#   bash scripts/transformer_engine_offline.sh install --parts DIR --target SITE_DIR
#
# prepare (a machine with network access, gcc and the GPU machine's Python minor version; no GPU
# needed) downloads TE's wheels for CUDA 13 (the core library and the Python package) and the
# pure-Python packages TE imports, and builds transformer_engine_torch, which PyPI publishes as a
# source distribution only, against torch==VERSION: the exact torch release of the GPU machine
# (its C++ ABI must match; install checks it). The CUDA, cuDNN and NCCL headers come from NVIDIA's
# wheels, so no CUDA toolkit is needed (--venv reuses a build environment made by an earlier
# run). Everything is packed into DIR/parts/part-NN of at most
# --part-mib MiB each (for links or copy tools with a size limit) with DIR/parts/SHA256SUMS.
#
# install (the GPU machine) joins the parts, checks their checksum, refuses a torch other than the
# one the extension was built for (or one not built for CUDA 13) and a bundle whose TE packages
# differ in version, installs the wheels into SITE_DIR with those of TE's imports the machine
# lacks (nothing else changes) and imports transformer_engine.pytorch. Afterwards:
# export PYTHONPATH=SITE_DIR:$PYTHONPATH.
# Each step prints how long it took.
set -euo pipefail

die() { echo "transformer_engine_offline.sh: $*" >&2; exit 2; }
now() { date +%s; }

# The imports of transformer_engine.pytorch that torch does not bring, as pip names them (with
# the lowest version the bundled pydantic takes where the machine's copy may be older).
DEPS="einops onnx onnx-ir onnxscript protobuf ml-dtypes pyyaml typing-extensions>=4.16"

prepare() {
  local out="" torch_version="" te_version="2.20.2" python="python3.12" part_mib=56 jobs venv=""
  jobs=$(nproc)
  while [ $# -gt 0 ]; do
    case "$1" in
      --out) out="$2"; shift ;;
      --torch) torch_version="$2"; shift ;;
      --te) te_version="$2"; shift ;;
      --python) python="$2"; shift ;;
      --venv) venv="$2"; shift ;;
      --part-mib) part_mib="$2"; shift ;;
      --jobs) jobs="$2"; shift ;;
      *) die "prepare: unknown argument $1" ;;
    esac
    shift
  done
  [ -n "$out" ] || die "prepare: --out DIR is required"
  [ -n "$torch_version" ] || die "prepare: --torch VERSION (the GPU machine's torch) is required"
  command -v "$python" >/dev/null || die "prepare: $python not found (--python)"
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  local t0 wheels="$out/wheels" py_tag
  venv=${venv:-$out/build-venv}
  t0=$(now)
  py_tag=$("$python" -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')
  rm -rf "$wheels" "$out/parts" && mkdir -p "$wheels" "$out/parts"

  echo "== build environment: torch==$torch_version for Python $py_tag"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  # torch pins setuptools below 82.
  "$venv/bin/python" -m pip install -q --upgrade pip "setuptools<82" wheel packaging pybind11 ninja numpy
  # The CUDA build of torch brings NVIDIA's runtime wheels with their headers; nvcc's crt headers
  # and CCCL (nv/target) are not among them.
  "$venv/bin/python" -m pip install -q "torch==$torch_version" "nvidia-cudnn-frontend>=1.29.0" \
    "nvidia-cuda-crt==13.0.*" "nvidia-cuda-cccl==13.0.*"
  local cuda
  cuda=$("$venv/bin/python" -c 'import torch; print(torch.version.cuda or "")')
  [ "${cuda%%.*}" = 13 ] || die "prepare: torch==$torch_version is built for CUDA '$cuda', not 13"

  echo "== wheels: transformer-engine $te_version (CUDA 13) and what it imports"
  local platform=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64)
  "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py_tag" \
    --implementation cp "${platform[@]}" -d "$wheels" \
    "transformer-engine==$te_version" "transformer-engine-cu13==$te_version" \
    pydantic pydantic-core annotated-types typing-inspection nvdlfw-inspect \
    "nvidia-cudnn-frontend>=1.29.0"
  # What transformer_engine.pytorch imports beyond torch: installed there only where the machine
  # lacks it (or has a typing_extensions too old for the bundled pydantic), so that the
  # machine's own copies are not shadowed.
  mkdir -p "$wheels/deps"
  "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version "$py_tag" \
    --implementation cp "${platform[@]}" -d "$wheels/deps" $DEPS
  # pydantic pins one pydantic-core release: take that one, not the newest.
  local core_pin
  core_pin=$(unzip -p "$wheels"/pydantic-[0-9]*.whl '*/METADATA' \
    | sed -n 's/^Requires-Dist: pydantic-core *==* *\([0-9.]*\).*/\1/p' | head -n 1)
  if [ -n "$core_pin" ]; then
    rm -f "$wheels"/pydantic_core-*.whl
    "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version \
      "$py_tag" --implementation cp "${platform[@]}" -d "$wheels" "pydantic-core==$core_pin"
  fi

  echo "== transformer_engine_torch $te_version from its source distribution ($jobs jobs)"
  local src="$out/src" t1
  t1=$(now)
  rm -rf "$src" && mkdir -p "$src"
  # Without build isolation the sdist's metadata step finds the build environment's torch.
  "$venv/bin/python" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation \
    -d "$src" "transformer_engine_torch==$te_version"
  tar -xzf "$src"/transformer_engine_torch-*.tar.gz -C "$src"
  (cd "$src/transformer_engine_torch-$te_version" \
    && NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_BUILD_USE_NVIDIA_WHEELS=1 MAX_JOBS="$jobs" \
      NVTE_NO_LOCAL_VERSION=1 \
      "$venv/bin/python" -m pip wheel -q --no-build-isolation --no-deps -w "$wheels" .) \
    > "$out/build.log" 2>&1 || { tail -n 30 "$out/build.log"; die "prepare: build failed ($out/build.log)"; }
  echo "   built in $(( $(now) - t1 )) s"

  "$venv/bin/python" - "$torch_version" "$te_version" > "$wheels/BUILT_FOR" <<'PY'
import sys, torch
print(f"torch={sys.argv[1]} cxx11abi={int(torch._C._GLIBCXX_USE_CXX11_ABI)} te={sys.argv[2]}")
PY
  echo "== parts of at most $part_mib MiB"
  tar -cf "$out/bundle.tar" -C "$out" wheels
  split -b "${part_mib}M" -d -a 2 "$out/bundle.tar" "$out/parts/part-"
  (cd "$out" && sha256sum bundle.tar > parts/SHA256SUMS)
  rm -f "$out/bundle.tar"
  ls -l "$out/parts"
  echo "prepared in $(( $(now) - t0 )) s: copy $out/parts/ to the GPU machine, then run there"
  echo "  bash scripts/transformer_engine_offline.sh install --parts DIR --target SITE_DIR"
}

install() {
  local parts="" target=""
  while [ $# -gt 0 ]; do
    case "$1" in
      --parts) parts="$2"; shift ;;
      --target) target="$2"; shift ;;
      *) die "install: unknown argument $1" ;;
    esac
    shift
  done
  [ -n "$parts" ] && [ -n "$target" ] || die "install: --parts DIR and --target SITE_DIR are required"
  [ -f "$parts/SHA256SUMS" ] || die "install: $parts/SHA256SUMS missing (copy it with the parts)"
  parts=$(cd "$parts" && pwd)
  local t0
  t0=$(now)
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  cat "$parts"/part-* > "$WORK/bundle.tar"
  (cd "$WORK" && sha256sum --quiet -c "$parts/SHA256SUMS") \
    || die "install: checksum mismatch: a part is missing or incomplete ($(ls "$parts" | wc -l) files)"
  tar -xf "$WORK/bundle.tar" -C "$WORK"
  # TE's import asserts that its three packages carry one version.
  local versions
  versions=$(cd "$WORK/wheels" && ls transformer_engine-*.whl transformer_engine_cu13-*.whl \
    transformer_engine_torch-*.whl 2>/dev/null | cut -d- -f2 | sort -u) \
    || die "install: the bundle lacks one of TE's three wheels: prepare it again"
  [ "$(echo "$versions" | wc -l)" = 1 ] \
    || die "install: the bundle's TE packages differ in version ($(echo $versions)): prepare it again"
  local built_for have
  built_for=$(sed -n 's/^torch=\([^ ]*\).*/\1/p' "$WORK/wheels/BUILT_FOR")
  have=$(python3 -c 'import torch; print(torch.__version__.split("+")[0], torch.version.cuda)') \
    || die "install: python3 cannot import torch"
  [ "${have%% *}" = "$built_for" ] \
    || die "install: transformer_engine_torch was built for torch $built_for; this machine has ${have%% *}"
  [ "$(echo "${have##* }" | cut -d. -f1)" = 13 ] \
    || die "install: this torch is built for CUDA ${have##* }; the bundle is for CUDA 13"
  local deps=()
  if [ -d "$WORK/wheels/deps" ]; then
    mapfile -t deps < <(python3 - "$WORK/wheels/deps" "$DEPS" <<'PY'
import pathlib, re, sys
from importlib.metadata import PackageNotFoundError, version


def release(text):
    return tuple(int(part) for part in re.findall(r"\d+", text)[:3])


folder, wanted = pathlib.Path(sys.argv[1]), sys.argv[2].split()
for spec in wanted:
    name, _, lowest = spec.partition(">=")
    try:
        have = version(name)
    except PackageNotFoundError:
        have = None
    missing = have is None or bool(lowest) and release(have) < release(lowest)
    stem = re.sub(r"[-_.]+", "_", name).lower()
    for wheel in folder.glob("*.whl") if missing else ():
        if wheel.name.lower().startswith(stem + "-"):
            print(wheel)
PY
    )
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$target" \
    "$WORK"/wheels/*.whl ${deps[@]+"${deps[@]}"}
  echo "installed in $(( $(now) - t0 )) s: $(cat "$WORK/wheels/BUILT_FOR")" \
    "(with the machine's missing imports: ${deps[*]##*/})"
  local t1
  t1=$(now)
  PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'PY' \
    || die "install: transformer_engine.pytorch does not import from $target (above: why)"
from importlib.metadata import version

import torch  # noqa: F401  (first: TE's core library links against the NCCL torch loads)
import transformer_engine.pytorch as te  # noqa: F401

print(f"transformer_engine {version('transformer_engine')} imports", flush=True)
PY
  echo "imported in $(( $(now) - t1 )) s; use: export PYTHONPATH=$target:\$PYTHONPATH"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  install) shift; install "$@" ;;
  -h|--help|"") sed -n '3,22p' "$0" ;;
  *) die "unknown command $1 (prepare or install)" ;;
esac
