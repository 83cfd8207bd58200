# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Applying and undoing the extensions a run requests, after checking they can act on it.

``apply_megatron_ext`` checks that each requested extension can act on the run's configuration
and raises :class:`~megatron_ext.flags.MegatronExtConfigError` when it cannot, instead of letting
a flag do nothing; then it applies the extension's patches (:data:`megatron_ext.patches.PATCHES`).
``undo_megatron_ext`` restores megatron-core's behaviour.
"""

import numbers
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, Dict, Optional

from megatron_ext import patches
from megatron_ext.flags import FLAG_DESTS, MLA_ROPE_CONTIGUOUS_LOAD_FLAG, MegatronExtConfigError
from megatron_ext.transformer.mla_dynamic_inference import mla_dynamic_config_problems
from megatron_ext.utils import check_megatron_core_version

__all__ = [
    "applied_megatron_ext",
    "apply_megatron_ext",
    "check_mla_rope_config",
    "undo_megatron_ext",
]


def _arg_value(args: Any, name: str, default: Any = None) -> Any:
    """``args.name``, or ``default`` where ``args`` is None or has no such field."""
    return getattr(args, name, default) if args is not None else default


def check_mla_rope_config(args: Any = None, config: Any = None) -> None:
    """Raise unless the contiguous-load MLA RoPE would actually run with this configuration.

    megatron-core reaches its fused MLA RoPE (the code the extension replaces) only for MLA with
    yarn RoPE, ``apply_rope_fusion`` on, and no inference-time latent caching; with the extension
    it runs in training and in static-batching inference. With ``cache_mla_latents`` (which
    megatron-core allows only with ``apply_rope_fusion`` off) the extension serves
    dynamic-batching steps instead (:mod:`megatron_ext.transformer.mla_dynamic_inference`), for
    the latent widths, parallel sizes and cache dtypes its kernels take.

    Args:
        args: a Megatron-LM argument namespace (``multi_latent_attention``, ``rope_type``,
            ``apply_rope_fusion``, ``position_embedding_type``, ...), or None.
        config: a megatron-core ``TransformerConfig``/``MLATransformerConfig``, or None; used in
            preference to ``args`` where it has the field.

    Raises:
        TypeError: if neither ``args`` nor ``config`` is given.
        MegatronExtConfigError: naming every reason the extension could not act.
    """
    if args is None and config is None:
        raise TypeError(
            "pass the parsed args or the TransformerConfig so that "
            f"{MLA_ROPE_CONTIGUOUS_LOAD_FLAG} can be checked against the run's configuration"
        )
    missing = object()

    def field(name: str, default: Any = None) -> Any:
        if config is not None:
            value = getattr(config, name, missing)
            if value is not missing:
                return value
        return _arg_value(args, name, default)

    problems = []
    if not field("multi_latent_attention", False):
        problems.append("multi_latent_attention is off (add --multi-latent-attention)")
    rope_type = field("rope_type", None)
    # Megatron-LM leaves rope_type None to take the config class's default, yarn for MLA.
    if rope_type not in (None, "yarn"):
        problems.append(f"rope_type is {rope_type!r}; megatron-core fuses MLA RoPE only for 'yarn'")
    latent_cache = bool(field("cache_mla_latents", False))
    if not latent_cache and not field("apply_rope_fusion", False):
        problems.append("apply_rope_fusion is off (drop --no-rope-fusion)")
    if config is None and not latent_cache:
        # Megatron-LM turns RoPE fusion off for any other position embedding type in
        # validate_args, which may run after this check.
        pos_type = _arg_value(args, "position_embedding_type", "rope")
        if pos_type != "rope":
            problems.append(
                f"position_embedding_type is {pos_type!r}; Megatron-LM disables RoPE fusion "
                "unless it is 'rope'"
            )
    if latent_cache:
        # Dynamic batching: megatron_ext's MLA step (its RoPE kernels with per-token positions,
        # the paged latent-cache kernels) replaces megatron-core's FlashMLA path.
        problems += mla_dynamic_config_problems(
            SimpleNamespace(
                **{
                    name: field(name, default)
                    for name, default in (
                        ("kv_lora_rank", None),
                        ("qk_pos_emb_head_dim", None),
                        ("rope_type", None),
                        ("context_parallel_size", 1),
                        ("tensor_model_parallel_size", 1),
                        ("num_attention_heads", None),
                        ("sequence_parallel", False),
                        ("fp8_dot_product_attention", False),
                        ("fp8_multi_head_attention", False),
                        ("params_dtype", None),
                        ("moe_expert_capacity_factor", None),
                    )
                }
            )
        )
    variant = field("experimental_attention_variant", None)
    if variant is not None:
        problems.append(
            f"experimental_attention_variant is {variant!r}; only standard MLA self-attention "
            "is extended"
        )
    if problems:
        raise MegatronExtConfigError(
            f"{MLA_ROPE_CONTIGUOUS_LOAD_FLAG} cannot act on this configuration: "
            + "; ".join(problems)
        )


# Values that are never a parsed namespace or a TransformerConfig: the fields would be looked up
# as attributes, find nothing, and every flag would read as off.
_NOT_AN_OBJECT_WITH_FIELDS = (Mapping, str, bytes, numbers.Number, list, tuple, set, frozenset)


def _check_object_with_fields(name: str, value: Any, hint: str) -> None:
    if isinstance(value, _NOT_AN_OBJECT_WITH_FIELDS):
        raise TypeError(f"{name} must be {hint} or None, got {type(value).__name__} {value!r}")


def apply_megatron_ext(
    args: Any = None,
    *,
    mla_rope_contiguous_load: Optional[bool] = None,
    inference_static_active_slices: Optional[bool] = None,
    config: Any = None,
) -> Dict[str, bool]:
    """Apply the megatron_ext extensions requested by parsed args and/or keywords.

    Each requested flag is checked against the configuration (:func:`check_mla_rope_config`) and
    then its patches of megatron-core are applied, all of them listed in
    :data:`megatron_ext.patches.PATCHES`: for ``mla_rope_contiguous_load`` megatron-core's MLA
    RoPE kernels and every spec builder that can produce MLA self-attention (call it before the
    model's layer spec is built); for ``inference_static_active_slices`` the constructors of the
    dynamic inference context and text generation controller. Calling it again with the same
    request is harmless; a flag that is off changes nothing (use :func:`undo_megatron_ext`).

    Args:
        args: a namespace from a parser that :func:`add_megatron_ext_args` extended (Megatron-LM's
            ``get_args()``), or None.
        mla_rope_contiguous_load: overrides ``args.mla_rope_contiguous_load``.
        inference_static_active_slices: overrides ``args.inference_static_active_slices``.
        config: the run's megatron-core ``TransformerConfig``; checked in preference to ``args``.

    Returns:
        Dict[str, bool]: which extensions are now applied.

    Raises:
        TypeError: if ``args`` or ``config`` is a dict, string, number or sequence, if ``args``
            has neither flag and no keyword gives one (its parser was not extended), if a flag
            is not a bool, or if MLA is requested with neither args nor config.
        MegatronExtConfigError: if an extension cannot act on this configuration.
        UnsupportedMegatronCoreVersionError: on a megatron-core release megatron_ext does not
            support.
    """
    _check_object_with_fields(
        "args", args, "a parsed namespace (e.g. argparse.Namespace; pass flags as keywords)"
    )
    _check_object_with_fields("config", config, "a megatron-core TransformerConfig")
    requested = {
        patches.MLA_ROPE_CONTIGUOUS_LOAD: mla_rope_contiguous_load,
        patches.INFERENCE_STATIC_ACTIVE_SLICES: inference_static_active_slices,
    }
    if (
        args is not None
        and all(value is None for value in requested.values())
        and not any(hasattr(args, name) for name in requested)
    ):
        raise TypeError(
            f"args ({type(args).__name__}) has neither {' nor '.join(FLAG_DESTS)}: pass "
            "add_megatron_ext_args as the script's extra_args_provider, or give the flags as "
            "keywords"
        )
    for name, value in requested.items():
        if value is None:
            requested[name] = value = _arg_value(args, name, False)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    mla = requested[patches.MLA_ROPE_CONTIGUOUS_LOAD]
    static_slices = requested[patches.INFERENCE_STATIC_ACTIVE_SLICES]

    if mla or static_slices:
        check_megatron_core_version()
    if mla:
        check_mla_rope_config(args, config)
    # Every check passed: only now patch megatron-core, so that a failure leaves nothing behind.
    done = []
    try:
        for name, on in requested.items():
            if on and patches.apply_patches(name):
                done.append(name)
    except BaseException:
        for name in done:
            patches.undo_patches(name)
        raise
    return applied_megatron_ext()


def undo_megatron_ext() -> Dict[str, bool]:
    """Undo every megatron_ext patch of megatron-core in effect, however it was applied.

    That includes the direct switches (``patch_megatron_core_gpt_specs``,
    ``enable_static_active_slices``) and the Transformer-Engine-free MLA fix that
    ``to_megatron_ext_spec`` applies where it swaps the SDPA core attention in. Models built
    meanwhile keep their modules; an ``ExtMLASelfAttention`` then refuses to run until the flag
    is applied again.

    Returns:
        Dict[str, bool]: which extensions are applied afterwards (all False).

    Raises:
        PatchConflictError: if something patched one of the same attributes after megatron_ext
            (that extension stays applied; undo the other patch first).
    """
    for name in patches.EXTENSIONS:
        patches.undo_patches(name)
    return applied_megatron_ext()


def applied_megatron_ext() -> Dict[str, bool]:
    """Which flags are in effect, however they were switched on.

    Returns:
        Dict[str, bool]: ``mla_rope_contiguous_load`` and ``inference_static_active_slices`` ->
        applied (what each patches: ``megatron_ext.patches.applied_extensions()``).
    """
    return {name: patches.is_applied(name) for name in FLAG_DESTS.values()}
