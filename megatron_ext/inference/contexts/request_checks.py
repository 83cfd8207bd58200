# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Type and range checks of the values a request brings into a context, each naming the value:
used before megatron-core's ``add_request`` converts them (after it has allocated the request's
KV blocks), so that a bad value changes nothing."""

import numbers
import operator
from typing import Any

import numpy as np
import torch

__all__ = ["as_bool", "as_int", "as_real", "check_metadata_value"]


def _is_bool(value: Any) -> bool:
    return isinstance(value, (bool, np.bool_))


def as_int(name: str, value: Any) -> int:
    """``value`` as an int (Python or numpy integers; not a bool, float, str or None).

    Raises:
        TypeError: naming ``name`` and the value.
    """
    if not _is_bool(value):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")


def as_real(name: str, value: Any) -> float:
    """``value`` as a float (a real number, numpy's included; not a bool, str or None).

    Raises:
        TypeError: naming ``name`` and the value.
    """
    if _is_bool(value) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({value!r})")
    return float(value)


def as_bool(name: str, value: Any) -> bool:
    """``value`` as a bool (Python's or numpy's only: ``'False'`` is no bool).

    Raises:
        TypeError: naming ``name`` and the value.
    """
    if not _is_bool(value):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({value!r})")
    return bool(value)


def check_metadata_value(label: str, value: Any, dtype: torch.dtype) -> None:
    """Refuse a request-metadata value that megatron-core would fail to store as ``dtype``, or
    would store as something else: a str or None, a bool where a number belongs, a float in an
    integer label, an integer outside the dtype's range.

    Raises:
        TypeError, ValueError: naming the label and the value.
    """
    if dtype == torch.bool:
        as_bool(label, value)
    elif dtype.is_floating_point:
        as_real(label, value)
    else:
        number = as_int(label, value)
        info = torch.iinfo(dtype)
        if not info.min <= number <= info.max:
            raise ValueError(
                f"{label} ({number}) does not fit the context's {dtype} "
                f"([{info.min}, {info.max}])"
            )
