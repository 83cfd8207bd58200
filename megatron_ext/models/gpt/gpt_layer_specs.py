# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Swap megatron_ext's classes into megatron-core GPT layer specs, and back.

:func:`to_megatron_ext_spec` takes any spec megatron-core's GPT spec functions return (a layer
``ModuleSpec``, ``TransformerLayerSubmodules``, a ``TransformerBlockSubmodules`` block spec, a
multi-token-prediction block spec, or a list of layer specs), Transformer Engine or local, and
returns a copy in which

* ``MLASelfAttention`` / ``FusedMLASelfAttention`` are megatron_ext's subclasses, which apply
  RoPE with the contiguous-load kernels, and
* the local ``DotProductAttention`` inside MLA (which cannot build MLA: it has no
  ``k_channels``/``v_channels``) is :class:`SDPADotProductAttention`.

:func:`to_megatron_core_spec` is the inverse. The input spec is never modified.

:func:`patch_megatron_core_gpt_specs` / :func:`unpatch_megatron_core_gpt_specs` make every
megatron-core spec builder that can produce MLA self-attention build the extension class, for
scripts (Megatron-LM's ``pretrain_gpt.py``) that call those builders themselves;
``megatron_ext.arguments.apply_megatron_ext`` uses them.
"""

import dataclasses
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from megatron.core.transformer import multi_latent_attention as _mcore_mla
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_ext import extension_state
from megatron_ext.transformer.multi_latent_attention import (
    ExtFusedMLASelfAttention,
    ExtMLASelfAttention,
)
from megatron_ext.transformer.sdpa_attention import SDPADotProductAttention, resolve_sdpa_backends

__all__ = [
    "megatron_core_mla_spec_modules",
    "to_megatron_ext_spec",
    "to_megatron_core_spec",
    "count_mla_attention_specs",
    "patch_megatron_core_gpt_specs",
    "unpatch_megatron_core_gpt_specs",
    "is_megatron_core_gpt_specs_patched",
]

_MCORE_MLA = _mcore_mla.MLASelfAttention
_MCORE_FUSED_MLA = getattr(_mcore_mla, "FusedMLASelfAttention", None)

# megatron-core class -> megatron_ext class, for the attention modules.
_MLA_TO_EXT: Dict[type, type] = {_MCORE_MLA: ExtMLASelfAttention}
if _MCORE_FUSED_MLA is not None:
    _MLA_TO_EXT[_MCORE_FUSED_MLA] = ExtFusedMLASelfAttention
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
        A new spec object; ``spec`` itself is not modified.

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
    seen = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, ModuleSpec):
            cls = _resolve(obj.module)
            if isinstance(cls, type) and cls in _ALL_MLA:
                counts[cls.__name__] = counts.get(cls.__name__, 0) + 1
            walk(obj.submodules)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for field in dataclasses.fields(obj):
                walk(getattr(obj, field.name, None))
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)

    walk(spec)
    return counts


# ----------------------------------------------------------------------------------------------
# Process-wide switch for scripts that build specs with megatron-core's own functions.

# (module name, attribute) -> original object, while patched.
_PATCHED: Dict[Tuple[str, str], Any] = {}
# Module-level spec constants changed in place, with the class each had, while patched.
_PATCHED_SPECS: List[Tuple[ModuleSpec, Any]] = []


def megatron_core_mla_spec_modules() -> List[types.ModuleType]:
    """The megatron-core modules whose spec builders can produce MLA self-attention.

    Each looks ``MLASelfAttention``/``FusedMLASelfAttention`` up as a module global when its
    builders run, or holds module-level specs that contain them:

    * ``models.gpt.gpt_layer_specs`` (0.16, 0.19): ``get_gpt_layer_local_spec``,
      ``get_gpt_layer_with_transformer_engine_spec``, ``get_gpt_layer_with_inference_spec`` (and
      their ``*_submodules`` forms in 0.19), hence ``get_gpt_decoder_layer_specs``,
      ``get_gpt_decoder_block_spec`` and ``get_gpt_mtp_block_spec``;
    * ``models.gpt.experimental_attention_variant_module_specs`` (0.16):
      ``get_dsa_module_spec_for_backend`` (0.19 builds ``AbsorbedMLASelfAttention`` there, which
      megatron_ext does not extend; ``apply_megatron_ext`` refuses an experimental attention
      variant);
    * ``post_training.modelopt.gpt.model_specs`` (0.16, 0.19): ``get_gpt_modelopt_spec``;
    * ``post_training.modelopt.hybrid.model_specs`` (0.19): ``get_hybrid_stack_modelopt_spec``;
    * ``models.hybrid.hybrid_layer_specs`` (0.19): the constants ``hybrid_stack_spec`` and
      ``hybrid_inference_stack_spec`` (``models.mamba.mamba_layer_specs`` re-exports them);
    * ``models.hybrid.hybrid_block`` (0.19): ``HybridStack`` builds ``FusedMLASelfAttention``
      when it fuses the MLA down-projections.

    Returns:
        List[types.ModuleType]: those of them that exist in the installed release and bind one of
        the MLA classes.
    """
    from megatron.core.models.gpt import experimental_attention_variant_module_specs
    from megatron.core.models.gpt import gpt_layer_specs as mcore_gpt_layer_specs
    from megatron.core.post_training.modelopt.gpt import model_specs as modelopt_gpt_specs

    modules = [
        mcore_gpt_layer_specs,
        experimental_attention_variant_module_specs,
        modelopt_gpt_specs,
    ]
    try:
        # Hybrid (Mamba) models build MLA from megatron-core 0.19 on.
        from megatron.core.models.hybrid import hybrid_block, hybrid_layer_specs
        from megatron.core.post_training.modelopt.hybrid import model_specs as modelopt_hybrid_specs
    except ImportError:
        pass
    else:
        modules += [hybrid_layer_specs, hybrid_block, modelopt_hybrid_specs]
    names = [cls.__name__ for cls in _MLA_TO_EXT]
    return [m for m in modules if any(getattr(m, name, None) is not None for name in names)]


def _module_spec_constants(module: types.ModuleType) -> List[ModuleSpec]:
    """Every ``ModuleSpec`` reachable from ``module``'s globals whose module is an MLA class."""
    found: List[ModuleSpec] = []
    seen = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, ModuleSpec):
            if isinstance(obj.module, type) and obj.module in _ALL_MLA:
                found.append(obj)
            walk(obj.submodules)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for field in dataclasses.fields(obj):
                walk(getattr(obj, field.name, None))
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)

    for value in list(vars(module).values()):
        if isinstance(value, (ModuleSpec, list, tuple)) or (
            dataclasses.is_dataclass(value) and not isinstance(value, type)
        ):
            walk(value)
    return found


