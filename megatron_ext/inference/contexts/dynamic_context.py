# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Dynamic inference context with static-address active slices (mirrors
``megatron.core.inference.contexts.dynamic_context``).

megatron-core's ``DynamicInferenceContext`` keeps per-request state in rows
``[paused | active | finished]``; the active window moves and changes length every step, so a
kernel reading it cannot be captured in a CUDA graph. ``StaticSlicesInferenceContext`` keeps
fixed-address copies of that window (``build_active_slices``), padded neutrally
(``pad_active_slices``).

This is the public import path and the one place that picks the class for the installed
megatron-core line: ``dynamic_context_0_16`` or ``dynamic_context_0_19`` (each defines a class of
this name; the module of the other line is never imported). The controller module picks its
class by the same :data:`UPSTREAM_HAS_ACTIVE_SLICES`.
"""

from megatron_ext.inference.contexts.sampling_registry import SamplingRequirements
from megatron_ext.inference.contexts.static_slices_context_base import (
    ACTIVE_METADATA_PAD_VALUES,
    ACTIVE_REQUEST_PAD_VALUES,
    UPSTREAM_HAS_ACTIVE_SLICES,
    ActiveSlices,
)

if UPSTREAM_HAS_ACTIVE_SLICES:
    from megatron_ext.inference.contexts.dynamic_context_0_19 import StaticSlicesInferenceContext
else:
    from megatron_ext.inference.contexts.dynamic_context_0_16 import StaticSlicesInferenceContext

__all__ = [
    "ACTIVE_METADATA_PAD_VALUES",
    "ACTIVE_REQUEST_PAD_VALUES",
    "ActiveSlices",
    "SamplingRequirements",
    "StaticSlicesInferenceContext",
    "UPSTREAM_HAS_ACTIVE_SLICES",
]
