# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Everything megatron_ext changes in megatron-core, and the one mechanism that does it.

:data:`PATCHES` lists, per extension, each megatron-core attribute that is replaced while the
extension is applied: module, attribute and replacement, and why. :func:`apply_patches` and
:func:`undo_patches` are the only code that writes to megatron-core; ``apply_megatron_ext``,
``undo_megatron_ext``, ``applied_megatron_ext`` and the direct switches all call them. Undo puts
back the very object that was there before (or removes the attribute where the owner had none of
its own), in any order of applies and undos.

Importing this module imports nothing of megatron-core; replacements are named as
``"module:attribute"`` and imported on apply.
"""

import dataclasses
import importlib
import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

__all__ = [
    "EXTENSIONS",
    "INFERENCE_STATIC_ACTIVE_SLICES",
    "MLA_ROPE_CONTIGUOUS_LOAD",
    "TE_FREE_MLA",
    "PATCHES",
    "Patch",
    "SpecConstantsPatch",
    "apply_patches",
    "applied_extensions",
    "is_applied",
    "resolve_targets",
    "undo_patches",
]

MLA_ROPE_CONTIGUOUS_LOAD = "mla_rope_contiguous_load"
INFERENCE_STATIC_ACTIVE_SLICES = "inference_static_active_slices"
# Not a user flag: applied when megatron_ext's SDPA core attention is built into an MLA module on a
# megatron-core release whose MLA module misreads Transformer Engine's absence (see its entry).
TE_FREE_MLA = "te_free_mla"
EXTENSIONS = (MLA_ROPE_CONTIGUOUS_LOAD, INFERENCE_STATIC_ACTIVE_SLICES, TE_FREE_MLA)

_MCORE_ROPE = "megatron.core.fusions.fused_mla_yarn_rope_apply"
_MCORE_MLA = "megatron.core.transformer.multi_latent_attention"
_EXT_ROPE = "megatron_ext.fusions.fused_mla_yarn_rope_apply"
_EXT_MLA = "megatron_ext.transformer.multi_latent_attention"
_EXT_REDIRECT = "megatron_ext.inference.redirect"
_MCORE_ENGINE = "megatron.core.inference.engines.dynamic_engine"
_EXT_ENGINE = "megatron_ext.inference.engines.dynamic_engine"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One megatron-core attribute replaced while an extension is applied.

    Args:
        module: the megatron-core module that holds the attribute.
        attribute: its name in the module; ``Class.attr`` for a class attribute.
        replacement: ``"module:name"`` of the object put in its place, or, with ``wraps``, of a
            factory called with the original that returns it.
        why: what the patch is for (reported by :func:`resolve_targets`).
        optional: skip it where the module or attribute does not exist in the installed release
            (a release-specific builder); a missing non-optional target raises on apply.
        wraps: ``replacement`` names a factory of the original.
        when: ``"module:name"`` of a predicate of the original; the patch is skipped when it
            returns False.
    """

    module: str
    attribute: str
    replacement: str
    why: str
    optional: bool = False
    wraps: bool = False
    when: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class SpecConstantsPatch:
    """The ``module`` field of every MLA ``ModuleSpec`` held in a module's global spec constants.

    Args:
        module: the megatron-core module whose globals hold prebuilt specs.
        why: what the patch is for.
        optional: skip it where the module does not exist in the installed release.
    """

    module: str
    why: str
    optional: bool = True


