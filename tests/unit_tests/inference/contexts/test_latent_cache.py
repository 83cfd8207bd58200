# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MLA latent cache in megatron_ext's dynamic context: with --mla-rope-contiguous-load, any
block size, and configurations the kernels cannot serve refused before anything is allocated;
without it, megatron-core's own checks. CPU (megatron-core's context allocates on
``torch.cuda.current_device()``, redirected to the CPU by ``cpu_torch_compat``)."""

import dataclasses
import re
from typing import Any, Tuple

import pytest
import torch
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext

from megatron_ext import apply_megatron_ext, undo_megatron_ext
from megatron_ext.inference.contexts.latent_cache import (
    check_latent_cache_request,
    latent_cache_request_0_16,
    latent_cache_request_0_19,
)
from megatron_ext.inference.contexts.static_slices_context_base import UPSTREAM_HAS_ACTIVE_SLICES
from megatron_ext.testing.mla_dynamic_engine import TINY_MLA_SIZES, build_dynamic_mla_model
from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def model():
    """A small MLA GPT with both flags applied; the flags undone afterwards."""
    with cpu_torch_compat():
        ensure_model_parallel()
        yield build_dynamic_mla_model(TINY_MLA_SIZES, torch.float32, DEVICE)
    undo_megatron_ext()


def test_any_block_size_on_megatron_exts_path(model):
    args, kwargs = _context_arguments(model.config, block_size=24)
    with cpu_torch_compat():
        context = DynamicInferenceContext(*args, **kwargs)
    assert type(context).__name__ == "StaticSlicesInferenceContext"
    assert context.cache_mla_latent is True
    assert context.block_size_tokens == 24
    row = TINY_MLA_SIZES["kv_lora_rank"] + TINY_MLA_SIZES["qk_pos_emb_head_dim"]
    assert context.memory_buffer.shape[2:] == (24, row)


def _context_arguments(config: Any, block_size: int = 16) -> Tuple[tuple, dict]:
    sizes = dict(
        max_sequence_length=64,
        buffer_size_gb=0.001,
        max_requests=4,
        max_tokens=64,
        block_size_tokens=block_size,
    )
    if UPSTREAM_HAS_ACTIVE_SLICES:
        from megatron.core.inference.config import InferenceConfig

        return (config, InferenceConfig(**sizes)), {}
    return (), dict(
        params_dtype=config.params_dtype,
        num_layers=config.num_layers,
        kv_channels=config.kv_channels,
        num_attention_heads=config.num_attention_heads,
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=1,
        cache_mla_latent=True,
        kv_lora_rank=config.kv_lora_rank,
        qk_pos_emb_head_dim=config.qk_pos_emb_head_dim,
        **sizes,
    )


def _request(config: Any) -> Tuple[bool, Any, dict]:
    args, kwargs = _context_arguments(config)
    if UPSTREAM_HAS_ACTIVE_SLICES:
        return latent_cache_request_0_19(args, kwargs)
    return latent_cache_request_0_16(kwargs)


@pytest.mark.parametrize(
    "change,option",
    [
        (dict(kv_lora_rank=48), "kv_lora_rank=48"),
        (dict(qk_pos_emb_head_dim=24), "qk_pos_emb_head_dim=24"),
        (dict(params_dtype=torch.float8_e4m3fn), "params_dtype=torch.float8_e4m3fn"),
    ],
    ids=["latent_width", "rope_width", "fp8_cache"],
)
def test_context_refuses_before_allocating(model, monkeypatch, change, option):
    allocations = []
    for name in ("allocate_all_tensors", "initialize_all_tensors"):
        if hasattr(DynamicInferenceContext, name):
            monkeypatch.setattr(
                DynamicInferenceContext, name, lambda *a, **k: allocations.append(1)
            )
    # Bypass the config's own checks: the context is what a user hands these sizes to.
    config = dataclasses.replace(model.config)
    for key, value in change.items():
        object.__setattr__(config, key, value)
    args, kwargs = _context_arguments(config)
    with cpu_torch_compat(), pytest.raises(ValueError, match=re.escape(option)):
        DynamicInferenceContext(*args, **kwargs)
    assert not allocations, "the context allocated before refusing"


@pytest.mark.parametrize(
    "change,option",
    [
        (dict(context_parallel_size=2), "context_parallel_size=2"),
        (dict(tensor_model_parallel_size=3), "tensor_model_parallel_size=3"),
    ],
    ids=["context_parallel", "tp_not_dividing_heads"],
)
def test_parallel_sizes_are_refused(model, change, option):
    config = dataclasses.replace(model.config)
    for key, value in change.items():
        object.__setattr__(config, key, value)
    request = _request(config)
    if "context_parallel_size" in change and not UPSTREAM_HAS_ACTIVE_SLICES:
        # 0.16's constructor takes no config: the process groups say the CP size.
        request = (request[0], request[1], dict(request[2], context_parallel_size=2))
    with pytest.raises(ValueError, match=option):
        check_latent_cache_request(request)
    with pytest.raises(ValueError, match=option):
        apply_megatron_ext(mla_rope_contiguous_load=True, config=config)


def test_without_the_flag_megatron_cores_block_size_check_stands(model):
    undo_megatron_ext()
    apply_megatron_ext(inference_static_active_slices=True)
    args, kwargs = _context_arguments(model.config, block_size=16)
    with cpu_torch_compat(), pytest.raises(AssertionError, match="block size of 64"):
        DynamicInferenceContext(*args, **kwargs)
