# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA's key RoPE and the paged latent-cache append: the former import path, kept for existing
imports.

The code lives in :mod:`megatron_ext.fusions.mla_latent.rope_cache_append` (its checks in
:mod:`megatron_ext.fusions.mla_latent.checks`). Import from there; this module re-exports the
public name it had.
"""

from megatron_ext.fusions.mla_latent import fused_mla_rope_cache_append

__all__ = ["fused_mla_rope_cache_append"]
