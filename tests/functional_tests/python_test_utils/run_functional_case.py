#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Run functional test cases and compare them with their golden values.

A case is a directory under ``tests/functional_tests/test_cases/<model>/<case>/`` holding a
``model_config.yaml`` and, per environment and platform, ``golden_values_<env>_<platform>.json``
(``env`` is the megatron-core minor release, e.g. ``mcore-0.16``; ``platform`` the GPU, e.g.
``h200``).

``model_config.yaml`` keys:

* ``ENTRYPOINT``: a script, relative to the repository root, or ``MODULE``: a module for
  ``python -m``. It must accept ``OUTPUT_ARG PATH`` and write there a JSON object with
  ``"runs": [{"mode": str, "<metric>": [value per step, ...], ...}, ...]`` (optionally
  ``"<metric> hex"`` lists and an ``"environment"`` object).
* ``ARGS`` (or ``MODEL_ARGS``): flag -> value; ``true`` passes the bare flag, ``false``/``null``
  omits it, a list passes several values.
* ``OUTPUT_ARG`` (default ``--output-json``), ``ENV_VARS``, ``NPROC`` (processes, one GPU each,
  launched with torchrun when > 1), ``TIMEOUT`` (seconds, default 600).
* ``METRICS``: the per-step metrics to check (default ``["lm loss"]``).
* ``COMPARE_MODES``: when true, every run in the output must equal the first bit for bit (e.g.
  the flag off and on).
* ``GOLDEN``: ``bitwise`` (default) or ``none``. Golden values hold one series per metric, so a
  ``bitwise`` case with several runs must set ``COMPARE_MODES`` (runs that should differ, such as
  two dtypes, are separate cases).
* ``CPU``: when true, the case also runs on a machine without a GPU (one process, on the CPU;
  ``NPROC`` must be 1); otherwise it needs ``NPROC`` GPUs.
* ``GPUS``: the GPUs the case needs on a GPU machine (default ``NPROC``), for an entry point that
  starts its ranks itself from one process (e.g. a server under torchrun).
* ``REQUIRES``: Python modules the case needs (e.g. ``megatron.training``, which only some
  megatron-core wheels ship); where one cannot be found the case is not run, and says why.
* ``GOLDEN_PENDING``: why a case has no golden values yet (e.g. no machine of its size has run it).
  It changes nothing at run time: without golden values the case fails unless
  ``--generate-golden`` is given; the repository test accepts the missing files only with it.

Usage::

    run_functional_case.py CASE_DIR [CASE_DIR ...] [--generate-golden] [--out DIR]

A directory without ``model_config.yaml`` is searched for cases. Exit status: 0 when every case
passed (or had its golden values written), 1 when any failed, 2 when none failed but some need
more GPUs than this machine has, or a module from ``REQUIRES`` it lacks (0 with
``--allow-missing-hardware``).
"""

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

REPO_ROOT = Path(__file__).resolve().parents[3]
CONFIG_NAME = "model_config.yaml"
KNOWN_KEYS = {
    "ENTRYPOINT",
    "MODULE",
    "ARGS",
    "MODEL_ARGS",
    "OUTPUT_ARG",
    "ENV_VARS",
    "NPROC",
    "TIMEOUT",
    "METRICS",
    "COMPARE_MODES",
    "GOLDEN",
    "GOLDEN_PENDING",
    "REQUIRES",
    "CPU",
    "GPUS",
    "TEST_TYPE",
    "DESCRIPTION",
}

PASSED, FAILED, GOLDEN_WRITTEN, NOT_RUN = "PASSED", "FAILED", "GOLDEN WRITTEN", "NOT RUN"


# ----------------------------------------------------------------------------------------------
# model_config.yaml


def load_yaml(path: Path) -> Dict[str, Any]:
    """Load a case file.

    Args:
        path: the ``model_config.yaml`` to read.

    Returns:
        Dict[str, Any]: its top-level mapping (empty for an empty file).

    Raises:
        ValueError: naming the file, if it cannot be read, is not YAML, or is not a mapping.
    """
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: not readable YAML: {_one_line(exc)}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"{path}: the top level must be a mapping of keys to values, got {_kind(data)}"
        )
    return data


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def _kind(value: Any) -> str:
    """A short description of a value's type for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class CaseConfig:
    """A parsed and checked ``model_config.yaml``."""

    path: Path
    name: str
    command_prefix: List[str]
    args: List[str]
    output_arg: str
    env_vars: Dict[str, str]
    nproc: int
    timeout: float
    metrics: List[str]
    compare_modes: bool
    golden: str
    requires: List[str] = field(default_factory=list)
    cpu: bool = False
    gpus: int = 1
    raw: Dict[str, Any] = field(repr=False, default_factory=dict)


