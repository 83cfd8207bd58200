# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Checked launch plans of megatron_ext's Triton kernels, cached by the call's layout.

Checking a call and building its launch arguments costs more host time than the launch itself,
and a model makes the same call (same shapes, strides, dtypes, devices, pointer alignments and
flags; new data pointers) once per layer and step. So every kernel function keys its call's
:class:`LaunchPlan` by the layout (:func:`layout_key`, or an inline key on the RoPE path) and keeps
it in a :class:`PlanCache`: a hit skips every check that depends on the layout alone and calls
the plan with the call's tensors. What depends on the data pointers (an output overlapping an
input) is checked on every call, before any launch.

A plan is one :class:`megatron_ext.fusions.direct_launch.PreparedLaunch` (one kernel, launched
directly through its C launcher once bound, else through Triton's JIT), a kernel's plan made of
such launches, or :data:`NO_LAUNCH` for a call with nothing to launch (no tokens, no heads).
"""

import threading
from typing import Any, Dict, Generic, Hashable, Optional, Tuple, TypeVar

import torch

__all__ = ["MAX_PLANS", "NO_LAUNCH", "LaunchPlan", "PlanCache", "layout_key"]

# The most plans a cache keeps (and launch bindings a kernel keeps) before it starts over.
MAX_PLANS = 4096


class LaunchPlan:
    """What one checked call layout launches: call it with the call's tensors.

    The base launches nothing (:data:`NO_LAUNCH`); subclasses hold no tensor (a cached plan must
    not keep device memory alive).
    """

    __slots__ = ()

    def __call__(self, *tensors: Optional[torch.Tensor]) -> None:
        """Launch nothing."""


# The plan of a call with nothing to launch.
NO_LAUNCH = LaunchPlan()

Plan = TypeVar("Plan", bound=LaunchPlan)


def layout_key(tensors: Tuple[Any, ...], scalars: Tuple[Any, ...]) -> Optional[tuple]:
    """Everything a call's checks and launch arguments depend on but the data pointers.

    Each pointer's 16-byte alignment is part of it: Triton specialises on it, so a plan's bound
    launch is only ever called with pointers it was compiled for.

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
            parts.append((type(x), x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15))
        else:
            return None
    for value in scalars:
        parts.append((type(value), value))
    return tuple(parts)


class PlanCache(Generic[Plan]):
    """A bounded map from layout keys to checked plans (cleared when :data:`MAX_PLANS` is reached).

    Threads may share it: a lookup never sees a half-built plan (plans are stored whole, after
    their checks passed, under a lock) and two threads that miss together both build the same
    plan.

    Args:
        max_entries: the most plans kept.

    Attributes:
        lookup: the plan stored under a key, or None; raises TypeError for an unhashable key
            (the dictionary's own ``get``: no Python frame, for a caller that catches it).
    """

    __slots__ = ("max_entries", "_plans", "_lock", "lookup")

    def __init__(self, max_entries: int = MAX_PLANS):
        self.max_entries = max_entries
        self._plans: Dict[Hashable, Plan] = {}
        self._lock = threading.Lock()
        self.lookup = self._plans.get

    def get(self, key: Optional[Hashable]) -> Optional[Plan]:
        """The plan stored under ``key``, or None (also for a None or unhashable key)."""
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

    def plans(self) -> Tuple[Plan, ...]:
        """The plans stored now."""
        return tuple(self._plans.values())

    def clear(self) -> None:
        """Forget every plan."""
        with self._lock:
            self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
