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
import importlib
import threading
from typing import Any, Dict, Optional

import torch

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

_KERNELS_MODULE = "megatron_ext.fusions.fused_mla_yarn_rope_apply"
_LOCK = threading.RLock()
_APPLIED: Dict[str, bool] = {
    "mla_rope_contiguous_load": False,
    "inference_static_active_slices": False,
}


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
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"expected an argparse.ArgumentParser, got {type(parser).__name__}")
    if MLA_ROPE_CONTIGUOUS_LOAD_FLAG in parser._option_string_actions:
        return parser
    group = parser.add_argument_group(title="megatron_ext")
    group.add_argument(
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
    group.add_argument(
        INFERENCE_STATIC_ACTIVE_SLICES_FLAG,
        action="store_true",
        default=False,
        dest="inference_static_active_slices",
        help="Dynamic inference: keep the active-request slices of the inference context in "
        "static-address tensors, rebuilt in place each step, so that sampling and step "
        "bookkeeping can run inside CUDA graphs.",
    )
    return parser


def _from(args: Any, name: str, default: Any = None) -> Any:
    return getattr(args, name, default) if args is not None else default


def check_mla_rope_config(args: Any = None, config: Any = None) -> None:
    """Raise unless the contiguous-load MLA RoPE would actually run with this configuration.

    megatron-core reaches its fused MLA RoPE (the code the extension replaces) only for MLA with
    yarn RoPE, ``apply_rope_fusion`` on, and no inference-time latent caching.

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
        problems.append("cache_mla_latents is on (inference latent caching never fuses RoPE)")
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
        importlib.import_module(_KERNELS_MODULE)
    except ImportError as exc:
        raise MegatronExtConfigError(
            f"{MLA_ROPE_CONTIGUOUS_LOAD_FLAG}: megatron_ext's kernels ({_KERNELS_MODULE}) "
            f"cannot be imported: {exc}"
        ) from exc


def _inference_hook(name: str):
    inference = importlib.import_module("megatron_ext.inference")
    return getattr(inference, name, None)


def apply_megatron_ext(
    args: Any = None,
    *,
    mla_rope_contiguous_load: Optional[bool] = None,
    inference_static_active_slices: Optional[bool] = None,
    config: Any = None,
) -> Dict[str, bool]:
    """Apply the megatron_ext extensions requested by parsed args and/or keywords.

    For ``mla_rope_contiguous_load`` the configuration is checked
    (:func:`check_mla_rope_config`), the kernels are imported, and megatron-core's GPT layer
    spec functions are made to build ``ExtMLASelfAttention``; call it before the model's layer
    spec is built. Calling it again with the same request is harmless.

    Args:
        args: a namespace from a parser that :func:`add_megatron_ext_args` extended (Megatron-LM's
            ``get_args()``), or None.
        mla_rope_contiguous_load: overrides ``args.mla_rope_contiguous_load``.
        inference_static_active_slices: overrides ``args.inference_static_active_slices``.
        config: the run's megatron-core ``TransformerConfig``; checked in preference to ``args``.

    Returns:
        Dict[str, bool]: which extensions are now applied.

    Raises:
        TypeError: if a flag is not a bool, or MLA is requested with neither args nor config.
        MegatronExtConfigError: if an extension cannot act on this configuration or the kernels
            cannot be imported.
        UnsupportedMegatronCoreVersionError: on a megatron-core release megatron_ext does not
            support.
        NotImplementedError: for ``inference_static_active_slices`` while
            ``megatron_ext.inference`` does not provide ``apply_inference_extension``.
    """
    mla = _from(args, "mla_rope_contiguous_load", False)
    if mla_rope_contiguous_load is not None:
        mla = mla_rope_contiguous_load
    static_slices = _from(args, "inference_static_active_slices", False)
    if inference_static_active_slices is not None:
        static_slices = inference_static_active_slices
    for name, value in (
        ("mla_rope_contiguous_load", mla),
        ("inference_static_active_slices", static_slices),
    ):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {value!r}")

    with _LOCK:
        if mla or static_slices:
            check_megatron_core_version()
        if mla:
            check_mla_rope_config(args, config)
            _import_kernels()
        if static_slices:
            hook = _inference_hook("apply_inference_extension")
            if hook is None:
                raise NotImplementedError(
                    f"{INFERENCE_STATIC_ACTIVE_SLICES_FLAG} needs "
                    "megatron_ext.inference.apply_inference_extension, which this megatron_ext "
                    "build does not provide yet"
                )
        # Every check passed: only now change process state, so a failure leaves none behind.
        if mla:
            from megatron_ext.models.gpt.gpt_layer_specs import patch_megatron_core_gpt_specs

            patch_megatron_core_gpt_specs()
            _APPLIED["mla_rope_contiguous_load"] = True
        if static_slices:
            hook(args=args, config=config)
            _APPLIED["inference_static_active_slices"] = True
        return dict(_APPLIED)


def undo_megatron_ext() -> Dict[str, bool]:
    """Undo :func:`apply_megatron_ext`: megatron-core's classes are built again.

    Models built while the extension was applied keep their modules. A no-op when nothing is
    applied.

    Returns:
        Dict[str, bool]: which extensions are applied afterwards (all False).
    """
    with _LOCK:
        if _APPLIED["mla_rope_contiguous_load"]:
            from megatron_ext.models.gpt.gpt_layer_specs import unpatch_megatron_core_gpt_specs

            unpatch_megatron_core_gpt_specs()
            _APPLIED["mla_rope_contiguous_load"] = False
        if _APPLIED["inference_static_active_slices"]:
            hook = _inference_hook("undo_inference_extension")
            if hook is not None:
                hook()
            _APPLIED["inference_static_active_slices"] = False
        return dict(_APPLIED)


def applied_megatron_ext() -> Dict[str, bool]:
    """Which extensions are currently applied.

    Returns:
        Dict[str, bool]: extension name -> applied.
    """
    with _LOCK:
        return dict(_APPLIED)


def check_model_uses_megatron_ext(model: Any) -> int:
    """Raise if ``--mla-rope-contiguous-load`` is applied but ``model`` has no extended MLA.

    A model whose layer spec was built before :func:`apply_megatron_ext`, or by a spec function
    the extension does not reach, would silently run megatron-core's kernels; this catches that.

    Args:
        model: a module or a list of model chunks.

    Returns:
        int: the number of megatron_ext MLA modules found.

    Raises:
        TypeError: if ``model`` is not a module or a list of modules.
        MegatronExtConfigError: if the extension is applied and no module uses it.
    """
    from megatron_ext.transformer.multi_latent_attention import _ContiguousLoadRopeMixin

    chunks = model if isinstance(model, (list, tuple)) else [model]
    found = 0
    for chunk in chunks:
        if not isinstance(chunk, torch.nn.Module):
            raise TypeError(f"expected torch.nn.Module(s), got {type(chunk).__name__}")
        found += sum(isinstance(m, _ContiguousLoadRopeMixin) for m in chunk.modules())
    if applied_megatron_ext()["mla_rope_contiguous_load"] and found == 0:
        raise MegatronExtConfigError(
            f"{MLA_ROPE_CONTIGUOUS_LOAD_FLAG} is applied but the model has no megatron_ext MLA "
            "module: build the layer spec after apply_megatron_ext(), or convert it with "
            "megatron_ext.models.gpt.gpt_layer_specs.to_megatron_ext_spec()"
        )
    return found
