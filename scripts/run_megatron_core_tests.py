#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Run megatron-core's own unit tests stock and with megatron_ext swapped in; print what differs.

    python scripts/run_megatron_core_tests.py --megatron-lm /path/to/Megatron-LM [--files F ...]

The checkout must be at the tag of the installed megatron-core (``core_v0.16.1`` for 0.16.1;
0.19.x has ``core_v0.19.0``): its ``tests/`` and ``megatron/training`` are used, its
``megatron/core`` is not (the installed megatron-core is). Without ``--files`` every test file
under ``tests/unit_tests`` that names one of the replaced functions or classes is run. Each file
runs twice in a fresh pytest process: stock, and with ``-p megatron_ext_swap``
(``tests/conformance/megatron_ext_swap.py``). ``--jobs N`` runs N files at a time and
``--workers K`` splits each file over K pytest-xdist workers; every process gets its own
``MASTER_PORT`` (the tests' single-rank process group binds one;
``tests/conformance/worker_ports.py``). Exit status 1 if a test that passes stock does not pass
with megatron_ext.
"""

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

REPO = Path(__file__).resolve().parents[1]
PLUGIN_DIR = REPO / "tests" / "conformance"
REPLACED = re.compile(
    r"fused_apply_mla_rope_for_(q|kv)|DynamicInferenceContext|TextGenerationController"
    r"|MLASelfAttention"
)


def discover(checkout: Path) -> List[str]:
    """Test files of the checkout that name a function or class megatron_ext replaces."""
    root = checkout / "tests" / "unit_tests"
    found = []
    for path in sorted(root.rglob("test_*.py")):
        if REPLACED.search(path.read_text(errors="replace")):
            found.append(str(path.relative_to(checkout)))
    return found


# A test's outcome line under -v: "PATH::NAME PASSED [ 3%]", or "[gw0] [ 3%] PASSED PATH::NAME"
# with pytest-xdist. Printed as each test ends, so a run cut off by its timeout keeps what ran.
_OUTCOME = re.compile(
    r"^(?:\[gw\d+\] \[\s*\d+%\] (?P<state1>[A-Z]+) (?P<id1>\S+::\S+)"
    r"|(?P<id2>\S+::\S+) (?P<state2>[A-Z]+)(?: |$))"
)
_STATES = {
    "PASSED": "passed",
    "FAILED": "failed",
    "ERROR": "error",
    "SKIPPED": "skipped",
    "XFAIL": "xfailed",
    "XPASS": "xpassed",
}


def outcomes(log_path: Path) -> Dict[str, str]:
    """test id -> passed / failed / error / skipped / xfailed / xpassed, from a -v log."""
    if not log_path.exists():
        return {}
    result = {}
    for line in log_path.read_text(errors="replace").splitlines():
        match = _OUTCOME.match(line)
        if match:
            state = _STATES.get(match.group("state1") or match.group("state2"))
            if state is not None:
                result[match.group("id1") or match.group("id2")] = state
    return result


def _last_error(lines: List[str]) -> str:
    """The last ``E`` line of a pytest log's lines ("" if none)."""
    errors = [line[1:].strip() for line in lines if line.startswith("E ") and line[1:].strip()]
    return errors[-1][:160] if errors else ""


def nothing_ran_reason(log_path: Path) -> str:
    """Why a run's log names no test outcome: its collection error, or its last line."""
    if not log_path.exists():
        return "no log"
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()]
    error = _last_error(lines)
    if error:
        return f"nothing ran: {error}"
    last = next((line for line in reversed(lines) if line), "empty log")
    return f"nothing ran: {last[:160]}"


def all_errored_reason(log_path: Path, outcome: Dict[str, str]) -> str:
    """Why every test of a run errored (a fixture of the checkout's conftest that needs a package
    not installed, say), or "" where one did not: the run compared nothing.

    Args:
        log_path: the run's ``-v`` log.
        outcome: its outcomes (:func:`outcomes`).

    Returns:
        str: the note, or "".
    """
    if not outcome or set(outcome.values()) != {"error"}:
        return ""
    lines = [line.strip() for line in log_path.read_text(errors="replace").splitlines()]
    return f"every test errored: {_last_error(lines) or 'no E line'}"


def stage(checkout: Path, out: Path) -> Tuple[Path, List[str]]:
    """A working directory with the checkout's tests, and the paths to append for the checkout's
    ``megatron`` packages other than ``core`` (``training``, ``legacy``, ``rl``: the tests' conftest
    imports them): the checkout's ``megatron/core`` must not shadow the installed one."""
    work = out / "_stage"
    training = out / "_megatron_training"
    links = [
        (work / "tests", checkout / "tests"),
        (work / "pyproject.toml", checkout / "pyproject.toml"),
    ]
    packages = checkout / "megatron"
    for package in sorted(packages.iterdir()) if packages.is_dir() else ():
        if package.is_dir() and package.name != "core":
            links.append((training / "megatron" / package.name, package))
    for link, target in links:
        if target.exists() and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(target)
    return work, [str(training)]


