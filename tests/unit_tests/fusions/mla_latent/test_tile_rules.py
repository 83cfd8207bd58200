# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the latent attention's launch choices (megatron_ext.fusions.mla_latent.tile_rules):
the tiles, the key-tile addressing, the pipelining stages and stage 2's tile, from static sizes."""

import pytest
import torch

from megatron_ext.fusions.mla_latent import MAX_KV_SPLITS, pipeline_stages, tile_rules


def test_combine_tile_from_heads_and_splits_only():
    tile = tile_rules.combine_tile
    assert tuple(tile(16, 512, 16)) == (8, 64)  # 16 splits: half the heads keep 64 values
    assert tuple(tile(16, 512, 4)) == (16, 64)
    assert tuple(tile(128, 512, 2)) == (16, 64)
    assert tuple(tile(16, 512, MAX_KV_SPLITS)) == (2, 64)
    assert tuple(tile(3, 32, 3)) == (4, 32)  # a narrow latent is one column tile
    assert tuple(tile(1, 512, 64)) == (1, 64)
    for heads in (1, 3, 16, 40, 128):
        for splits in range(2, MAX_KV_SPLITS + 1):
            block_h, block_d = tile(heads, 512, splits)
            assert block_h & (block_h - 1) == 0 and 512 % block_d == 0
            assert block_h * block_d * splits <= tile_rules.COMBINE_IN_FLIGHT or block_h == 1


def test_one_block_id_per_key_tile_where_tiles_fill_pages_and_it_was_faster(monkeypatch):
    decode_16 = tile_rules.tile_shape(64, 16, 512, 1, fp32=False)  # (1, 16, 32, 4)
    decode_32 = tile_rules.tile_shape(64, 32, 512, 1, fp32=False)  # (1, 32, 64, 8)
    decode_128 = tile_rules.tile_shape(64, 128, 512, 1, fp32=False)  # (1, 64, 32, 8)
    prefill = tile_rules.tile_shape(2048, 128, 512, 2048, fp32=False)  # (4, 16, 32, 8)
    fp32_decode = tile_rules.tile_shape(64, 16, 512, 1, fp32=True)  # 16-key tiles
    assert tile_rules.page_tiles(64, decode_16) and tile_rules.page_tiles(256, decode_16)
    assert not tile_rules.page_tiles(16, decode_16)  # a 32-key tile spans two 16-row pages
    assert not tile_rules.page_tiles(48, decode_16)
    assert tile_rules.page_tiles(16, fp32_decode)
    assert tile_rules.page_tiles(64, decode_32) and tile_rules.page_tiles(256, decode_32)
    assert not tile_rules.page_tiles(32, decode_32)  # a 64-key tile spans two 32-row pages
    assert not tile_rules.page_tiles(64, prefill)  # 8 warps off decode: not measured
    # The 64-head decode tile of 8 warps: per-row ids before Triton 3.9, one id per tile from it.
    monkeypatch.setattr(tile_rules, "TRITON_RELEASE", (3, 7))
    assert not tile_rules.page_tiles(64, decode_128)
    monkeypatch.setattr(tile_rules, "TRITON_RELEASE", (3, 9))
    assert tile_rules.page_tiles(64, decode_128) and not tile_rules.page_tiles(16, decode_128)


def test_the_triton_release_is_the_installed_one(monkeypatch):
    import triton

    assert tile_rules.TRITON_RELEASE == tuple(int(x) for x in triton.__version__.split(".")[:2])
    monkeypatch.setattr(triton, "__version__", "3.10.0+git1234abcd")
    assert tile_rules.triton_release() == (3, 10)
    monkeypatch.setattr(triton, "__version__", "not a version")
    assert tile_rules.triton_release() == (0, 0)  # the older releases' choices


def test_three_pipeline_stages_only_where_the_shared_memory_holds_them():
    assert pipeline_stages(227 * 1024) == 3  # H100, H200
    assert pipeline_stages(163 * 1024) == 2  # A100: the widest tile's 3 stages would not fit
    assert pipeline_stages(99 * 1024) == 2
    assert pipeline_stages(None) == 2  # a torch without the property: the smaller choice


def test_head_tiles_are_wide_only_for_16_bit_decode():
    assert tile_rules.head_tile(128, decode=True, fp32=False) == 64
    assert tile_rules.head_tile(40, decode=True, fp32=False) == 64
    assert tile_rules.head_tile(32, decode=True, fp32=False) == 32
    assert tile_rules.head_tile(3, decode=True, fp32=False) == 16  # a tensor-core tile at least
    assert tile_rules.head_tile(128, decode=True, fp32=True) == 16
    assert tile_rules.head_tile(128, decode=False, fp32=False) == 16
    assert tile_rules.head_tile(3, decode=False, fp32=False) == 4  # tokens fill the tile
    # The whole stage-1 tile: (BLOCK_Q, BLOCK_H, BLOCK_N, warps).
    assert tuple(tile_rules.tile_shape(64, 128, 512, 1, fp32=False)) == (1, 64, 32, 8)
    assert tuple(tile_rules.tile_shape(64, 128, 512, 1, fp32=True)) == (1, 16, 16, 4)
    # 32 heads: 64-key steps where 3 stages of them fit, 32 otherwise.
    assert tuple(tile_rules.tile_shape(64, 32, 512, 1, fp32=False)) == (1, 32, 64, 8)
    assert tuple(tile_rules.tile_shape(64, 32, 512, 1, fp32=False, num_stages=2)) == (1, 32, 32, 8)
    assert tuple(tile_rules.tile_shape(64, 32, 512, 1, fp32=True)) == (1, 16, 16, 4)
    assert tuple(tile_rules.tile_shape(64, 32, 512, 4, fp32=False)) == (4, 16, 32, 8)
    assert tuple(tile_rules.tile_shape(2048, 128, 512, 2048, fp32=False)) == (4, 16, 32, 8)
    assert tuple(tile_rules.tile_shape(5, 3, 32, None, fp32=True)) == (8, 4, 16, 4)


@pytest.mark.gpu
def test_gpu_hopper_gets_three_pipeline_stages():
    """torch reports the shared memory a block may opt into, so a Hopper GPU runs 3 stages (a
    torch without the property would fall back to 2 without a word)."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("checked on Hopper, whose blocks may use 227 KiB of shared memory")
    device = torch.device("cuda", torch.cuda.current_device())
    assert tile_rules.launch_limits(device).stages == 3
