# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Text generation controller whose sampling step reads the context's static active slices
(mirrors ``megatron.core.inference.text_generation_controllers.text_generation_controller``).

``StaticSlicesTextGenerationController`` runs sampling, log-probs and the termination mask as one
graph-safe region over static buffers (``static_slices_controller_base``), captured in CUDA
graphs. Public import path; the class comes from ``text_generation_controller_0_16`` or
``..._0_19``, picked by the same test as the context (``contexts/dynamic_context.py``).
"""

from megatron_ext.inference.contexts.dynamic_context import UPSTREAM_HAS_ACTIVE_SLICES
from megatron_ext.inference.text_generation_controllers.static_slices_controller_base import (
    REQUIRED_METADATA_LABELS,
    SamplingPlan,
)

if UPSTREAM_HAS_ACTIVE_SLICES:
    from megatron_ext.inference.text_generation_controllers.text_generation_controller_0_19 import (
        StaticSlicesTextGenerationController,
    )
else:
    from megatron_ext.inference.text_generation_controllers.text_generation_controller_0_16 import (
        StaticSlicesTextGenerationController,
    )

__all__ = ["REQUIRED_METADATA_LABELS", "SamplingPlan", "StaticSlicesTextGenerationController"]
