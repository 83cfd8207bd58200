# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""cos_sin_table: megatron-core's get_cached_cos_sin values, computed once and never rewritten."""

import threading

import pytest
import torch
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

from megatron_ext.transformer.rotary_tables import cos_sin_table


@pytest.fixture
def rotary(cpu_current_device):
    return YarnRotaryEmbedding(
        64, scaling_factor=40.0, original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tables_are_megatron_cores_bitwise(rotary, dtype):
    cos, sin = cos_sin_table(rotary, 96, dtype, torch.device("cpu"))
    expected_cos, expected_sin = rotary.get_cached_cos_sin(96, dtype=dtype)
    assert cos.dtype == dtype and cos.shape == expected_cos.shape
    assert torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)


def test_tables_are_built_once_and_not_rewritten(rotary):
    cos, sin = cos_sin_table(rotary, 64, torch.float32, "cpu")
    first = cos.clone()
    # Another length and dtype (megatron-core's own cache would be rebuilt in place).
    cos_sin_table(rotary, 128, torch.bfloat16, "cpu")
    again, _ = cos_sin_table(rotary, 64, torch.float32, torch.device("cpu"))
    assert again is cos and torch.equal(cos, first)


def test_threads_get_one_table(rotary):
    seen = []
    threads = [
        threading.Thread(
            target=lambda: seen.append(cos_sin_table(rotary, 80, torch.float16, "cpu")[0])
        )
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8 and all(table is seen[0] for table in seen)
