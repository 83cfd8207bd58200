# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Benchmarks of megatron_ext against megatron-core, the package's main job.

Each benchmark times megatron-core's own code and megatron_ext's in the same process and prints a
table last. Without a GPU it says so and runs a small correctness check instead of timing.

The report goes to ``--out`` (default ``results/bench`` under the current directory): each
benchmark's JSON (and, on a GPU, the plots ``rope.png`` and ``mla_serving.png``), its section
``reports/BENCHMARK.md`` (its environment, exit status and printed output, tables included), and
``report.md``, every section in the directory joined under an index. A run rewrites the sections
of the benchmarks it ran and keeps the others, so ``rope`` run after ``all`` leaves the other
benchmarks' sections in ``report.md``.
"""

import argparse
import contextlib
import io
import os
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, TextIO

import torch

from megatron_ext.utils import ignore_optional_dependency_warnings

BENCHMARKS: Dict[str, str] = {
    "rope": "MLA query RoPE kernels, megatron-core's against megatron_ext's",
    "inference": "dynamic-inference bookkeeping (static slices) and static MLA generation",
    "mla-serving": "MLA paged latent attention and RoPE+append vs the copy ceiling and FlashInfer",
}
# Benchmarks that run only when named: `all` leaves them out (minutes of model builds, graph
# captures and engine rounds on a GPU).
NAMED_ONLY: Dict[str, str] = {
    "mla-engine": "MLA decode tokens/s: dynamic engine with CUDA graphs vs static batching",
}
DEFAULT_OUT = Path("results") / "bench"
REPORT_NAME = "report.md"
# One file per benchmark under --out, from which report.md is rebuilt after every run.
SECTIONS_DIR = "reports"
_STATUS_PREFIX = "- exit status: "
# Options that every benchmark accepts, so that `all` can pass them on.
_COMMON_OPTIONS = ("--quick",)
_HELP = ("-h", "--help")


def _parser() -> argparse.ArgumentParser:
    listing = "\n".join(
        [f"  {name:<12} {text}" for name, text in BENCHMARKS.items()]
        + [f"  {name:<12} {text} (not in `all`)" for name, text in NAMED_ONLY.items()]
    )
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        epilog=(
            f"benchmarks:\n{listing}\n  {'all':<12} every benchmark above but those marked, in "
            "turn (the default)"
            "\n\nEach benchmark's own options: python -m megatron_ext.bench BENCHMARK --help\n"
            "(with `all`, only --out and --quick)"
        ),
    )
    parser.add_argument(
        *_HELP, action="store_true", help="show this help; after a benchmark's name, its options"
    )
    parser.add_argument(
        "benchmark",
        nargs="?",
        default="all",
        choices=["all", *BENCHMARKS, *NAMED_ONLY],
        help="which benchmark to run (default: all)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"directory for the report (default: {DEFAULT_OUT} under the current directory)",
    )
    return parser


class _Tee(io.TextIOBase):
    """Writes to the console and keeps a copy for the report."""

    def __init__(self, console: TextIO) -> None:
        self.console = console
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.console.write(text)
        self.copy.write(text)
        return len(text)

    def flush(self) -> None:
        self.console.flush()


def _benchmark_main(name: str) -> Callable[[List[str]], int]:
    if name == "rope":
        from megatron_ext.bench import rope

        return rope.main
    if name == "mla-serving":
        from megatron_ext.bench import mla_serving

        return mla_serving.main
    if name == "mla-engine":
        from megatron_ext.bench import mla_engine

        return mla_engine.main
    from megatron_ext.bench import inference

    return inference.main


def _environment() -> List[str]:
    from megatron_ext import MEGATRON_CORE_VERSION

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA GPU (CPU)"
    return [
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- device: {device}",
        f"- Python {platform.python_version()}, torch {torch.__version__}, triton "
        f"{triton_version}, megatron-core {MEGATRON_CORE_VERSION}",
    ]


def _section(name: str, status: int, output: str) -> str:
    """One benchmark's section of the report: its heading, environment, exit status and output.

    Args:
        name: the benchmark.
        status: its exit status.
        output: what it printed.

    Returns:
        str: the section's markdown.
    """
    lines = [f"## {name}", "", *_environment(), f"{_STATUS_PREFIX}{status}", "", "```text"]
    return "\n".join(lines + [output.rstrip(), "```"]) + "\n"


def _section_status(text: str) -> str:
    """The exit status a section records ("?" where it has none)."""
    for line in text.splitlines():
        if line.startswith(_STATUS_PREFIX):
            return line[len(_STATUS_PREFIX) :].strip()
    return "?"


def _write_report(out: Path) -> None:
    """Rebuild ``report.md`` from every benchmark section under ``out``: an index (benchmark, exit
    status) and the sections, known benchmarks in their listing's order, then any others by name.

    Args:
        out: the report directory.
    """
    order = [*BENCHMARKS, *NAMED_ONLY]
    files = {p.stem: p for p in (out / SECTIONS_DIR).glob("*.md")}
    names = [n for n in order if n in files] + sorted(set(files) - set(order))
    texts = {name: files[name].read_text() for name in names}
    lines = ["# megatron_ext benchmarks", "", "Each section is the last run of its benchmark.", ""]
    lines += ["| benchmark | exit status |", "| --- | --- |"]
    lines += [f"| {name} | {_section_status(texts[name])} |" for name in names]
    body = "\n".join(lines) + "\n"
    (out / REPORT_NAME).write_text(body + "".join("\n" + texts[name] for name in names))


def main(argv: Optional[List[str]] = None) -> int:
    """Run one benchmark, or all of them, and write the report.

    Args:
        argv: command-line arguments (see ``--help``); options this parser does not know go to
            the benchmark.

    Returns:
        int: the process exit code (non-zero if any benchmark failed).
    """
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # -h after a benchmark's name is that benchmark's help, so this parser does not consume it.
    args, rest = parser.parse_known_args([word for word in argv if word not in _HELP])
    if any(word in _HELP for word in argv):
        if args.benchmark == "all":
            parser.print_help()
            return 0
        # Importing a benchmark imports megatron-core, which warns about optional packages.
        with warnings.catch_warnings():
            ignore_optional_dependency_warnings()
            benchmark = _benchmark_main(args.benchmark)
        return benchmark([*rest, "--help"])
    names = list(BENCHMARKS) if args.benchmark == "all" else [args.benchmark]
    if len(names) > 1:
        foreign = [word for word in rest if word not in _COMMON_OPTIONS]
        if foreign:
            parser.error(
                f"{' '.join(foreign)}: with `all`, only --out and --quick; give a benchmark "
                "for its own options (python -m megatron_ext.bench BENCHMARK --help)"
            )
    if not torch.cuda.is_available():
        # Triton reads this when a kernel module is imported; set it before the imports below.
        os.environ.setdefault("TRITON_INTERPRET", "1")

    out = args.out.resolve()
    rc = 0
    for name in names:
        tee = _Tee(sys.stdout)
        with contextlib.redirect_stdout(tee), warnings.catch_warnings():
            ignore_optional_dependency_warnings()
            status = _benchmark_main(name)([*rest, "--out", str(out)])
        rc |= status
        (out / SECTIONS_DIR).mkdir(parents=True, exist_ok=True)
        section = _section(name, status, tee.copy.getvalue())
        (out / SECTIONS_DIR / f"{name}.md").write_text(section)
        _write_report(out)
    written = sorted(p.name for p in out.iterdir() if p.is_file())
    print(f"report written to {out}: {', '.join(written)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