def pythonpath(work: Path, tail: List[str]) -> str:
    head = [str(work), str(PLUGIN_DIR), str(REPO), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join([p for p in head if p] + tail)


def conftest_error(work: Path, tail: List[str]) -> str:
    """Why the checkout's root conftest cannot be imported here ("" if it can)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import tests.unit_tests.conftest"],
        cwd=work,
        env={**os.environ, "PYTHONPATH": pythonpath(work, tail)},
        capture_output=True,
        text=True,
        check=False,
    )
    return "" if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["?"])[-1]


def run(
    work: Path,
    tail: List[str],
    test_file: str,
    swapped: bool,
    out: Path,
    timeout: int,
    noconftest: bool,
    port: int = 29500,
    workers: int = 1,
    select: Optional[str] = None,
) -> Tuple[Dict[str, str], bool]:
    tag = "megatron_ext" if swapped else "stock"
    env = dict(os.environ)
    env["PYTHONPATH"] = pythonpath(work, tail)
    env["MASTER_PORT"] = str(port)
    # The checkout's addopts stop at the first failure (-x); every test must run here.
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        test_file,
        "-v",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
    ]
    if noconftest:
        cmd += ["--noconftest"]
    if swapped:
        cmd += ["-p", "megatron_ext_swap"]
    if workers > 1:
        cmd += ["-n", str(workers), "-p", "worker_ports"]
    if select:
        cmd += ["-k", select]
    log = out / f"{tag}-{test_file.replace('/', '_')}.log"
    timed_out = False
    with open(log, "w") as f:
        try:
            subprocess.run(
                cmd,
                cwd=work,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            f.write(f"\nTIMEOUT after {timeout} s\n")
            timed_out = True
    return outcomes(log), timed_out


def _passed(outcome: Dict[str, str]) -> int:
    """How many of a run's tests passed (test id -> outcome)."""
    return sum(state == "passed" for state in outcome.values())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron-lm", required=True, type=Path, help="Megatron-LM checkout")
    parser.add_argument("--files", nargs="*", help="test files relative to the checkout")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "megatron_core_tests")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per pytest process")
    parser.add_argument("--jobs", type=int, default=1, help="test files at a time")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers per file")
    parser.add_argument("-k", dest="select", help="only the tests pytest's -k EXPR selects")
    args = parser.parse_args(argv)
    checkout = args.megatron_lm.resolve()
    if not (checkout / "tests" / "unit_tests").is_dir():
        parser.error(f"{checkout} has no tests/unit_tests: pass a Megatron-LM checkout")
    files = args.files or discover(checkout)
    if not files:
        parser.error("no test file names a replaced function or class")
    args.out.mkdir(parents=True, exist_ok=True)
    from megatron.core import package_info

    print(f"megatron-core {package_info.__version__}; tests from {checkout}")
    work, tail = stage(checkout, args.out)
    why = conftest_error(work, tail)
    if why:
        # Both runs skip it alike, so the comparison stays fair; tests needing its fixtures
        # error in both.
        print(
            f"the checkout's tests/unit_tests/conftest.py cannot be imported here ({why}): "
            "running with --noconftest"
        )
    if args.jobs < 1 or args.workers < 1:
        parser.error(f"--jobs and --workers must be >= 1; got {args.jobs}, {args.workers}")

    def both(index: int, test_file: str):
        start = time.time()
        # A block of ports per run (its workers take the ports after the first): a file's stock
        # and swapped runs, and files running side by side, never share one.
        stride = args.workers + 1
        ports = (29500 + 2 * index * stride, 29500 + (2 * index + 1) * stride)
        common = (args.out, args.timeout, bool(why))
        stock, stock_cut = run(
            work, tail, test_file, False, *common, ports[0], args.workers, args.select
        )
        ext, ext_cut = run(
            work, tail, test_file, True, *common, ports[1], args.workers, args.select
        )
        if stock_cut or ext_cut:
            # A run its timeout cut off: compare only the tests both runs finished.
            both_ran = set(stock) & set(ext)
            stock = {t: s for t, s in stock.items() if t in both_ran}
            ext = {t: s for t, s in ext.items() if t in both_ran}
        notes = ["cut at the timeout"] if stock_cut or ext_cut else []
        for tag, outcome in (("stock", stock), ("megatron_ext", ext)):
            log = args.out / f"{tag}-{test_file.replace('/', '_')}.log"
            reason = all_errored_reason(log, outcome) if outcome else nothing_ran_reason(log)
            if reason:
                notes.append(f"{tag}: {reason}")
        seconds = time.time() - start
        # As each file ends: a run cut short by an outer timeout keeps the files done by then.
        print(
            f"done {test_file}: stock {_passed(stock)}/{len(stock)} passed, megatron_ext "
            f"{_passed(ext)}/{len(ext)} ({seconds:.0f} s)",
            flush=True,
        )
        return test_file, stock, ext, seconds, "; ".join(notes)

    rows, regressions = [], []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(both, range(len(files)), files))
    for test_file, stock, ext, seconds, note in results:
        passed_stock = {t for t, s in stock.items() if s == "passed"}
        lost = sorted(t for t in passed_stock if ext.get(t) != "passed")
        regressions += [(t, ext.get(t, "not run")) for t in lost]
        rows.append(
            (
                test_file,
                _passed(stock),
                len(stock),
                _passed(ext),
                len(ext),
                len(lost),
                seconds,
                note.replace("|", "/"),
            )
        )
    print(
        "\n| test file | stock passed/run | megatron_ext passed/run | passed stock, not ours | s "
        "| note |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, sp, sn, ep, en, lost, secs, note in rows:
        print(f"| {name} | {sp}/{sn} | {ep}/{en} | {lost} | {secs:.0f} | {note} |")
    for test_id, state in regressions:
        print(f"REGRESSION {test_id}: passes stock, {state} with megatron_ext")
    total = sum(r[1] for r in rows)
    print(f"\n{total} tests passed stock; {len(regressions)} of them do not pass with megatron_ext")
    return 1 if regressions else 0


if __name__ == "__main__":
    sys.exit(main())
