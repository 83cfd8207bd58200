# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Checked launch plans of the paged latent-cache kernels, cached by the call's layout.

Checking a call of the paged latent attention
(:mod:`megatron_ext.fusions.mla_paged_latent_attention`) and building its launch arguments took
most of its host time, and an engine makes the same call (same shapes, strides, dtypes, devices
and flags; new data pointers) once per layer and step. A kernel's function keys its plan by
:func:`layout_key` of the call and keeps it in a :class:`PlanCache`: a hit skips every check that
depends on the layout alone and launches the plan's
:class:`megatron_ext.fusions.direct_launch.PreparedLaunch` objects. What depends on the data
pointers (an output overlapping an input) is checked on every call, before any launch.
"""

import threading
from typing import Any, Dict, Generic, Hashable, Optional, Tuple, TypeVar

import torch

__all__ = ["PlanCache", "layout_key"]

Plan = TypeVar("Plan")


def layout_key(tensors: Tuple[Any, ...], scalars: Tuple[Any, ...]) -> Optional[tuple]:
    """Everything a call's checks and launch arguments depend on but the data pointers.

    Args:
        tensors: the call's tensor arguments (None for an absent optional one).
        scalars: its other arguments (hashable values; each keyed with its type, so that
            ``True`` and ``1`` or ``1`` and ``1.0`` differ, as the checks tell them apart).

    Returns:
        Optional[tuple]: the key, or None when a tensor argument is neither a tensor nor None
        (the caller checks it on the slow path, which raises). A key holding an unhashable
        scalar is never found in a :class:`PlanCache` (it is hashed there, once per lookup).
    """
    parts = []
    for x in tensors:
        if x is None:
            parts.append(None)
        elif isinstance(x, torch.Tensor):
            parts.append((type(x), x.shape, x.stride(), x.dtype, x.device))
        else:
            return None
    for value in scalars:
        parts.append((type(value), value))
    return tuple(parts)


class PlanCache(Generic[Plan]):
    """A bounded map from :func:`layout_key` keys to checked plans (cleared when full).

    Threads may share it: a lookup never sees a half-built plan (plans are stored whole, after
    their checks passed) and two threads that miss together both build the same plan.

    Args:
        max_entries: the most plans kept.
    """

    def __init__(self, max_entries: int = 1024):
        self.max_entries = max_entries
        self._plans: Dict[Hashable, Plan] = {}
        self._lock = threading.Lock()

    def get(self, key: Optional[Hashable]) -> Optional[Plan]:
        """The plan stored under ``key``, or None (also for a None or unhashable key)."""
        if key is None:
            return None
        try:
            return self._plans.get(key)
        except TypeError:
            return None

    def put(self, key: Optional[Hashable], plan: Plan) -> Plan:
        """Store ``plan`` under ``key`` (not for a None or unhashable key); return it."""
        if key is not None:
            try:
                hash(key)
            except TypeError:
                return plan
            with self._lock:
                if len(self._plans) >= self.max_entries:
                    self._plans.clear()
                self._plans[key] = plan
        return plan

    def clear(self) -> None:
        """Forget every plan."""
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