def _args_to_list(args: Any, where: str) -> List[str]:
    if args is None:
        return []
    if not isinstance(args, dict):
        raise ValueError(f"{where}: ARGS must be a mapping of flag -> value")
    out: List[str] = []
    for flag, value in args.items():
        flag = str(flag)
        if not flag.startswith("-"):
            raise ValueError(f"{where}: ARGS key {flag!r} must be a flag (start with '-')")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list):
            out.append(flag)
            out.extend(_fmt(v, f"{where}: ARGS {flag}") for v in value)
        else:
            out.extend([flag, _fmt(value, f"{where}: ARGS {flag}")])
    return out


def _fmt(value: Any, where: str = "ARGS") -> str:
    if isinstance(value, bool):
        raise ValueError(f"{where}: booleans are only allowed as whole flag values, got {value}")
    if not isinstance(value, (str, int, float)):
        raise ValueError(f"{where}: values must be strings or numbers, got {_kind(value)}")
    return str(value)


def load_case(case_dir: Path) -> CaseConfig:
    """Read and validate a case directory's ``model_config.yaml``.

    Args:
        case_dir: the case directory.

    Returns:
        CaseConfig: the case.

    Raises:
        ValueError: naming every problem with the file.
    """
    path = case_dir / CONFIG_NAME
    if not path.is_file():
        raise ValueError(f"{case_dir}: no {CONFIG_NAME}")
    raw = load_yaml(path)
    where = str(path)
    unknown = set(raw) - KNOWN_KEYS
    if unknown:
        raise ValueError(
            f"{where}: unknown keys {sorted(map(str, unknown))}; known: {sorted(KNOWN_KEYS)}"
        )
    for key in (
        "ENTRYPOINT",
        "MODULE",
        "OUTPUT_ARG",
        "GOLDEN",
        "GOLDEN_PENDING",
        "TEST_TYPE",
        "DESCRIPTION",
    ):
        if key in raw and (not isinstance(raw[key], str) or not raw[key].strip()):
            raise ValueError(f"{where}: {key} must be a non-empty string, got {_kind(raw[key])}")
    if ("ENTRYPOINT" in raw) == ("MODULE" in raw):
        raise ValueError(f"{where}: give exactly one of ENTRYPOINT (a script) or MODULE")
    if "ENTRYPOINT" in raw:
        script = REPO_ROOT / raw["ENTRYPOINT"]
        if not script.is_file():
            raise ValueError(f"{where}: ENTRYPOINT {raw['ENTRYPOINT']} does not exist")
        prefix = [str(script)]
    else:
        prefix = ["-m", raw["MODULE"]]
    if "ARGS" in raw and "MODEL_ARGS" in raw:
        raise ValueError(f"{where}: give ARGS or MODEL_ARGS, not both")
    args = _args_to_list(raw.get("ARGS", raw.get("MODEL_ARGS")), where)
    env_vars = raw.get("ENV_VARS") or {}
    if not isinstance(env_vars, dict):
        raise ValueError(f"{where}: ENV_VARS must be a mapping, got {_kind(env_vars)}")
    for name, value in env_vars.items():
        if (
            not isinstance(name, str)
            or not isinstance(value, (str, int, float))
            or isinstance(value, bool)
        ):
            raise ValueError(
                f"{where}: ENV_VARS {name!r} must map a name to a string or number, got "
                f"{_kind(value)}"
            )
    nproc = raw.get("NPROC", 1)
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"{where}: NPROC must be a positive integer, got {nproc!r}")
    metrics = raw.get("METRICS", ["lm loss"])
    if not isinstance(metrics, list) or not metrics or not all(isinstance(m, str) for m in metrics):
        raise ValueError(f"{where}: METRICS must be a non-empty list of names")
    golden = raw.get("GOLDEN", "bitwise")
    if golden not in ("bitwise", "none"):
        raise ValueError(f"{where}: GOLDEN must be 'bitwise' or 'none', got {golden!r}")
    timeout = raw.get("TIMEOUT", 600)
    if not _is_number(timeout) or timeout <= 0:
        raise ValueError(
            f"{where}: TIMEOUT must be a positive number of seconds, got {_kind(timeout)}"
        )
    compare_modes = raw.get("COMPARE_MODES", False)
    if not isinstance(compare_modes, bool):
        # YAML 1.1 reads yes/no/on/off unquoted as booleans; quoted, 'no' is a (true) string.
        raise ValueError(
            f"{where}: COMPARE_MODES must be true or false, got {_kind(compare_modes)}"
        )
    requires = raw.get("REQUIRES", [])
    if not isinstance(requires, list) or not all(isinstance(m, str) and m for m in requires):
        raise ValueError(f"{where}: REQUIRES must be a list of module names, got {_kind(requires)}")
    cpu = raw.get("CPU", False)
    if not isinstance(cpu, bool):
        raise ValueError(f"{where}: CPU must be true or false, got {_kind(cpu)}")
    if cpu and nproc != 1:
        raise ValueError(f"{where}: CPU: true runs one process, so NPROC must be 1, got {nproc}")
    gpus = raw.get("GPUS", nproc)
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < nproc:
        raise ValueError(f"{where}: GPUS must be an integer >= NPROC ({nproc}), got {gpus!r}")
    return CaseConfig(
        path=case_dir,
        name=f"{case_dir.parent.name}/{case_dir.name}",
        command_prefix=prefix,
        args=args,
        output_arg=str(raw.get("OUTPUT_ARG", "--output-json")),
        env_vars={str(k): str(v) for k, v in env_vars.items()},
        nproc=nproc,
        timeout=float(timeout),
        metrics=metrics,
        compare_modes=compare_modes,
        golden=golden,
        requires=requires,
        cpu=cpu,
        gpus=gpus,
        raw=raw,
    )


