# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Constructors that build the static-slices subclasses in place of megatron-core's classes.

Installed by :mod:`megatron_ext.patches` (``inference_static_active_slices``) as the ``__init__``
of megatron-core's ``DynamicInferenceContext`` and ``TextGenerationController``. An object of
exactly that class becomes the extension's subclass before its ``__init__`` runs; subclasses a
user wrote are built as written. ``__init__`` and not ``__new__``: CPython cannot take back a
``__new__`` assigned after class creation, so undo would not be exact.
"""

import functools
from typing import Any, Callable


def _redirecting_init(original: Callable, base: type, replacement: type) -> Callable:
    @functools.wraps(original)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if type(self) is base:
            # The subclass adds no slots, so the layouts match; its __init__ reaches this
            # function again through super() with type(self) no longer the base.
            self.__class__ = replacement
            self.__init__(*args, **kwargs)
            return
        original(self, *args, **kwargs)

    return __init__


def redirect_context_init(original: Callable) -> Callable:
    """``DynamicInferenceContext.__init__`` that builds ``StaticSlicesInferenceContext``.

    Args:
        original: megatron-core's ``DynamicInferenceContext.__init__``.

    Returns:
        Callable: the replacement.
    """
    # Imported on apply, so that a release whose subclasses fail to import fails there and not
    # inside a constructor.
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

    from megatron_ext.inference.contexts.dynamic_context import StaticSlicesInferenceContext

    return _redirecting_init(original, DynamicInferenceContext, StaticSlicesInferenceContext)


def redirect_controller_init(original: Callable) -> Callable:
    """``TextGenerationController.__init__`` that builds ``StaticSlicesTextGenerationController``.

    Args:
        original: megatron-core's ``TextGenerationController.__init__``.

    Returns:
        Callable: the replacement.
    """
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from megatron_ext.inference.text_generation_controllers.text_generation_controller import (
        StaticSlicesTextGenerationController,
    )

    return _redirecting_init(
        original, TextGenerationController, StaticSlicesTextGenerationController
    )
