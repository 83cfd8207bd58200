# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``python -m megatron_ext --version`` and what a wheel ships besides the code."""

import re
import subprocess
import sys
from pathlib import Path

import megatron_ext

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_version_from_the_command_line():
    out = subprocess.run(
        [sys.executable, "-m", "megatron_ext", "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO_ROOT,
    ).stdout.strip()
    assert out == f"megatron_ext {megatron_ext.__version__} ({_megatron_core()})"
    assert re.fullmatch(r"megatron_ext \d+\.\d+\.\d+\S* \(megatron-core \d+\.\d+\.\d+\S*\)", out)


def _megatron_core() -> str:
    return f"megatron-core {megatron_ext.MEGATRON_CORE_VERSION}"


def test_without_arguments_it_prints_its_help(capsys):
    from megatron_ext.__main__ import main

    assert main([]) == 0
    assert "--version" in capsys.readouterr().out


def test_the_package_is_marked_typed_and_ships_the_marker():
    """PEP 561: ``py.typed`` in the package, listed as package data so that wheels carry it."""
    assert (Path(megatron_ext.__file__).parent / "py.typed").is_file()
    text = (REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(
        r'\[tool\.setuptools\.package-data\]\s*\n(#.*\n)*megatron_ext = \[[^]]*"py\.typed"', text
    )
