# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The host-side launch arithmetic equals Triton's."""

import triton

from megatron_ext.fusions.launch_math import cdiv, next_power_of_2


def test_next_power_of_2_equals_triton_s():
    for n in list(range(1, 4100)) + [2**31 - 1, 2**31, 2**31 + 1, 2**40 + 3]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n


def test_cdiv_equals_triton_s():
    for x in list(range(0, 300)) + [2**31 + 5, 2**40]:
        for y in (1, 2, 3, 16, 64, 132):
            assert cdiv(x, y) == triton.cdiv(x, y), (x, y)
