# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of scripts/transformer_engine_offline.sh's install step on bundles that must be refused
(no GPU, no Transformer Engine: each refusal comes before anything is installed)."""

import hashlib
import os
import pathlib
import subprocess
import sys
import tarfile

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "transformer_engine_offline.sh"
TE = "2.20.2"


def bundle(folder, torch_version, te_torch_version=TE, drop=()):
    """Parts of a bundle whose wheels are empty files with the names prepare gives them."""
    wheels = folder / "wheels"
    wheels.mkdir(parents=True)
    names = [
        f"transformer_engine-{TE}-py3-none-any.whl",
        f"transformer_engine_cu13-{TE}-py3-none-manylinux_2_28_x86_64.whl",
        f"transformer_engine_torch-{te_torch_version}-cp312-cp312-linux_x86_64.whl",
    ]
    for name in names:
        if not any(name.startswith(prefix + "-") for prefix in drop):
            (wheels / name).write_bytes(b"")
    (wheels / "BUILT_FOR").write_text(f"torch={torch_version} cxx11abi=1 te={TE}\n")
    tar_path = folder / "bundle.tar"
    with tarfile.open(tar_path, "w") as tar:
        tar.add(wheels, arcname="wheels")
    data = tar_path.read_bytes()
    parts = folder / "parts"
    parts.mkdir()
    half = len(data) // 2
    (parts / "part-00").write_bytes(data[:half])
    (parts / "part-01").write_bytes(data[half:])
    (parts / "SHA256SUMS").write_text(f"{hashlib.sha256(data).hexdigest()}  bundle.tar\n")
    tar_path.unlink()
    return parts


def install(tmp_path, parts_arg, cwd):
    """Runs install with this interpreter first on PATH and its own temporary directory."""
    scratch = tmp_path / "scratch"
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(scratch))
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    done = subprocess.run(
        ["bash", str(SCRIPT), "install", "--parts", parts_arg, "--target", str(tmp_path / "site")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    # Whatever the outcome: nothing installed, and the joined bundle removed.
    assert not (tmp_path / "site").exists()
    assert list(scratch.iterdir()) == []
    return done


def test_te_packages_of_different_versions_are_refused(tmp_path):
    """TE's import asserts one version across its packages: a bundle built with a local version
    on one of them is refused before install (a relative --parts path is taken too)."""
    bundle(tmp_path / "b", "2.11.0", te_torch_version=f"{TE}+27e074e")
    done = install(tmp_path, "b/parts", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"differ in version ({TE} {TE}+27e074e)" in done.stderr


def test_a_bundle_without_one_of_the_te_wheels_is_refused(tmp_path):
    parts = bundle(tmp_path / "b", "2.11.0", drop=("transformer_engine_cu13",))
    done = install(tmp_path, str(parts), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "lacks one of TE's three wheels" in done.stderr


def test_a_damaged_part_is_refused(tmp_path):
    parts = bundle(tmp_path / "b", "2.11.0")
    with open(parts / "part-01", "ab") as part:
        part.write(b"x")
    done = install(tmp_path, str(parts), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "checksum mismatch" in done.stderr


def test_another_torch_release_is_refused(tmp_path):
    torch = pytest.importorskip("torch", reason="the check reads this interpreter's torch")
    parts = bundle(tmp_path / "b", "0.0.1")
    done = install(tmp_path, str(parts), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    have = torch.__version__.split("+")[0]
    assert f"built for torch 0.0.1; this machine has {have}" in done.stderr


def test_a_torch_not_built_for_cuda_13_is_refused(tmp_path):
    torch = pytest.importorskip("torch", reason="the check reads this interpreter's torch")
    if (torch.version.cuda or "").split(".")[0] == "13":
        pytest.skip("this torch is built for CUDA 13: the refusal needs another build")
    parts = bundle(tmp_path / "b", torch.__version__.split("+")[0])
    done = install(tmp_path, str(parts), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert f"built for CUDA {torch.version.cuda}; the bundle is for CUDA 13" in done.stderr
