# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A tiny DeepSeek-V2-Lite-shaped GPT: MLA attention, a dense first layer, then mixture-of-experts
layers of megatron-core's ``MoELayer`` (routed top-k experts and a shared expert).

Built by :func:`megatron_ext.testing.small_mla_gpt.build_small_mla_gpt` (the same MLA config,
flags and seeds as the MLA-only tests) with a decoder spec from megatron-core's own
``get_gpt_decoder_layer_specs``: local layers (no Transformer Engine), ``moe_layer_freq`` picking
the dense and the MoE layer spec, the MLA class whatever the flag applied makes it, megatron_ext's
SDPA core attention swapped in as :func:`get_gpt_layer_local_mla_spec` does. Tensor and expert
parallel sizes are 1. :data:`TINY_MLA_MOE_SIZES` are keywords for ``build_small_mla_gpt``,
``build_dynamic_mla_model`` and ``float64_copy`` alike.
"""

from typing import Any, Dict, Optional

import torch

__all__ = [
    "TINY_MLA_MOE_SIZES",
    "build_dynamic_mla_moe_model",
    "mla_moe_block_spec",
    "moe_config_overrides",
    "tiny_mla_moe_sizes",
]


def mla_moe_block_spec(config: Any) -> Any:
    """megatron-core's local GPT decoder layer specs for ``config`` (dense or MoE per
    ``moe_layer_freq``) with megatron_ext's SDPA core attention in MLA, and torch's final norm.

    Call it after applying (or undoing) the MLA flag: megatron-core's spec builder then names
    megatron_ext's (or its own) MLA class.

    Args:
        config: an ``MLATransformerConfig`` with the MoE fields set.

    Returns:
        TransformerBlockSubmodules: the decoder's spec.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    from megatron_ext.models.gpt.gpt_layer_specs import to_megatron_ext_spec

    layers = get_gpt_decoder_layer_specs(
        config, use_transformer_engine=False, normalization=config.normalization
    )
    # Only the core attention is swapped (the MLA class was chosen by the builder); SDPA's math
    # backend, as get_gpt_layer_local_mla_spec, so the float64 copy runs the same arithmetic.
    layers = to_megatron_ext_spec(layers, mla_rope_contiguous_load=False, sdpa_backends=["math"])
    # torch's norm, not Apex's where installed: the float64 reference needs one that takes it.
    return TransformerBlockSubmodules(layer_specs=list(layers), layer_norm=WrappedTorchNorm)


def moe_config_overrides(
    num_layers: int,
    *,
    experts: int = 4,
    top_k: int = 2,
    expert_hidden: int = 32,
    shared_hidden: Optional[int] = 32,
    **overrides: Any,
) -> Dict[str, Any]:
    """``MLATransformerConfig`` MoE fields of a DeepSeek-V2-Lite-like layout: the first layer
    dense, every other one MoE with ``experts`` routed experts (``top_k`` per token) and a shared
    expert; no token dropping (capacity factor None), which inference needs.

    Args:
        num_layers: layers of the model.
        experts: routed experts per MoE layer.
        top_k: experts per token.
        expert_hidden: each routed expert's FFN width.
        shared_hidden: the shared expert's FFN width (None: no shared expert).
        overrides: further config fields (e.g. ``moe_expert_capacity_factor``).

    Returns:
        Dict[str, Any]: the fields.
    """
    fields = dict(
        num_moe_experts=experts,
        moe_router_topk=top_k,
        moe_ffn_hidden_size=expert_hidden,
        moe_shared_expert_intermediate_size=shared_hidden,
        moe_layer_freq=[0] + [1] * (num_layers - 1),
        moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather",
        # Training's balancing loss; in eval mode megatron-core's router does not add it.
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_expert_capacity_factor=None,
    )
    fields.update(overrides)
    return fields


def tiny_mla_moe_sizes(q_lora_rank: Optional[int] = 32, **overrides: Any) -> Dict[str, Any]:
    """The tiny MLA sizes the CPU tests use (``TINY_MLA_SIZES``), three layers, with the MoE
    layout of :func:`moe_config_overrides` and :func:`mla_moe_block_spec`.

    Args:
        q_lora_rank: the query's down-projection width; None for DeepSeek-V2-Lite's direct
            query projection (``linear_q_proj``).
        overrides: MoE config fields passed to :func:`moe_config_overrides`.

    Returns:
        Dict[str, Any]: keywords for ``build_small_mla_gpt`` and ``float64_copy``.
    """
    from megatron_ext.testing.mla_dynamic_engine import TINY_MLA_SIZES

    num_layers = 3
    sizes = dict(TINY_MLA_SIZES, num_layers=num_layers)
    # Through the overrides: build_small_mla_gpt reads its own q_lora_rank None as a default width.
    sizes["config_overrides"] = dict(
        moe_config_overrides(num_layers, **overrides), q_lora_rank=q_lora_rank
    )
    sizes["block_spec"] = mla_moe_block_spec
    return sizes


TINY_MLA_MOE_SIZES: Dict[str, Any] = tiny_mla_moe_sizes()


def build_dynamic_mla_moe_model(sizes: Dict[str, Any], dtype: torch.dtype, device: Any) -> Any:
    """The MLA + MoE GPT for dynamic batching with both flags applied (as
    ``build_dynamic_mla_model``); undo with ``undo_megatron_ext()``.

    Args:
        sizes: e.g. :data:`TINY_MLA_MOE_SIZES`.
        dtype: parameter dtype.
        device: where the model lives.

    Returns:
        GPTModel: the model, in eval mode.
    """
    from megatron_ext.testing.mla_dynamic_engine import build_dynamic_mla_model

    return build_dynamic_mla_model(sizes, dtype, device)
