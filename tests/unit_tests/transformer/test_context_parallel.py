# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron-core's load-balanced context-parallel layout (the all-gather runs in
test_sdpa_attention.py's two-process tests)."""

import pytest

from megatron_ext.transformer.context_parallel import cp_chunk_positions


def test_cp_chunk_positions_layout_and_odd_length():
    # 16 tokens, cp 2: chunks of 4; rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
    assert cp_chunk_positions(8, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert cp_chunk_positions(8, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="local_len must be even"):
        cp_chunk_positions(7, 2, 0)
