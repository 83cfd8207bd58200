# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A small MLA GPT served by megatron-core's ``DynamicInferenceEngine`` through megatron_ext's
dynamic MLA path, with every step's logits recorded for teacher-forced checks.

:func:`build_mla_dynamic_engine` builds the context (latent cache, any block size), controller
and engine around a model from :func:`megatron_ext.testing.small_mla_gpt.build_small_mla_gpt`
with ``cache_mla_latents=True``, on megatron-core 0.16 and 0.19 alike, with megatron-core's class
names (``--inference-static-active-slices`` turns them into megatron_ext's). The model runs
behind :class:`RecordingModelWrapper` (the forward megatron-core's GPT wrapper makes, on CPU
too), which keeps each step's last-token logits with the request and position they belong to;
:func:`teacher_forced_errors` checks them against a full-sequence forward of a float64 copy.
"""

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from megatron_ext.testing.synthetic import SyntheticInferenceWrapper, SyntheticTokenizer

__all__ = [
    "TINY_MLA_SIZES",
    "RecordedRow",
    "RecordingModelWrapper",
    "build_dynamic_mla_model",
    "build_mla_dynamic_engine",
    "teacher_forced_errors",
]

# build_small_mla_gpt's sizes for CPU tests: widths the latent-cache kernels take (powers of two
# >= 16), small enough for Triton's interpreter.
TINY_MLA_SIZES: Dict[str, Any] = dict(
    num_layers=1,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    max_sequence_length=160,
    init_method_std=0.2,
    kv_lora_rank=32,
    qk_head_dim=32,
    qk_pos_emb_head_dim=16,
    v_head_dim=32,
)


def build_dynamic_mla_model(sizes: Dict[str, Any], dtype: torch.dtype, device: Any) -> Any:
    """A small MLA GPT for dynamic batching (``cache_mla_latents``), with
    ``--mla-rope-contiguous-load`` and ``--inference-static-active-slices`` applied for its
    config: the one documented way to serve it. Undo with ``undo_megatron_ext()``.

    Args:
        sizes: ``build_small_mla_gpt``'s size keywords (e.g. :data:`TINY_MLA_SIZES`).
        dtype: parameter dtype.
        device: where the model lives.

    Returns:
        GPTModel: the model, in eval mode.
    """
    from megatron_ext import apply_megatron_ext
    from megatron_ext.testing.small_mla_gpt import build_small_mla_gpt

    model = build_small_mla_gpt("on", dtype=dtype, device=device, cache_mla_latents=True, **sizes)
    apply_megatron_ext(
        mla_rope_contiguous_load=True, inference_static_active_slices=True, config=model.config
    )
    return model


@dataclass
class RecordedRow:
    """One last-token logits row of one engine step.

    Attributes:
        step: the forward's index.
        request_id: the request the row belongs to.
        position: the token position whose next-token logits these are.
        logits: ``[vocab]`` float32 logits.
        decode_only: whether the step had no prefill.
    """

    step: int
    request_id: int
    position: int
    logits: Tensor
    decode_only: bool


class RecordingModelWrapper(SyntheticInferenceWrapper):
    """megatron-core's GPT inference wrapper's dynamic-batching forward around a real model,
    recording each step's last-token logits (:class:`RecordedRow`).

    Args:
        model: a GPT model.
        context: the dynamic inference context.
    """

    def __init__(self, model: Any, context: Any) -> None:
        params = next(model.parameters())
        super().__init__(
            context, model.config, SimpleNamespace(vocab_size=model.vocab_size, dtype=params.dtype)
        )
        self.model = model
        self.rows: List[RecordedRow] = []
        self.steps = 0
        # Most requests paused during a forward (the engine's counter, read between steps,
        # misses requests paused and evicted within one step).
        self.max_paused = 0

    @torch.no_grad()
    def run_one_forward_step(self, inference_input: Dict[str, Any]) -> Tensor:
        """The model's logits for the step, ``[1, rows, vocab]`` as the controller expects."""
        context = self.inference_context
        tokens = inference_input["tokens"].reshape(1, -1)
        positions = inference_input["position_ids"].reshape(1, -1)
        logits = self.model(
            tokens, positions, None, inference_context=context, runtime_gather_output=True
        )
        if logits.shape[1] == tokens.shape[1]:
            logits = context.last_token_logits(logits).unsqueeze(0)
        self._record(context, logits[0])
        return logits

    def _record(self, context: Any, logits: Tensor) -> None:
        paused, total = context.paused_request_count, context.total_request_count
        self.max_paused = max(self.max_paused, paused)
        ids = context.request_ids[paused:total].tolist()
        ends = (
            context.request_kv_length_offsets[paused:total]
            + context.request_query_lengths[paused:total]
            - 1
        ).tolist()
        decode_only = bool(context.is_decode_only())
        for row, (request_id, position) in enumerate(zip(ids, ends)):
            self.rows.append(
                RecordedRow(
                    self.steps, int(request_id), int(position), logits[row].float(), decode_only
                )
            )
        self.steps += 1


def build_mla_dynamic_engine(
    model: Any,
    *,
    max_requests: int,
    max_tokens: int,
    max_sequence_length: int,
    block_size_tokens: int,
    kv_blocks: int,
    paused_kv_blocks: int = 0,
    enable_chunked_prefill: bool = True,
    seed: int = 0,
    megatron_wrapper: bool = False,
    num_cuda_graphs: Optional[int] = None,
    moe_pad_experts_for_cuda_graph_inference: bool = False,
) -> Tuple[Any, Any, Any]:
    """megatron-core's dynamic context (latent cache), controller and engine around ``model``.

    Args:
        model: a GPT from ``build_small_mla_gpt(..., cache_mla_latents=True)``.
        max_requests, max_tokens, max_sequence_length, block_size_tokens: context sizes.
        kv_blocks: latent-cache blocks (few force pausing and eviction).
        paused_kv_blocks: blocks reserved for paused requests.
        enable_chunked_prefill: split prompts longer than the token budget.
        seed: the engine's seed (0.16).
        megatron_wrapper: wrap the model in megatron-core's ``GPTInferenceWrapper`` (what a
            serving script uses) instead of :class:`RecordingModelWrapper`.
        num_cuda_graphs: the context's CUDA-graph batch buckets (with a model config's
            ``cuda_graph_impl="local"``, megatron-core's engine captures them on construction).
        moe_pad_experts_for_cuda_graph_inference: megatron-core's setting that gives its MoE
            layers fixed shapes (drop-and-pad at a capacity no token exceeds) in graphed steps,
            without which their capture reads expert counts back to the host; the model config's
            field on 0.19, the inference wrapper config's on 0.16 (needs ``megatron_wrapper``).

    Raises:
        ValueError: for the MoE padding on 0.16 without ``megatron_wrapper``; on 0.19 for a
            config whose ``params_dtype`` is not the weights' dtype.

    Returns:
        Tuple[DynamicInferenceEngine, context, wrapper]: the objects.
    """
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )

    from megatron_ext.inference.contexts.static_slices_context_base import (
        UPSTREAM_HAS_ACTIVE_SLICES,
    )
    from megatron_ext.testing.synthetic import build_engine

    config = model.config
    if moe_pad_experts_for_cuda_graph_inference:
        if UPSTREAM_HAS_ACTIVE_SLICES:
            config.moe_pad_experts_for_cuda_graph_inference = True
        elif not megatron_wrapper:
            raise ValueError(
                "moe_pad_experts_for_cuda_graph_inference on megatron-core 0.16 is a setting of "
                "its inference wrapper: pass megatron_wrapper=True"
            )
    dtype = next(model.parameters()).dtype
    if UPSTREAM_HAS_ACTIVE_SLICES and config.params_dtype != dtype:
        # 0.19's context allocates the cache in the config's dtype; the attention would refuse
        # the first step's rows with a message about the cache, not the model.
        raise ValueError(
            f"the model's config says params_dtype={config.params_dtype} but its weights are "
            f"{dtype}: megatron-core 0.19 allocates the latent cache in the config's dtype"
        )
    row = config.kv_lora_rank + config.qk_pos_emb_head_dim
    block_bytes = dtype.itemsize * config.num_layers * block_size_tokens * row
    sizes = dict(
        max_sequence_length=max_sequence_length,
        # Half a block of slack so that the context's floor division gives exactly the count.
        buffer_size_gb=(kv_blocks + 0.5) * block_bytes / 1024**3,
        paused_buffer_size_gb=(
            (paused_kv_blocks + 0.5) * block_bytes / 1024**3 if paused_kv_blocks else None
        ),
        max_requests=max_requests,
        max_tokens=max_tokens,
        block_size_tokens=block_size_tokens,
        materialize_only_last_token_logits=True,
        num_cuda_graphs=num_cuda_graphs,
    )
    if UPSTREAM_HAS_ACTIVE_SLICES:
        from megatron.core.inference.config import InferenceConfig

        inference_config = InferenceConfig(enable_chunked_prefill=enable_chunked_prefill, **sizes)
        context = DynamicInferenceContext(config, inference_config)
    else:
        context = DynamicInferenceContext(
            params_dtype=dtype,
            num_layers=config.num_layers,
            kv_channels=config.kv_channels,
            num_attention_heads=config.num_attention_heads,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            cache_mla_latent=True,
            kv_lora_rank=config.kv_lora_rank,
            qk_pos_emb_head_dim=config.qk_pos_emb_head_dim,
            **sizes,
        )
    wrapper = (
        _megatron_wrapper(
            model,
            context,
            dtype,
            max_requests,
            max_sequence_length,
            moe_pad_experts_for_cuda_graph_inference,
        )
        if megatron_wrapper
        else RecordingModelWrapper(model, context)
    )
    controller = TextGenerationController(wrapper, SyntheticTokenizer(model.vocab_size))
    engine = build_engine(
        SimpleNamespace(controller=controller, context=context),
        enable_chunked_prefill=enable_chunked_prefill,
        seed=seed,
    )
    return engine, context, wrapper


