# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The check that a built model runs megatron_ext's RoPE where the flag is applied."""

from typing import Any

import torch

from megatron_ext import patches
from megatron_ext.flags import MLA_ROPE_CONTIGUOUS_LOAD_FLAG, MegatronExtConfigError

__all__ = ["check_model_uses_megatron_ext"]


def _megatron_core_mla_classes() -> tuple:
    """megatron-core's MLA attention base classes in the installed release."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    try:
        # megatron-core 0.19's DSA layers; megatron_ext does not extend them.
        from megatron.core.transformer.experimental_attention_variant.absorbed_mla import (
            AbsorbedMLASelfAttention,
        )
    except ImportError:
        return (MultiLatentAttention,)
    return (MultiLatentAttention, AbsorbedMLASelfAttention)


def check_model_uses_megatron_ext(model: Any) -> int:
    """Raise if ``--mla-rope-contiguous-load`` is applied but ``model`` runs megatron-core's RoPE.

    A model whose layer spec was built before :func:`apply_megatron_ext`, or by a spec that
    megatron_ext does not reach (a hand-written spec, megatron-core 0.19's
    ``AbsorbedMLASelfAttention``), would silently run megatron-core's kernels; this catches that.

    Args:
        model: a module or a list of model chunks.

    Returns:
        int: the number of megatron_ext MLA modules found.

    Raises:
        TypeError: if ``model`` is not a module or a list of modules.
        MegatronExtConfigError: if the extension is applied and the model has no megatron_ext MLA
            module, or has a megatron-core MLA attention module it did not replace.
    """
    from megatron_ext.transformer.multi_latent_attention import EXT_MLA_CLASSES

    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = 0
    plain = []
    mla_classes = _megatron_core_mla_classes()
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"expected torch.nn.Module(s), got {type(chunk).__name__}")
        for name, module in chunk.named_modules():
            if isinstance(module, EXT_MLA_CLASSES):
                found += 1
            elif isinstance(module, mla_classes):
                plain.append(f"{name or '<model>'} ({type(module).__name__})")
    if not patches.is_applied(patches.MLA_ROPE_CONTIGUOUS_LOAD):
        return found
    if plain:
        raise MegatronExtConfigError(
            f"{MLA_ROPE_CONTIGUOUS_LOAD_FLAG} is applied but these MLA modules run "
            f"megatron-core's RoPE: {', '.join(plain[:5])}"
            + (f" and {len(plain) - 5} more" if len(plain) > 5 else "")
            + ". Build the layer spec after apply_megatron_ext(), or convert it with "
            "megatron_ext.models.gpt.gpt_layer_specs.to_megatron_ext_spec()"
        )
    if found == 0:
        raise MegatronExtConfigError(
            f"{MLA_ROPE_CONTIGUOUS_LOAD_FLAG} is applied but the model has no megatron_ext MLA "
            "module: build the layer spec after apply_megatron_ext(), or convert it with "
            "megatron_ext.models.gpt.gpt_layer_specs.to_megatron_ext_spec()"
        )
    return found
