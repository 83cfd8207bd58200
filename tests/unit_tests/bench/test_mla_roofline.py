# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The decode step's roofline (megatron_ext.bench.mla_roofline): bytes and FLOPs of a tiny model
counted by hand, the head-tile passes, and the bound."""

import pytest

from megatron_ext.bench import mla_roofline

# hidden 8, 2 heads, q rank 4, latent 4, qk 2 + RoPE 2, v 2, MLP 32, vocabulary 10, 2 layers.
HEADS = dict(num_attention_heads=2, qk_head_dim=2, qk_pos_emb_head_dim=2, v_head_dim=2)
TINY = dict(num_layers=2, hidden_size=8, q_lora_rank=4, kv_lora_rank=4, vocab_size=10, **HEADS)


def test_bytes_and_flops_of_a_tiny_model_by_hand():
    # Two requests attending to 3 and 5 rows, one head per attention program (2 passes).
    cost = mla_roofline.decode_step_cost(TINY, [3, 5], itemsize=2, head_tile=1)
    # Per layer, weights: input norm 8, q_down 8x4 = 32, q norm 4, q_up 4x2x(2+2) = 32,
    # kv_down 8x(4+2) = 48, kv norm 4, kv_up 4x2x(2+2) = 32, proj 2x2x8 = 32, MLP norm 8,
    # fc1 8x32 = 256, fc2 256: 712. Final norm 8, output layer 80, 2 embedding rows 16.
    assert cost["weight_bytes"] == (2 * 712 + 8 + 80 + 16) * 2
    # Per layer: (3 + 5) rows x 2 passes read and 2 new rows written, 6 wide.
    assert cost["cache_bytes"] == 2 * (8 * 2 + 2) * 6 * 2
    # Per token and layer, GEMM inputs + outputs: q_down 12, q_up 12, kv_down 14, the absorbed
    # key projection 4 + 8, value projection 8 + 4, proj 12, fc1 40, fc2 40; attention query
    # 2x6 read and output 2x4 written: 174. Output layer 8 + 10 per token.
    assert cost["activation_bytes"] == (2 * 174 + 18) * 2 * 2
    assert cost["bytes"] == cost["weight_bytes"] + cost["cache_bytes"] + cost["activation_bytes"]
    # Per token and layer, 2 x multiply-adds: 32 + 32 + 48 + 2x2x4 + 2x4x2 + 32 + 256 + 256
    # = 688; output 80.
    assert cost["gemm_flops"] == 2 * 2 * (2 * 688 + 80)
    # Per layer: 8 rows x 2 heads x 2 x (2 x 4 + 2).
    assert cost["attention_flops"] == 2 * 8 * 2 * 2 * 10
    assert cost["flops"] == 6464 and cost["bytes"] == 4952
    assert cost["head_passes"] == 2
    # Every head in one program: the rows are read once.
    assert mla_roofline.decode_step_cost(TINY, [3, 5], head_tile=2)["cache_bytes"] == (
        2 * (8 + 2) * 6 * 2
    )


def test_the_kernels_decode_tile_sets_the_passes():
    dsv3 = dict(TINY, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512)
    # bf16 decode: tiles of 64 heads, so 128 heads read each row twice; fp32: tiles of 16.
    assert mla_roofline.decode_step_cost(dsv3, [4])["head_passes"] == 2
    assert mla_roofline.decode_step_cost(dsv3, [4], itemsize=4)["head_passes"] == 8
    # Ranks default as the model builder's: hidden // 2 and hidden // 4.
    bare = {k: v for k, v in TINY.items() if k not in ("q_lora_rank", "kv_lora_rank")}
    assert mla_roofline.decode_step_cost(bare, [3, 5], head_tile=1) == (
        mla_roofline.decode_step_cost(dict(TINY, kv_lora_rank=2), [3, 5], head_tile=1)
    )
    for bad in ([], [0, 3]):
        with pytest.raises(ValueError):
            mla_roofline.decode_step_cost(TINY, bad)


def test_the_bound_is_the_larger_of_memory_and_compute():
    cost = {"bytes": 4e9, "flops": 1e12}
    memory = mla_roofline.roofline(cost, 0.004, 2e12, 1e15)  # 2 ms of copies, 1 ms of GEMMs
    assert memory["bound_by"] == "memory" and memory["bound_ms"] == pytest.approx(2.0)
    assert memory["compute_ms"] == pytest.approx(1.0)
    assert memory["achieved"] == pytest.approx(0.5)
    compute = mla_roofline.roofline(cost, 0.004, 4e12, 2.5e14)  # 1 ms of copies, 4 ms of GEMMs
    assert compute["bound_by"] == "compute" and compute["achieved"] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        mla_roofline.roofline(cost, 0.0, 1.0, 1.0)