PATCHES: Dict[str, Tuple[Any, ...]] = {
    MLA_ROPE_CONTIGUOUS_LOAD: (
        Patch(
            _MCORE_MLA,
            "fused_apply_mla_rope_for_q",
            f"{_EXT_ROPE}:fused_apply_mla_rope_for_q",
            "MLA's get_query_key_value_tensors calls it by this global name",
        ),
        Patch(
            _MCORE_MLA,
            "fused_apply_mla_rope_for_kv",
            f"{_EXT_ROPE}:fused_apply_mla_rope_for_kv",
            "likewise for the key and value",
        ),
        Patch(
            _MCORE_ROPE,
            "fused_apply_mla_rope_for_q",
            f"{_EXT_ROPE}:fused_apply_mla_rope_for_q",
            "code that imports megatron-core's kernel after apply gets megatron_ext's",
        ),
        Patch(
            _MCORE_ROPE,
            "fused_apply_mla_rope_for_kv",
            f"{_EXT_ROPE}:fused_apply_mla_rope_for_kv",
            "likewise for the key and value",
        ),
        Patch(
            "megatron.core.models.gpt.gpt_layer_specs",
            "MLASelfAttention",
            f"{_EXT_MLA}:ExtMLASelfAttention",
            "the GPT layer spec builders (local, TE, inference; decoder block and MTP specs)",
        ),
        Patch(
            "megatron.core.models.gpt.gpt_layer_specs",
            "FusedMLASelfAttention",
            f"{_EXT_MLA}:ExtFusedMLASelfAttention",
            "0.19's GPT layer specs with fused MLA down-projections",
            optional=True,
        ),
        Patch(
            "megatron.core.models.gpt.experimental_attention_variant_module_specs",
            "MLASelfAttention",
            f"{_EXT_MLA}:ExtMLASelfAttention",
            "0.16's get_dsa_module_spec_for_backend",
            optional=True,
        ),
        Patch(
            "megatron.core.post_training.modelopt.gpt.model_specs",
            "MLASelfAttention",
            f"{_EXT_MLA}:ExtMLASelfAttention",
            "get_gpt_modelopt_spec",
        ),
        Patch(
            "megatron.core.post_training.modelopt.hybrid.model_specs",
            "MLASelfAttention",
            f"{_EXT_MLA}:ExtMLASelfAttention",
            "0.19's get_hybrid_stack_modelopt_spec",
            optional=True,
        ),
        Patch(
            "megatron.core.models.hybrid.hybrid_block",
            "FusedMLASelfAttention",
            f"{_EXT_MLA}:ExtFusedMLASelfAttention",
            "0.19's HybridStack builds it when it fuses the MLA down-projections",
            optional=True,
        ),
        Patch(
            "megatron.core.models.hybrid.hybrid_layer_specs",
            "MLASelfAttention",
            f"{_EXT_MLA}:ExtMLASelfAttention",
            "0.19's hybrid layer spec builders",
            optional=True,
        ),
        SpecConstantsPatch(
            "megatron.core.models.hybrid.hybrid_layer_specs",
            "0.19's prebuilt hybrid_stack_spec / hybrid_inference_stack_spec",
        ),
    ),
    INFERENCE_STATIC_ACTIVE_SLICES: (
        # A constructor, not the module names: scripts import the classes before their arguments
        # are parsed, so only the class itself can redirect names bound earlier. Objects made
        # without __init__ (__new__, copy) stay megatron-core's class.
        Patch(
            "megatron.core.inference.contexts.dynamic_context",
            "DynamicInferenceContext.__init__",
            f"{_EXT_REDIRECT}:redirect_context_init",
            "DynamicInferenceContext(...) builds StaticSlicesInferenceContext",
            wraps=True,
        ),
        Patch(
            "megatron.core.inference.text_generation_controllers.text_generation_controller",
            "TextGenerationController.__init__",
            f"{_EXT_REDIRECT}:redirect_controller_init",
            "TextGenerationController(...) builds StaticSlicesTextGenerationController",
            wraps=True,
        ),
        Patch(
            _MCORE_ENGINE,
            "DynamicInferenceEngine._add_request",
            f"{_EXT_ENGINE}:checked_add_request",
            "a request the extension's context refuses fails alone when it enters, not at "
            "scheduling, where it would stall the queue",
            wraps=True,
        ),
        Patch(
            _MCORE_ENGINE,
            "DynamicInferenceEngine.async_bookkeep",
            f"{_EXT_ENGINE}:failing_bookkeep",
            "a request whose logits row is not finite fails alone, without a token",
            wraps=True,
        ),
    ),
    TE_FREE_MLA: (
        Patch(
            _MCORE_MLA,
            "TELinear",
            "megatron_ext.transformer.sdpa_attention:AbsentTELinear",
            "without Transformer Engine, 0.16's MLA module imports megatron-core's mock TELinear "
            "(not a class) and its constructor's isinstance(linear_proj, TELinear) raises; a "
            "class nothing is an instance of gives the answer TE's absence means",
            when="megatron_ext.transformer.sdpa_attention:is_mock_te_linear",
        ),
    ),
}

# extension -> [(owner, attribute, original, owner had its own attribute, replacement)]
_APPLIED: Dict[str, List[Tuple[Any, str, Any, bool, Any]]] = {}
_LOCK = threading.RLock()
_MISSING = object()


