# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MLA serving benchmark's bytes and FLOP models and its paged steps."""

import torch

from megatron_ext.bench import mla_serving_cases as cases


def test_decode_bytes_minimum_is_each_row_once_plus_query_and_output():
    nbytes = cases.step_bytes(cases.decode_requests(2, 100), heads=128)
    assert nbytes["cache"] == 2 * 100 * 576 * 2
    assert nbytes["query"] == 2 * 128 * 576 * 2 and nbytes["output"] == 2 * 128 * 512 * 2
    assert nbytes["minimum"] == nbytes["cache"] + nbytes["query"] + nbytes["output"]
    # 16-bit decode reads the rows once per tile of 64 heads.
    assert nbytes["head_tiles"] == 2
    assert nbytes["kernel"] == 2 * nbytes["cache"] + nbytes["query"] + nbytes["output"]
    assert cases.step_bytes(cases.decode_requests(1, 10), heads=17)["head_tiles"] == 1
    # fp32 decode and prefill keep 16-head tiles.
    assert cases.step_bytes(cases.decode_requests(1, 10), heads=32, elt=4)["head_tiles"] == 2
    assert cases.step_bytes([(0, 8)], heads=128)["head_tiles"] == 8


def test_the_largest_decode_row_fits_a_gpu():
    nbytes = cases.step_bytes(cases.decode_requests(128, 32768), heads=128)
    assert 4.8e9 < nbytes["cache"] < 4.9e9


def test_flops_count_only_attended_pairs():
    # 3 new tokens on an empty cache attend 1 + 2 + 3 rows; 2 on 5 cached attend 6 + 7.
    per_pair = 2 * (576 + 512)
    assert cases.step_flops([(0, 3)], heads=1) == 6 * per_pair
    assert cases.step_flops([(5, 2)], heads=4) == 4 * 13 * per_pair
    assert cases.step_flops(cases.decode_requests(3, 10), heads=2) == 2 * 30 * per_pair


def test_append_bytes():
    # latent 512 + k_pe 64 + cos and sin 2 x 64 read, 576 written, in bf16; 3 int64 indices.
    assert cases.append_bytes(1) == (512 + 64 + 128 + 576) * 2 + 24
    assert cases.append_bytes(10, index_bytes=4) == 10 * ((512 + 64 + 128 + 576) * 2 + 12)


def test_steps_have_shuffled_pages_and_megatron_core_metadata():
    step = cases.build_step(
        [(100, 1), (30, 5)], 4, latent=32, rope=16, block_size=16, dtype=torch.float32, device="cpu"
    )
    assert step.cu_query_lengths.tolist() == [0, 1, 6]
    assert step.kv_lengths.tolist() == [101, 35] and step.max_query_len == 5
    assert step.block_table.dtype == torch.int32 and step.block_table.shape == (2, 7)
    assert step.block_table[1, 3:].tolist() == [-1] * 4
    used = step.block_table[step.block_table >= 0]
    assert used.unique().numel() == used.numel() == 7 + 3
    assert used[:7].tolist() != sorted(used[:7].tolist())  # not contiguous, not ordered
    assert step.query.shape == (6, 4, 48) and step.kv_cache.shape == (13, 16, 48)


def test_attention_reference_is_causal_within_a_chunk():
    step = cases.build_step(
        [(3, 4)], 2, latent=16, rope=16, block_size=16, dtype=torch.float32, device="cpu"
    )
    out = cases.attention_reference(step, 0.1)
    # The first new token (position 3) sees rows 0..3 only: changing row 5 leaves it alone.
    step.kv_cache[step.block_table[0, 0], 5] += 10.0
    changed = cases.attention_reference(step, 0.1)
    assert torch.equal(out[:2], changed[:2]) and not torch.equal(out[2:], changed[2:])
