# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``python -m megatron_ext --version``: the installed release, and the megatron-core it checked.

The benchmarks are ``python -m megatron_ext.bench``.
"""

import argparse
from typing import List, Optional


def version_text() -> str:
    """``megatron_ext X.Y.Z (megatron-core A.B.C)``, without importing megatron-core.

    Returns:
        str: the line ``--version`` prints.
    """
    import megatron_ext

    core = megatron_ext.MEGATRON_CORE_VERSION
    return f"megatron_ext {megatron_ext.__version__} (megatron-core {core})"


def main(argv: Optional[List[str]] = None) -> int:
    """Print the version (``--version``, then exit) or the help.

    Args:
        argv: command-line arguments.

    Returns:
        int: 0.
    """
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext",
        description="megatron_ext: extensions for NVIDIA Megatron-Core. Benchmarks: "
        "python -m megatron_ext.bench",
    )
    parser.add_argument("--version", action="version", version=version_text())
    parser.parse_args(argv)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
