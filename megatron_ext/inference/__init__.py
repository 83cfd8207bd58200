# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Inference extensions, and the switch that turns on static active slices.

Typical use, before the engine is built (nothing else in the set-up changes)::

    import megatron_ext.inference

    megatron_ext.inference.enable_static_active_slices()
    context = DynamicInferenceContext(...)          # a StaticSlicesInferenceContext
    controller = TextGenerationController(...)      # a StaticSlicesTextGenerationController
    engine = DynamicInferenceEngine(controller, context, ...)

While the extension is enabled, constructing megatron-core's ``DynamicInferenceContext`` or
``TextGenerationController`` (also through ``DynamicInferenceContext.from_config`` or, on
megatron-core 0.16, the ``SimpleTextGenerationController`` alias) builds the extension's subclass
instead. Only those two
exact classes are redirected: other subclasses of them are constructed as written. The
redirection works however the names were imported, because it hooks the classes' ``__new__``
(the hook stays installed once set and does nothing while the extension is disabled).

Code that prefers to choose the classes explicitly can call :func:`get_inference_context_class`
and :func:`get_text_generation_controller_class`, which follow the same switch.

A command-line flag maps onto :func:`apply_inference_extension` /
:func:`undo_inference_extension`::

    apply_inference_extension(args.inference_static_active_slices)
"""

from typing import Any, Dict, Tuple, Type

from megatron_ext import extension_state

__all__ = [
    "apply_inference_extension",
    "disable_static_active_slices",
    "enable_static_active_slices",
    "get_inference_context_class",
    "get_text_generation_controller_class",
    "is_static_active_slices_enabled",
    "undo_inference_extension",
]

# Base class -> its __new__ hook, installed on first use and kept: removing a __new__ assigned
# after class creation does not restore CPython's default constructor slot, so disabling only
# clears the switch in megatron_ext.extension_state and the hook then builds the class that was
# asked for.
_HOOKS: Dict[type, Any] = {}
_SWITCH = extension_state.INFERENCE_STATIC_ACTIVE_SLICES


def _class_pairs() -> Tuple[Tuple[type, type], ...]:
    """(megatron-core class, extension subclass) pairs; imported lazily so that importing this
    package does not pull in megatron-core's inference stack."""
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from megatron_ext.inference.static_slices import (
        StaticSlicesInferenceContext,
        StaticSlicesTextGenerationController,
    )

    return (
        (DynamicInferenceContext, StaticSlicesInferenceContext),
        (TextGenerationController, StaticSlicesTextGenerationController),
    )


def _make_redirecting_new(base: type, replacement: type):
    def __new__(cls, *args: Any, **kwargs: Any):
        # The arguments go to __init__, which Python calls on the returned instance because it
        # is an instance of `cls`.
        redirect = cls is base and extension_state.is_applied(_SWITCH)
        return object.__new__(replacement if redirect else cls)

    return staticmethod(__new__)


def is_static_active_slices_enabled() -> bool:
    """Whether :func:`enable_static_active_slices` is in effect.

    Returns:
        bool: True while megatron-core's classes are redirected to the extension.
    """
    return extension_state.is_applied(_SWITCH)


def enable_static_active_slices() -> None:
    """Make new ``DynamicInferenceContext`` / ``TextGenerationController`` objects the
    extension's subclasses (static active slices, graph-safe sampling). Idempotent.

    Raises:
        RuntimeError: if megatron-core's classes define their own ``__new__`` (an untested
            release or another patch), in which case nothing is changed.
    """
    pairs = _class_pairs()
    for base, _ in pairs:
        defined = vars(base).get("__new__")
        if defined is not None and defined is not _HOOKS.get(base):
            raise RuntimeError(
                f"{base.__qualname__} already defines __new__; cannot redirect it. Use "
                "get_inference_context_class() / get_text_generation_controller_class() instead."
            )
    for base, replacement in pairs:
        if base not in _HOOKS:
            _HOOKS[base] = _make_redirecting_new(base, replacement)
            base.__new__ = _HOOKS[base]
    extension_state.set_applied(_SWITCH, True)


def disable_static_active_slices() -> None:
    """Undo :func:`enable_static_active_slices`: megatron-core's classes are built as written
    again; objects already built keep their class. Idempotent."""
    extension_state.set_applied(_SWITCH, False)


def apply_inference_extension(enable: bool = True, *, args: Any = None, config: Any = None) -> None:
    """Turn the static-active-slices extension on or off (the hook behind
    ``--inference-static-active-slices``).

    Args:
        enable (bool): True to enable, False to disable.
        args: the parsed command-line namespace, if any. Accepted so that the argument layer can
            pass what it has; the extension needs no setting from it.
        config: the run's ``TransformerConfig``, if any; accepted for the same reason.

    Raises:
        TypeError: if enable is not a bool.
    """
    del args, config  # nothing to read: the switch is all-or-nothing
    if not isinstance(enable, bool):
        raise TypeError(f"enable must be a bool, got {type(enable).__name__}")
    if enable:
        enable_static_active_slices()
    else:
        disable_static_active_slices()


def undo_inference_extension() -> None:
    """Undo :func:`apply_inference_extension` (same as :func:`disable_static_active_slices`)."""
    disable_static_active_slices()


def get_inference_context_class() -> Type:
    """The dynamic inference context class to construct under the current switch.

    Returns:
        type: ``StaticSlicesInferenceContext`` when enabled, else megatron-core's
        ``DynamicInferenceContext``.
    """
    context_pair, _ = _class_pairs()
    return context_pair[1] if is_static_active_slices_enabled() else context_pair[0]


def get_text_generation_controller_class() -> Type:
    """The text generation controller class to construct under the current switch.

    Returns:
        type: ``StaticSlicesTextGenerationController`` when enabled, else megatron-core's
        ``TextGenerationController``.
    """
    _, controller_pair = _class_pairs()
    return controller_pair[1] if is_static_active_slices_enabled() else controller_pair[0]
