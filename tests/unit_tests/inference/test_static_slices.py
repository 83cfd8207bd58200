# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

from megatron_ext.inference import static_slices
from megatron_ext.inference.contexts.dynamic_context import StaticSlicesInferenceContext
from megatron_ext.inference.text_generation_controllers.text_generation_controller import (
    StaticSlicesTextGenerationController,
)
from megatron_ext.utils import is_megatron_core_min_version


def test_one_class_per_megatron_core_line_chosen_in_one_place():
    line = "0_19" if is_megatron_core_min_version("0.19.0") else "0_16"
    assert static_slices.UPSTREAM_HAS_ACTIVE_SLICES == (line == "0_19")
    context_cls = static_slices.StaticSlicesInferenceContext
    controller_cls = static_slices.StaticSlicesTextGenerationController
    assert context_cls.__module__.endswith(f"dynamic_context_{line}")
    assert controller_cls.__module__.endswith(f"text_generation_controller_{line}")
    # The public paths re-export the same classes.
    assert StaticSlicesInferenceContext is context_cls
    assert StaticSlicesTextGenerationController is controller_cls
    # sampling_plan is defined once per class along the chain that matters.
    assert "sampling_plan" in vars(controller_cls)
