# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The latent-cache package's public names, and the former import paths that re-export them."""

import importlib

from megatron_ext.fusions import mla_latent


def test_the_package_exports_what_it_lists():
    for name in mla_latent.__all__:
        assert getattr(mla_latent, name) is not None, name
        assert not name.startswith("_"), name


def test_the_former_import_paths_re_export_the_package_objects():
    for former in (
        "megatron_ext.fusions.mla_paged_latent_attention",
        "megatron_ext.fusions.fused_mla_rope_cache_append",
        "megatron_ext.fusions.latent_cache_checks",
    ):
        module = importlib.import_module(former)
        assert module.__all__, former
        for name in module.__all__:
            assert getattr(module, name) is getattr(mla_latent, name), (former, name)
