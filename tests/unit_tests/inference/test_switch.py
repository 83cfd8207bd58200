# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the programmatic switch in megatron_ext.inference."""

import pytest
import torch
from megatron.core.inference.contexts import DynamicInferenceContext as ReexportedContext
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)

import megatron_ext.inference as ext
from megatron_ext.inference.contexts.dynamic_context import (
    UPSTREAM_HAS_ACTIVE_SLICES,
    StaticSlicesInferenceContext,
)
from megatron_ext.inference.text_generation_controllers.text_generation_controller import (
    StaticSlicesTextGenerationController,
)
from megatron_ext.testing.synthetic import (
    SyntheticInferenceWrapper,
    SyntheticTokenizer,
    build_synthetic_stack,
    cpu_torch_compat,
)


@pytest.fixture(autouse=True)
def _restore_switch():
    with cpu_torch_compat():
        yield
    ext.disable_static_active_slices()


@pytest.fixture
def build_context():
    """Build a context of the given class with the installed release's constructor arguments
    (0.19 takes a model and an inference config, 0.16 the sizes), as a user's engine set-up does.

    Returns:
        Callable[[type], DynamicInferenceContext]: the builder, and its template stack as
        ``build_context.template``.
    """
    template = build_synthetic_stack(extension=False, max_requests=8, max_tokens=64)

    def build(cls=DynamicInferenceContext):
        if UPSTREAM_HAS_ACTIVE_SLICES:
            return cls(template.model_config, template.context.config)
        return cls(
            params_dtype=torch.float32,
            num_layers=1,
            kv_channels=8,
            num_attention_heads=1,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            **template.context_sizes,
        )

    build.template = template
    return build


@pytest.fixture
def build_with_megatron_core_names(build_context):
    """Build a context and controller with megatron-core's own class names."""

    def build():
        context, template = build_context(), build_context.template
        wrapper = SyntheticInferenceWrapper(context, template.model_config, template.logits_fn)
        return context, TextGenerationController(wrapper, SyntheticTokenizer(256))

    return build


def test_enable_redirects_megatron_core_constructors(build_with_megatron_core_names):
    ext.enable_static_active_slices()
    assert ext.is_static_active_slices_enabled()
    context, controller = build_with_megatron_core_names()
    assert type(context) is StaticSlicesInferenceContext
    assert type(controller) is StaticSlicesTextGenerationController
    assert ReexportedContext is DynamicInferenceContext
    # The objects work: a step initialises the static slices.
    context.initialize_attention_state()
    context.publish_active_slices()
    assert context.device_active_slices.request_ids.numel() == context.max_requests


def test_disable_restores_megatron_core_classes(build_with_megatron_core_names):
    init = vars(DynamicInferenceContext)["__init__"]
    ext.enable_static_active_slices()
    assert vars(DynamicInferenceContext)["__init__"] is not init
    ext.disable_static_active_slices()
    assert vars(DynamicInferenceContext)["__init__"] is init
    assert not ext.is_static_active_slices_enabled()
    context, controller = build_with_megatron_core_names()
    assert type(context) is DynamicInferenceContext
    assert type(controller) is TextGenerationController


def test_enable_and_disable_are_idempotent():
    ext.enable_static_active_slices()
    ext.enable_static_active_slices()
    assert ext.is_static_active_slices_enabled()
    ext.disable_static_active_slices()
    ext.disable_static_active_slices()
    assert not ext.is_static_active_slices_enabled()


def test_objects_made_without_init_stay_megatron_core_classes():
    """megatron-core's own tests build controllers with ``__new__`` and set attributes by hand."""
    ext.enable_static_active_slices()
    controller = TextGenerationController.__new__(TextGenerationController)
    context = DynamicInferenceContext.__new__(DynamicInferenceContext)
    assert type(controller) is TextGenerationController
    assert type(context) is DynamicInferenceContext


@pytest.mark.skipif(
    UPSTREAM_HAS_ACTIVE_SLICES,
    reason="megatron-core 0.19 has no " "SimpleTextGenerationController alias",
)
def test_simple_text_generation_controller_alias_is_redirected():
    from megatron.core.inference.text_generation_controllers.simple_text_generation_controller import (  # noqa: E501
        SimpleTextGenerationController,
    )

    ext.enable_static_active_slices()
    template = build_synthetic_stack(extension=True, max_requests=8, max_tokens=64)
    wrapper = template.controller.inference_wrapped_model
    controller = SimpleTextGenerationController(wrapper, SyntheticTokenizer(256))
    assert type(controller) is StaticSlicesTextGenerationController


def test_other_subclasses_are_not_redirected(build_context):
    class UserContext(DynamicInferenceContext):
        pass

    ext.enable_static_active_slices()
    assert type(build_context(UserContext)) is UserContext
