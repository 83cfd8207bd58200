# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The static-active-slices classes for the installed megatron-core line, chosen here and only
here.

megatron-core 0.16.x keeps request bookkeeping on the device and has no active slices; 0.19.x
keeps it in pinned host memory and builds (part of) the slices itself. Each line has its own
context module (``contexts/dynamic_context_0_16.py``, ``contexts/dynamic_context_0_19.py``) and
controller module (``text_generation_controllers/text_generation_controller_0_16.py``,
``..._0_19.py``); a module of the other line is never imported.
"""

from megatron_ext.inference.contexts.static_slices_base import UPSTREAM_HAS_ACTIVE_SLICES

if UPSTREAM_HAS_ACTIVE_SLICES:
    from megatron_ext.inference.contexts.dynamic_context_0_19 import StaticSlicesInferenceContext
    from megatron_ext.inference.text_generation_controllers.text_generation_controller_0_19 import (
        StaticSlicesTextGenerationController,
    )
else:
    from megatron_ext.inference.contexts.dynamic_context_0_16 import StaticSlicesInferenceContext
    from megatron_ext.inference.text_generation_controllers.text_generation_controller_0_16 import (
        StaticSlicesTextGenerationController,
    )

__all__ = [
    "StaticSlicesInferenceContext",
    "StaticSlicesTextGenerationController",
    "UPSTREAM_HAS_ACTIVE_SLICES",
]