def find_cases(paths: Sequence[Path]) -> List[Path]:
    """Case directories named by ``paths`` (a case directory, or a directory searched for them)."""
    cases: List[Path] = []
    for path in paths:
        if (path / CONFIG_NAME).is_file():
            cases.append(path)
        elif path.is_dir():
            cases.extend(sorted(p.parent for p in path.rglob(CONFIG_NAME)))
        else:
            raise ValueError(f"{path}: not a directory")
    if not cases:
        raise ValueError(f"no {CONFIG_NAME} under {', '.join(map(str, paths))}")
    return cases


# ----------------------------------------------------------------------------------------------
# Results and golden values


def bits(value: Any) -> str:
    """The exact identity of a metric value: float bit pattern as hex, integers as themselves."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return value.hex()
    raise TypeError(f"metric values must be numbers, got {type(value).__name__}")


def run_series(run: Dict[str, Any], metric: str) -> List[str]:
    """A run's per-step values of ``metric`` as exact strings (checked against its ``hex`` list).

    Raises:
        ValueError: if the metric is missing, is not a list of numbers, or disagrees with its
            ``hex`` list.
    """
    mode = run.get("mode", "?")
    if metric not in run:
        raise ValueError(f"run {mode!r} has no metric {metric!r}")
    values = run[metric]
    if not isinstance(values, list):
        raise ValueError(f"run {mode!r}: {metric!r} must be a list of numbers, got {_kind(values)}")
    for step, value in enumerate(values, start=1):
        if not _is_number(value):
            raise ValueError(f"run {mode!r}: {metric!r} at step {step} is {_kind(value)}")
    exact = [bits(v) for v in values]
    hexes = run.get(f"{metric} hex")
    if hexes is not None and (not isinstance(hexes, list) or hexes != exact):
        raise ValueError(f"run {mode!r}: {metric!r} values and hex strings disagree")
    return exact


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not readable JSON: {_one_line(exc)}") from exc


def load_result(path: Path, metrics: Sequence[str]) -> Dict[str, Any]:
    """Read and check an entry point's result file.

    Args:
        path: the JSON file.
        metrics: the metrics every run must have.

    Returns:
        Dict[str, Any]: the result.

    Raises:
        ValueError: one line naming the file and the problem.
    """
    result = _read_json(path)
    if not isinstance(result, dict):
        raise ValueError(
            f"{path}: the top level must be an object with 'runs', got {_kind(result)}"
        )
    runs = result.get("runs")
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{path}: 'runs' must be a non-empty list, got {_kind(runs)}")
    for index, run in enumerate(runs):
        if not isinstance(run, dict):
            raise ValueError(f"{path}: runs[{index}] must be an object, got {_kind(run)}")
        for metric in metrics:
            try:
                run_series(run, metric)
            except ValueError as exc:
                raise ValueError(f"{path}: runs[{index}]: {exc}") from exc
        timing = run.get("median_step_time_ms")
        if timing is not None and not _is_number(timing):
            raise ValueError(
                f"{path}: runs[{index}]: median_step_time_ms must be a number, got {_kind(timing)}"
            )
    environment = result.get("environment", {})
    if not isinstance(environment, dict):
        raise ValueError(f"{path}: 'environment' must be an object, got {_kind(environment)}")
    for key in ("megatron_core", "device"):
        if environment.get(key) is not None and not isinstance(environment[key], str):
            raise ValueError(
                f"{path}: environment.{key} must be a string, got {_kind(environment[key])}"
            )
    return result


def _step_field(entry: Dict[str, Any], name: str, metric: str, minimum: int) -> int:
    if name not in entry:
        raise ValueError(f"{metric!r} has no {name}")
    value = entry[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{metric!r}.{name} must be an integer >= {minimum}, got {_kind(value)}")
    return value


def check_golden(golden: Any, metrics: Sequence[str]) -> Dict[str, Dict[int, str]]:
    """Check golden values and return, per metric present, the exact value of each step.

    Every step from ``start_step`` to ``end_step`` in ``step_interval`` needs a number in
    ``values``, and, where the file has ``hex``, a hex string that is that number's exact bits.

    Args:
        golden: the parsed golden file.
        metrics: the metrics to check (missing ones are left to the comparison to report).

    Returns:
        Dict[str, Dict[int, str]]: metric -> step -> exact value.

    Raises:
        ValueError: naming the first problem.
    """
    if not isinstance(golden, dict):
        raise ValueError(f"the top level must be an object of metrics, got {_kind(golden)}")
    out: Dict[str, Dict[int, str]] = {}
    for metric in metrics:
        if metric not in golden:
            continue
        entry = golden[metric]
        if not isinstance(entry, dict):
            raise ValueError(f"{metric!r} must be an object, got {_kind(entry)}")
        start = _step_field(entry, "start_step", metric, 1)
        end = _step_field(entry, "end_step", metric, start)
        interval = _step_field(entry, "step_interval", metric, 1)
        values = entry.get("values")
        if not isinstance(values, dict):
            raise ValueError(
                f"{metric!r}.values must be an object of step -> value, got {_kind(values)}"
            )
        hexes = entry.get("hex")
        if hexes is not None and not isinstance(hexes, dict):
            raise ValueError(f"{metric!r}.hex must be an object of step -> hex, got {_kind(hexes)}")
        exact: Dict[int, str] = {}
        for step in range(start, end + 1, interval):
            if str(step) not in values:
                raise ValueError(f"{metric!r}.values has no step {step} (end_step is {end})")
            value = values[str(step)]
            if not _is_number(value):
                raise ValueError(f"{metric!r}.values step {step} is {_kind(value)}, not a number")
            exact[step] = bits(value)
            if hexes is not None:
                if str(step) not in hexes:
                    raise ValueError(f"{metric!r}.hex has no step {step}")
                if hexes[str(step)] != exact[step]:
                    raise ValueError(
                        f"{metric!r} step {step}: hex {hexes[str(step)]!r} disagrees with its "
                        f"value {value!r} ({exact[step]})"
                    )
        out[metric] = exact
    return out


def load_golden(path: Path, metrics: Sequence[str]) -> Dict[str, Any]:
    """Read and check a golden-values file.

    Args:
        path: the JSON file.
        metrics: the metrics the case compares.

    Returns:
        Dict[str, Any]: the golden values.

    Raises:
        ValueError: one line naming the file and the problem.
    """
    golden = _read_json(path)
    try:
        check_golden(golden, metrics)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return golden


def compare_runs(result: Dict[str, Any], metrics: Sequence[str]) -> List[str]:
    """Bitwise comparison of every run with the first; returns the differences."""
    runs = result["runs"]
    problems = []
    for index, run in enumerate(runs[1:], start=1):
        for metric in metrics:
            a, b = run_series(runs[0], metric), run_series(run, metric)
            if len(a) != len(b):
                problems.append(
                    f"run {index} ({run.get('mode')}) has {len(b)} {metric!r} steps, "
                    f"run 0 has {len(a)}"
                )
                continue
            diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            if diff:
                i = diff[0]
                problems.append(
                    f"run {index} ({run.get('mode')}) vs run 0 ({runs[0].get('mode')}): {metric!r} "
                    f"differs at {len(diff)} of {len(a)} steps, first at step {i + 1}: "
                    f"{runs[0][metric][i]!r} ({a[i]}) vs {run[metric][i]!r} ({b[i]})"
                )
    return problems


def golden_from_result(result: Dict[str, Any], metrics: Sequence[str]) -> Dict[str, Any]:
    """Golden values (upstream's layout, plus exact hex strings) from a run's first run."""
    run = result["runs"][0]
    golden: Dict[str, Any] = {}
    for metric in metrics:
        values = run[metric]
        golden[metric] = {
            "start_step": 1,
            "end_step": len(values),
            "step_interval": 1,
            "values": {str(i): v for i, v in enumerate(values, start=1)},
            "hex": {str(i): bits(v) for i, v in enumerate(values, start=1)},
        }
    if "step_time_ms" in run:
        times = run["step_time_ms"]
        golden["iteration-time"] = {
            "start_step": 1,
            "end_step": len(times),
            "step_interval": 1,
            "values": {str(i): round(t / 1000.0, 6) for i, t in enumerate(times, start=1)},
            "compared": False,
        }
    golden["metadata"] = {
        "environment": result.get("environment", {}),
        "note": "values are per step; 'hex' holds the exact float bit patterns that are compared",
    }
    return golden


def compare_golden(
    result: Dict[str, Any], golden: Dict[str, Any], metrics: Sequence[str]
) -> List[str]:
    """Bitwise comparison of every run with the golden values; returns the differences.

    Raises:
        ValueError: if the golden values are malformed (see :func:`check_golden`).
    """
    exact_by_metric = check_golden(golden, metrics)
    problems = []
    for metric in metrics:
        if metric not in golden:
            problems.append(f"golden values have no {metric!r}")
            continue
        entry, exact = golden[metric], exact_by_metric[metric]
        steps = sorted(exact)
        for index, run in enumerate(result["runs"]):
            series = run_series(run, metric)
            if len(series) < entry["end_step"]:
                problems.append(
                    f"run {index} ({run.get('mode')}): {len(series)} {metric!r} "
                    f"steps, golden values go to step {entry['end_step']}"
                )
                continue
            diff = [s for s in steps if series[s - 1] != exact[s]]
            if diff:
                s = diff[0]
                problems.append(
                    f"run {index} ({run.get('mode')}): {metric!r} differs from golden at "
                    f"{len(diff)} of {len(steps)} steps, first at step {s}: got "
                    f"{run[metric][s - 1]!r} ({series[s - 1]}), golden "
                    f"{entry['values'][str(s)]!r} ({exact[s]})"
                )
    return problems


def env_name(version: str) -> str:
    """``mcore-<major>.<minor>`` for a megatron-core version string."""
    parts = version.split(".")
    if len(parts) < 2:
        raise ValueError(f"cannot read a release from megatron-core version {version!r}")
    return f"mcore-{parts[0]}.{parts[1]}"


def is_file_tag(tag: str) -> bool:
    """Whether ``tag`` can be part of a golden file's name: letters, digits, '.', '_', '-'
    (no path separator, not '.' or '..')."""
    return bool(re.fullmatch(r"[A-Za-z0-9._-]+", tag)) and tag not in (".", "..")


def platform_name(device: str) -> str:
    """A short platform tag from a GPU name: 'NVIDIA H200' -> 'h200'."""
    match = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", device.replace("NVIDIA", ""))
    if match:
        return match.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_") or "unknown"


def detect_env() -> Optional[str]:
    """The environment tag of the megatron-core this interpreter imports, or None."""
    try:
        from importlib.metadata import version

        return env_name(version("megatron-core"))
    except Exception:  # pylint: disable=broad-except
        pass
    try:
        from megatron.core import package_info

        return env_name(package_info.__version__)
    except Exception:  # pylint: disable=broad-except
        return None


def gpu_count() -> int:
    """Visible CUDA devices (0 without a GPU or without nvidia-smi)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


# ----------------------------------------------------------------------------------------------
# Running a case


@dataclass
class CaseOutcome:
    """What happened to one case."""

    name: str
    status: str
    messages: List[str] = field(default_factory=list)
    seconds: float = 0.0
    timings: List[str] = field(default_factory=list)


def build_command(
    case: CaseConfig, output_json: Path, python: str, extra_args: Sequence[str]
) -> List[str]:
    """The command that runs ``case`` and writes its results to ``output_json``."""
    tail = [*case.command_prefix, *case.args, *extra_args, case.output_arg, str(output_json)]
    if case.nproc == 1:
        return [python, *tail]
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={case.nproc}",
        *tail,
    ]


