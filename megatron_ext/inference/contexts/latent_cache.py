# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA's latent cache (``cache_mla_latent``) in megatron_ext's dynamic inference context.

With ``--mla-rope-contiguous-load`` applied, megatron_ext's MLA module serves dynamic-batching
steps with its own Triton kernels, which take any block size. megatron-core's constructor asserts
a block size of 64 for FlashMLA; the context lifts that assert for this path only (its
``cache_mla_latent`` property), once :func:`check_latent_cache_request` has refused, before any
allocation, a configuration the kernels cannot serve. Without the flag, the context behaves as
megatron-core's.
"""

from types import SimpleNamespace
from typing import Any, Dict, Tuple

from megatron_ext import patches
from megatron_ext.transformer.mla_dynamic_inference import check_mla_dynamic_config

__all__ = [
    "check_latent_cache_request",
    "latent_cache_request_0_16",
    "latent_cache_request_0_19",
]


def _tp_cp_sizes(pg_collection: Any, tp_size: Any) -> Tuple[int, int]:
    from megatron.core import parallel_state

    cp_size = 1
    if pg_collection is not None:
        tp_size = pg_collection.tp.size() if tp_size is None else tp_size
        cp = getattr(pg_collection, "cp", None)
        cp_size = cp.size() if cp is not None else 1
    elif parallel_state.model_parallel_is_initialized():
        tp_size = (
            parallel_state.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
        )
        cp_size = parallel_state.get_context_parallel_world_size()
    return (1 if tp_size is None else int(tp_size)), int(cp_size)


def latent_cache_request_0_16(kwargs: Dict[str, Any]) -> Tuple[bool, Any, Dict[str, Any]]:
    """(latent cache requested, config, overrides) from 0.16's constructor keywords."""
    tp, cp = _tp_cp_sizes(kwargs.get("pg_collection"), kwargs.get("tensor_model_parallel_size"))
    config = SimpleNamespace(
        kv_lora_rank=kwargs.get("kv_lora_rank"),
        qk_pos_emb_head_dim=kwargs.get("qk_pos_emb_head_dim"),
        num_attention_heads=kwargs.get("num_attention_heads"),
        rope_type=None,
    )
    overrides = dict(
        tensor_parallel_size=tp,
        context_parallel_size=cp,
        cache_dtype=kwargs.get("params_dtype"),
    )
    return bool(kwargs.get("cache_mla_latent", False)), config, overrides


def latent_cache_request_0_19(
    args: Tuple, kwargs: Dict[str, Any]
) -> Tuple[bool, Any, Dict[str, Any]]:
    """(latent cache requested, config, overrides) from 0.19's constructor arguments."""
    model_config = args[0] if args else kwargs.get("model_config")
    inference_config = args[1] if len(args) > 1 else kwargs.get("inference_config")
    on = bool(getattr(model_config, "cache_mla_latents", False)) and getattr(
        model_config, "multi_latent_attention", False
    )
    pg_collection = getattr(inference_config, "pg_collection", None)
    tp, cp = _tp_cp_sizes(pg_collection, getattr(model_config, "tensor_model_parallel_size", None))
    config_cp = getattr(model_config, "context_parallel_size", None)
    if isinstance(config_cp, int) and not isinstance(config_cp, bool) and config_cp >= 1:
        cp = max(cp, config_cp)
    elif config_cp is not None:
        cp = config_cp  # no size (0, a negative, a float): the check names it
    return on, model_config, dict(tensor_parallel_size=tp, context_parallel_size=cp)


def check_latent_cache_request(request: Tuple[bool, Any, Dict[str, Any]]) -> bool:
    """Before megatron-core's constructor runs: with ``--mla-rope-contiguous-load`` applied and a
    latent cache requested, refuse what the kernels cannot serve and let any block size through.

    Args:
        request: from :func:`latent_cache_request_0_16` or :func:`latent_cache_request_0_19`.

    Raises:
        ValueError: naming each option the dynamic MLA path does not take (FP8 or other cache
            dtypes, latent or RoPE widths, context parallelism, TP sizes not dividing the heads,
            MoE token dropping), before anything is allocated.

    Returns:
        bool: whether megatron_ext's path serves the latent cache (then any block size goes).
    """
    on, config, overrides = request
    if not on or not patches.is_applied(patches.MLA_ROPE_CONTIGUOUS_LOAD):
        return False  # no latent cache, or megatron-core's own (with its checks)
    check_mla_dynamic_config(
        config,
        "DynamicInferenceContext with an MLA latent cache (megatron_ext's path)",
        **overrides,
    )
    return True
