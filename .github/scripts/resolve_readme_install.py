# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Resolve the README's install commands the way a fresh machine that reaches only PyPI would.

For each ``python3 -m pip install ...`` that starts a command of the README's quick start, asks
this interpreter's pip to resolve it (``--dry-run --ignore-installed``, nothing is installed) with
no pip configuration, no extra index and no local wheel folder, and prints the torch, triton and
megatron-core it would install. Exit status 1 if any command does not resolve.

    python3.10 .github/scripts/resolve_readme_install.py     # from the repository root

The CPU workflow's fresh-resolve job runs it on every Python the README claims.
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import List

REPO_ROOT = Path(__file__).resolve().parents[2]
_KEEP = re.compile(r"(torch|triton|megatron[-_]core)-\S+")


def readme_install_commands(readme: str) -> List[List[str]]:
    """The pip install part of each quick-start command, as argument lists.

    Args:
        readme: the README's text.

    Returns:
        List[List[str]]: one argument list per command (``python3 -m pip install ...``).

    Raises:
        ValueError: if the quick start has no such command.
    """
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)\n```", section, flags=re.S):
        words = shlex.split(block.split("&&", 1)[0])
        if words[:4] == ["python3", "-m", "pip", "install"]:
            commands.append(words)
    if not commands:
        raise ValueError("the README's quick start has no `python3 -m pip install` command")
    return commands


def main() -> int:
    """Resolve every command; returns the exit status."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    failed = False
    version = f"Python {sys.version_info.major}.{sys.version_info.minor}"
    for words in readme_install_commands((REPO_ROOT / "README.md").read_text()):
        command = [sys.executable, *words[1:], "--dry-run", "--ignore-installed"]
        proc = subprocess.run(
            command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False
        )
        shown = shlex.join(words)
        if proc.returncode == 0:
            print(f"{version}: resolves: {shown}: {' '.join(_found(proc.stdout))}")
        else:
            failed = True
            print(f"{version}: FAILS: {shown}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return 1 if failed else 0


def _found(stdout: str) -> List[str]:
    """torch, triton and megatron-core in pip's "Would install" line."""
    line = stdout.split("Would install", 1)[-1].splitlines()[0]
    return [word for word in line.split() if _KEEP.fullmatch(word)]


if __name__ == "__main__":
    sys.exit(main())
