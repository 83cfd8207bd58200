# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Text generation controller whose sampling step reads the context's static active slices
(mirrors ``megatron.core.inference.text_generation_controllers.text_generation_controller``).

``StaticSlicesTextGenerationController`` runs sampling, log-probs and the termination mask as one
graph-safe region over static buffers (``static_slices_base``), captured in CUDA graphs. The
class is megatron-core-line specific (``text_generation_controller_0_16`` / ``..._0_19``, chosen
in ``megatron_ext.inference.static_slices``); this module is its public import path.
"""

from megatron_ext.inference.static_slices import StaticSlicesTextGenerationController
from megatron_ext.inference.text_generation_controllers.static_slices_base import (
    REQUIRED_METADATA_LABELS,
    SamplingPlan,
)

__all__ = ["REQUIRED_METADATA_LABELS", "SamplingPlan", "StaticSlicesTextGenerationController"]
