# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Swap megatron_ext's classes into megatron-core GPT layer specs, and back.

:func:`to_megatron_ext_spec` takes any spec megatron-core's GPT spec functions return (a layer
``ModuleSpec``, ``TransformerLayerSubmodules``, a ``TransformerBlockSubmodules`` block spec, a
multi-token-prediction block spec, or a list of layer specs), Transformer Engine or local, and
returns a copy in which

* ``MLASelfAttention`` / ``FusedMLASelfAttention`` are megatron_ext's subclasses, which apply
  RoPE with the contiguous-load kernels, and
* the local ``DotProductAttention`` inside MLA (which cannot build MLA: it has no
  ``k_channels``/``v_channels``) is :class:`SDPADotProductAttention`; where it puts that in, it
  also applies the ``te_free_mla`` patch (:data:`megatron_ext.patches.PATCHES`), which
  megatron-core 0.16's MLA constructor needs without Transformer Engine.

:func:`to_megatron_core_spec` is the inverse. The input spec is never modified.

:func:`get_gpt_layer_local_mla_spec` is a layer spec for Megatron-LM's ``--spec`` option: MLA
without Transformer Engine.

:func:`patch_megatron_core_gpt_specs` / :func:`unpatch_megatron_core_gpt_specs` apply and undo
the flag's patches of megatron-core (:mod:`megatron_ext.patches` lists them) without checking a
configuration.
"""

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext import patches
from megatron_ext.transformer.multi_latent_attention import megatron_core_to_ext_classes
from megatron_ext.transformer.sdpa_attention import SDPADotProductAttention, resolve_sdpa_backends
from megatron_ext.transformer.spec_utils import iter_module_specs

__all__ = [
    "get_gpt_layer_local_mla_spec",
    "to_megatron_ext_spec",
    "to_megatron_core_spec",
    "count_mla_attention_specs",
    "iter_module_specs",
    "patch_megatron_core_gpt_specs",
    "unpatch_megatron_core_gpt_specs",
    "is_megatron_core_gpt_specs_patched",
]

# megatron-core class -> megatron_ext class, for the attention modules.
_MLA_TO_EXT: Dict[type, type] = megatron_core_to_ext_classes()
_EXT_TO_MLA: Dict[type, type] = {ext: mcore for mcore, ext in _MLA_TO_EXT.items()}
_ALL_MLA = tuple(_MLA_TO_EXT) + tuple(_EXT_TO_MLA)

_SDPA_PARAM = "sdpa_backends"


def _resolve(module: Any) -> Any:
    """The class a ``ModuleSpec.module`` names; ``(path, name)`` tuples are matched by name."""
    if isinstance(module, tuple) and len(module) == 2:
        path, name = module
        for cls in (*_ALL_MLA, DotProductAttention, SDPADotProductAttention):
            if cls.__module__ == path and cls.__name__ == name:
                return cls
    return module


class _SpecMapper:
    """Copy-on-write walk over a spec tree that replaces module classes.

    Dataclass instances (``ModuleSpec`` and the ``*Submodules`` classes), lists and tuples are
    walked; everything else (classes, functions, partials) is a leaf. Objects that are shared in
    the input (one layer spec repeated in a block's ``layer_specs``) stay shared in the output,
    and unchanged subtrees are returned as they are.
    """

    def __init__(self, to_ext: bool, mla: bool, sdpa: bool, sdpa_backends: Optional[list]):
        self.to_ext = to_ext
        self.mla = mla
        self.sdpa = sdpa
        self.sdpa_backends = sdpa_backends
        self.memo: Dict[int, Any] = {}
        self.mla_found = 0
        self.sdpa_swapped_in = 0

    def map(self, obj: Any) -> Any:
        """The mapped copy of ``obj`` (``obj`` itself when nothing in it changes)."""
        if id(obj) in self.memo:
            return self.memo[id(obj)]
        if isinstance(obj, ModuleSpec):
            out = self._map_module_spec(obj)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            out = self._map_fields(obj, self.map)
        elif isinstance(obj, list):
            items = [self.map(item) for item in obj]
            out = obj if all(a is b for a, b in zip(items, obj)) else items
        elif isinstance(obj, tuple) and not _is_import_tuple(obj):
            items = tuple(self.map(item) for item in obj)
            out = obj if all(a is b for a, b in zip(items, obj)) else type(obj)(items)
        else:
            out = obj
        self.memo[id(obj)] = out
        return out

    @staticmethod
    def _map_fields(obj: Any, fn: Callable[[Any], Any]) -> Any:
        changes = {}
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name, None)
            new = fn(value)
            if new is not value:
                changes[field.name] = new
        if not changes:
            return obj
        # A shallow copy keeps fields that are not constructor arguments and works for frozen
        # dataclasses; dataclasses.replace would re-run __init__/__post_init__.
        clone = _shallow_copy(obj)
        for name, value in changes.items():
            object.__setattr__(clone, name, value)
        return clone

    def _map_module_spec(self, spec: ModuleSpec) -> ModuleSpec:
        cls = _resolve(spec.module)
        if isinstance(cls, type) and cls in _ALL_MLA:
            self.mla_found += 1
            new_module = spec.module
            if self.mla:
                new_module = (_MLA_TO_EXT if self.to_ext else _EXT_TO_MLA).get(cls, spec.module)
            new_sub = spec.submodules
            if dataclasses.is_dataclass(new_sub) and not isinstance(new_sub, type):
                new_sub = self._map_mla_submodules(new_sub)
            if new_module is spec.module and new_sub is spec.submodules:
                return spec
            clone = _shallow_copy(spec)
            clone.module = new_module
            clone.submodules = new_sub
            return clone
        return self._map_fields(spec, self.map)

    def _map_mla_submodules(self, sub: Any) -> Any:
        # Inside an MLA module only the core attention is swapped; the linear layers, norms and
        # whatever else the submodules hold are left as they are.
        changes = {}
        for field in dataclasses.fields(sub):
            value = getattr(sub, field.name, None)
            new = self._map_core_attention(value) if field.name == "core_attention" else value
            if new is not value:
                changes[field.name] = new
        if not changes:
            return sub
        clone = _shallow_copy(sub)
        for name, value in changes.items():
            object.__setattr__(clone, name, value)
        return clone

    def _map_core_attention(self, value: Any) -> Any:
        if not self.sdpa:
            return value
        if isinstance(value, ModuleSpec):
            cls = _resolve(value.module)
            params = dict(value.params or {})
            if self.to_ext and cls is DotProductAttention:
                if self.sdpa_backends is not None:
                    params[_SDPA_PARAM] = self.sdpa_backends
                self.sdpa_swapped_in += 1
                clone = _shallow_copy(value)
                clone.module, clone.params = SDPADotProductAttention, params
                return clone
            if not self.to_ext and cls is SDPADotProductAttention:
                params.pop(_SDPA_PARAM, None)
                if not params and value.submodules is None:
                    return DotProductAttention
                clone = _shallow_copy(value)
                clone.module, clone.params = DotProductAttention, params
                return clone
            return value
        if self.to_ext and value is DotProductAttention:
            self.sdpa_swapped_in += 1
            if self.sdpa_backends is not None:
                return ModuleSpec(
                    module=SDPADotProductAttention, params={_SDPA_PARAM: self.sdpa_backends}
                )
            return SDPADotProductAttention
        if not self.to_ext and value is SDPADotProductAttention:
            return DotProductAttention
        return value


def _is_import_tuple(obj: tuple) -> bool:
    return len(obj) == 2 and isinstance(obj[0], str) and isinstance(obj[1], str)


def _shallow_copy(obj: Any) -> Any:
    clone = object.__new__(type(obj))
    if hasattr(obj, "__dict__"):
        clone.__dict__.update(obj.__dict__)
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            object.__setattr__(clone, slot, getattr(obj, slot))
    return clone


SpecLike = Union[ModuleSpec, Any]


def to_megatron_ext_spec(
    spec: SpecLike,
    *,
    mla_rope_contiguous_load: bool = True,
    sdpa_core_attention: bool = True,
    sdpa_backends: Optional[Sequence[str]] = None,
    strict: bool = True,
) -> SpecLike:
    """Return ``spec`` with megatron_ext's classes swapped in.

    Args:
        spec: a megatron-core GPT layer spec (``ModuleSpec``), ``TransformerLayerSubmodules``,
            block spec (``TransformerBlockSubmodules``), MTP block spec or a list of those.
        mla_rope_contiguous_load: swap ``MLASelfAttention``/``FusedMLASelfAttention`` for the
            megatron_ext subclasses that run the contiguous-load RoPE kernels.
        sdpa_core_attention: swap megatron-core's local ``DotProductAttention`` inside MLA specs
            for :class:`SDPADotProductAttention` (needed to build MLA without Transformer Engine;
            Transformer Engine specs have no ``DotProductAttention`` and are left alone).
        sdpa_backends: SDPA backends for the swapped-in core attention, e.g. ``["math"]`` for a
            deterministic backward; PyTorch chooses when None.
        strict: raise if the spec has no MLA self-attention (nothing for the extension to do).

    Returns:
        A new spec object; ``spec`` itself is not modified. Where it swapped the SDPA core
        attention in, the ``te_free_mla`` patch of megatron-core is applied (a no-op except on
        megatron-core 0.16 without Transformer Engine, whose MLA constructor needs it; undone by
        ``undo_megatron_ext``).

    Raises:
        ValueError: if ``strict`` and the spec contains no MLA self-attention module.
    """
    backends = resolve_sdpa_backends(sdpa_backends) if sdpa_backends is not None else None
    mapper = _SpecMapper(
        to_ext=True, mla=mla_rope_contiguous_load, sdpa=sdpa_core_attention, sdpa_backends=backends
    )
    out = mapper.map(spec)
    if strict and mapper.mla_found == 0:
        raise ValueError(
            "the spec contains no MLASelfAttention/FusedMLASelfAttention module: megatron_ext's "
            "MLA extension has nothing to act on (build the spec with multi_latent_attention=True,"
            " or pass strict=False)"
        )
    if mapper.sdpa_swapped_in:
        patches.apply_patches(patches.TE_FREE_MLA)
    return out


def to_megatron_core_spec(spec: SpecLike) -> SpecLike:
    """Return ``spec`` with megatron-core's classes swapped back in.

    Args:
        spec: a spec produced by :func:`to_megatron_ext_spec` (or any megatron-core spec).

    Returns:
        A new spec object with ``ExtMLASelfAttention`` -> ``MLASelfAttention``,
        ``ExtFusedMLASelfAttention`` -> ``FusedMLASelfAttention`` and
        ``SDPADotProductAttention`` -> ``DotProductAttention`` (its ``sdpa_backends`` parameter
        dropped); ``spec`` itself is not modified.
    """
    mapper = _SpecMapper(to_ext=False, mla=True, sdpa=True, sdpa_backends=None)
    return mapper.map(spec)


def count_mla_attention_specs(spec: SpecLike) -> Dict[str, int]:
    """Count MLA attention module specs by class name (for checks and logs).

    Args:
        spec: any spec accepted by :func:`to_megatron_ext_spec`.

    Returns:
        Dict[str, int]: class name -> number of distinct ``ModuleSpec`` objects using it.
    """
    counts: Dict[str, int] = {}
    for module_spec in iter_module_specs(spec):
        cls = _resolve(module_spec.module)
        if isinstance(cls, type) and cls in _ALL_MLA:
            counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
    return counts


def get_gpt_layer_local_mla_spec(config: Any, vp_stage: Optional[int] = None) -> ModuleSpec:
    """megatron-core's local GPT layer spec with MLA and the SDPA core attention.

    For megatron.training 0.19's ``--transformer-impl local --spec
    megatron_ext.models.gpt.gpt_layer_specs get_gpt_layer_local_mla_spec``, which calls it with
    the model config; the MLA class is whatever megatron-core's spec builder builds (megatron_ext's
    while ``--mla-rope-contiguous-load`` is applied). SDPA runs its math backend, whose backward is
    deterministic.

    Args:
        config: the model config (``qk_layernorm`` and ``normalization`` are read; a 0.19
            ``GPTModelConfig`` passes them through from its transformer config).
        vp_stage: the virtual pipeline stage (unused: the layers are all alike).

    Returns:
        ModuleSpec: the layer spec.
    """
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(
        multi_latent_attention=True,
        qk_layernorm=config.qk_layernorm,
        normalization=config.normalization,
    )
    return to_megatron_ext_spec(spec, mla_rope_contiguous_load=False, sdpa_backends=["math"])


# ----------------------------------------------------------------------------------------------
# The process-wide switch, for scripts that call megatron-core's own spec builders.


def patch_megatron_core_gpt_specs() -> List[str]:
    """Apply ``--mla-rope-contiguous-load``'s patches without checking a configuration.

    megatron-core's spec builders then build megatron_ext's MLA classes and its MLA module runs
    megatron_ext's kernels (every target: ``megatron_ext.patches.PATCHES``). Specs and models
    built earlier keep their classes. Prefer ``apply_megatron_ext``, which checks the
    configuration first. Idempotent; thread-safe.

    Returns:
        List[str]: the ``owner.attribute`` names now patched.
    """
    patches.apply_patches(patches.MLA_ROPE_CONTIGUOUS_LOAD)
    return patches.applied_extensions()[patches.MLA_ROPE_CONTIGUOUS_LOAD]


def unpatch_megatron_core_gpt_specs() -> None:
    """Undo :func:`patch_megatron_core_gpt_specs` (a no-op when not patched)."""
    patches.undo_patches(patches.MLA_ROPE_CONTIGUOUS_LOAD)


def is_megatron_core_gpt_specs_patched() -> bool:
    """Whether megatron-core's spec builders currently build megatron_ext's classes."""
    return patches.is_applied(patches.MLA_ROPE_CONTIGUOUS_LOAD)
