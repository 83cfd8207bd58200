# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The query RoPE's call path stays short: few project files, few moves between them.

Traced by ``scripts/trace_rope_call_path.py`` in a fresh process (Triton's interpreter on CPU), so
that "first call of a shape" and "cached call" mean what they say whatever ran before here.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
SCRIPT = REPO / "scripts" / "trace_rope_call_path.py"

# The bounds: a cached call in the drop-in, the run path and the prepared launch (the package's
# one "direct launch, else JIT" path) only, entering each once; a shape's first call also in the
# checks that plan it, the shared tensor checks, the plan cache and the internals that name the
# kernel's parameters (megatron_ext/fusions/mla_rope/kernels.py not counted).
FIRST_CALL_FILES = 7
CACHED_CALL_FILES = 3
CACHED_CALL_MOVES = 4


def _trace(*flags: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--json", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def inference_path() -> dict:
    return _trace()


@pytest.fixture(scope="module")
def training_path() -> dict:
    return _trace("--requires-grad")


def _path(info: dict) -> str:
    return " -> ".join(info["path"])


def test_a_first_call_of_a_shape_runs_in_seven_project_files_at_most(inference_path):
    first = inference_path["first"]
    assert first["file_count"] <= FIRST_CALL_FILES, _path(first)
    assert first["path"][0] == first["path"][-1] == "fusions/fused_mla_yarn_rope_apply.py"
    assert "fusions/mla_rope/checks.py" in first["files"], "a first call must check its inputs"


def test_a_cached_call_runs_in_three_files_with_four_moves_at_most(inference_path):
    cached = inference_path["cached"]
    assert cached["file_count"] <= CACHED_CALL_FILES, _path(cached)
    assert cached["moves"] <= CACHED_CALL_MOVES, _path(cached)
    assert "fusions/mla_rope/checks.py" not in cached["files"], "a cached call was checked again"
    assert "fusions/tensor_checks.py" not in cached["files"], "a cached call was checked again"


def test_the_autograd_path_keeps_the_same_bounds(training_path):
    """With a query that requires grad (a fresh tensor, not a view: no creation metadata asked)."""
    first, cached = training_path["first"], training_path["cached"]
    assert first["file_count"] <= FIRST_CALL_FILES, _path(first)
    assert cached["file_count"] <= CACHED_CALL_FILES, _path(cached)
    assert cached["moves"] <= CACHED_CALL_MOVES, _path(cached)


def test_the_trace_counts_moves_between_project_files_only():
    spec = importlib.util.spec_from_file_location("trace_rope_call_path", SCRIPT)
    tracer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tracer)
    summary = tracer.summary(["a.py", "b.py", "a.py"])
    assert summary == {
        "path": ["a.py", "b.py", "a.py"],
        "files": ["a.py", "b.py"],
        "file_count": 2,
        "moves": 2,
    }
    assert tracer._project_file(str(tracer.KERNELS)) is None
    assert tracer._project_file(os.__file__) is None
    assert tracer._project_file(str(tracer.PACKAGE / "internals.py")) == "internals.py"