def patch_megatron_core_gpt_specs() -> List[str]:
    """Make megatron-core's spec builders build megatron_ext's MLA classes.

    The builders of :func:`megatron_core_mla_spec_modules` look the MLA classes up as module
    globals when called, so rebinding those globals reaches every caller, including scripts that
    imported the functions before this call; module-level spec constants are changed in place.
    Only specs built afterwards are affected; models already built keep their classes. Recorded
    in :mod:`megatron_ext.extension_state` (``undo_megatron_ext`` undoes it). Idempotent;
    thread-safe.

    Returns:
        List[str]: the ``module.attribute`` names now bound to megatron_ext classes.
    """
    modules = megatron_core_mla_spec_modules()
    with extension_state.LOCK:
        for module in modules:
            for mcore_cls, ext_cls in _MLA_TO_EXT.items():
                name = mcore_cls.__name__
                if getattr(module, name, None) is None:
                    continue
                key = (module.__name__, name)
                if key not in _PATCHED:
                    _PATCHED[key] = getattr(module, name)
                setattr(module, name, ext_cls)
            for spec in _module_spec_constants(module):
                if spec.module in _MLA_TO_EXT:
                    _PATCHED_SPECS.append((spec, spec.module))
                    spec.module = _MLA_TO_EXT[spec.module]
        extension_state.set_applied(extension_state.MLA_ROPE_CONTIGUOUS_LOAD, True)
        return [f"{mod}.{attr}" for mod, attr in _PATCHED]


def unpatch_megatron_core_gpt_specs() -> None:
    """Undo :func:`patch_megatron_core_gpt_specs` (a no-op when not patched)."""
    with extension_state.LOCK:
        for (mod_name, attr), original in list(_PATCHED.items()):
            setattr(sys.modules[mod_name], attr, original)
            del _PATCHED[(mod_name, attr)]
        while _PATCHED_SPECS:
            spec, original = _PATCHED_SPECS.pop()
            spec.module = original
        extension_state.set_applied(extension_state.MLA_ROPE_CONTIGUOUS_LOAD, False)


def is_megatron_core_gpt_specs_patched() -> bool:
    """Whether megatron-core's spec builders currently build megatron_ext's classes."""
    return extension_state.is_applied(extension_state.MLA_ROPE_CONTIGUOUS_LOAD)
