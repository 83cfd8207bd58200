# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Test-wide set-up: the Triton interpreter on CPU-only machines, and the ``gpu`` marker."""

import os

import pytest
import torch

HAVE_CUDA = torch.cuda.is_available()

# Triton decides at decoration time whether a kernel runs in the interpreter, so this must happen
# before megatron-core's or megatron_ext's kernel modules are imported by any test module.
if not HAVE_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no CUDA device is present, and say why."""
    if HAVE_CUDA:
        return
    skip_gpu = pytest.mark.skip(
        reason="needs a CUDA GPU; run scripts/run_gpu_suite.sh on a GPU machine"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
