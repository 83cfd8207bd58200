# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""pytest plugin: megatron-core's own tests with megatron_ext swapped in.

``python -m pytest -p megatron_ext_swap ...`` in a Megatron-LM checkout applies both flags' patches
(``megatron_ext.patches.PATCHES``) before any test module is imported, so a test that imports
megatron-core's kernels, builds its MLA specs or constructs its inference context and controller
gets megatron_ext's. Used by ``scripts/run_megatron_core_tests.py``.
"""

import megatron_ext.inference
from megatron_ext import patches
from megatron_ext.models.gpt.gpt_layer_specs import patch_megatron_core_gpt_specs


def pytest_configure(config):
    """Apply the patches before collection."""
    patch_megatron_core_gpt_specs()
    megatron_ext.inference.enable_static_active_slices()


def pytest_report_header(config):
    """Say in the run's header what is swapped in."""
    applied = patches.applied_extensions()
    return [
        f"megatron_ext swapped in: {name} ({len(targets)} patches)"
        for name, targets in applied.items()
    ]
