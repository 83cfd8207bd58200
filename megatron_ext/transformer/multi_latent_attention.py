# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA self-attention that applies RoPE with megatron_ext's contiguous-load kernels.

megatron-core's MLA calls its fused RoPE through the module globals
``fused_apply_mla_rope_for_q/kv``, which the ``mla_rope_contiguous_load`` patch
(:data:`megatron_ext.patches.PATCHES`) points at megatron_ext's bit-identical kernels. The
subclasses here only refuse to run when that patch is not in effect (the flag would silently do
nothing) and check context-parallel thd lengths; everything else is megatron-core's.
"""

from typing import Any, Dict, Tuple

from megatron.core.transformer import multi_latent_attention as _mcore_mla

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


def _check_context_parallel_lengths(module, args: Tuple, kwargs: Dict[str, Any]) -> None:
    # Only lengths already on the host are checked: reading CUDA cu_seqlens would sync on every
    # forward, so there the kernels' documented precondition stands unchecked.
    params = kwargs.get("packed_seq_params", args[3] if len(args) > 3 else None)
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


class _ContiguousLoadRopeMixin:
    """The checks shared by megatron_ext's MLA subclasses (see the module docstring)."""

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any):
        """megatron-core's method, after the checks.

        Raises:
            MegatronExtRopeNotAppliedError: if RoPE fusion is on and megatron_ext's RoPE patch is
                not applied.
        """
        if self.config.apply_rope_fusion:
            if not _rope_patched():
                raise MegatronExtRopeNotAppliedError(
                    f"{type(self).__name__} needs megatron_ext's RoPE kernels in megatron-core's "
                    "MLA module: call megatron_ext.apply_megatron_ext(mla_rope_contiguous_load="
                    "True, config=...) before the forward (undo_megatron_ext() takes them out)"
                )
            _check_context_parallel_lengths(self, args, kwargs)
        return super().get_query_key_value_tensors(*args, **kwargs)


class ExtMLASelfAttention(_ContiguousLoadRopeMixin, _mcore_mla.MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` with megatron_ext's contiguous-load RoPE kernels.

    Only the fused RoPE calls (``apply_rope_fusion`` with ``rope_type='yarn'``) differ;
    ``apply_megatron_ext`` refuses configurations where the flag would change nothing.
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
