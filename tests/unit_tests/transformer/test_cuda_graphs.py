# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron-core's per-layer CUDA-graph argument check with the inference flag's contexts."""

import pytest
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.transformer import cuda_graphs as mcore_cuda_graphs

from megatron_ext import undo_megatron_ext
from megatron_ext.inference import enable_static_active_slices
from megatron_ext.transformer.cuda_graphs import accept_context_subclasses


class _SubclassedContext(DynamicInferenceContext):
    """Stands for the flag's StaticSlicesInferenceContext: the check reads only the type."""


def _context(cls):
    return object.__new__(cls)  # no allocation: the check never looks inside


def _check(meta_of):
    mcore_cuda_graphs._check_supported_type(mcore_cuda_graphs.ArgMetadata(meta_of))


def test_megatron_core_refuses_a_context_subclass():
    """What the patch is for: megatron-core's check compares exact types. The day it takes
    subclasses, this test fails and the patch can go."""
    _check(_context(DynamicInferenceContext))
    with pytest.raises(AssertionError, match="not supported"):
        _check(_context(_SubclassedContext))


def test_the_wrapper_takes_context_subclasses_and_keeps_every_other_verdict():
    checked = accept_context_subclasses(mcore_cuda_graphs._check_supported_type)
    checked(mcore_cuda_graphs.ArgMetadata(_context(_SubclassedContext)))
    checked(mcore_cuda_graphs.ArgMetadata(3))
    with pytest.raises(AssertionError, match="not supported"):
        checked(mcore_cuda_graphs.ArgMetadata(object()))
    assert checked.__wrapped__ is mcore_cuda_graphs._check_supported_type


def test_the_inference_flag_applies_and_undoes_the_patch():
    original = mcore_cuda_graphs._check_supported_type
    enable_static_active_slices()
    try:
        _check(_context(_SubclassedContext))
        assert mcore_cuda_graphs._check_supported_type.__wrapped__ is original
    finally:
        undo_megatron_ext()
    assert mcore_cuda_graphs._check_supported_type is original
    with pytest.raises(AssertionError, match="not supported"):
        _check(_context(_SubclassedContext))