def _timing_lines(result: Dict[str, Any]) -> List[str]:
    lines = []
    by_mode: Dict[str, List[float]] = {}
    for index, run in enumerate(result.get("runs", [])):
        if "median_step_time_ms" not in run:
            continue
        by_mode.setdefault(run.get("mode", "?"), []).append(run["median_step_time_ms"])
        line = f"run {index} [{run.get('mode')}] median step {run['median_step_time_ms']:.3f} ms"
        profile = run.get("rope_profile")
        if profile:
            line += (
                f", RoPE {profile['rope_us_per_step']:.1f} us/step "
                f"({100 * (profile.get('rope_share_of_kernel_time') or 0):.2f}% of kernel "
                f"time, {100 * profile.get('rope_share_of_step_time', 0):.2f}% of step)"
            )
        lines.append(line)
    if "on" in by_mode and "off" in by_mode:
        on, off = statistics.median(by_mode["on"]), statistics.median(by_mode["off"])
        lines.append(f"step time on/off {on:.3f}/{off:.3f} ms ({100 * (on / off - 1):+.2f}%)")
    return lines


def _module_available(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a parent package is missing
        return False


def run_case(
    case: CaseConfig,
    out_dir: Path,
    *,
    generate_golden: bool,
    env: Optional[str],
    platform: Optional[str],
    python: str,
    extra_args: Sequence[str],
    available_gpus: int,
) -> CaseOutcome:
    """Run one case and check it; never raises for a failing case.

    Args:
        case: the case.
        out_dir: where its log and results go.
        generate_golden: write the golden file instead of requiring it.
        env, platform: golden file tags; detected when None.
        python: the interpreter that runs the entry point.
        extra_args: arguments appended to the case's own.
        available_gpus: GPUs on this machine.

    Returns:
        CaseOutcome: status and messages.
    """
    outcome = CaseOutcome(case.name, FAILED)
    # A CPU case runs on the CPU where there is no GPU (the entry point picks the device).
    if case.gpus > available_gpus and not (case.cpu and available_gpus == 0):
        outcome.status = NOT_RUN
        outcome.messages.append(
            f"needs a machine with {case.gpus} GPUs (this one has {available_gpus}); not run, "
            "no golden values checked"
        )
        return outcome
    missing = [m for m in case.requires if not _module_available(m)]
    if missing:
        outcome.status = NOT_RUN
        outcome.messages.append(
            f"needs {', '.join(missing)}, which this environment does not have; not run, no "
            "golden values checked"
        )
        return outcome
    out_dir.mkdir(parents=True, exist_ok=True)
    output_json = out_dir / "result.json"
    if output_json.exists():
        output_json.unlink()
    log_path = out_dir / "log.txt"
    command = build_command(case, output_json, python, extra_args)
    env_vars = dict(os.environ)
    env_vars.update(case.env_vars)
    env_vars["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
    )
    start = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(command) + "\n")
        log.flush()
        try:
            proc = subprocess.run(
                command,
                cwd=REPO_ROOT,
                env=env_vars,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=case.timeout,
                check=False,
            )
            returncode: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            returncode = None
    outcome.seconds = time.monotonic() - start
    tail = "".join(log_path.read_text(errors="replace").splitlines(True)[-40:])
    if returncode is None:
        outcome.messages.append(f"timed out after {case.timeout:.0f} s; log: {log_path}")
        outcome.messages.append("last lines:\n" + tail)
        return outcome
    if not output_json.is_file():
        outcome.messages.append(
            f"the entry point exited with status {returncode} and wrote no {output_json.name}; "
            f"log: {log_path}\nlast lines:\n{tail}"
        )
        return outcome
    try:
        result = load_result(output_json, case.metrics)
    except ValueError as exc:
        outcome.messages.append(f"unusable result: {exc}")
        return outcome
    try:
        outcome.timings = _timing_lines(result)
    except (KeyError, TypeError, ValueError) as exc:
        outcome.timings = [f"timings in {output_json} unreadable: {_one_line(exc)}"]

    problems = []
    if returncode != 0:
        problems.append(f"the entry point exited with status {returncode}; log: {log_path}")
    if case.golden == "bitwise" and not case.compare_modes and len(result["runs"]) > 1:
        problems.append(
            f"{len(result['runs'])} runs ({', '.join(str(r.get('mode')) for r in result['runs'])})"
            " against one series of golden values: set COMPARE_MODES if they must be equal, "
            "or make each run its own case"
        )
    if case.compare_modes:
        if len(result["runs"]) < 2:
            problems.append("COMPARE_MODES is set but the output has a single run")
        problems.extend(compare_runs(result, case.metrics))

    environment = result.get("environment", {})
    tag_problem = None
    try:
        env = env or (
            env_name(environment["megatron_core"])
            if environment.get("megatron_core")
            else detect_env()
        )
    except ValueError as exc:
        tag_problem = f"{output_json}: {exc}; pass --env"
    platform = platform or (
        platform_name(environment["device"]) if environment.get("device") else None
    )
    if tag_problem is None and env is not None and not is_file_tag(env):
        tag_problem = f"{output_json}: the env tag {env!r} cannot name a golden file; pass --env"
    if case.golden == "bitwise":
        if tag_problem is not None:
            problems.append(tag_problem)
        elif env is None or platform is None:
            problems.append(
                "cannot tell the environment/platform for the golden file name; "
                "pass --env and --platform"
            )
        else:
            golden_path = case.path / f"golden_values_{env}_{platform}.json"
            if generate_golden:
                if problems:
                    problems.append(
                        f"golden values NOT written to {golden_path}: the run "
                        "failed the checks above"
                    )
                else:
                    golden_path.write_text(
                        json.dumps(golden_from_result(result, case.metrics), indent=4) + "\n"
                    )
                    outcome.messages.append(f"wrote {golden_path}")
            elif not golden_path.is_file():
                problems.append(
                    f"no golden values for env {env!r} on platform {platform!r}: {golden_path} "
                    "is missing. Generate them on a trusted machine with --generate-golden and "
                    "commit the file."
                )
            else:
                try:
                    golden_values = load_golden(golden_path, case.metrics)
                except ValueError as exc:
                    problems.append(f"unusable golden values: {exc}")
                else:
                    problems.extend(compare_golden(result, golden_values, case.metrics))
    outcome.messages.extend(problems)
    if problems:
        outcome.status = FAILED
    else:
        outcome.status = GOLDEN_WRITTEN if generate_golden and case.golden == "bitwise" else PASSED
    return outcome


