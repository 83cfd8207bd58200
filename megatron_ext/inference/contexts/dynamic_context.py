# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Dynamic inference context with static-address active slices (mirrors
``megatron.core.inference.contexts.dynamic_context``).

megatron-core's ``DynamicInferenceContext`` keeps per-request state in tensors of ``max_requests``
rows laid out as ``[paused | active | finished]``. The active requests are the rows
``[paused_request_count, total_request_count)``: a window whose start and length change every
step, so any kernel that reads "the active requests" sees a different address and shape each
step and cannot be captured in a CUDA graph. ``StaticSlicesInferenceContext`` adds fixed-address
copies of the active window (``build_active_slices``), padded neutrally (``pad_active_slices``);
:attr:`device_active_slices` gives the device-resident static buffers on every release.

The class is megatron-core-line specific (``dynamic_context_0_16`` / ``dynamic_context_0_19``,
chosen in ``megatron_ext.inference.static_slices``); this module is its public import path.
"""

from megatron_ext.inference.contexts.sampling_registry import SamplingRequirements
from megatron_ext.inference.contexts.static_slices_base import (
    ACTIVE_METADATA_PAD_VALUES,
    ACTIVE_REQUEST_PAD_VALUES,
    UPSTREAM_HAS_ACTIVE_SLICES,
    ActiveSlices,
)
from megatron_ext.inference.static_slices import StaticSlicesInferenceContext

__all__ = [
    "ACTIVE_METADATA_PAD_VALUES",
    "ACTIVE_REQUEST_PAD_VALUES",
    "ActiveSlices",
    "SamplingRequirements",
    "StaticSlicesInferenceContext",
    "UPSTREAM_HAS_ACTIVE_SLICES",
]
