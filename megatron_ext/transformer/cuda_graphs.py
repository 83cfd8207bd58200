# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron-core's CUDA graphs (``cuda_graph_impl="local"``, per layer or, on 0.19, per block)
around the inference contexts the ``--inference-static-active-slices`` flag builds."""

from typing import Any, Callable

from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

__all__ = ["accept_context_subclasses"]


def accept_context_subclasses(check: Callable[[Any], None]) -> Callable[[Any], None]:
    """Wrap megatron-core's ``cuda_graphs._check_supported_type`` so that it takes subclasses of
    ``DynamicInferenceContext`` as it takes the class itself.

    megatron-core compares an argument's exact type with the types its graph runners accept, so
    the flag's ``StaticSlicesInferenceContext`` (a ``DynamicInferenceContext`` everywhere else in
    megatron-core, which tests ``isinstance``) made a graphed layer raise ``AssertionError:
    Cudagraphs received an arg of type ... which is not supported``. A context is passed through
    by reference, as megatron-core passes its own; every other argument is megatron-core's check.

    Args:
        check: megatron-core's ``_check_supported_type``.

    Returns:
        Callable[[Any], None]: the check, taking an ``ArgMetadata``.
    """

    def check_supported_type(meta: Any) -> None:
        if isinstance(getattr(meta, "value", None), DynamicInferenceContext):
            return
        check(meta)

    check_supported_type.__wrapped__ = check
    return check_supported_type
