# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Input checks of the paged MLA latent cache's layout: the former import path.

The code lives in :mod:`megatron_ext.fusions.mla_latent.checks`. Kept so that a copy of an older
revision's ``mla_paged_latent_attention.py`` still imports (``scripts/compare_latent_attention.py``
loads one beside this checkout's package).
"""

from megatron_ext.fusions.mla_latent.checks import check_paged_cache, rows_of

__all__ = ["check_paged_cache", "rows_of"]