def _import_object(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _owner_and_name(patch: Patch) -> Optional[Tuple[Any, str]]:
    try:
        owner = importlib.import_module(patch.module)
    except ImportError:
        if patch.optional:
            return None
        raise
    *path, name = patch.attribute.split(".")
    for part in path:
        owner = getattr(owner, part, _MISSING)
        if owner is _MISSING:
            break
    if owner is _MISSING or getattr(owner, name, _MISSING) is _MISSING:
        if patch.optional:
            return None
        raise AttributeError(
            f"megatron_ext cannot patch {patch.module}.{patch.attribute}: this megatron-core "
            "release has no such attribute"
        )
    return owner, name


def _spec_constant_targets(entry: SpecConstantsPatch) -> List[Tuple[Any, str, Any]]:
    try:
        module = importlib.import_module(entry.module)
    except ImportError:
        if entry.optional:
            return []
        raise
    from megatron.core.transformer.spec_utils import ModuleSpec

    from megatron_ext.models.gpt.gpt_layer_specs import iter_module_specs
    from megatron_ext.transformer.multi_latent_attention import megatron_core_to_ext_classes

    mapping = megatron_core_to_ext_classes()
    found = {}  # one entry per spec object, however many globals reach it
    for value in list(vars(module).values()):
        # 0.19.2's ModuleSpec is callable: only functions, classes and modules are passed over.
        if isinstance(value, (type, type(module))) or (
            callable(value) and not isinstance(value, ModuleSpec)
        ):
            continue
        for spec in iter_module_specs(value):
            if isinstance(spec.module, type) and spec.module in mapping:
                found[id(spec)] = (spec, "module", mapping[spec.module])
    return list(found.values())


def resolve_targets(extension: str) -> List[Tuple[Any, str, Callable[[Any], Any], str]]:
    """The concrete (owner, attribute, make replacement, why) of an extension's patches.

    Args:
        extension: one of :data:`EXTENSIONS`.

    Returns:
        list: one entry per attribute the extension would replace in the installed release;
        ``make`` maps the current object to its replacement.

    Raises:
        KeyError: for an unknown extension.
        AttributeError: if a non-optional target does not exist in this release.
    """
    if extension not in PATCHES:
        raise KeyError(f"unknown megatron_ext extension {extension!r}; known: {list(EXTENSIONS)}")
    targets = []
    for entry in PATCHES[extension]:
        if isinstance(entry, SpecConstantsPatch):
            for owner, name, new in _spec_constant_targets(entry):
                targets.append((owner, name, lambda _old, new=new: new, entry.why))
            continue
        located = _owner_and_name(entry)
        if located is None:
            continue
        owner, name = located
        if entry.when is not None and not _import_object(entry.when)(getattr(owner, name)):
            continue
        replacement = _import_object(entry.replacement)
        make = replacement if entry.wraps else (lambda _old, new=replacement: new)
        targets.append((owner, name, make, entry.why))
    return targets


def _patched_elsewhere(owner: Any, name: str) -> Optional[str]:
    for other, records in _APPLIED.items():
        if any(o is owner and n == name for o, n, *_ in records):
            return other
    return None


def apply_patches(extension: str) -> bool:
    """Apply one extension's patches (all or none). Idempotent; thread-safe.

    Args:
        extension: one of :data:`EXTENSIONS`.

    Returns:
        bool: True if this call applied them, False if they were already applied.

    Raises:
        KeyError: for an unknown extension.
        AttributeError: if a non-optional target does not exist in this release.
        RuntimeError: if another extension already patches one of the same attributes.
    """
    with _LOCK:
        if extension in _APPLIED:
            return False
        targets = resolve_targets(extension)
        records = []
        try:
            for owner, name, make, _why in targets:
                other = _patched_elsewhere(owner, name)
                if other is not None:
                    raise RuntimeError(f"{name} of {owner!r} is already patched by {other!r}")
                had_own = name in getattr(owner, "__dict__", {})
                original = getattr(owner, name)
                replacement = make(original)
                setattr(owner, name, replacement)
                records.append((owner, name, original, had_own, replacement))
        except BaseException:
            _restore(records)
            raise
        _APPLIED[extension] = records
        return True


def _restore(records: List[Tuple[Any, str, Any, bool, Any]]) -> None:
    for owner, name, original, had_own, _replacement in reversed(records):
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


def undo_patches(extension: str) -> bool:
    """Put back what :func:`apply_patches` replaced for ``extension``. Idempotent; thread-safe.

    Args:
        extension: one of :data:`EXTENSIONS`.

    Returns:
        bool: True if this call undid patches, False if none were applied.

    Raises:
        KeyError: for an unknown extension.
    """
    if extension not in PATCHES:
        raise KeyError(f"unknown megatron_ext extension {extension!r}; known: {list(EXTENSIONS)}")
    with _LOCK:
        records = _APPLIED.pop(extension, None)
        if records is None:
            return False
        _restore(records)
        return True


def is_applied(extension: str) -> bool:
    """Whether ``extension``'s patches are in effect.

    Args:
        extension: one of :data:`EXTENSIONS`.

    Returns:
        bool: True while applied.
    """
    if extension not in PATCHES:
        raise KeyError(f"unknown megatron_ext extension {extension!r}; known: {list(EXTENSIONS)}")
    with _LOCK:
        return extension in _APPLIED


def applied_extensions() -> Dict[str, List[str]]:
    """What is patched now, for logs and bug reports.

    Returns:
        Dict[str, List[str]]: applied extension -> ``owner.attribute`` names it replaced.
    """
    with _LOCK:
        return {
            ext: [f"{getattr(o, '__name__', type(o).__name__)}.{n}" for o, n, *_ in records]
            for ext, records in _APPLIED.items()
        }
