# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A model-free harness around megatron-core's dynamic inference stack.

Builds a dynamic inference context and text generation controller (megatron-core's or the
extension's) around :class:`SyntheticLogits`, a deterministic stand-in for a language model, so
that the context, the controller's sampling step and the engine's scheduling can be exercised
and timed without a real model. Used by ``python -m megatron_ext.bench inference`` and by the
unit tests, on megatron-core 0.16.x and 0.19.x alike.

:func:`cpu_torch_compat` lets the stack run on a CPU-only torch build: megatron-core allocates
pinned host memory and CUDA events unconditionally, which such builds refuse.
"""

import contextlib
import functools
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import torch
from torch import Tensor

from megatron_ext.inference.contexts.static_slices_context_base import UPSTREAM_HAS_ACTIVE_SLICES
from megatron_ext.testing.network import free_port


class _CPUEvent:
    """Stand-in for ``torch.cuda.Event`` on a CPU-only build (everything is synchronous)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def wait(self, *args: Any, **kwargs: Any) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, other: "_CPUEvent") -> float:
        """Not measured."""
        return 0.0


def _strip_pin_memory(fn):
    @functools.wraps(fn)
    def wrapper(*args: Any, pin_memory: bool = False, **kwargs: Any):
        return fn(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def cpu_torch_compat() -> Iterator[None]:
    """Let megatron-core's inference stack run on a CPU-only torch build.

    Inside the block, ``torch.cuda.current_device()`` returns ``"cpu"`` (so megatron-core
    allocates on the CPU), pinned-memory requests are ignored, and CUDA events, streams and
    synchronisation are no-ops. Does nothing when CUDA is available.
    """
    if torch.cuda.is_available():
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.current_device", return_value="cpu"))
        for name in ("empty", "full", "zeros", "ones", "empty_like", "zeros_like", "full_like"):
            stack.enter_context(
                mock.patch(f"torch.{name}", _strip_pin_memory(getattr(torch, name)))
            )
        stack.enter_context(mock.patch("torch.Tensor.pin_memory", lambda self, *a, **k: self))
        stack.enter_context(mock.patch("torch.cuda.Event", _CPUEvent))
        stack.enter_context(mock.patch("torch.cuda.Stream", lambda *a, **k: None))
        stack.enter_context(mock.patch("torch.cuda.synchronize", lambda *a, **k: None))
        # NVTX ranges (used by megatron-core's engine) raise on builds without CUDA.
        nvtx = SimpleNamespace(
            rangePushA=lambda *a: 0,
            rangePop=lambda *a: 0,
            rangeStartA=lambda *a: 0,
            rangeEnd=lambda *a: None,
            markA=lambda *a: None,
        )
        stack.enter_context(mock.patch("torch.cuda.nvtx._nvtx", nvtx))
        yield


def ensure_model_parallel() -> None:
    """Initialise a one-process ``torch.distributed`` group and megatron-core's model-parallel
    state (tensor and pipeline parallel size 1), unless already initialised."""
    from megatron.core import parallel_state

    if not torch.distributed.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
        # Sizes of 1 never communicate, so gloo serves CPU and CUDA tensors alike.
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(1, 1)


class SyntheticLogits:
    """Deterministic logits from (token id, position): ``(E[token] + P[position]) @ W``.

    Each token's logits depend only on that token and its position, so a request decodes the
    same way whatever else is in the batch.

    Args:
        vocab_size (int): vocabulary size.
        max_positions (int): positions supported (larger positions wrap).
        device (torch.device): where to compute.
        dtype (torch.dtype): logits dtype.
        seed (int): table seed.
        rank (int): inner dimension of the tables.
        scale (float): logits scale (larger means peakier distributions).
    """

    def __init__(
        self,
        vocab_size: int,
        max_positions: int,
        device: Any,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        rank: int = 16,
        scale: float = 2.0,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.emb = torch.randn(vocab_size, rank, generator=gen).to(device)
        self.pos = torch.randn(max_positions, rank, generator=gen).to(device)
        self.out = (torch.randn(rank, vocab_size, generator=gen) * scale / rank**0.5).to(device)
        self.dtype = dtype

    def __call__(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Logits ``[T, V]`` for flat token and position ids ``[T]``."""
        # Padding tokens carry stale ids; keep every lookup in range.
        ids = input_ids.clamp(0, self.vocab_size - 1)
        pos = position_ids.remainder(self.max_positions)
        return ((self.emb[ids] + self.pos[pos]) @ self.out).to(self.dtype)


class _SyntheticModule(torch.nn.Module):
    """The ``model`` attribute controllers read: a config and a vocabulary size."""

    def __init__(self, config: Any, vocab_size: int) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = vocab_size


class SyntheticInferenceWrapper:
    """Stands in for megatron-core's ``GPTInferenceWrapper`` around :class:`SyntheticLogits`.

    Args:
        context: the dynamic inference context.
        model_config: the ``TransformerConfig`` controllers read.
        logits_fn (SyntheticLogits): the model.
    """

    def __init__(self, context: Any, model_config: Any, logits_fn: SyntheticLogits) -> None:
        self.inference_context = context
        self.config = model_config
        self.model = _SyntheticModule(model_config, logits_fn.vocab_size)
        self.logits_fn = logits_fn
        self.tp_group = None
        self.pp_group = None
        self.inference_wrapper_config = SimpleNamespace(
            params_dtype=logits_fn.dtype,
            padded_vocab_size=logits_fn.vocab_size,
            nccl_all_reduce_for_prefill=False,
            moe_pad_experts_for_cuda_graph_inference=False,
            inference_batch_times_seqlen_threshold=-1,
            fp32_residual_connection=False,
        )

    def run_one_forward_step(self, inference_input: Dict[str, Any]) -> Tensor:
        """Logits ``[1, S, V]`` as megatron-core's GPT forward would shape them."""
        tokens = inference_input["tokens"].reshape(-1)
        positions = inference_input["position_ids"].reshape(-1)
        logits = self.logits_fn(tokens, positions).unsqueeze(0)
        context = self.inference_context
        materialize = getattr(context, "materializes_only_last_token_logits", None)
        if materialize is None:
            config = getattr(context, "config", None)
            materialize = (
                config.materialize_only_last_token_logits
                if config is not None
                else context.materialize_only_last_token_logits
            )
        if materialize:
            logits = context.last_token_logits(logits).unsqueeze(0)
        return logits

    def dummy_forward(self) -> None:
        """Nothing to run."""


@dataclass
class SyntheticStack:
    """A context, controller and synthetic model built by :func:`build_synthetic_stack`."""

    context: Any
    controller: Any
    logits_fn: SyntheticLogits
    model_config: Any
    context_sizes: Dict[str, Any] = field(default_factory=dict)


def build_synthetic_stack(
    *,
    extension: bool,
    max_requests: int = 64,
    max_tokens: int = 256,
    max_sequence_length: int = 256,
    block_size_tokens: int = 16,
    num_blocks: int = 64,
    num_paused_blocks: int = 0,
    vocab_size: int = 256,
    num_layers: int = 1,
    num_heads: int = 1,
    head_dim: int = 8,
    params_dtype: torch.dtype = torch.float32,
    materialize_only_last_token_logits: bool = True,
    enable_chunked_prefill: bool = True,
    num_cuda_graphs: Optional[int] = None,
    seed: int = 0,
    controller_kwargs: Optional[Dict[str, Any]] = None,
    instrument: Optional[Callable[[type, type], Tuple[type, type]]] = None,
) -> SyntheticStack:
    """Build a dynamic inference context and controller around :class:`SyntheticLogits`.

    Call inside :func:`cpu_torch_compat` on a CPU-only build; calls :func:`ensure_model_parallel`.

    Args:
        extension (bool): build megatron_ext's classes (else megatron-core's).
        max_requests (int): context request slots.
        max_tokens (int): context token slots per step.
        max_sequence_length (int): longest request (prompt + generation).
        block_size_tokens (int): KV block size.
        num_blocks (int): KV blocks (small values force pausing).
        num_paused_blocks (int): blocks reserved for paused requests (0: no reserve).
        vocab_size (int): vocabulary size.
        num_layers (int): KV-cache layers.
        num_heads (int): KV heads.
        head_dim (int): head dimension.
        params_dtype (torch.dtype): KV-cache and logits dtype.
        materialize_only_last_token_logits (bool): context setting.
        enable_chunked_prefill (bool): context setting on 0.19 (the 0.16 engine takes it).
        num_cuda_graphs (Optional[int]): context setting (batch-dimension buckets).
        seed (int): synthetic model seed; also the controller's sampling seed.
        controller_kwargs (Optional[Dict[str, Any]]): extra controller keywords (extension only).
        instrument (Optional[Callable]): given the context and controller classes, returns the
            subclasses to build instead (the benchmark's step probe times their methods).

    Returns:
        SyntheticStack: the objects.
    """
    from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
    from megatron.core.inference.text_generation_controllers.text_generation_controller import (
        TextGenerationController,
    )
    from megatron.core.transformer import TransformerConfig

    from megatron_ext.inference.contexts.dynamic_context import StaticSlicesInferenceContext
    from megatron_ext.inference.text_generation_controllers.text_generation_controller import (
        StaticSlicesTextGenerationController,
    )

    ensure_model_parallel()
    context_cls = StaticSlicesInferenceContext if extension else DynamicInferenceContext
    controller_cls = StaticSlicesTextGenerationController if extension else TextGenerationController
    if instrument is not None:
        context_cls, controller_cls = instrument(context_cls, controller_cls)

    model_config = TransformerConfig(
        num_layers=num_layers,
        hidden_size=num_heads * head_dim,
        num_attention_heads=num_heads,
        kv_channels=head_dim,
        params_dtype=params_dtype,
        use_cpu_initialization=True,
        inference_sampling_seed=seed,
    )
    block_bytes = params_dtype.itemsize * 2 * num_layers * block_size_tokens * num_heads * head_dim
    # Half a block of slack so that the floor division in the context gives exactly num_blocks.
    buffer_size_gb = (num_blocks + 0.5) * block_bytes / 1024**3
    paused_buffer_size_gb = (
        (num_paused_blocks + 0.5) * block_bytes / 1024**3 if num_paused_blocks else None
    )
    sizes = dict(
        max_sequence_length=max_sequence_length,
        buffer_size_gb=buffer_size_gb,
        paused_buffer_size_gb=paused_buffer_size_gb,
        max_requests=max_requests,
        max_tokens=max_tokens,
        block_size_tokens=block_size_tokens,
        materialize_only_last_token_logits=materialize_only_last_token_logits,
        num_cuda_graphs=num_cuda_graphs,
    )
    if UPSTREAM_HAS_ACTIVE_SLICES:
        from megatron.core.inference.config import InferenceConfig

        inference_config = InferenceConfig(enable_chunked_prefill=enable_chunked_prefill, **sizes)
        context = context_cls(model_config, inference_config)
    else:
        context = context_cls(
            params_dtype=params_dtype,
            num_layers=num_layers,
            kv_channels=head_dim,
            num_attention_heads=num_heads,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            **sizes,
        )
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    logits_fn = SyntheticLogits(vocab_size, max_sequence_length, device, params_dtype, seed)
    wrapper = SyntheticInferenceWrapper(context, model_config, logits_fn)
    tokenizer = SyntheticTokenizer(vocab_size)
    kwargs = dict(controller_kwargs or {}) if extension else {}
    controller = controller_cls(wrapper, tokenizer, **kwargs)
    return SyntheticStack(context, controller, logits_fn, model_config, context_sizes=sizes)


class SyntheticTokenizer:
    """Minimal tokenizer: token ids are their own text."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.bos = None

    def tokenize(self, text: str) -> List[int]:
        """Space-separated integers."""
        return [int(tok) for tok in text.split()]

    def detokenize(self, tokens: Sequence[int], **kwargs: Any) -> str:
        """Space-separated integers."""
        return " ".join(str(int(tok)) for tok in tokens)

    def offsets(self, tokens: Sequence[int], text: str) -> List[int]:
        """Character offsets of each token in ``text``."""
        offsets, position = [], 0
        for tok in tokens:
            offsets.append(position)
            position += len(str(int(tok))) + 1
        return offsets


def build_engine(stack: SyntheticStack, *, enable_chunked_prefill: bool = True, seed: int = 0):
    """megatron-core's ``DynamicInferenceEngine`` around a synthetic stack.

    Args:
        stack (SyntheticStack): from :func:`build_synthetic_stack`.
        enable_chunked_prefill (bool): engine setting (0.16; on 0.19 it is the context's).
        seed (int): engine random seed (0.16).

    Returns:
        DynamicInferenceEngine: the engine.
    """
    from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine

    if UPSTREAM_HAS_ACTIVE_SLICES:
        return DynamicInferenceEngine(stack.controller, stack.context)
    return DynamicInferenceEngine(
        stack.controller,
        stack.context,
        random_seed=seed,
        enable_chunked_prefill=enable_chunked_prefill,
    )


def run_engine(
    engine: Any, requests: Sequence[Tuple[List[int], Any]], max_steps: int = 100000
) -> Tuple[Dict[int, Dict[str, Any]], Dict[str, int]]:
    """Add every request, step the engine until all finish, and collect the outputs.

    Args:
        engine: a ``DynamicInferenceEngine``.
        requests (Sequence[Tuple[List[int], SamplingParams]]): prompt token ids and sampling
            parameters; request ids are the indices.
        max_steps (int): safety bound on engine steps.

    Returns:
        Tuple[Dict[int, Dict[str, Any]], Dict[str, int]]: per request id its
        ``generated_tokens``, ``generated_log_probs``, ``prompt_log_probs`` and
        ``generated_top_n_logprobs``; and counters
        (``steps``, ``max_paused``: most requests paused at once, ``evicted``).

    Raises:
        RuntimeError: if the engine does not finish within max_steps.
    """
    for request_id, (prompt, sampling_params) in enumerate(requests):
        # A list of ids: the engine places it on its own device.
        engine.add_request(request_id, [int(t) for t in prompt], sampling_params)
    outputs: Dict[int, Dict[str, Any]] = {}
    stats = {"steps": 0, "max_paused": 0, "evicted": 0}
    while engine.has_unfinished_requests():
        if stats["steps"] >= max_steps:
            raise RuntimeError(f"engine did not finish within {max_steps} steps")
        stats["max_paused"] = max(stats["max_paused"], engine.context.paused_request_count)
        result = engine.step_modern()
        stats["steps"] += 1
        for record in result["finished_request_records"]:
            request = record.merge() if hasattr(record, "merge") else record
            outputs[int(request.request_id)] = {
                "generated_tokens": [int(t) for t in request.generated_tokens],
                "generated_log_probs": list(request.generated_log_probs or []),
                "prompt_log_probs": list(request.prompt_log_probs or []),
                "generated_top_n_logprobs": list(
                    getattr(request, "generated_top_n_logprobs", None) or []
                ),
            }
    stats["evicted"] = int(getattr(engine, "evicted_request_count", 0))
    return outputs, stats


__all__ = [
    "SyntheticInferenceWrapper",
    "SyntheticLogits",
    "SyntheticStack",
    "SyntheticTokenizer",
    "build_engine",
    "build_synthetic_stack",
    "cpu_torch_compat",
    "ensure_model_parallel",
    "run_engine",
]
