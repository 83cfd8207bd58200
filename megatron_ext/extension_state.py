# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The one record of which megatron_ext extensions are in effect in this process.

Every switch writes here when it changes process state (``patch_megatron_core_gpt_specs`` /
``unpatch_megatron_core_gpt_specs`` and ``enable_static_active_slices`` /
``disable_static_active_slices``), whether it was called directly or through
``megatron_ext.arguments.apply_megatron_ext``; ``applied_megatron_ext`` and
``undo_megatron_ext`` read it. Importing this module imports nothing else.
"""

import threading
from typing import Dict

__all__ = [
    "EXTENSIONS",
    "INFERENCE_STATIC_ACTIVE_SLICES",
    "MLA_ROPE_CONTIGUOUS_LOAD",
    "LOCK",
    "applied",
    "is_applied",
    "set_applied",
]

MLA_ROPE_CONTIGUOUS_LOAD = "mla_rope_contiguous_load"
INFERENCE_STATIC_ACTIVE_SLICES = "inference_static_active_slices"
EXTENSIONS = (MLA_ROPE_CONTIGUOUS_LOAD, INFERENCE_STATIC_ACTIVE_SLICES)

# Re-entrant: apply/undo hold it around the switches, which take it again to record their state.
LOCK = threading.RLock()
_STATE: Dict[str, bool] = dict.fromkeys(EXTENSIONS, False)


def _check_name(name: str) -> None:
    if name not in _STATE:
        raise KeyError(f"unknown megatron_ext extension {name!r}; known: {list(EXTENSIONS)}")


def set_applied(name: str, value: bool) -> None:
    """Record that extension ``name`` is now (or no longer) in effect.

    Args:
        name: one of :data:`EXTENSIONS`.
        value: whether it is in effect.

    Raises:
        KeyError: for an unknown extension name.
        TypeError: if ``value`` is not a bool.
    """
    _check_name(name)
    if not isinstance(value, bool):
        raise TypeError(f"value must be a bool, got {value!r}")
    with LOCK:
        _STATE[name] = value


def is_applied(name: str) -> bool:
    """Whether extension ``name`` is in effect.

    Args:
        name: one of :data:`EXTENSIONS`.

    Returns:
        bool: its recorded state.

    Raises:
        KeyError: for an unknown extension name.
    """
    _check_name(name)
    with LOCK:
        return _STATE[name]


def applied() -> Dict[str, bool]:
    """Every extension's state.

    Returns:
        Dict[str, bool]: a copy, extension name -> in effect.
    """
    with LOCK:
        return dict(_STATE)
