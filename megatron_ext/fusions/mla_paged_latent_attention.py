# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Paged attention over MLA's latent cache: the former import path, kept for existing imports.

The code lives in the package :mod:`megatron_ext.fusions.mla_latent`: the entry in
:mod:`~megatron_ext.fusions.mla_latent.attention`, the kernels and their design in
:mod:`~megatron_ext.fusions.mla_latent.attention_kernels`, the tile rules in
:mod:`~megatron_ext.fusions.mla_latent.tile_rules`. Import from there; this module re-exports
the public names it had.
"""

from megatron_ext.fusions.mla_latent import (
    MAX_KV_SPLITS,
    CombineTile,
    TileShape,
    combine_tile,
    default_num_kv_splits,
    head_tile,
    mla_paged_latent_attention,
    page_tiles,
    pipeline_stages,
    tile_shape,
)

__all__ = [
    "MAX_KV_SPLITS",
    "CombineTile",
    "combine_tile",
    "default_num_kv_splits",
    "TileShape",
    "head_tile",
    "mla_paged_latent_attention",
    "page_tiles",
    "pipeline_stages",
    "tile_shape",
]
