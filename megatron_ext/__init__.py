# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron_ext: extensions for NVIDIA Megatron-Core.

The entry points the README uses are attributes of the package::

    import megatron_ext

    megatron_ext.apply_megatron_ext(mla_rope_contiguous_load=True, config=transformer_config)
    megatron_ext.undo_megatron_ext()
    megatron_ext.fused_apply_mla_rope_for_q(...)   # drop-in for megatron-core's kernel
    megatron_ext.fused_apply_mla_rope_for_kv(...)

They are imported on first access, so ``import megatron_ext`` stays cheap (no torch, Triton or
megatron-core model code until one is used).
"""

from typing import Any, List

from megatron_ext.package_info import __version__
from megatron_ext.utils import check_megatron_core_version

# Fail at import on an untested megatron-core, before any extension class is defined on top of
# internals that may have changed.
MEGATRON_CORE_VERSION = check_megatron_core_version()

_ARGUMENTS = (
    "add_megatron_ext_args",
    "apply_megatron_ext",
    "applied_megatron_ext",
    "undo_megatron_ext",
    "MegatronExtConfigError",
)
_KERNELS = ("fused_apply_mla_rope_for_q", "fused_apply_mla_rope_for_kv")

__all__ = ["__version__", "MEGATRON_CORE_VERSION", *_ARGUMENTS, *_KERNELS]


def __getattr__(name: str) -> Any:
    """Import an entry point on first access (PEP 562)."""
    if name in _ARGUMENTS:
        from megatron_ext import arguments

        return getattr(arguments, name)
    if name in _KERNELS:
        from megatron_ext.fusions import fused_mla_yarn_rope_apply

        return getattr(fused_mla_yarn_rope_apply, name)
    raise AttributeError(f"module 'megatron_ext' has no attribute {name!r}")


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
