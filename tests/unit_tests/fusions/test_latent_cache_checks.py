# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the input checks shared by the paged latent-cache kernels
(megatron_ext.fusions.latent_cache_checks). The kernels' own refusals are tested with them."""

import pytest
import torch

from megatron_ext.fusions import latent_cache_checks as checks


def test_overlap_is_found_between_views_of_one_allocation_only():
    buffer = torch.zeros(100)
    assert checks.overlaps(buffer[:50], buffer[49:])
    assert not checks.overlaps(buffer[:50], buffer[50:])
    assert not checks.overlaps(torch.zeros(10), torch.zeros(10))
    assert not checks.overlaps(buffer[:0], buffer)  # nothing to overlap
    rows = buffer.view(10, 10)
    # Column slices of the same rows interleave: their spans intersect, which is refused.
    assert checks.overlaps(rows[:, :5], rows[:, 5:])


def test_disjoint_check_names_the_input():
    buffer = torch.zeros(64)
    with pytest.raises(ValueError, match="out overlaps second"):
        checks.check_disjoint("out", buffer[:8], [("first", buffer[8:16]), ("second", buffer[4:])])
    checks.check_disjoint("out", buffer[:8], [("first", buffer[8:16])])


def test_outputs_whose_elements_share_memory_are_refused():
    with pytest.raises(ValueError, match="share memory"):
        checks.check_no_self_overlap("out", torch.zeros(1, 4).expand(3, 4))
    checks.check_no_self_overlap("out", torch.zeros(3, 8)[:, :4])  # a strided view is fine


def test_token_rows_accept_unit_middle_dimensions():
    assert checks.rows_of("x", torch.zeros(5, 1, 8)) == (5, 8, 8)
    assert checks.rows_of("x", torch.zeros(5, 12)[:, :8]) == (5, 12, 8)
    with pytest.raises(ValueError, match=r"x must be \[tokens, width\]"):
        checks.rows_of("x", torch.zeros(5, 2, 8))
    with pytest.raises(ValueError, match="unit stride"):
        checks.rows_of("x", torch.zeros(8, 5).t())


def test_index_vectors_must_be_contiguous_int_vectors_of_the_token_count():
    checks.check_index_vector("idx", torch.zeros(4, dtype=torch.int32), 4, torch.device("cpu"))
    with pytest.raises(TypeError, match="idx must have dtype"):
        checks.check_index_vector("idx", torch.zeros(4), 4, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"idx must have shape \(4,\)"):
        checks.check_index_vector("idx", torch.zeros(5, dtype=torch.long), 4, torch.device("cpu"))


def test_paged_cache_must_be_three_dimensional():
    assert checks.check_paged_cache("c", torch.zeros(3, 16, 8), torch.device("cpu")) == (3, 16, 8)
    with pytest.raises(ValueError, match="c must be"):
        checks.check_paged_cache("c", torch.zeros(1, 3, 16, 8), torch.device("cpu"))
    with pytest.raises(ValueError, match="block size >= 1"):
        checks.check_paged_cache("c", torch.zeros(3, 0, 8), torch.device("cpu"))


def test_cpu_tensors_are_refused_outside_the_interpreter(monkeypatch):
    monkeypatch.setattr(checks, "INTERPRETED", False)
    with pytest.raises(ValueError, match="f: x is on cpu.*TRITON_INTERPRET=1"):
        checks.check_runnable("f", "x", torch.zeros(1))
