# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Integer arithmetic for host code that sizes kernel launches.

Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions since Triton 3.6:
called from host code, each call unwraps its arguments and imports a module, a few microseconds
per call, several times per launch. These are the same results in plain Python for the host; kernels
keep Triton's.
"""

__all__ = ["cdiv", "next_power_of_2"]


def cdiv(x: int, y: int) -> int:
    """``ceil(x / y)`` for integers (``triton.cdiv``).

    Args:
        x: the dividend.
        y: the divisor, non-zero.

    Returns:
        int: the quotient rounded towards positive infinity.
    """
    return -(-x // y)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``triton.next_power_of_2`` for ``n`` >= 1).

    Args:
        n: a positive integer.

    Returns:
        int: the power of two.
    """
    return 1 << max(n - 1, 0).bit_length()
