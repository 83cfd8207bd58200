#!/usr/bin/env bash
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.
#
# FlashInfer's MLA decode (as `python -m megatron_ext.bench mla-serving` uses it) for a GPU machine
# without network access, in two steps.
#
#   bash scripts/flashinfer_offline.sh prepare --out DIR [--flashinfer 0.7.4] \
#        [--python-version 3.12] [--part-mib 56]
#   bash scripts/flashinfer_offline.sh install --parts DIR --target SITE_DIR
#
# prepare (a machine with network access and pip; no GPU, CUDA or torch needed) downloads, without
# dependencies, the x86-64 manylinux wheels of flashinfer-python==VERSION and of what
# `import flashinfer` needs beyond a CUDA torch: apache-tvm-ffi (built per Python version),
# nvidia-ml-py (pynvml) and typing-extensions (for tvm_ffi). Their versions are the known-good set
# for 0.7.4, for other versions the newest that the wheels' requirements allow. The other
# requirements of flashinfer-python (nvidia-cutlass-dsl, cuda-tile, cuda-python, nccl4py,
# nccl-extensions, nvidia-cudnn-frontend, tabulate) are not needed to import it nor to plan and run
# BatchMLAPagedAttentionWrapper, whose module FlashInfer JIT-builds with nvcc. The wheels are
# unpacked into one site directory and FlashInfer's CUDA sources are pruned to what the MLA module
# compiles: every Python file, JSON and template and the include/, cutlass/, cccl/ and spdlog/
# headers stay; the subdirectories of data/csrc, the data/csrc/*.cu other than batch_mla_*.cu and
# the *.cu outside data/ go. typing-extensions goes to _fallback/ (install uses it only where the
# machine's is older than 4.13). A manifest (FLASHINFER_OFFLINE.txt: versions, wheel sha256s, what
# was pruned) is added, the directory is packed reproducibly (sorted, fixed owner and mtime,
# xz -9) and split into DIR/parts/part-NN of at most --part-mib MiB each with DIR/parts/SHA256SUMS
# (each part and the whole archive).
#
# install (the GPU machine: Python of --python-version, x86-64, a CUDA torch, nvcc, jinja2,
# filelock, ninja, numpy, packaging, requests, tqdm) joins the parts, checks the checksums, unpacks
# into SITE_DIR (replacing an earlier install there; nothing else changes), copies typing_extensions
# from _fallback/ to the top only where the machine's is older than 4.13, checks that those modules
# import and that the ninja executable is on PATH, and imports flashinfer and
# BatchMLAPagedAttentionWrapper with SITE_DIR first on PYTHONPATH. Afterwards:
# export PYTHONPATH=SITE_DIR:$PYTHONPATH. The first plan() JIT-builds the MLA module with nvcc.
# Each step prints how long it took.
set -euo pipefail

die() { echo "flashinfer_offline.sh: $*" >&2; exit 2; }
now() { date +%s; }
manifest=FLASHINFER_OFFLINE.txt

# The METADATA of the wheel $1.
wheel_metadata() {
  python3 -c 'import sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
print(wheel.read(name).decode())' "$1"
}

# The version of the distribution unpacked as $1-*.dist-info.
dist_version() {
  sed -n 's/^Version: //p' "$1"-*.dist-info/METADATA
}

# The unconditional requirement on $1 in METADATA on stdin, e.g. "<0.2,>=0.1.11" (may be empty).
requirement() {
  sed -n "s/^Requires-Dist: $1 *\([^;]*\)\$/\1/p" | tr -d ' ()' | head -n 1
}

