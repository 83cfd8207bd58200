# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What a functional case or benchmark result records about the run that produced it."""

import sys
from typing import Any, Dict

import torch

__all__ = ["run_environment"]


def run_environment() -> Dict[str, Any]:
    """Versions and device of this process's run.

    The functional-test runner names golden files by ``megatron_core`` (``mcore-X.Y``) and the
    device.

    Returns:
        Dict[str, Any]: megatron-core, torch, Triton and Python versions, and the device name
        (``"cpu"`` without CUDA).
    """
    import triton
    from megatron.core import package_info

    return {
        "megatron_core": package_info.__version__,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
