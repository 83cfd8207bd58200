# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The stand-in for Transformer Engine's TELinear in megatron-core's MLA module without TE."""

import unittest.mock

import pytest
import torch
from megatron.core.extensions import transformer_engine as mcore_te
from megatron.core.transformer import multi_latent_attention as mcore_mla

from megatron_ext import patches
from megatron_ext.extensions.transformer_engine import AbsentTELinear, is_mock_te_linear


@pytest.fixture(autouse=True)
def _te_free_mla_undone():
    patches.undo_patches(patches.TE_FREE_MLA)
    yield
    patches.undo_patches(patches.TE_FREE_MLA)


def test_only_megatron_core_mock_counts_as_a_mock():
    assert is_mock_te_linear(unittest.mock.MagicMock())
    assert not is_mock_te_linear(torch.nn.Linear)
    assert not is_mock_te_linear(None)
    assert not any(isinstance(m, AbsentTELinear) for m in (torch.nn.Linear(2, 2), object()))


def test_te_free_mla_replaces_only_the_mock_and_undo_restores_it():
    if mcore_te.HAVE_TE:
        pytest.skip("Transformer Engine is installed: megatron-core's TELinear is TE's class")
    have_te, te_linear = mcore_mla.HAVE_TE, mcore_mla.TELinear
    mocked = is_mock_te_linear(te_linear)  # 0.16; 0.19's MLA module holds None
    assert patches.apply_patches(patches.TE_FREE_MLA)
    assert bool(patches.applied_extensions()[patches.TE_FREE_MLA]) is mocked
    assert (mcore_mla.TELinear is AbsentTELinear) is mocked
    if mocked:
        assert not isinstance(torch.nn.Linear(2, 2), mcore_mla.TELinear)
    assert mcore_mla.HAVE_TE is have_te  # never written
    patches.undo_patches(patches.TE_FREE_MLA)
    assert mcore_mla.TELinear is te_linear and mcore_mla.HAVE_TE is have_te
