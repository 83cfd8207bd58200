# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA self-attention that applies RoPE with megatron_ext's contiguous-load kernels.

megatron-core's MLA calls its fused RoPE through the module globals
``fused_apply_mla_rope_for_q/kv``, which the ``mla_rope_contiguous_load`` patch
(:data:`megatron_ext.patches.PATCHES`) points at megatron_ext's bit-identical kernels. The
subclasses here refuse to run when that patch is not in effect (the flag would silently do
nothing), check context-parallel thd lengths, run the fused RoPE under static-batching
inference, which megatron-core refuses (Megatron-LM #7106), and run dynamic-batching steps through
:mod:`megatron_ext.transformer.mla_dynamic_inference` (megatron-core's own needs FlashMLA and
flash-attn); everything else is megatron-core's.
"""

from contextvars import ContextVar
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from megatron.core.transformer import multi_latent_attention as _mcore_mla
from megatron.core.utils import deprecate_inference_params

from megatron_ext.fusions import fused_mla_yarn_rope_apply as _ext_rope
from megatron_ext.fusions.mla_rope.checks import check_cp_sequence_lengths
from megatron_ext.transformer.mla_dynamic_inference import mla_dynamic_attention
from megatron_ext.transformer.rotary_tables import cos_sin_table

__all__ = [
    "EXT_MLA_CLASSES",
    "ExtFusedMLASelfAttention",
    "ExtMLASelfAttention",
    "MegatronExtRopeNotAppliedError",
    "megatron_core_to_ext_classes",
]


class MegatronExtRopeNotAppliedError(RuntimeError):
    """An ``ExtMLASelfAttention`` ran while megatron_ext's RoPE patch was not applied."""


def _rope_patched() -> bool:
    return (
        _mcore_mla.fused_apply_mla_rope_for_q is _ext_rope.fused_apply_mla_rope_for_q
        and _mcore_mla.fused_apply_mla_rope_for_kv is _ext_rope.fused_apply_mla_rope_for_kv
    )


def _check_context_parallel_lengths(module, packed_seq_params) -> None:
    # Only lengths already on the host are checked: reading CUDA cu_seqlens would sync on every
    # forward, so there the kernels' documented precondition stands unchecked.
    params = packed_seq_params
    if params is None or getattr(params, "qkv_format", None) != "thd":
        return
    cp_size = module.pg_collection.cp.size() if getattr(module, "pg_collection", None) else 1
    if cp_size <= 1:
        return
    for padded, plain in (
        ("cu_seqlens_q_padded", "cu_seqlens_q"),
        ("cu_seqlens_kv_padded", "cu_seqlens_kv"),
    ):
        cu = getattr(params, padded, None)
        cu = cu if cu is not None else getattr(params, plain, None)
        if cu is not None and cu.device.type == "cpu":
            check_cp_sequence_lengths((cu[1:] - cu[:-1]).tolist(), cp_size)


def _check_inference_context(module: Any, inference_context: Any, packed_seq_params: Any) -> int:
    """The checks of a call with an inference context; returns its ``sequence_len_offset``."""
    if not callable(getattr(inference_context, "is_static_batching", None)):
        raise TypeError(
            "inference_context must be a megatron-core inference context (BaseInferenceContext), "
            f"got {type(inference_context).__name__}"
        )
    if not inference_context.is_static_batching():
        raise ValueError(
            "megatron_ext's fused MLA RoPE runs under static-batching inference "
            "(StaticInferenceContext) only: megatron-core's dynamic-batching MLA path needs "
            "FlashMLA or flash-attn and applies RoPE through the context; build the model with "
            "apply_rope_fusion=False for dynamic batching"
        )
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        raise ValueError(
            "static-batching inference passes sbhd activations; got packed_seq_params with "
            "qkv_format='thd'"
        )
    pg_collection = getattr(module, "pg_collection", None)
    cp_size = pg_collection.cp.size() if pg_collection is not None else 1
    if cp_size > 1:
        raise ValueError(
            f"static-batching inference with context parallelism ({cp_size} ranks) is not "
            "supported: each step's rows would be split across ranks"
        )
    for name in ("sequence_len_offset", "max_sequence_length"):
        value = getattr(inference_context, name, None)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
            raise TypeError(
                f"inference_context.{name} must be a host int (a tensor would sync the host on "
                f"every step), got {type(value).__name__} ({value!r})"
            )
    offset = int(inference_context.sequence_len_offset)
    if offset < 0:
        raise ValueError(f"inference_context.sequence_len_offset must be >= 0, got {offset}")
    return offset


# The static-batching step running in this thread or task: (module, the rotary embedding as that
# step sees it). A context variable rather than state on the module, so that threads and tasks
# sharing one module each see their own step.
_STEP: ContextVar[Optional[Tuple[Any, "_StepRotaryEmbedding"]]] = ContextVar(
    "megatron_ext_static_inference_step", default=None
)


class _StepRotaryEmbedding:
    """A module's rotary embedding as one static-batching step sees it: ``get_cached_cos_sin``
    returns the step's rows (positions ``offset..``) instead of rows from 0.

    megatron-core's method takes its cos/sin rows from ``get_cached_cos_sin(n)``, rows from 0,
    and its fused kernels rotate token i with row i: right for training, wrong for a step whose
    first token sits at ``offset``. Row p holds the same bits in every table length, so a
    decode step rotates exactly as the full-sequence forward does. Everything else is the
    embedding's own.
    """

    __slots__ = ("_rotary", "_cos", "_sin")

    def __init__(self, rotary: Any, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self._rotary = rotary
        self._cos = cos
        self._sin = sin

    def get_cached_cos_sin(self, *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """The step's rows (the length megatron-core asks for is the step's, or a packed
        ``max_seqlen``, which bounds no position of a static-batching step)."""
        return self._cos, self._sin

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rotary, name)


def _step_rotary_embedding(
    rotary: Any,
    offset: int,
    count: int,
    max_sequence_length: int,
    dtype: torch.dtype,
    device: torch.device,
) -> _StepRotaryEmbedding:
    """``rotary`` as a step of ``count`` tokens from position ``offset`` sees it."""
    cos, sin = cos_sin_table(rotary, max_sequence_length, dtype, device)
    return _StepRotaryEmbedding(rotary, cos[offset : offset + count], sin[offset : offset + count])


class _ContiguousLoadRopeMixin:
    """What megatron_ext's MLA subclasses share (see the module docstring): the dynamic-batching
    route and the fused-RoPE checks."""

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_context=None,
        rotary_pos_emb=None,
        rotary_pos_cos=None,
        rotary_pos_sin=None,
        rotary_pos_cos_sin=None,
        attention_bias=None,
        packed_seq_params=None,
        position_ids=None,
        sequence_len_offset=None,
        *,
        inference_params=None,
    ):
        """megatron-core's forward; a dynamic-batching step runs
        :func:`~megatron_ext.transformer.mla_dynamic_inference.mla_dynamic_attention` instead
        (megatron-core's needs FlashMLA and flash-attn, and raises TypeError on both releases).

        GRAPH-SAFE for dynamic-batching steps (no host synchronisation), and writes no state of
        the module.

        Raises:
            MegatronExtRopeNotAppliedError: for a dynamic-batching step while megatron_ext's RoPE
                patch is not applied.
            ValueError: for a dynamic-batching step with arguments the path does not take
                (key/value states, RoPE tensors, attention bias, packed sequences) or a context
                without ``cache_mla_latent``.
        """
        inference_context = deprecate_inference_params(inference_context, inference_params)
        if inference_context is None or inference_context.is_static_batching():
            return super().forward(
                hidden_states,
                attention_mask,
                key_value_states,
                inference_context,
                rotary_pos_emb,
                rotary_pos_cos,
                rotary_pos_sin,
                rotary_pos_cos_sin,
                attention_bias,
                packed_seq_params,
                position_ids,
                sequence_len_offset,
            )
        if not _rope_patched():
            raise MegatronExtRopeNotAppliedError(
                f"{type(self).__name__} serves dynamic batching with megatron_ext's kernels only "
                "while --mla-rope-contiguous-load is applied: call megatron_ext.apply_megatron_ext("
                "mla_rope_contiguous_load=True, config=...) first"
            )
        unused = {
            "key_value_states": key_value_states,
            "rotary_pos_emb": rotary_pos_emb,
            "rotary_pos_cos": rotary_pos_cos,
            "rotary_pos_sin": rotary_pos_sin,
            "rotary_pos_cos_sin": rotary_pos_cos_sin,
            "attention_bias": attention_bias,
            "packed_seq_params": packed_seq_params,
        }
        given = [name for name, value in unused.items() if value is not None]
        if given:
            raise ValueError(
                "MLA under dynamic batching takes its positions and lengths from the context; "
                f"got {', '.join(given)}"
            )
        return mla_dynamic_attention(self, hidden_states, inference_context)

    def get_query_key_value_tensors(
        self,
        hidden_states,
        key_value_states=None,
        position_ids=None,
        packed_seq_params=None,
        inference_context=None,
        *,
        inference_params=None,
    ):
        """megatron-core's method, after the checks; with a static inference context, RoPE from
        the context's ``sequence_len_offset``.

        Graph-safe as megatron-core's unfused inference path is: the offset is a host int.
        Writes no state of the module: the step's cos/sin rows reach megatron-core's method
        through this call's context (threads and tasks may share the module).

        Raises:
            MegatronExtRopeNotAppliedError: if RoPE fusion is on and megatron_ext's RoPE patch is
                not applied.
            TypeError: for an ``inference_context`` that is not an inference context, one whose
                ``sequence_len_offset`` or ``max_sequence_length`` is not a host int, or
                ``hidden_states`` that are not a 3-D tensor.
            ValueError: for a dynamic-batching context, thd input or context parallelism under a
                static one, a negative offset, or a step past ``max_sequence_length`` (all before
                any projection or RoPE kernel runs).
        """
        inference_context = deprecate_inference_params(inference_context, inference_params)
        args = (hidden_states, key_value_states, position_ids, packed_seq_params)
        if not self.config.apply_rope_fusion:
            return super().get_query_key_value_tensors(*args, inference_context=inference_context)
        if not _rope_patched():
            raise MegatronExtRopeNotAppliedError(
                f"{type(self).__name__} needs megatron_ext's RoPE kernels in megatron-core's "
                "MLA module: call megatron_ext.apply_megatron_ext(mla_rope_contiguous_load="
                "True, config=...) before the forward (undo_megatron_ext() takes them out)"
            )
        _check_context_parallel_lengths(self, packed_seq_params)
        if inference_context is None:
            return super().get_query_key_value_tensors(*args)
        offset = _check_inference_context(self, inference_context, packed_seq_params)
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            raise TypeError(
                "hidden_states must be a 3-D tensor [s, b, h], got "
                + (
                    f"shape {tuple(hidden_states.shape)}"
                    if isinstance(hidden_states, torch.Tensor)
                    else type(hidden_states).__name__
                )
            )
        rotary = self._modules["rotary_pos_emb"]
        # The step's rows: every token of the step, as megatron-core counts them without packing
        # (a packed sbhd max_seqlen bounds the batch's lengths, not this step's positions).
        count = rotary.get_rotary_seq_len(None, None, hidden_states, self.config, None)
        max_sequence_length = int(inference_context.max_sequence_length)
        if offset + count > max_sequence_length:
            raise ValueError(
                f"inference step covers positions {offset}..{offset + count - 1}, past the "
                f"context's max_sequence_length {max_sequence_length}"
            )
        step = _step_rotary_embedding(
            rotary, offset, count, max_sequence_length, hidden_states.dtype, hidden_states.device
        )
        # megatron-core's only other uses of the context in this method are its unfused and
        # latent-caching branches, which a fused static-batching call never takes.
        token = _STEP.set((self, step))
        try:
            return super().get_query_key_value_tensors(*args)
        finally:
            _STEP.reset(token)

    @property
    def rotary_pos_emb(self) -> Any:
        """megatron-core's rotary embedding; during a static-batching step of this module in
        this thread or task, that step's view of it (:class:`_StepRotaryEmbedding`)."""
        try:
            rotary = self._modules["rotary_pos_emb"]
        except KeyError:
            raise AttributeError("rotary_pos_emb") from None
        step = _STEP.get()
        if step is not None and step[0] is self:
            return step[1]
        return rotary


class ExtMLASelfAttention(_ContiguousLoadRopeMixin, _mcore_mla.MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` with megatron_ext's contiguous-load RoPE kernels.

    The fused RoPE calls (``apply_rope_fusion`` with ``rope_type='yarn'``) differ, and they also
    run under static-batching inference; under a dynamic-batching context (``cache_mla_latent``)
    the whole step is megatron_ext's (:mod:`megatron_ext.transformer.mla_dynamic_inference`).
    ``apply_megatron_ext`` refuses configurations where the flag would change nothing.
    """


_McoreFusedMLA = getattr(_mcore_mla, "FusedMLASelfAttention", None)

if _McoreFusedMLA is not None:

    class ExtFusedMLASelfAttention(_ContiguousLoadRopeMixin, _McoreFusedMLA):
        """megatron-core's ``FusedMLASelfAttention`` (one q/kv down projection, 0.19's
        ``mla_down_proj_fusion``) with megatron_ext's RoPE kernels, and its dynamic-batching steps
        through :mod:`megatron_ext.transformer.mla_dynamic_inference`, as
        :class:`ExtMLASelfAttention`'s."""

else:
    # megatron-core releases before FusedMLASelfAttention existed (0.16) have nothing to extend.
    ExtFusedMLASelfAttention = None

EXT_MLA_CLASSES: Tuple[type, ...] = tuple(
    cls for cls in (ExtMLASelfAttention, ExtFusedMLASelfAttention) if cls is not None
)


def megatron_core_to_ext_classes() -> Dict[type, type]:
    """megatron-core's MLA self-attention classes in this release -> megatron_ext's subclass."""
    mapping = {_mcore_mla.MLASelfAttention: ExtMLASelfAttention}
    if ExtFusedMLASelfAttention is not None:
        mapping[_McoreFusedMLA] = ExtFusedMLASelfAttention
    return mapping