prepare() {
  local out="" fi_version="0.7.4" py_version="3.12" part_mib=56
  while [ $# -gt 0 ]; do
    case "$1" in
      --out) out="$2"; shift ;;
      --flashinfer) fi_version="$2"; shift ;;
      --python-version) py_version="$2"; shift ;;
      --part-mib) part_mib="$2"; shift ;;
      *) die "prepare: unknown argument $1" ;;
    esac
    shift
  done
  [ -n "$out" ] || die "prepare: --out DIR is required"
  local pip=(python3 -m pip)
  "${pip[@]}" --version >/dev/null 2>&1 || die "prepare: python3 -m pip is needed"
  command -v xz >/dev/null || die "prepare: xz is needed"
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  local t0 t1 wheels="$out/wheels" site="$out/site" py_tag=${py_version/./}
  t0=$(now)
  rm -rf "$wheels" "$site" "$out/parts" && mkdir -p "$wheels" "$site/_fallback" "$out/parts"
  local download=("${pip[@]}" download -q --no-deps --only-binary=:all: -d "$wheels"
    --python-version "$py_version" --implementation cp
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64)

  echo "== wheels: flashinfer-python $fi_version and what it imports (cp$py_tag, x86-64)"
  t1=$(now)
  "${download[@]}" "flashinfer-python==$fi_version"
  local tvm_req nvml_req te_req=""
  if [ "$fi_version" = 0.7.4 ]; then
    tvm_req="==0.1.15.post2" nvml_req="==13.615.71" te_req="==4.16.0"  # tested together
  else
    local meta
    meta=$(wheel_metadata "$(ls "$wheels"/flashinfer_python-*.whl)")
    tvm_req=$(requirement apache-tvm-ffi <<< "$meta")
    nvml_req=$(requirement nvidia-ml-py <<< "$meta")
  fi
  "${download[@]}" "apache-tvm-ffi$tvm_req" "nvidia-ml-py$nvml_req"
  if [ -z "$te_req" ]; then
    te_req=$(wheel_metadata "$(ls "$wheels"/apache_tvm_ffi-*.whl)" | requirement typing-extensions)
  fi
  "${download[@]}" "typing-extensions$te_req"
  (cd "$wheels" && ls -l -- *.whl)
  echo "   downloaded in $(( $(now) - t1 )) s"

  echo "== site directory and pruning"
  t1=$(now)
  local whl
  for whl in "$wheels"/flashinfer_python-*.whl "$wheels"/apache_tvm_ffi-*.whl \
    "$wheels"/nvidia_ml_py-*.whl; do
    python3 -m zipfile -e "$whl" "$site"
  done
  python3 -m zipfile -e "$wheels"/typing_extensions-*.whl "$site/_fallback"
  rm -f "$site/example.py"  # nvidia-ml-py's sample script, not a module
  local before dirs cus others
  before=$(du -sm "$site/flashinfer" | cut -f1)
  dirs=$(cd "$site" && find flashinfer/data/csrc -mindepth 1 -maxdepth 1 -type d | wc -l)
  cus=$(cd "$site" && find flashinfer/data/csrc -maxdepth 1 -name '*.cu' ! -name 'batch_mla_*.cu' \
    | wc -l)
  others=$(cd "$site" && find flashinfer -path flashinfer/data -prune -o -name '*.cu' -type f -print \
    | wc -l)
  [ "$dirs" -gt 0 ] && [ -d "$site/flashinfer/data/include" ] \
    || die "prepare: flashinfer-python $fi_version's data/ is not laid out as this script expects"
  (cd "$site" \
    && find flashinfer/data/csrc -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} + \
    && find flashinfer/data/csrc -maxdepth 1 -name '*.cu' ! -name 'batch_mla_*.cu' -delete \
    && find flashinfer -path flashinfer/data -prune -o -name '*.cu' -type f -exec rm -f {} + \
    && find flashinfer -type d -empty -delete)
  [ -n "$(ls "$site"/flashinfer/data/csrc/batch_mla_*.cu 2>/dev/null)" ] \
    || die "prepare: flashinfer/data/csrc/batch_mla_*.cu missing from flashinfer-python $fi_version"
  {
    echo "FlashInfer MLA decode for an offline GPU machine (scripts/flashinfer_offline.sh)."
    echo "Put this directory first on PYTHONPATH. Python $py_version (cp$py_tag), x86-64 manylinux."
    echo "flashinfer-python==$(dist_version "$site"/flashinfer_python) (pruned, see below)"
    echo "apache-tvm-ffi==$(dist_version "$site"/apache_tvm_ffi)"
    echo "nvidia-ml-py==$(dist_version "$site"/nvidia_ml_py)"
    echo "typing-extensions==$(dist_version "$site"/_fallback/typing_extensions) in _fallback/" \
      "(copied to the top by install only where the machine's is older than 4.13)"
    echo "wheel sha256:"
    (cd "$wheels" && sha256sum -- *.whl | sed 's/^/  /')
    echo "pruned from flashinfer/ ($before MiB -> $(du -sm "$site/flashinfer" | cut -f1) MiB): the" \
      "$dirs subdirectories of data/csrc, the $cus data/csrc/*.cu other than batch_mla_*.cu and" \
      "the $others *.cu outside data/ (other modules' CUDA sources; the MLA JIT module compiles" \
      "data/csrc/batch_mla_*.cu with the headers of data/include, cutlass, cccl and spdlog, kept)."
  } > "$site/$manifest"
  cp "$site/$manifest" "$out/$manifest"
  echo "   $(du -sm "$site" | cut -f1) MiB unpacked (flashinfer $before MiB before pruning) in" \
    "$(( $(now) - t1 )) s"

  echo "== archive (xz -9) and parts of at most $part_mib MiB"
  t1=$(now)
  local archive="flashinfer-$fi_version-cp$py_tag.tar.xz"
  (cd "$site" && tar --sort=name --owner=0 --group=0 --numeric-owner --mode='u+rwX,go+rX,go-w' \
    --mtime='2026-01-01 00:00:00 UTC' -cf - .) | xz -9 -T0 > "$out/$archive"
  split -b "${part_mib}M" -d -a 2 "$out/$archive" "$out/parts/part-"
  (cd "$out/parts" && sha256sum part-* > SHA256SUMS)
  (cd "$out" && sha256sum "$archive" >> parts/SHA256SUMS)
  rm -f "$out/$archive"
  rm -rf "$site"
  ls -l "$out/parts"
  echo "   packed in $(( $(now) - t1 )) s"
  echo "prepared in $(( $(now) - t0 )) s: copy $out/parts/ to the GPU machine, then run there"
  echo "  bash scripts/flashinfer_offline.sh install --parts DIR --target SITE_DIR"
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
  if [ -e "$target" ] && [ -n "$(ls -A "$target")" ] && [ ! -f "$target/$manifest" ]; then
    die "install: $target is not empty and holds no earlier install ($manifest): choose another"
  fi
  parts=$(cd "$parts" && pwd)
  local t0 t1 work archive
  t0=$(now)
  work=$(mktemp -d)
  trap "rm -rf '$work'" EXIT
  archive=$(awk '$2 !~ /^part-/ {print $2}' "$parts/SHA256SUMS")
  [ -n "$archive" ] || die "install: $parts/SHA256SUMS names no archive"
  (cd "$parts" && grep ' part-' SHA256SUMS | sha256sum --quiet -c -) \
    || die "install: checksum mismatch: a part is missing or incomplete ($(ls "$parts" | wc -l) files)"
  cat "$parts"/part-* > "$work/$archive"
  (cd "$work" && grep -v ' part-' "$parts/SHA256SUMS" | sha256sum --quiet -c -) \
    || die "install: the joined archive's checksum does not match: a part is missing"
  echo "joined and checked in $(( $(now) - t0 )) s: $archive ($(du -m "$work/$archive" | cut -f1) MiB)"

  t1=$(now)
  mkdir -p "$work/site"
  xz -dc -T0 "$work/$archive" | tar -x --no-same-owner -C "$work/site"
  rm -f "$work/$archive"
  rm -rf "$target" && mkdir -p "$(dirname "$target")" && mv "$work/site" "$target"
  target=$(cd "$target" && pwd)
  # tvm_ffi imports get_annotations from typing_extensions, new in 4.13.
  if ! python3 -c 'from typing_extensions import get_annotations' 2>/dev/null; then
    cp -r "$target"/_fallback/* "$target"/
    echo "this machine's typing_extensions is older than 4.13: using the one in $target"
  fi
  echo "unpacked into $target ($(du -sm "$target" | cut -f1) MiB) in $(( $(now) - t1 )) s"

  t1=$(now)
  local missing="" module
  for module in jinja2 filelock ninja torch numpy packaging requests tqdm; do
    python3 -c "import $module" 2>/dev/null || missing="$missing $module"
  done
  command -v ninja >/dev/null || missing="$missing ninja(the executable, on PATH)"
  PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}" python3 - <<'PY' \
    || die "install: import flashinfer failed${missing:+; missing on this machine:$missing}"
import flashinfer
from flashinfer.mla import BatchMLAPagedAttentionWrapper  # noqa: F401

print(f"flashinfer {flashinfer.__version__} imports from {flashinfer.__file__}", flush=True)
PY
  echo "imported in $(( $(now) - t1 )) s"
  [ -z "$missing" ] || die "install: missing on this machine (FlashInfer's JIT needs them):$missing"
  echo "use: export PYTHONPATH=$target:\$PYTHONPATH"
  echo "The first plan() JIT-builds the MLA module with nvcc (about 20 s on 16 cores for sm90): set"
  echo "FLASHINFER_WORKSPACE_BASE to a writable directory (the build cache goes there) and CUDA_HOME"
  echo "to the toolkit that nvcc belongs to."
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  install) shift; install "$@" ;;
  -h|--help|"") sed -n '3,35p' "$0" ;;
  *) die "unknown command $1 (prepare or install)" ;;
esac
