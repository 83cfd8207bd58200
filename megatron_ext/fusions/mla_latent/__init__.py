# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The paged MLA latent cache's kernels: the RoPE + cache append, the attention in the absorbed
and in the MHA form.

One concern per module, each importing only the ones before it and the ground floor of
:mod:`megatron_ext.fusions` (``tensor_checks``, ``launch_plans``, ``direct_launch``,
``launch_math``):

* :mod:`.tile_rules`: the launch choices from static sizes (tiles, split count, stages).
* :mod:`.checks`: the host-side checks of the cache layout and of both kernels' calls.
* :mod:`.attention_kernels`: the attention's ``@triton.jit`` kernels (stage 1, split combine) and
  the kernel design.
* :mod:`.decode_gluon`: the warp-specialized decode kernel in Gluon (Hopper, Triton >= 3.7, 32
  heads or more; ``MEGATRON_EXT_MLA_GLUON_DECODE=off`` keeps stage 1), stage 1's replacement for
  decode tiles.
* :mod:`.attention_plan`: :class:`LatentAttentionPlan`, a checked call's prepared launches, and
  the choice between stage 1 and the Gluon kernel (:func:`gluon_decode_refusal`).
* :mod:`.attention`: :func:`mla_paged_latent_attention` and its plan cache.
* :mod:`.rope_cache_append`: the RoPE + append kernel, its plan and
  :func:`fused_mla_rope_cache_append`.
* :mod:`.mha_rows`, :mod:`.mha_dense`, :mod:`.mha_backends`, :mod:`.mha_chunks`,
  :mod:`.mha_merge`, :mod:`.mha_gather`, :mod:`.mha_plan`, :mod:`.mha_weights`: the MHA form's
  row arithmetic, its dense cuDNN calls, its ragged attention backends, its chunks of rows, the
  merge of their partial attentions and the gather of cache rows through the block table (kernels
  on CUDA), a step's plan and the decompression weights' layout.
* :mod:`.mha_form`: :func:`mla_paged_mha_attention`, the same attention in the MHA form
  (decompressed keys and values, dense ragged attention on FlashAttention, cuDNN, Transformer
  Engine or torch).

``megatron_ext.fusions.mla_paged_latent_attention`` and
``megatron_ext.fusions.fused_mla_rope_cache_append`` re-export the entries for older imports.
"""

from megatron_ext.fusions.mla_latent.attention import ATTENTION_PLANS, mla_paged_latent_attention
from megatron_ext.fusions.mla_latent.attention_kernels import COMBINE_LAUNCHES, STAGE1_LAUNCHES
from megatron_ext.fusions.mla_latent.attention_plan import (
    GLUON_DECODE_ENV,
    LatentAttentionPlan,
    gluon_decode_refusal,
    plan_for_call,
)
from megatron_ext.fusions.mla_latent.checks import check_paged_cache, rows_of
from megatron_ext.fusions.mla_latent.mha_form import mla_paged_mha_attention
from megatron_ext.fusions.mla_latent.rope_cache_append import (
    APPEND_LAUNCHES,
    APPEND_PLANS,
    TOKENS_PER_PROGRAM,
    fused_mla_rope_cache_append,
)
from megatron_ext.fusions.mla_latent.tile_rules import (
    MAX_KV_SPLITS,
    SEQ_BLOCK,
    CombineTile,
    TileShape,
    combine_tile,
    default_num_kv_splits,
    head_tile,
    page_tiles,
    pipeline_stages,
    tile_shape,
)

__all__ = [
    "APPEND_LAUNCHES",
    "APPEND_PLANS",
    "ATTENTION_PLANS",
    "COMBINE_LAUNCHES",
    "GLUON_DECODE_ENV",
    "MAX_KV_SPLITS",
    "SEQ_BLOCK",
    "STAGE1_LAUNCHES",
    "TOKENS_PER_PROGRAM",
    "CombineTile",
    "LatentAttentionPlan",
    "TileShape",
    "check_paged_cache",
    "combine_tile",
    "default_num_kv_splits",
    "fused_mla_rope_cache_append",
    "gluon_decode_refusal",
    "head_tile",
    "mla_paged_latent_attention",
    "mla_paged_mha_attention",
    "page_tiles",
    "pipeline_stages",
    "plan_for_call",
    "rows_of",
    "tile_shape",
]
