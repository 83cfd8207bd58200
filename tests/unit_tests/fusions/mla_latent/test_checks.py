# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the paged latent cache's layout checks (megatron_ext.fusions.mla_latent.checks)."""

import pytest
import torch

from megatron_ext.fusions.mla_latent import checks


def test_token_rows_accept_unit_middle_dimensions():
    assert checks.rows_of("x", torch.zeros(5, 1, 8)) == (5, 8, 8)
    assert checks.rows_of("x", torch.zeros(5, 12)[:, :8]) == (5, 12, 8)
    with pytest.raises(ValueError, match=r"x must be \[tokens, width\]"):
        checks.rows_of("x", torch.zeros(5, 2, 8))
    with pytest.raises(ValueError, match="unit stride"):
        checks.rows_of("x", torch.zeros(8, 5).t())


def test_paged_cache_must_be_three_dimensional():
    assert checks.check_paged_cache("c", torch.zeros(3, 16, 8), torch.device("cpu")) == (3, 16, 8)
    with pytest.raises(ValueError, match="c must be"):
        checks.check_paged_cache("c", torch.zeros(1, 3, 16, 8), torch.device("cpu"))
    with pytest.raises(ValueError, match="block size >= 1"):
        checks.check_paged_cache("c", torch.zeros(3, 0, 8), torch.device("cpu"))