def summary_markdown(outcomes: Sequence[CaseOutcome]) -> str:
    """A Markdown report of the cases (for CI job summaries).

    Args:
        outcomes: the cases' outcomes.

    Returns:
        str: a table of status and time, then each case's timings and messages.
    """
    lines = ["| case | result | seconds |", "| --- | --- | --- |"]
    lines += [f"| {o.name} | {o.status} | {o.seconds:.1f} |" for o in outcomes]
    for o in outcomes:
        if o.timings or o.messages:
            lines += ["", f"**{o.name}** ({o.status})", "", "```"]
            lines += [*o.timings, *o.messages, "```"]
    return "\n".join(lines) + "\n"


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> List[str]:
    """Refuse (argparse's usage error, exit status 2) what would otherwise fail later with a
    traceback; returns the split ``--extra-args``."""
    try:
        extra = shlex.split(args.extra_args)
    except ValueError as exc:
        parser.error(f"--extra-args {args.extra_args!r}: {exc}")
    for name in ("env", "platform"):
        tag = getattr(args, name)
        if tag is not None and not is_file_tag(tag):
            parser.error(
                f"--{name} {tag!r}: a golden file tag is letters, digits, '.', '_' and '-' only"
            )
    if shutil.which(args.python) is None:
        parser.error(f"--python {args.python!r}: no such executable")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {str(args.out)!r}: exists and is not a directory")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {str(args.out)!r}: {exc.strerror or exc}")
    return extra


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command-line entry point; see the module docstring.

    Args:
        argv: arguments; ``sys.argv[1:]`` when None.

    Returns:
        int: the exit status.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", type=Path, help="case directories (or parents)")
    parser.add_argument(
        "--generate-golden",
        action="store_true",
        help="write golden_values_<env>_<platform>.json from this run",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO_ROOT / "results" / "functional_tests",
        help="directory for logs and per-case results",
    )
    parser.add_argument("--env", default=None, help="golden env tag (default: detected)")
    parser.add_argument("--platform", default=None, help="golden platform tag (default: GPU)")
    parser.add_argument("--python", default=sys.executable, help="interpreter for entry points")
    parser.add_argument(
        "--extra-args",
        default="",
        help="arguments appended to every case's own (shell-quoted string)",
    )
    parser.add_argument(
        "--gpus",
        type=_non_negative_int,
        default=None,
        help="GPUs this machine offers (default: detected with nvidia-smi)",
    )
    parser.add_argument(
        "--allow-missing-hardware",
        action="store_true",
        help="exit 0 when the only unrun cases need more GPUs or a module this environment lacks",
    )
    args = parser.parse_args(argv)
    extra = _check_arguments(parser, args)

    try:
        case_dirs = find_cases(args.cases)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    available = gpu_count() if args.gpus is None else args.gpus
    outcomes = []
    total_start = time.monotonic()
    for case_dir in case_dirs:
        case_dir = case_dir.resolve()
        try:
            case = load_case(case_dir)
        except ValueError as exc:
            # A broken case file fails its case; the others still run.
            outcome = CaseOutcome(f"{case_dir.parent.name}/{case_dir.name}", FAILED, [str(exc)])
            print(f"=== {outcome.name}", flush=True)
        else:
            print(f"=== {case.name} (NPROC {case.nproc})", flush=True)
            try:
                outcome = run_case(
                    case,
                    args.out / case.path.parent.name / case.path.name,
                    generate_golden=args.generate_golden,
                    env=args.env,
                    platform=args.platform,
                    python=args.python,
                    extra_args=extra,
                    available_gpus=available,
                )
            except Exception as exc:  # pylint: disable=broad-except
                # A runner bug fails its case; the others still run and the summary is written.
                outcome = CaseOutcome(
                    case.name, FAILED, [f"the runner failed: {type(exc).__name__}: {exc}"]
                )
        outcomes.append(outcome)
        print(f"--- {outcome.status}: {outcome.name} ({outcome.seconds:.1f} s)")
        for line in outcome.timings:
            print(f"    {line}")
        for message in outcome.messages:
            print("    " + message.replace("\n", "\n    "))
    print(f"=== summary ({time.monotonic() - total_start:.1f} s)")
    for outcome in outcomes:
        print(f"  {outcome.status:<15} {outcome.name} ({outcome.seconds:.1f} s)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(summary_markdown(outcomes))
    if any(o.status == FAILED for o in outcomes):
        return 1
    if any(o.status == NOT_RUN for o in outcomes) and not args.allow_missing_hardware:
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
