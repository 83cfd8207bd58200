# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Benchmarks of megatron_ext against megatron-core, the package's main job.

    python -m megatron_ext.bench [all|rope|inference] [--out DIR] [--quick]

Each benchmark times megatron-core's own code and megatron_ext's in the same process and prints a
table last. Without a GPU it says so and runs a small correctness pass instead of timing.
"""

import os
import sys
from typing import List, Optional

import torch

BENCHMARKS = ("rope", "inference")


def main(argv: Optional[List[str]] = None) -> int:
    """Run one benchmark, or all of them.

    Args:
        argv: command-line arguments; the first may name a benchmark ("all" when omitted), the
            rest go to that benchmark.

    Returns:
        int: the process exit code (non-zero if any benchmark failed).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    which = "all"
    if argv and not argv[0].startswith("-"):
        which = argv.pop(0)
    if which in ("-h", "--help") or which not in ("all",) + BENCHMARKS:
        print(__doc__)
        return 0 if which in ("-h", "--help") else 2
    if not torch.cuda.is_available():
        # Triton reads this when a kernel module is imported; set it before the imports below.
        os.environ.setdefault("TRITON_INTERPRET", "1")

    import importlib

    rc = 0
    for name in BENCHMARKS if which == "all" else (which,):
        module = importlib.import_module(f"megatron_ext.bench.{name}")
        rc |= module.main(argv)
    return rc


if __name__ == "__main__":
    sys.exit(main())
