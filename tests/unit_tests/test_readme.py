# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The README's set-up commands are the ones CI runs, and they name things that exist; the Python
blocks of the README and of docs/ run, compile or quote their files line for line."""

import re
import shlex
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
README = (REPO_ROOT / "README.md").read_text()
# The documents whose ```python blocks are checked: the README and every page under docs/.
DOCUMENTS = ["README.md"] + sorted(
    p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "docs").rglob("*.md")
)


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


def _python_blocks(document: str = "README.md"):
    """(marker, path, code) for every ```python block of a document (a path from the repository
    root). A ``<!-- readme-block: sketch -->`` line right before a block marks a sketch that the
    tests only compile; ``<!-- readme-block: excerpt PATH -->`` marks lines quoted from a file of
    the repository (PATH from the repository root)."""
    text = (REPO_ROOT / document).read_text()
    pattern = r"(?:<!-- readme-block: (\w+)(?: (\S+))? -->\n)?```python\n(.*?)\n```"
    return [m.groups() for m in re.finditer(pattern, text, flags=re.S)]


def _all_python_blocks():
    """(document, index) of every ```python block of the README and docs/."""
    return [(doc, index) for doc in DOCUMENTS for index in range(len(_python_blocks(doc)))]


def test_python_blocks_are_marked_or_run():
    blocks = [block for doc in DOCUMENTS for block in _python_blocks(doc)]
    assert len(blocks) >= 3
    assert {marker for marker, _, _ in blocks} <= {None, "sketch", "excerpt"}
    assert all((marker == "excerpt") == (path is not None) for marker, path, _ in blocks)
    assert sum(marker is None for marker, _, _ in _python_blocks()) >= 2  # the README's own
    markers = {marker for doc in DOCUMENTS[1:] for marker, _, _ in _python_blocks(doc)}
    assert {"sketch", "excerpt"} <= markers, "docs/ hold the sketches and excerpts"


def test_every_readme_block_marker_is_read():
    """A marker that is not right before a ```python block would leave its block unchecked."""
    for doc in DOCUMENTS:
        text = (REPO_ROOT / doc).read_text()
        markers = len(re.findall(r"<!-- readme-block: ", text))
        marked = sum(marker is not None for marker, _, _ in _python_blocks(doc))
        assert markers == marked, f"{doc}: {markers} markers, {marked} marked blocks"


EXCERPT_HEADER = "# A fragment, not a script: "
ELISION = "# ..."


def check_excerpt(code: str, source: str, where: str) -> None:
    """Fail unless ``code`` says it is a fragment and its lines are ``source``'s, in order, with
    ``# ...`` wherever lines of the file are left out (so that what is shown together is together).

    Args:
        code: the README block.
        source: the text of the file it quotes.
        where: the block, for messages.
    """
    header, *lines = code.splitlines()
    assert header.startswith(EXCERPT_HEADER), f"{where}: first line must say {EXCERPT_HEADER!r}"
    source_lines = source.splitlines()
    position, gap = 0, True
    for line in lines:
        if line.strip() == ELISION:
            gap = True
            continue
        if not line.strip():
            continue
        try:
            found = source_lines.index(line, position)
        except ValueError:
            pytest.fail(f"{where}: {line!r} is not in the file after line {position}")
        skipped = [s for s in source_lines[position:found] if s.strip()]
        assert gap or not skipped, f"{where}: lines left out before {line!r} need {ELISION!r}"
        position, gap = found + 1, False


def test_excerpt_check():
    source = "a = 1\nb = 2\n\nc = 3\n"
    check_excerpt(EXCERPT_HEADER + "x\na = 1\nb = 2\nc = 3", source, "ok")
    check_excerpt(EXCERPT_HEADER + "x\na = 1\n# ...\nc = 3", source, "elided")
    for code, message in (
        ("a = 1", "must say"),
        (EXCERPT_HEADER + "x\na = 1\nc = 3", "need '# ...'"),
        (EXCERPT_HEADER + "x\nb = 2\na = 1", "not in the file"),
    ):
        with pytest.raises((AssertionError, pytest.fail.Exception), match=message):
            check_excerpt(code, source, "bad")


@pytest.mark.parametrize("document,index", _all_python_blocks())
def test_python_block_runs_as_written(document, index):
    """Every unmarked block runs as written on CPU; a sketch compiles and its megatron_ext
    imports resolve (it also needs megatron.training and a GPU, which CI does not have); an
    excerpt's lines are its file's, in the file's order (the file runs where it can)."""
    marker, path, code = _python_blocks(document)[index]
    where = f"{document} block {index}"
    if marker == "excerpt":
        check_excerpt(code, (REPO_ROOT / path).read_text(), f"{where} ({path})")
        return
    if marker == "sketch":
        compile(code, where, "exec")
        for line in code.splitlines():
            if line.startswith("from megatron_ext"):
                exec(compile(line, where, "exec"), {})
        return
    from megatron_ext import undo_megatron_ext

    try:
        exec(compile(code, where, "exec"), {"__name__": "readme"})
    finally:
        undo_megatron_ext()
