# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Inference extensions, and the switch that turns on static active slices.

Before the engine is built (nothing else in the set-up changes)::

    import megatron_ext.inference

    megatron_ext.inference.enable_static_active_slices()
    context = DynamicInferenceContext(...)          # a StaticSlicesInferenceContext
    controller = TextGenerationController(...)      # a StaticSlicesTextGenerationController
    engine = DynamicInferenceEngine(controller, context, ...)

While enabled, constructing exactly megatron-core's ``DynamicInferenceContext`` or
``TextGenerationController`` (also through ``DynamicInferenceContext.from_config`` or 0.16's
``SimpleTextGenerationController`` alias) builds the extension's subclass, however the names were
imported; subclasses a user wrote are built as written. megatron-core's ``DynamicInferenceEngine``
then fails a request that the extension's context refuses, or whose logits are not finite,
alone (:mod:`megatron_ext.inference.engines.dynamic_engine`). The patches are declared in
:data:`megatron_ext.patches.PATCHES` (``inference_static_active_slices``).
"""

from megatron_ext import patches

__all__ = [
    "disable_static_active_slices",
    "enable_static_active_slices",
    "is_static_active_slices_enabled",
]


def enable_static_active_slices() -> None:
    """Make new ``DynamicInferenceContext`` / ``TextGenerationController`` objects the
    extension's subclasses (static active slices, graph-safe sampling), and megatron-core's
    engine fail a bad request alone. Idempotent."""
    patches.apply_patches(patches.INFERENCE_STATIC_ACTIVE_SLICES)


def disable_static_active_slices() -> None:
    """Undo :func:`enable_static_active_slices`; objects already built keep their class."""
    patches.undo_patches(patches.INFERENCE_STATIC_ACTIVE_SLICES)


def is_static_active_slices_enabled() -> bool:
    """Whether :func:`enable_static_active_slices` is in effect.

    Returns:
        bool: True while megatron-core's classes are redirected to the extension.
    """
    return patches.is_applied(patches.INFERENCE_STATIC_ACTIVE_SLICES)
