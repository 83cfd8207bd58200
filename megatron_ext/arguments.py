# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Command-line flags for megatron_ext and the calls that apply and undo them.

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

import argparse
import numbers
from collections.abc import Mapping
from typing import Any, Dict, Optional

import torch

from megatron_ext import patches
from megatron_ext.utils import check_megatron_core_version

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

MLA_ROPE_CONTIGUOUS_LOAD_FLAG = "--mla-rope-contiguous-load"
INFERENCE_STATIC_ACTIVE_SLICES_FLAG = "--inference-static-active-slices"

# flag -> the namespace attribute (argparse ``dest``) it sets.
_FLAG_DESTS = {
    MLA_ROPE_CONTIGUOUS_LOAD_FLAG: patches.MLA_ROPE_CONTIGUOUS_LOAD,
    INFERENCE_STATIC_ACTIVE_SLICES_FLAG: patches.INFERENCE_STATIC_ACTIVE_SLICES,
}
# Marks the parser actions add_megatron_ext_args created, to tell them from a script's own.
_OWN_ACTION = "_megatron_ext_flag"


class MegatronExtConfigError(ValueError):
    """A megatron_ext extension was requested for a configuration it cannot act on."""


def add_megatron_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron_ext's flags to ``parser``; usable as Megatron-LM's ``extra_args_provider``.

    Calling it twice on one parser is harmless (the flags are added once).

    Args:
        parser: the script's argument parser.

    Returns:
        argparse.ArgumentParser: the same parser, with a ``megatron_ext`` argument group.

    Raises:
        TypeError: if ``parser`` is not an ``argparse.ArgumentParser``.
        ValueError: if the parser already defines one of the flags, or an option that stores to
            one of their attribute names, itself (named in the message); nothing is added then.
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"expected an argparse.ArgumentParser, got {type(parser).__name__}")
    if any(getattr(action, _OWN_ACTION, False) for action in parser._actions):
        return parser
    clashes = []
    for action in parser._actions:
        for flag, dest in _FLAG_DESTS.items():
            if flag in action.option_strings:
                clashes.append(flag)
            elif action.dest == dest:
                own = "/".join(action.option_strings) or dest
                clashes.append(f"{own} (it stores to args.{dest}, as {flag} does)")
    if clashes:
        raise ValueError(
            f"add_megatron_ext_args: the parser already defines {', '.join(clashes)}; "
            f"megatron_ext adds {' and '.join(_FLAG_DESTS)} itself. Remove the script's own "
            "definition."
        )
    group = parser.add_argument_group(title="megatron_ext")
    mla_action = group.add_argument(
        MLA_ROPE_CONTIGUOUS_LOAD_FLAG,
        action="store_true",
        default=False,
        dest="mla_rope_contiguous_load",
        help="Apply multi-latent attention's fused YaRN RoPE with megatron_ext's contiguous-load "
        "Triton kernels instead of megatron-core's (bit-identical results, fewer memory "
        "transactions). Needs --multi-latent-attention, yarn RoPE (--rope-type yarn or the MLA "
        "default) and RoPE fusion (--position-embedding-type rope, no --no-rope-fusion); "
        "training only.",
    )
    slices_action = group.add_argument(
        INFERENCE_STATIC_ACTIVE_SLICES_FLAG,
        action="store_true",
        default=False,
        dest="inference_static_active_slices",
        help="Dynamic inference: keep the active-request slices of the inference context in "
        "static-address tensors, rebuilt in place each step, so that sampling and step "
        "bookkeeping can run inside CUDA graphs.",
    )
    for action in (mla_action, slices_action):
        setattr(action, _OWN_ACTION, True)
    return parser


def _from(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


def check_mla_rope_config(args: Any = None, config: Any = None) -> None:
    """Raise unless the contiguous-load MLA RoPE would actually run with this configuration.

    megatron-core reaches its fused MLA RoPE (the code the extension replaces) only for MLA with
    yarn RoPE, ``apply_rope_fusion`` on, and no inference-time latent caching; with the extension
    it runs in training and in static-batching inference.

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
        return _from(args, name, default)

    problems = []
    if not field("multi_latent_attention", False):
        problems.append("multi_latent_attention is off (add --multi-latent-attention)")
    rope_type = field("rope_type", None)
    # Megatron-LM leaves rope_type None to take the config class's default, yarn for MLA.
    if rope_type not in (None, "yarn"):
        problems.append(f"rope_type is {rope_type!r}; megatron-core fuses MLA RoPE only for 'yarn'")
    if not field("apply_rope_fusion", False):
        problems.append("apply_rope_fusion is off (drop --no-rope-fusion)")
    if config is None:
        # Megatron-LM turns RoPE fusion off for any other position embedding type in
        # validate_args, which may run after this check.
        pos_type = _from(args, "position_embedding_type", "rope")
        if pos_type != "rope":
            problems.append(
                f"position_embedding_type is {pos_type!r}; Megatron-LM disables RoPE fusion "
                "unless it is 'rope'"
            )
    if field("cache_mla_latents", False):
        problems.append(
            "cache_mla_latents is on (dynamic-batching latent caching applies RoPE unfused, "
            "through the inference context; the fused RoPE runs in training and static-batching "
            "inference)"
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


def _import_kernels() -> None:
    try:
        import megatron_ext.fusions.fused_mla_yarn_rope_apply  # noqa: F401
    except ImportError as exc:
        raise MegatronExtConfigError(
            f"{MLA_ROPE_CONTIGUOUS_LOAD_FLAG}: megatron_ext's kernels "
            f"(megatron_ext.fusions.fused_mla_yarn_rope_apply) cannot be imported: {exc}"
        ) from exc


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
        MegatronExtConfigError: if an extension cannot act on this configuration or the kernels
            cannot be imported.
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
            f"args ({type(args).__name__}) has neither {' nor '.join(_FLAG_DESTS)}: pass "
            "add_megatron_ext_args as the script's extra_args_provider, or give the flags as "
            "keywords"
        )
    for name, value in requested.items():
        if value is None:
            requested[name] = value = _from(args, name, False)
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    mla = requested[patches.MLA_ROPE_CONTIGUOUS_LOAD]
    static_slices = requested[patches.INFERENCE_STATIC_ACTIVE_SLICES]

    if mla or static_slices:
        check_megatron_core_version()
    if mla:
        check_mla_rope_config(args, config)
        _import_kernels()
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
    ``enable_static_active_slices``) and the Transformer-Engine-free MLA fix that building
    ``SDPADotProductAttention`` applies. Models built meanwhile keep their modules; an
    ``ExtMLASelfAttention`` then refuses to run until the flag is applied again.

    Returns:
        Dict[str, bool]: which extensions are applied afterwards (all False).
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
    return {name: patches.is_applied(name) for name in _FLAG_DESTS.values()}


def _mla_attention_classes() -> tuple:
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
    mla_classes = _mla_attention_classes()
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
