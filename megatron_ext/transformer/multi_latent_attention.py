# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA self-attention that applies RoPE with megatron_ext's contiguous-load kernels.

:class:`ExtMLASelfAttention` (and, on megatron-core releases that have ``FusedMLASelfAttention``,
:class:`ExtFusedMLASelfAttention`) is megatron-core's class with one change: wherever megatron-core
would call its fused MLA RoPE (``fused_apply_mla_rope_for_q`` / ``fused_apply_mla_rope_for_kv``,
used when ``apply_rope_fusion`` is on with yarn RoPE), megatron_ext's kernels of the same name and
signature run instead. Those kernels reproduce megatron-core's results bit for bit (see
``megatron_ext.fusions.fused_mla_yarn_rope_apply`` for the exact contract), so a model built with
these classes trains as one built without them.
"""

import dis
import functools
import importlib
import types
from typing import Any, Callable, Dict, Tuple

from megatron.core.transformer import multi_latent_attention as _mcore_mla

__all__ = ["ExtMLASelfAttention", "ExtFusedMLASelfAttention", "ROPE_FUNCTION_NAMES"]

# The names megatron-core's MLA module binds at import and looks up, as globals, at call time.
ROPE_FUNCTION_NAMES: Tuple[str, str] = ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv")


_EXT_ROPE_MODULE = "megatron_ext.fusions.fused_mla_yarn_rope_apply"


def _ext_rope_module() -> types.ModuleType:
    """megatron_ext's kernels module, imported on first use.

    Importing on use (not at import of this file) keeps Triton out of processes that never run
    the fused path, and looking the functions up on every call means a replacement installed on
    that module (a newer kernel, a test double) takes effect at once.
    """
    try:
        return importlib.import_module(_EXT_ROPE_MODULE)
    except ImportError as exc:
        raise ImportError(
            f"megatron_ext's MLA RoPE kernels ({_EXT_ROPE_MODULE}) cannot be imported ({exc}); "
            "they need triton"
        ) from exc


def fused_apply_mla_rope_for_q(*args: Any, **kwargs: Any):
    """Forward to megatron_ext's ``fused_apply_mla_rope_for_q`` (same signature as mcore's)."""
    return _ext_rope_module().fused_apply_mla_rope_for_q(*args, **kwargs)


def fused_apply_mla_rope_for_kv(*args: Any, **kwargs: Any):
    """Forward to megatron_ext's ``fused_apply_mla_rope_for_kv`` (same signature as mcore's)."""
    return _ext_rope_module().fused_apply_mla_rope_for_kv(*args, **kwargs)


_EXT_ROPE_FUNCTIONS: Dict[str, Callable] = {
    "fused_apply_mla_rope_for_q": fused_apply_mla_rope_for_q,
    "fused_apply_mla_rope_for_kv": fused_apply_mla_rope_for_kv,
}


def _code_objects(code: types.CodeType):
    """``code`` and every code object nested in it (the closures defined inside a method)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


@functools.lru_cache(maxsize=None)
def _check_reroutable(func: types.FunctionType) -> None:
    """Refuse a megatron-core method whose RoPE calls cannot be rerouted by name.

    Rerouting works by running the method's code with the two names bound to megatron_ext's
    functions. That is a no-op if the method (or a closure inside it) does not look the names up
    as globals (say, a future release wraps it in a decorator or renames the functions), and it
    would lose writes if the code assigned module globals. Both would be silent, so both raise.
    """
    codes = list(_code_objects(func.__code__))
    names = set()
    for code in codes:
        names.update(code.co_names)
        for ins in dis.get_instructions(code):
            if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                raise RuntimeError(
                    f"{func.__qualname__} assigns the global {ins.argval!r}; megatron_ext cannot "
                    "reroute its RoPE calls safely on this megatron-core release"
                )
    missing = [name for name in ROPE_FUNCTION_NAMES if name not in names]
    if missing:
        raise RuntimeError(
            f"{func.__module__}.{func.__qualname__} does not call {missing} by name; megatron_ext "
            "cannot reroute its RoPE on this megatron-core release"
        )


