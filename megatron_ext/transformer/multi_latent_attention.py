# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA self-attention that applies RoPE with megatron_ext's contiguous-load kernels.

megatron-core's MLA calls its fused RoPE through the module globals
``fused_apply_mla_rope_for_q/kv``, which the ``mla_rope_contiguous_load`` patch
(:data:`megatron_ext.patches.PATCHES`) points at megatron_ext's bit-identical kernels. The
subclasses here refuse to run when that patch is not in effect (the flag would silently do
nothing), check context-parallel thd lengths, and run the fused RoPE under static-batching
inference, which megatron-core refuses (Megatron-LM #7106); everything else is megatron-core's.
"""

import contextlib
from typing import Any, Dict, Iterator, Optional, Tuple

from megatron.core.transformer import multi_latent_attention as _mcore_mla
from megatron.core.utils import deprecate_inference_params

from megatron_ext.fusions import fused_mla_yarn_rope_apply as _ext_rope
from megatron_ext.fusions.mla_rope.checks import check_cp_sequence_lengths

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


def _check_inference_context(inference_context: Any, packed_seq_params: Any) -> None:
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
    offset = inference_context.sequence_len_offset
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise TypeError(
            "inference_context.sequence_len_offset must be a non-negative int (a tensor would "
            f"sync the host on every step), got {offset!r}"
        )


@contextlib.contextmanager
def _rope_rows_from(rotary_pos_emb: Any, offset: int, max_sequence_length: int) -> Iterator[None]:
    """For one call, ``rotary_pos_emb.get_cached_cos_sin(n)`` returns rows ``offset..offset+n``.

    megatron-core's method takes its cos/sin rows from ``get_cached_cos_sin(n)``, rows from 0,
    and its fused kernels rotate token i with row i: right for training, wrong for a step whose
    first token sits at ``offset``. Rows come from one table of ``max_sequence_length`` rows
    (built once, then sliced), so a step costs no launches; row p holds the same bits in every
    table length, so a decode step rotates exactly as the full-sequence forward does.
    """
    full_table = type(rotary_pos_emb).get_cached_cos_sin

    def rows(seq_len: int, offset_: int = 0, dtype: Optional[Any] = None, packed_seq=False):
        if offset + seq_len > max_sequence_length:
            raise ValueError(
                f"inference step covers positions {offset}..{offset + seq_len - 1}, past the "
                f"context's max_sequence_length {max_sequence_length}"
            )
        kwargs = {} if dtype is None else {"dtype": dtype}
        cos, sin = full_table(
            rotary_pos_emb, max_sequence_length, offset_, packed_seq=packed_seq, **kwargs
        )
        return cos[offset : offset + seq_len], sin[offset : offset + seq_len]

    rotary_pos_emb.get_cached_cos_sin = rows
    try:
        yield
    finally:
        del rotary_pos_emb.get_cached_cos_sin


class _ContiguousLoadRopeMixin:
    """The checks shared by megatron_ext's MLA subclasses (see the module docstring)."""

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

        Raises:
            MegatronExtRopeNotAppliedError: if RoPE fusion is on and megatron_ext's RoPE patch is
                not applied.
            ValueError: for a dynamic-batching context, thd input under a static one, or a step
                past ``max_sequence_length`` (before any RoPE kernel runs).
            TypeError: if the context's ``sequence_len_offset`` is not a host int.
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
        _check_inference_context(inference_context, packed_seq_params)
        # megatron-core's only other uses of the context in this method are its unfused and
        # latent-caching branches, which a fused static-batching call never takes.
        with _rope_rows_from(
            self.rotary_pos_emb,
            inference_context.sequence_len_offset,
            inference_context.max_sequence_length,
        ):
            return super().get_query_key_value_tensors(*args)


class ExtMLASelfAttention(_ContiguousLoadRopeMixin, _mcore_mla.MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` with megatron_ext's contiguous-load RoPE kernels.

    Only the fused RoPE calls (``apply_rope_fusion`` with ``rope_type='yarn'``) differ, and they
    also run under static-batching inference; ``apply_megatron_ext`` refuses configurations where
    the flag would change nothing.
    """


_McoreFusedMLA = getattr(_mcore_mla, "FusedMLASelfAttention", None)

if _McoreFusedMLA is not None:

    class ExtFusedMLASelfAttention(_ContiguousLoadRopeMixin, _McoreFusedMLA):
        """megatron-core's ``FusedMLASelfAttention`` with megatron_ext's RoPE kernels."""

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
