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
import operator
import types
from typing import Any, Callable, Dict, Tuple

from megatron.core.transformer import multi_latent_attention as _mcore_mla

from megatron_ext.fusions.fused_mla_yarn_rope_apply import (
    fused_apply_mla_rope_for_kv,
    fused_apply_mla_rope_for_q,
)
from megatron_ext.fusions.mla_rope.checks import check_cp_sequence_lengths

__all__ = ["ExtMLASelfAttention", "ExtFusedMLASelfAttention", "ROPE_FUNCTION_NAMES"]

# The names megatron-core's MLA module binds at import and looks up, as globals, at call time.
ROPE_FUNCTION_NAMES: Tuple[str, str] = ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv")


def _code_objects(code: types.CodeType):
    """``code`` and every code object nested in it (the closures defined inside a method)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _global_loads(func: types.FunctionType):
    """The names ``func`` (or a closure inside it) reads as globals."""
    return {
        ins.argval
        for code in _code_objects(func.__code__)
        for ins in dis.get_instructions(code)
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    }


@functools.lru_cache(maxsize=None)
def _check_reroutable(func: types.FunctionType) -> None:
    """Refuse a megatron-core method whose RoPE calls cannot be rerouted by name.

    Rerouting works by running the method's code with the two names bound to megatron_ext's
    functions. That is a no-op if the method (or a closure inside it) does not look the names up
    as globals (say, a future release wraps it in a decorator or renames the functions), and it
    would lose writes if the code assigned module globals. Both would be silent, so both raise.
    """
    for code in _code_objects(func.__code__):
        for ins in dis.get_instructions(code):
            if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL"):
                raise RuntimeError(
                    f"{func.__qualname__} assigns the global {ins.argval!r}; megatron_ext cannot "
                    "reroute its RoPE calls safely on this megatron-core release"
                )
    missing = [name for name in ROPE_FUNCTION_NAMES if name not in _global_loads(func)]
    if missing:
        raise RuntimeError(
            f"{func.__module__}.{func.__qualname__} does not call {missing} by name; megatron_ext "
            "cannot reroute its RoPE on this megatron-core release"
        )


class _Rerouted:
    """``func`` with its global lookups of the RoPE names finding megatron_ext's kernels.

    Built once per megatron-core method: same code object, closure and defaults; only the globals
    dictionary differs, a copy of the defining module's. Before each call the copy takes the
    current values of the globals the method reads (one C-level gather, ~1 us), so a change made
    to megatron-core's module after import is seen as megatron-core sees it, and the two RoPE names
    take this module's current bindings (tests may replace them here).
    """

    def __init__(self, func: types.FunctionType):
        _check_reroutable(func)
        self.source = func.__globals__
        self.namespace = dict(self.source)
        names = sorted(
            n for n in _global_loads(func) if n in self.source and n not in ROPE_FUNCTION_NAMES
        )
        self.names = tuple(names)
        self.gather: Callable = operator.itemgetter(*names) if len(names) > 1 else None
        self.function = types.FunctionType(
            func.__code__, self.namespace, func.__name__, func.__defaults__, func.__closure__
        )
        self.function.__kwdefaults__ = func.__kwdefaults__
        self.function.__qualname__ = func.__qualname__
        self.function.__doc__ = func.__doc__
        self.function.__module__ = func.__module__

    def sync(self) -> types.FunctionType:
        """Refresh the copied globals; return the rerouted function."""
        namespace = self.namespace
        try:
            if self.gather is not None:
                namespace.update(zip(self.names, self.gather(self.source)))
            elif self.names:
                namespace[self.names[0]] = self.source[self.names[0]]
        except KeyError:  # a global was deleted from megatron-core's module: copy it all again
            namespace.clear()
            namespace.update(self.source)
        namespace["fused_apply_mla_rope_for_q"] = fused_apply_mla_rope_for_q
        namespace["fused_apply_mla_rope_for_kv"] = fused_apply_mla_rope_for_kv
        return self.function


@functools.lru_cache(maxsize=None)
def _rerouted(func: types.FunctionType) -> _Rerouted:
    return _Rerouted(func)


def _with_ext_rope(func: types.FunctionType) -> types.FunctionType:
    """The rerouted copy of ``func`` (built once, globals refreshed now)."""
    return _rerouted(func).sync()


def _check_context_parallel_lengths(module, args: Tuple, kwargs: Dict[str, Any]) -> None:
    """Refuse thd sequence lengths the RoPE kernels would map wrongly under context parallelism.

    Only where the lengths are already on the host (``cu_seqlens`` on the CPU): reading CUDA
    tensors would cost a device-to-host sync on every forward, so there the kernels' documented
    precondition stands unchecked.
    """
    params = kwargs.get("packed_seq_params", args[3] if len(args) > 3 else None)
    if params is None or getattr(params, "qkv_format", None) != "thd":
        return
    cp_size = module.pg_collection.cp.size() if getattr(module, "pg_collection", None) else 1
    if cp_size <= 1:
        return
    for padded, plain in (
        ("cu_seqlens_q_padded", "cu_seqlens_q"),
        ("cu_seqlens_kv_padded", "cu_seqlens_kv"),
    ):
        cu = getattr(params, padded, None)
        cu = cu if cu is not None else getattr(params, plain, None)
        if cu is not None and cu.device.type == "cpu":
            check_cp_sequence_lengths((cu[1:] - cu[:-1]).tolist(), cp_size)


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
    resolves names in (:class:`_Rerouted`, built once per method). Nothing of megatron-core's is
    mutated, so the change is confined to instances of this class and is thread-safe; the closure
    created inside the call keeps that dictionary, so the recomputation in backward uses
    megatron_ext's kernels too; and it works on every release whose method calls the functions by
    these names (checked, not assumed: :func:`_check_reroutable` raises otherwise). Both
    megatron-core 0.16 and 0.19 do.
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
        _check_context_parallel_lengths(self, args, kwargs)
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