def _with_ext_rope(func: types.FunctionType) -> types.FunctionType:
    """A copy of ``func`` whose global lookups of the RoPE names find megatron_ext's kernels.

    Same code object, closure and defaults; only the globals dictionary differs: a copy of the
    defining module's globals taken now, at each call (so changes made to that module between
    calls are seen as megatron-core sees them), with the two RoPE names rebound.
    """
    _check_reroutable(func)
    module_globals = dict(func.__globals__)
    module_globals.update(_EXT_ROPE_FUNCTIONS)
    rerouted = types.FunctionType(
        func.__code__, module_globals, func.__name__, func.__defaults__, func.__closure__
    )
    rerouted.__kwdefaults__ = func.__kwdefaults__
    rerouted.__qualname__ = func.__qualname__
    rerouted.__doc__ = func.__doc__
    rerouted.__module__ = func.__module__
    return rerouted


class _ContiguousLoadRopeMixin:
    """Runs megatron-core's ``get_query_key_value_tensors`` with megatron_ext's RoPE kernels.

    Why this way: megatron-core's MLA module imports the two fused RoPE functions at module level
    and calls them, by global name, from a closure inside ``get_query_key_value_tensors``. The
    alternatives all fall short:

    * patching the module attributes (even just around the call) changes every MLA instance in
      the process, including plain megatron-core ones running in other threads, and is undone
      before the closure runs again when ``mla_up_proj`` recomputation replays it in backward;
    * copying the method's body forks megatron-core's logic and drifts with every release.

    Instead the parent method (found through ``super()``, so the MRO is honoured) is called as a
    copy that shares its code, closure and defaults and differs only in the globals dictionary it
    resolves names in. Nothing shared is mutated, so the change is confined to instances of this
    class and is thread-safe; the closure created inside the call keeps that dictionary, so the
    recomputation in backward uses megatron_ext's kernels too; and it works on every release
    whose method calls the functions by these names (checked, not assumed:
    :func:`_check_reroutable` raises otherwise). Both megatron-core 0.16 and 0.19 do. The copy
    of the globals is taken per call, so later changes to megatron-core's module are seen as
    megatron-core sees them; it costs about a microsecond per layer and step.
    """

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any):
        """megatron-core's ``get_query_key_value_tensors`` with megatron_ext's RoPE kernels.

        Args:
            *args: positional arguments of the parent method (hidden_states, ...).
            **kwargs: keyword arguments of the parent method.

        Returns:
            The parent method's return value: query, key, value, q_compressed, kv_compressed.
        """
        parent = super().get_query_key_value_tensors
        if not self.config.apply_rope_fusion:
            # megatron-core does not reach its fused RoPE then: nothing to reroute.
            return parent(*args, **kwargs)
        return _with_ext_rope(parent.__func__)(self, *args, **kwargs)


class ExtMLASelfAttention(_ContiguousLoadRopeMixin, _mcore_mla.MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` with megatron_ext's contiguous-load RoPE kernels.

    Constructor, parameters, state dict and every code path are megatron-core's; only the fused
    MLA RoPE calls (taken when ``config.apply_rope_fusion`` is on with ``rope_type='yarn'``) go
    to ``megatron_ext.fusions.fused_mla_yarn_rope_apply``. With any other configuration this class
    behaves exactly as megatron-core's; ``megatron_ext.arguments.apply_megatron_ext`` refuses such
    configurations instead of letting the flag do nothing.
    """


_McoreFusedMLA = getattr(_mcore_mla, "FusedMLASelfAttention", None)

if _McoreFusedMLA is not None:

    class ExtFusedMLASelfAttention(_ContiguousLoadRopeMixin, _McoreFusedMLA):
        """megatron-core's ``FusedMLASelfAttention`` with megatron_ext's RoPE kernels."""

else:
    # megatron-core releases before FusedMLASelfAttention existed (0.16) have nothing to extend.
    ExtFusedMLASelfAttention = None

# Fail at import, not at the first forward, on a release whose method cannot be rerouted.
_check_reroutable(_mcore_mla.MLASelfAttention.get_query_key_value_tensors)