def _megatron_wrapper(
    model: Any,
    context: Any,
    dtype: torch.dtype,
    max_requests: int,
    max_sequence_length: int,
    moe_pad_experts_for_cuda_graph_inference: bool = False,
) -> Any:
    """megatron-core's ``GPTInferenceWrapper`` around ``model`` (its constructor differs by
    release)."""
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import (
        GPTInferenceWrapper,
    )

    from megatron_ext.inference.contexts.static_slices_context_base import (
        UPSTREAM_HAS_ACTIVE_SLICES,
    )

    if UPSTREAM_HAS_ACTIVE_SLICES:
        return GPTInferenceWrapper(model, context)
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (
        InferenceWrapperConfig,
    )

    config = InferenceWrapperConfig(
        hidden_size=model.config.hidden_size,
        params_dtype=dtype,
        inference_batch_times_seqlen_threshold=-1,
        padded_vocab_size=model.vocab_size,
        inference_max_requests=max_requests,
        inference_max_seq_length=max_sequence_length,
        moe_pad_experts_for_cuda_graph_inference=moe_pad_experts_for_cuda_graph_inference,
    )
    return GPTInferenceWrapper(model, config, context)


@torch.no_grad()
def teacher_forced_errors(
    rows: List[RecordedRow], reference: Any, sequences: Dict[int, List[int]]
) -> Dict[str, Any]:
    """Each recorded row against a full-sequence forward of ``reference`` over the request's
    final tokens (teacher forcing), and each generated token against the reference's argmax.

    Args:
        rows: the recorded rows.
        reference: the float64 model (``small_mla_gpt.float64_copy``).
        sequences: request id -> prompt + generated tokens.

    Returns:
        dict: ``max_abs_error`` (over every row), ``largest_abs_logit``, ``rows`` compared,
        ``argmax_mismatches`` (rows whose argmax differs from the reference's, with the
        reference's top-2 margin), ``worst`` (step, request, position of the largest error).
    """
    device = next(reference.parameters()).device
    full: Dict[int, Tensor] = {}
    for request_id, tokens in sequences.items():
        ids = torch.tensor(tokens, device=device).unsqueeze(0)
        length = ids.shape[1]
        positions = torch.arange(length, device=device).unsqueeze(0)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).triu(1)
        full[request_id] = reference(
            ids, positions, causal[None, None], runtime_gather_output=True
        )[0]
    worst, worst_at, largest, mismatches = 0.0, None, 0.0, []
    for row in rows:
        expected = full[row.request_id][row.position]
        error = float((row.logits.double().to(device) - expected).abs().max())
        largest = max(largest, float(expected.abs().max()))
        if error > worst:
            worst, worst_at = error, (row.step, row.request_id, row.position)
        if int(row.logits.argmax()) != int(expected.argmax()):
            top2 = expected.topk(2).values
            mismatches.append((row.step, row.request_id, row.position, float(top2[0] - top2[1])))
    return {
        "max_abs_error": worst,
        "largest_abs_logit": largest,
        "rows": len(rows),
        "argmax_mismatches": mismatches,
        "worst": worst_at,
    }
