# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Everything megatron_ext changes in megatron-core, and the one mechanism that does it.

:data:`PATCHES` lists, per extension, each megatron-core attribute that is replaced while the
extension is applied: the module or class that holds it, the attribute, the replacement, and why.
:func:`apply_patches` and :func:`undo_patches` are the only code that writes to megatron-core;
``apply_megatron_ext``, ``undo_megatron_ext``, ``applied_megatron_ext``, the direct switches and
``to_megatron_ext_spec`` (for ``te_free_mla``) all call them. Undo puts back the very object that
was there before (or removes the attribute where the owner had none of its own), in any order of
applies and undos, and refuses to remove a replacement that is no longer there (something patched
the attribute after megatron_ext did).

How an entry names things:

* Targets and replacements are the objects themselves, imported above, wherever their module
  imports on every supported release. A target's module is named by its dotted path only where
  some releases lack the module (``optional=True``: 0.19's hybrid stack).
* The kernel drop-ins are :class:`AttributeOf` megatron_ext's kernel module: the function that
  module holds when the patch is applied, which is what ``ExtMLASelfAttention`` checks for at
  every call (a wrapper put on that module, e.g. a profiler's, is what megatron-core then calls).
* The inference constructors are ``"module:name"`` strings, imported on apply: their module is
  part of :mod:`megatron_ext.inference`, whose switch imports this module, so importing it here
  would make a circle; and the subclasses they build are release-specific, so a release whose
  subclasses fail to import fails on apply, not at ``import megatron_ext.patches``.

Why the inference flag rewrites a constructor, not a module name (the context redirect,
:mod:`megatron_ext.inference.redirect`): users' scripts bind ``DynamicInferenceContext`` and
``TextGenerationController`` with ``from megatron.core... import ...`` before their arguments are
parsed, so rebinding the names in megatron-core's modules (what the RoPE flag does) would not
reach them. Only the class object those names share can redirect them: while applied, its
``__init__`` sets ``__class__`` to megatron_ext's subclass for an object of exactly
megatron-core's class (the subclass adds no slots, so the layouts match) and runs the subclass's
``__init__``; subclasses a user wrote are built as written. ``__init__`` rather than ``__new__``:
CPython cannot take back a ``__new__`` assigned after class creation, so undo would not be exact;
a metaclass cannot be changed after the class exists. Objects made without ``__init__``
(``__new__``, ``copy``) stay megatron-core's class.

Importing this module imports megatron-core's MLA, GPT spec and inference modules and
megatron_ext's kernels (not ``import megatron_ext``, which stays light).
"""

import dataclasses
import importlib
import threading
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from megatron.core.fusions import fused_mla_yarn_rope_apply as mcore_rope
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.engines.dynamic_engine import DynamicInferenceEngine
from megatron.core.inference.text_generation_controllers.text_generation_controller import (
    TextGenerationController,
)
from megatron.core.models.gpt import experimental_attention_variant_module_specs as mcore_dsa_specs
from megatron.core.models.gpt import gpt_layer_specs as mcore_gpt_specs
from megatron.core.post_training.modelopt.gpt import model_specs as mcore_modelopt_gpt_specs
from megatron.core.transformer import cuda_graphs as mcore_cuda_graphs
from megatron.core.transformer import multi_latent_attention as mcore_mla
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext.extensions.transformer_engine import AbsentTELinear, is_mock_te_linear
from megatron_ext.fusions import fused_mla_yarn_rope_apply as ext_rope
from megatron_ext.transformer.cuda_graphs import accept_context_subclasses
from megatron_ext.transformer.multi_latent_attention import (
    ExtFusedMLASelfAttention,
    ExtMLASelfAttention,
    megatron_core_to_ext_classes,
)
from megatron_ext.transformer.spec_utils import iter_module_specs

__all__ = [
    "EXTENSIONS",
    "INFERENCE_STATIC_ACTIVE_SLICES",
    "MLA_ROPE_CONTIGUOUS_LOAD",
    "TE_FREE_MLA",
    "PATCHES",
    "AttributeOf",
    "Patch",
    "PatchConflictError",
    "SpecConstantsPatch",
    "apply_patches",
    "applied_extensions",
    "is_applied",
    "resolve_targets",
    "undo_patches",
]

MLA_ROPE_CONTIGUOUS_LOAD = "mla_rope_contiguous_load"
INFERENCE_STATIC_ACTIVE_SLICES = "inference_static_active_slices"
# Not a user flag: applied by to_megatron_ext_spec when it puts megatron_ext's SDPA core attention
# into an MLA spec, on a megatron-core release whose MLA module misreads Transformer Engine's
# absence (see its entry).
TE_FREE_MLA = "te_free_mla"
EXTENSIONS = (MLA_ROPE_CONTIGUOUS_LOAD, INFERENCE_STATIC_ACTIVE_SLICES, TE_FREE_MLA)

Owner = Union[ModuleType, type, str]


class PatchConflictError(RuntimeError):
    """An attribute megatron_ext patches is (or is about to be) patched by someone else too."""


@dataclasses.dataclass(frozen=True)
class AttributeOf:
    """The object ``getattr(owner, name)`` gives when the patch is applied.

    Args:
        owner: the module (or class) that holds the replacement.
        name: its attribute name there.
    """

    owner: Any
    name: str


# Named, not imported: megatron_ext.inference imports this module (see the module docstring).
_EXT_ENGINE = "megatron_ext.inference.engines.dynamic_engine"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One megatron-core attribute replaced while an extension is applied.

    Args:
        target: the megatron-core module or class that holds the attribute; the module's dotted
            name only where some supported releases lack the module (then ``optional``).
        attribute: the attribute's name in ``target``.
        replacement: the object put in its place, an :class:`AttributeOf`, or ``"module:name"``
            imported on apply; with ``wraps``, a factory called with the original that returns it.
        why: what the patch is for (reported by :func:`resolve_targets`).
        optional: skip it where the module or attribute does not exist in the installed release
            (a release-specific builder); a missing non-optional target raises on apply.
        wraps: ``replacement`` is a factory of the original.
        when: a predicate of the original; the patch is skipped when it returns False.
    """

    target: Owner
    attribute: str
    replacement: Any
    why: str
    optional: bool = False
    wraps: bool = False
    when: Optional[Callable[[Any], bool]] = None

    @property
    def module_name(self) -> str:
        """The dotted name of the module that holds (or defines) the target."""
        if isinstance(self.target, str):
            return self.target
        if isinstance(self.target, ModuleType):
            return self.target.__name__
        return self.target.__module__


@dataclasses.dataclass(frozen=True)
class SpecConstantsPatch:
    """The ``module`` field of every MLA ``ModuleSpec`` held in a module's global spec constants.

    Args:
        module: the dotted name of the megatron-core module whose globals hold prebuilt specs
            (a name: only 0.19 has such a module).
        why: what the patch is for.
        optional: skip it where the module does not exist in the installed release.
    """

    module: str
    why: str
    optional: bool = True

    @property
    def module_name(self) -> str:
        """The dotted name of the module whose globals are patched."""
        return self.module


PATCHES: Dict[str, Tuple[Any, ...]] = {
    MLA_ROPE_CONTIGUOUS_LOAD: (
        Patch(
            mcore_mla,
            "fused_apply_mla_rope_for_q",
            AttributeOf(ext_rope, "fused_apply_mla_rope_for_q"),
            "MLA's get_query_key_value_tensors calls it by this global name",
        ),
        Patch(
            mcore_mla,
            "fused_apply_mla_rope_for_kv",
            AttributeOf(ext_rope, "fused_apply_mla_rope_for_kv"),
            "likewise for the key and value",
        ),
        Patch(
            mcore_rope,
            "fused_apply_mla_rope_for_q",
            AttributeOf(ext_rope, "fused_apply_mla_rope_for_q"),
            "code that imports megatron-core's kernel after apply gets megatron_ext's",
        ),
        Patch(
            mcore_rope,
            "fused_apply_mla_rope_for_kv",
            AttributeOf(ext_rope, "fused_apply_mla_rope_for_kv"),
            "likewise for the key and value",
        ),
        Patch(
            mcore_gpt_specs,
            "MLASelfAttention",
            ExtMLASelfAttention,
            "the GPT layer spec builders (local, TE, inference; decoder block and MTP specs)",
        ),
        Patch(
            mcore_gpt_specs,
            "FusedMLASelfAttention",
            ExtFusedMLASelfAttention,
            "0.19's GPT layer specs with fused MLA down-projections",
            optional=True,
        ),
        Patch(
            mcore_dsa_specs,
            "MLASelfAttention",
            ExtMLASelfAttention,
            "0.16's get_dsa_module_spec_for_backend",
            optional=True,
        ),
        Patch(
            mcore_modelopt_gpt_specs,
            "MLASelfAttention",
            ExtMLASelfAttention,
            "get_gpt_modelopt_spec",
        ),
        Patch(
            "megatron.core.post_training.modelopt.hybrid.model_specs",
            "MLASelfAttention",
            ExtMLASelfAttention,
            "0.19's get_hybrid_stack_modelopt_spec",
            optional=True,
        ),
        Patch(
            "megatron.core.models.hybrid.hybrid_block",
            "FusedMLASelfAttention",
            ExtFusedMLASelfAttention,
            "0.19's HybridStack builds it when it fuses the MLA down-projections",
            optional=True,
        ),
        Patch(
            "megatron.core.models.hybrid.hybrid_layer_specs",
            "MLASelfAttention",
            ExtMLASelfAttention,
            "0.19's hybrid layer spec builders",
            optional=True,
        ),
        SpecConstantsPatch(
            "megatron.core.models.hybrid.hybrid_layer_specs",
            "0.19's prebuilt hybrid_stack_spec / hybrid_inference_stack_spec",
        ),
    ),
    INFERENCE_STATIC_ACTIVE_SLICES: (
        # The class's constructor, not the module names (see the module docstring).
        Patch(
            DynamicInferenceContext,
            "__init__",
            "megatron_ext.inference.redirect:redirect_context_init",
            "DynamicInferenceContext(...) builds StaticSlicesInferenceContext",
            wraps=True,
        ),
        Patch(
            TextGenerationController,
            "__init__",
            "megatron_ext.inference.redirect:redirect_controller_init",
            "TextGenerationController(...) builds StaticSlicesTextGenerationController",
            wraps=True,
        ),
        Patch(
            DynamicInferenceEngine,
            "_add_request",
            f"{_EXT_ENGINE}:checked_add_request",
            "a request the extension's context refuses fails alone when it enters, not at "
            "scheduling, where it would stall the queue",
            wraps=True,
        ),
        Patch(
            DynamicInferenceEngine,
            "async_bookkeep",
            f"{_EXT_ENGINE}:failing_bookkeep",
            "a request whose logits row is not finite fails alone, without a token",
            wraps=True,
        ),
        Patch(
            mcore_cuda_graphs,
            "_check_supported_type",
            accept_context_subclasses,
            "megatron-core's CUDA graphs (cuda_graph_impl='local', per layer or per block) "
            "compare an "
            "argument's exact type, so they refused the context this flag builds (a "
            "DynamicInferenceContext subclass); they take it as they take megatron-core's",
            wraps=True,
        ),
    ),
    TE_FREE_MLA: (
        Patch(
            mcore_mla,
            "TELinear",
            AbsentTELinear,
            "without Transformer Engine, 0.16's MLA module imports megatron-core's mock TELinear "
            "(not a class) and its constructor's isinstance(linear_proj, TELinear) raises; a "
            "class nothing is an instance of gives the answer TE's absence means",
            when=is_mock_te_linear,
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


def _replacement(patch: Patch) -> Any:
    if isinstance(patch.replacement, AttributeOf):
        return getattr(patch.replacement.owner, patch.replacement.name)
    if isinstance(patch.replacement, str):
        return _import_object(patch.replacement)
    return patch.replacement


def _owner_and_name(patch: Patch) -> Optional[Tuple[Any, str]]:
    owner = patch.target
    if isinstance(owner, str):
        try:
            owner = importlib.import_module(owner)
        except ImportError:
            if patch.optional:
                return None
            raise
    if getattr(owner, patch.attribute, _MISSING) is _MISSING:
        if patch.optional:
            return None
        raise AttributeError(
            f"megatron_ext cannot patch {patch.module_name}.{patch.attribute}: this megatron-core "
            "release has no such attribute"
        )
    return owner, patch.attribute


def _spec_constant_targets(entry: SpecConstantsPatch) -> List[Tuple[Any, str, Any]]:
    try:
        module = importlib.import_module(entry.module)
    except ImportError:
        if entry.optional:
            return []
        raise
    mapping = megatron_core_to_ext_classes()
    found = {}  # one entry per spec object, however many globals reach it
    for value in list(vars(module).values()):
        # 0.19.2's ModuleSpec is callable: only functions, classes and modules are passed over.
        if isinstance(value, (type, ModuleType)) or (
            callable(value) and not isinstance(value, ModuleSpec)
        ):
            continue
        for spec in iter_module_specs(value):
            if isinstance(spec.module, type) and spec.module in mapping:
                found[id(spec)] = (spec, "module", mapping[spec.module])
    return list(found.values())


def _check_extension(extension: str) -> None:
    if extension not in PATCHES:
        raise KeyError(f"unknown megatron_ext extension {extension!r}; known: {list(EXTENSIONS)}")


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
    _check_extension(extension)
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
        if entry.when is not None and not entry.when(getattr(owner, name)):
            continue
        replacement = _replacement(entry)
        make = replacement if entry.wraps else (lambda _old, new=replacement: new)
        targets.append((owner, name, make, entry.why))
    return targets


def _describe(owner: Any, name: str) -> str:
    return f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"


def _patched_elsewhere(owner: Any, name: str) -> Optional[str]:
    for other, records in _APPLIED.items():
        if any(o is owner and n == name for o, n, *_ in records):
            return other
    return None


def _current(owner: Any, name: str) -> Any:
    """What ``owner`` holds under ``name`` itself (not through its class or bases)."""
    own = getattr(owner, "__dict__", None)
    if own is not None:
        return own.get(name, _MISSING)
    return getattr(owner, name, _MISSING)


def apply_patches(extension: str) -> bool:
    """Apply one extension's patches (all or none). Idempotent; thread-safe.

    Args:
        extension: one of :data:`EXTENSIONS`.

    Returns:
        bool: True if this call applied them, False if they were already applied.

    Raises:
        KeyError: for an unknown extension.
        AttributeError: if a non-optional target does not exist in this release.
        PatchConflictError: if another extension already patches one of the same attributes.
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
                    raise PatchConflictError(
                        f"{_describe(owner, name)} is already patched by {other!r}"
                    )
                had_own = name in getattr(owner, "__dict__", {})
                original = getattr(owner, name)
                replacement = make(original)
                setattr(owner, name, replacement)
                records.append((owner, name, original, had_own, replacement))
        except BaseException:
            _restore(extension, records)
            raise
        _APPLIED[extension] = records
        return True


def _restore(extension: str, records: List[Tuple[Any, str, Any, bool, Any]]) -> None:
    """Put back what ``records`` replaced, after checking that every replacement is still there.

    Raises:
        PatchConflictError: naming the first attribute whose replacement something else has
            replaced since (then nothing is restored).
    """
    for owner, name, _original, _had_own, replacement in records:
        current = _current(owner, name)
        if current is not replacement:
            raise PatchConflictError(
                f"cannot undo megatron_ext's {extension!r}: {_describe(owner, name)} is no longer "
                f"megatron_ext's replacement but {'nothing' if current is _MISSING else current!r}"
                " (something patched it after megatron_ext did); undo that patch first"
            )
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
        PatchConflictError: if a replacement is no longer in place (something patched the same
            attribute later); nothing is undone and the extension stays applied.
    """
    _check_extension(extension)
    with _LOCK:
        records = _APPLIED.get(extension)
        if records is None:
            return False
        _restore(extension, records)
        del _APPLIED[extension]
        return True


def is_applied(extension: str) -> bool:
    """Whether ``extension``'s patches are in effect.

    Args:
        extension: one of :data:`EXTENSIONS`.

    Returns:
        bool: True while applied.
    """
    _check_extension(extension)
    with _LOCK:
        return extension in _APPLIED


def applied_extensions() -> Dict[str, List[str]]:
    """What is patched now, for logs and bug reports.

    Returns:
        Dict[str, List[str]]: applied extension -> ``owner.attribute`` names it replaced.
    """
    with _LOCK:
        return {ext: [_describe(o, n) for o, n, *_ in records] for ext, records in _APPLIED.items()}
