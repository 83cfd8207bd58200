# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The import path Megatron-LM scripts use: megatron_ext's flags and the calls that apply them.

The flags live in :mod:`megatron_ext.flags`, applying and undoing them in :mod:`megatron_ext.apply`
and the check of a built model in :mod:`megatron_ext.model_check`; this module gathers them.

Megatron-LM scripts (``pretrain_gpt.py`` and the like) take extra flags through
``extra_args_provider``; with megatron_ext::

    from megatron_ext.arguments import add_megatron_ext_args, apply_megatron_ext

    def model_provider(pre_process=True, post_process=True, vp_stage=None):
        apply_megatron_ext(get_args())  # before the layer spec is built
        ...

    pretrain(..., model_provider, ..., extra_args_provider=add_megatron_ext_args)

(Chain it with a script's own provider as ``lambda p: add_megatron_ext_args(own(p))``.)

``apply_megatron_ext`` checks that each requested extension can act on the run's configuration
and raises :class:`MegatronExtConfigError` when it cannot, instead of letting a flag do nothing.
``undo_megatron_ext`` restores megatron-core's behaviour.
"""

from megatron_ext.apply import (
    applied_megatron_ext,
    apply_megatron_ext,
    check_mla_rope_config,
    undo_megatron_ext,
)
from megatron_ext.flags import (
    INFERENCE_STATIC_ACTIVE_SLICES_FLAG,
    MLA_ROPE_CONTIGUOUS_LOAD_FLAG,
    MegatronExtConfigError,
    add_megatron_ext_args,
)
from megatron_ext.model_check import check_model_uses_megatron_ext

__all__ = [
    "MLA_ROPE_CONTIGUOUS_LOAD_FLAG",
    "INFERENCE_STATIC_ACTIVE_SLICES_FLAG",
    "MegatronExtConfigError",
    "add_megatron_ext_args",
    "apply_megatron_ext",
    "undo_megatron_ext",
    "applied_megatron_ext",
    "check_mla_rope_config",
    "check_model_uses_megatron_ext",
]
