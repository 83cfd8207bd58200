# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The decode step's host profile (megatron_ext.bench.mla_engine_host_profile): owners over
made-up pstats data, a real cProfile of a small function tree, the printed profile and the
command-line option."""

import os

import pytest
import torch

from megatron_ext.bench import mla_engine
from megatron_ext.bench import mla_engine_host_profile as host_lib

ROOTS = {
    "/r/megatron_ext": "megatron_ext",
    "/sp/megatron/core": "megatron.core",
    "/sp/torch": "torch",
    "/sp/triton": "triton",
}
TORCH = "<method 'item' of 'torch._C.TensorBase' objects>"
SYNC = "<built-in method torch._C._cuda_synchronize>"


def _stats():
    """Two decode steps' pstats: per (file, line, name), (primitive calls, calls, self seconds,
    cumulative seconds, callers)."""
    rows = [
        ("/r/megatron_ext/bench/mla_engine.py", 300, "decode_step", 2, 0.0001, 0.0098),
        ("/r/megatron_ext/inference/static_slices.py", 40, "update", 4, 0.0004, 0.0012),
        ("/r/megatron_ext/ops/rope.py", 10, "apply", 8, 0.0002, 0.0020),
        (
            "/sp/megatron/core/inference/engines/dynamic_engine.py",
            900,
            "step_modern",
            2,
            1e-3,
            9e-3,
        ),
        ("/sp/megatron/training/arguments.py", 1, "f", 2, 0.0001, 0.0001),
        ("/sp/torch/nn/modules/module.py", 1750, "_call_impl", 20, 0.0006, 0.0040),
        ("/sp/torchvision/ops.py", 5, "nms", 2, 0.0001, 0.0001),
        ("/sp/triton/runtime/jit.py", 700, "run", 8, 0.0004, 0.0006),
        ("~", 0, "<built-in method __triton_launcher.launch>", 8, 0.0002, 0.0002),
        ("~", 0, TORCH, 2, 0.0020, 0.0020),
        ("~", 0, SYNC, 2, 0.0030, 0.0030),
        ("~", 0, "<built-in method torch.nonzero>", 2, 0.0004, 0.0004),
        ("~", 0, "<method 'item' of 'numpy.generic' objects>", 2, 0.0001, 0.0001),
        ("~", 0, "<built-in method builtins.isinstance>", 40, 0.0002, 0.0002),
        ("~", 0, "<method 'disable' of '_lsprof.Profiler' objects>", 2, 0.5, 0.5),
    ]
    return {(f, line, name): (n, n, tt, ct, {}) for f, line, name, n, tt, ct in rows}


def test_owners_come_from_the_files_package_and_c_functions_from_their_names():
    owners = {key[2]: host_lib.owner_of(key, ROOTS) for key in _stats()}
    assert owners["decode_step"] == owners["update"] == "megatron_ext"
    assert owners["step_modern"] == "megatron.core"
    assert owners["f"] == "python/other"  # megatron.training is not megatron.core
    assert owners["_call_impl"] == "torch" and owners["nms"] == "python/other"  # torchvision
    assert owners["run"] == owners["<built-in method __triton_launcher.launch>"] == "triton"
    assert owners[TORCH] == owners[SYNC] == "torch"
    assert owners["<method 'item' of 'numpy.generic' objects>"] == "python/other"
    assert owners["<built-in method builtins.isinstance>"] == "python/other"
    # The longest package directory wins: a package inside another's tree is its own.
    nested = dict(ROOTS, **{"/sp/torch/vendored/triton": "triton"})
    assert host_lib.owner_of(("/sp/torch/vendored/triton/x.py", 1, "g"), nested) == "triton"


def test_labels_start_at_the_package():
    label = host_lib.function_label
    key = ("/sp/megatron/core/inference/engines/dynamic_engine.py", 900, "step_modern")
    assert label(key, ROOTS) == "megatron/core/inference/engines/dynamic_engine.py:900(step_modern)"
    assert label(("/r/megatron_ext/ops/rope.py", 10, "apply"), ROOTS) == (
        "megatron_ext/ops/rope.py:10(apply)"
    )
    assert label(("~", 0, TORCH), ROOTS) == "{method 'item' of 'torch._C.TensorBase' objects}"
    assert label(("/elsewhere/x/tool.py", 3, "h"), ROOTS) == "tool.py:3(h)"


def test_owners_sum_to_the_profiled_time_and_the_waits_are_apart():
    profile = host_lib.host_breakdown(_stats(), steps=2, wall_seconds=0.010, roots=ROOTS, top=3)
    assert profile["wall_ms_per_step"] == pytest.approx(5.0)
    # The profiler's own disable() is left out.
    assert profile["profiled_ms_per_step"] == pytest.approx(4.4)
    owners = profile["owners"]
    assert list(owners) == list(host_lib.OWNERS)
    expected = {"megatron_ext": 0.35, "megatron.core": 0.5, "torch": 3.0, "triton": 0.3}
    assert owners == pytest.approx(dict(expected, **{"python/other": 0.25}))
    assert sum(owners.values()) == pytest.approx(profile["profiled_ms_per_step"])
    # torch's read-backs and synchronisations, not numpy's item().
    waits = {w["function"]: w["ms_per_step"] for w in profile["waits"]}
    assert waits == pytest.approx(
        {
            "{built-in method torch._C._cuda_synchronize}": 1.5,
            "{method 'item' of 'torch._C.TensorBase' objects}": 1.0,
            "{built-in method torch.nonzero}": 0.2,
        }
    )
    assert list(waits)[0] == "{built-in method torch._C._cuda_synchronize}"  # by time
    assert profile["gpu_wait_ms_per_step"] == pytest.approx(2.7)
    assert profile["host_ms_per_step"] == pytest.approx(4.4 - 2.7)
    assert profile["bench_ms_per_step"] == pytest.approx(0.05)
    top = profile["top_self"]
    assert [(r["owner"], r["ms_per_step"]) for r in top] == [
        ("torch", pytest.approx(1.5)),
        ("torch", pytest.approx(1.0)),
        ("megatron.core", pytest.approx(0.5)),
    ]
    assert top[2]["calls_per_step"] == 1
    # megatron_ext's cumulative times, the benchmark's own stepping (the whole step) left out.
    cumulative = [(r["function"], r["ms_per_step"]) for r in profile["top_cumulative"]]
    assert cumulative == [
        ("megatron_ext/ops/rope.py:10(apply)", pytest.approx(1.0)),
        ("megatron_ext/inference/static_slices.py:40(update)", pytest.approx(0.6)),
    ]
    assert profile["top_cumulative"][0]["calls_per_step"] == 4
    for steps, wall in ((0, 1.0), (1, 0.0)):
        with pytest.raises(ValueError):
            host_lib.host_breakdown(_stats(), steps, wall, ROOTS)


def test_the_printed_profile():
    profile = host_lib.host_breakdown(_stats(), 2, 0.010, ROOTS, top=2, top_cumulative=1)
    lines = host_lib.host_profile_lines("small, 1024 requests, dynamic-graphed", profile, 3.5)
    assert lines[0] == (
        "host profile per decode step (small, 1024 requests, dynamic-graphed, 2 steps under "
        "cProfile): wall 5.000 ms (timed rounds: 3.500 ms), self time 4.400 ms: waits on the GPU "
        "2.700 ms (61%), host work 1.700 ms (39%)"
    )
    assert lines[1] == "  self time per owner:"
    assert lines[2].split() == [
        "8.0%",
        "0.350",
        "ms",
        "megatron_ext",
        "(the",
        "benchmark's",
        "own",
        "stepping",
        "0.050",
        "ms)",
    ]
    assert lines[4].split()[:4] == ["68.2%", "3.000", "ms", "torch"]
    assert lines[4].endswith("(waits on the GPU 2.700 ms)")
    assert lines[6].split() == ["5.7%", "0.250", "ms", "python/other"]
    assert lines[7].startswith("  waits on the GPU")
    assert lines[8].split() == [
        "1.500",
        "ms",
        "x1",
        "{built-in",
        "method",
        "torch._C._cuda_synchronize}",
    ]
    assert lines[11] == "  top 2 functions by self time:"
    assert lines[12].split()[:4] == ["1.500", "ms", "x1", "torch"]
    assert lines[14].startswith("  top 1 megatron_ext functions by cumulative time")
    assert lines[15].split() == ["1.000", "ms", "x4", "megatron_ext/ops/rope.py:10(apply)"]
    assert len(lines) == 16
    assert host_lib.host_profile_lines("tiny", {"steps": 0}) == [
        "host profile per decode step (tiny): no decode step was profiled"
    ]


# ------------------------------------------------------------- a real profile, no GPU


def _inner(n):
    return sum(i * i for i in range(n))


def _outer():
    _inner(2000)
    _inner(2000)
    return torch.ones(4).sum().item()


class _Unit:
    """Three decode steps of a made-up engine, each running :func:`_outer`."""

    def __init__(self):
        self.left, self.calls = 0, []

    def start(self, prompts):
        self.left = 3
        self.calls.append("start")

    def prefill(self):
        self.calls.append("prefill")

    def decode_step(self):
        self.left -= 1
        return _outer()

    @property
    def done(self):
        return self.left <= 0

    def drain(self):
        self.calls.append(f"drain {self.left}")
        self.left = 0


def test_decode_steps_under_cprofile_with_the_tests_directory_as_the_plugin():
    here = os.path.dirname(os.path.abspath(__file__))
    roots = {here: "megatron_ext", os.path.dirname(torch.__file__): "torch"}
    unit, syncs = _Unit(), []
    profile = host_lib.profile_host_decode_steps(unit, [[1]], 2, lambda: syncs.append(1), roots)
    # Two of the three steps profiled, the third drained outside; a sync after the prefill and
    # before and after each step.
    assert profile["steps"] == 2 and unit.calls == ["start", "prefill", "drain 1"]
    assert len(syncs) == 5
    assert sum(profile["owners"].values()) == pytest.approx(profile["profiled_ms_per_step"])
    assert 0 < profile["profiled_ms_per_step"] <= profile["wall_ms_per_step"]
    assert profile["owners"]["megatron_ext"] > 0 and profile["owners"]["torch"] > 0
    [wait] = profile["waits"]
    assert wait["function"] == "{method 'item' of 'torch._C.TensorBase' objects}"
    assert wait["calls_per_step"] == 1
    # Cumulative: the step's own method includes both _inner calls.
    cumulative = {r["function"].split("(")[-1]: r for r in profile["top_cumulative"]}
    assert cumulative["decode_step)"]["ms_per_step"] >= cumulative["_outer)"]["ms_per_step"]
    assert cumulative["_outer)"]["ms_per_step"] > cumulative["_inner)"]["ms_per_step"] > 0
    assert cumulative["_inner)"]["calls_per_step"] == 2
    assert not any("_lsprof" in r["function"] for r in profile["top_self"])
    # A batch with no decode step left profiles nothing.
    unit.start = lambda prompts: None
    assert host_lib.profile_host_decode_steps(unit, [[1]], 2, lambda: None, roots) == {"steps": 0}


def test_the_host_profile_option():
    assert mla_engine.parse_args(["--host-profile-steps", "4"]).host_profile_steps == 4
    assert mla_engine.parse_args([]).host_profile_steps == 0
    with pytest.raises(SystemExit):
        mla_engine.parse_args(["--host-profile-steps", "-1"])
