# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA RoPE internals: Triton kernels, input checks and plans, launch configs and the cached launch.

Users import the drop-ins from :mod:`megatron_ext.fusions.fused_mla_yarn_rope_apply`.
"""
