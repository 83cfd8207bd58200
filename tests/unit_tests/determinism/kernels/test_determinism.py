# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Bit-exact determinism of every kernel registered in manifest.py.

On a GPU: the same bits on repeated runs at each registered config, and the same bits across the
configs (the autotuner may pick any of them). Without a GPU: the same checks in fp32 in the Triton
interpreter, where it is cheap.
"""

import ast
import importlib.util
from pathlib import Path

import pytest
import torch

# Loaded by path: "manifest" is too generic a module name to put on sys.path.
_spec = importlib.util.spec_from_file_location(
    "megatron_ext_kernel_determinism_manifest", Path(__file__).with_name("manifest.py")
)
manifest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(manifest)

INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _bits(outputs):
    return [x.contiguous().view(INT_VIEW[x.dtype]).clone() for x in outputs]


def _assert_same_bits(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"{what}: output {i} differs in {int((x != y).sum())} elements"


def _check(name, case, device, dtype, configs):
    first = None
    for config in configs:
        runs = [_bits(case.run(device, dtype, config)) for _ in range(2)]
        _assert_same_bits(runs[0], runs[1], f"{name} {dtype}: repeated run at {config}")
        if first is None:
            first = (config, runs[0])
        else:
            _assert_same_bits(first[1], runs[0], f"{name} {dtype}: {config} vs {first[0]}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(manifest.KERNELS))
def test_kernel_is_bitwise_deterministic_gpu(name):
    case = manifest.KERNELS[name]
    for dtype in case.gpu_dtypes:
        _check(name, case, torch.device("cuda"), dtype, case.configs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU variant covers this on CUDA")
@pytest.mark.parametrize("name", sorted(manifest.KERNELS))
def test_kernel_is_bitwise_deterministic_interpreter(name):
    case = manifest.KERNELS[name]
    # The interpreter cannot autotune: no "kernel's own choice" (None) entry there, unless the
    # kernel has no configs to choose from (None is then its only launch).
    configs = [c for c in case.configs if c is not None][:2] or [None]
    for dtype in case.cpu_dtypes:
        _check(name, case, torch.device("cpu"), dtype, configs)


REPO_ROOT = Path(__file__).resolve().parents[4]


def _module_names(path: Path):
    """Top-level function names of a Python file, and its top-level tuples of strings by name."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    tuples = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Tuple):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    tuples[target.id] = [getattr(e, "value", None) for e in node.value.elts]
    return functions, tuples


@pytest.mark.parametrize("name", sorted(manifest.KERNELS))
def test_manifest_names_the_race_test(name):
    """Every entry names an existing GPU test that holds its kernel race-free, and the kernel is
    one that test runs."""
    case = manifest.KERNELS[name]
    assert case.race_test, f"{name}: no race_test (see manifest.py's docstring)"
    path, _, function = case.race_test.partition("::")
    test_file = REPO_ROOT / path
    assert test_file.is_file(), f"{name}: {path} does not exist"
    functions, _ = _module_names(test_file)
    assert function in functions, f"{name}: {path} defines no {function}"
    marks = [ast.unparse(d) for d in functions[function].decorator_list]
    assert "pytest.mark.gpu" in marks, f"{name}: {case.race_test} is not a GPU test"
    if not case.race_kernel:
        return  # the race test serves this kernel alone
    # The race test is parametrized over its relaunch helper's KERNELS.
    _, tuples = _module_names(test_file.with_name("mla_rope_relaunch.py"))
    run_there = tuples["KERNELS"] + tuples["OURS_ONLY"]
    assert case.race_kernel in run_there, f"{name}: {case.race_kernel!r} is not run there"
