# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The README's set-up commands are the ones CI runs, and they name things that exist."""

import re
import shlex
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
README = (REPO_ROOT / "README.md").read_text()


def _quick_start_commands():
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_quick_start_has_exactly_a_main_job_and_a_test_command():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert main_job.endswith("python3 -m megatron_ext.bench")
    assert tests.endswith("python3 -m pytest tests/unit_tests")


def test_ci_runs_the_readme_test_command_verbatim():
    ci_lines = (REPO_ROOT / ".ci" / "run").read_text().splitlines()
    assert _quick_start_commands()[1] in ci_lines


def test_quick_start_names_existing_extras_and_files():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from 3.11")
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    extras = set(pyproject["project"]["optional-dependencies"])
    for command in _quick_start_commands():
        words = shlex.split(command)
        constraint = words[words.index("-c") + 1]
        assert (REPO_ROOT / constraint).is_file(), constraint
        target = words[words.index("-e") + 1]
        requested = re.fullmatch(r"\.\[(.*)\]", target).group(1).split(",")
        assert set(requested) <= extras, requested


def test_quick_start_names_the_main_jobs_report_directory():
    from megatron_ext.bench.__main__ import DEFAULT_OUT

    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert f"`{DEFAULT_OUT.as_posix()}/`" in section
    assert "python3 -m megatron_ext.bench --help" in section
