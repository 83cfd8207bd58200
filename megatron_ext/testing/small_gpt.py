# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A small GPT and megatron-core's dynamic inference engine around it, as the inference
functional case (``gpt/inference_static_active_slices``) and the engine benchmark build them.

megatron-core's dynamic-batching attention needs flash-attn; the model uses
``TorchPagedSelfAttention`` (:mod:`megatron_ext.testing.torch_paged_attention`) instead, so run
the engine inside that module's ``allow_dynamic_inference_without_flash_attn()``.
"""

from types import SimpleNamespace
from typing import Any, Tuple

import torch

__all__ = ["build_small_gpt", "build_small_gpt_engine"]


def build_small_gpt(args: Any, dtype: torch.dtype) -> Tuple[Any, Any]:
    """A small GPT (megatron-core's local layer spec) whose attention runs the plain-torch
    paged-KV attention of :mod:`megatron_ext.testing.torch_paged_attention`.

    Args:
        args: sizes, with the attribute names of the functional case's command line
            (``num_layers``, ``hidden_size``, ``num_attention_heads``, ``num_query_groups``,
            ``ffn_hidden_size``, ``vocab_size``, ``max_sequence_length``, ``seed``, ``device``).
        dtype (torch.dtype): parameter dtype.

    Returns:
        Tuple[GPTModel, TransformerConfig]: the model (in eval mode, on ``args.device``) and its
        config.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.testing.local_block_spec import local_block_spec
    from megatron_ext.testing.torch_paged_attention import TorchPagedSelfAttention

    config = TransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        apply_rope_fusion=False,
        use_cpu_initialization=True,
        inference_sampling_seed=args.seed,
    )
    spec = get_gpt_layer_local_spec()
    spec.submodules.self_attention.module = TorchPagedSelfAttention
    torch.manual_seed(args.seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=local_block_spec(spec, args.num_layers),
        vocab_size=args.vocab_size,
        max_sequence_length=args.max_sequence_length,
        position_embedding_type="rope",
    )
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else "cpu"
    model = model.to(device=device, dtype=dtype).eval()
    return model, config


def build_small_gpt_engine(model: Any, args: Any, dtype: torch.dtype) -> Tuple[Any, Any, Any]:
    """megatron-core's dynamic inference context, controller and engine around ``model``, built
    with megatron-core's class names (so :mod:`megatron_ext.inference`'s switch decides which
    classes they are).

    Args:
        model: from :func:`build_small_gpt`.
        args: sizes, with the attribute names of the functional case's command line (those of
            :func:`build_small_gpt` plus ``max_requests``, ``max_tokens``,
            ``block_size_tokens``, ``kv_blocks``, ``paused_kv_blocks``; optionally
            ``async_sched_mode``, megatron-core 0.19's schedule, default ``"legacy"``).
        dtype (torch.dtype): KV-cache dtype.

    Returns:
        Tuple[DynamicInferenceEngine, context, controller]: the objects.

    Raises:
        ValueError: for a schedule other than ``"legacy"`` on megatron-core 0.16 (it has one).
    """
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from megatron_ext.inference.contexts.static_slices_context_base import (
        UPSTREAM_HAS_ACTIVE_SLICES,
    )
    from megatron_ext.testing.synthetic import SyntheticTokenizer
    from megatron_ext.testing.synthetic import build_engine as make_engine

    heads_kv = args.num_query_groups
    head_dim = args.hidden_size // args.num_attention_heads
    block_bytes = dtype.itemsize * 2 * args.num_layers * args.block_size_tokens * heads_kv
    block_bytes *= head_dim
    sizes = dict(
        max_sequence_length=args.max_sequence_length,
        buffer_size_gb=(args.kv_blocks + 0.5) * block_bytes / 1024**3,
        paused_buffer_size_gb=(args.paused_kv_blocks + 0.5) * block_bytes / 1024**3,
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        block_size_tokens=args.block_size_tokens,
        materialize_only_last_token_logits=True,
    )
    schedule = getattr(args, "async_sched_mode", "legacy")
    if UPSTREAM_HAS_ACTIVE_SLICES:
        from megatron.core.inference.config import InferenceConfig
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
            GPTInferenceWrapper,
        )

        config = InferenceConfig(enable_chunked_prefill=True, async_sched_mode=schedule, **sizes)
        context = DynamicInferenceContext(model.config, config)
        wrapper = GPTInferenceWrapper(model, context)
    else:
        if schedule != "legacy":
            raise ValueError(
                f"megatron-core 0.16 has one schedule ('legacy'); async_sched_mode={schedule!r}"
            )
        from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
            GPTInferenceWrapper,
        )
        from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
            InferenceWrapperConfig,
        )

        context = DynamicInferenceContext(
            params_dtype=dtype,
            num_layers=args.num_layers,
            kv_channels=head_dim,
            num_attention_heads=heads_kv,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            **sizes,
        )
        wrapper_config = InferenceWrapperConfig(
            hidden_size=args.hidden_size,
            params_dtype=dtype,
            inference_batch_times_seqlen_threshold=-1,
            padded_vocab_size=args.vocab_size,
            inference_max_requests=args.max_requests,
            inference_max_seq_length=args.max_sequence_length,
        )
        wrapper = GPTInferenceWrapper(model, wrapper_config, context)
    controller = TextGenerationController(wrapper, SyntheticTokenizer(args.vocab_size))
    engine = make_engine(SimpleNamespace(controller=controller, context=context), seed=args.seed)
    return engine, context, controller
