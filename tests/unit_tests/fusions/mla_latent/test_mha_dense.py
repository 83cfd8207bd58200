# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the dense cuDNN calls (megatron_ext.fusions.mla_latent.mha_dense) with a stand-in for
torch's operator: square causal sequences batched by length (views where back to back), any
lengths with the mask as a bias (views where they fill the batch), the groups built once per
lengths. Their GPU runs are in test_mha_backends.py (the fused backends against float64)."""

import math

import numpy as np
import pytest
import torch

from megatron_ext.fusions.mla_latent import mha_backends, mha_dense, mha_form
from tests.unit_tests.fusions.mla_latent.mha_testlib import dense_backend


def test_cudnn_dense_takes_equal_back_to_back_prefills_as_views(monkeypatch):
    """Two fresh prefills of one bucketed length: one dense call over views of the packed
    rows (no padded copies); a third of another length gets its own call."""
    seen = []
    dense_backend(monkeypatch, seen)
    q = torch.randn(2 * 32 + 5, 2, 24, dtype=torch.float64)
    k, v = torch.randn_like(q), torch.randn(q.shape[0], 2, 8, dtype=torch.float64)
    lengths = np.array([32, 32, 5])
    out, lse = mha_form.varlen_attention(
        "cudnn-dense", q, k, v, (lengths, lengths), "top_left", 0.3, True
    )
    assert sorted((b, n) for b, n, _, _ in seen) == [(1, 16), (2, 32)]
    views = [ptr for b, n, ptr, _ in seen if n == 32]
    assert views == [q.untyped_storage().data_ptr()]
    want, want_lse = mha_backends.torch_varlen(q, k, v, lengths, lengths, "top_left", 0.3)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)


def test_cudnn_dense_refuses_a_causal_call_that_is_not_square(monkeypatch):
    dense_backend(monkeypatch)
    q = torch.randn(4, 2, 24, dtype=torch.float64)
    k, v = torch.randn(6, 2, 24, dtype=torch.float64), torch.randn(6, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="square sequences only"):
        mha_form.varlen_attention(
            "cudnn-dense", q, k, v, (np.array([4]), np.array([6])), "top_left", 0.3, True
        )


def test_dense_groups_are_built_once_per_lengths():
    """A step's layers call with the same lengths: one grouping (and one index copy) for all;
    back-to-back full sequences are views, others gathered through an index."""
    cpu = torch.device("cpu")
    lengths = np.array([32, 32, 5, 0, 6])
    groups = mha_dense.dense_groups(lengths, cpu)
    assert mha_dense.dense_groups(lengths.copy(), cpu) is groups
    by_length = {g.length: g for g in groups}
    assert sorted(by_length) == [16, 32]
    assert by_length[32].rows == slice(0, 64) and by_length[32].index is None
    short = by_length[16]
    assert short.rows is None and (short.count, short.batch) == (2, 2)
    # Rows 64..68 and 69..74 (the empty sequence has none) to places 0..4 and 16..21.
    assert short.index[0].tolist() == list(range(64, 75))
    assert short.index[1].tolist() == list(range(0, 5)) + list(range(16, 22))
    assert mha_dense.dense_groups(np.array([32, 32]), cpu) is not groups


def test_masked_groups_mask_bottom_right_and_are_built_once():
    """A chunk of 2 new tokens on 3 rows and a square 3: grouped by bucketed lengths, the bias
    0 where a query attends (bottom-right), -inf elsewhere; padding queries attend the first
    key; a sequence without keys left out; one build per lengths."""
    cpu = torch.device("cpu")
    q_lens, k_lens = np.array([2, 3, 4]), np.array([3, 3, 0])
    groups = mha_dense.masked_groups(q_lens, k_lens, True, cpu, torch.float32)
    assert mha_dense.masked_groups(q_lens, k_lens, True, cpu, torch.float32) is groups
    (group,) = groups  # both live sequences bucket to (16, 16)
    assert (group.query_length, group.key_length, group.batch) == (16, 16, 2)
    allowed = group.bias[:, 0] == 0
    assert allowed[0, 0, :3].tolist() == [True, True, False]  # query 0 of 2 sits at row 1
    assert allowed[0, 1, :3].tolist() == [True, True, True]
    assert allowed[1, :3, :3].tolist() == torch.ones(3, 3).tril().bool().tolist()
    assert allowed[0, 2:].sum(-1).tolist() == [1] * 14 and allowed[0, 2:, 0].all()
    assert not allowed[:, :, 3:].any()
    # Packed rows 0-1 and 2-4 to batch places 0-1 and 16-18; keys 0-2 and 3-5 likewise.
    assert group.queries.tolist() == [[0, 1, 2, 3, 4], [0, 1, 16, 17, 18]]
    assert group.keys.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 16, 17, 18]]
    unmasked = mha_dense.masked_groups(q_lens, k_lens, False, cpu, torch.float32)
    assert unmasked is not groups and (unmasked[0].bias[0, 0, :2, :3] == 0).all()


def test_dense_masked_calls_match_plain_torch_with_a_keyless_sequence(monkeypatch):
    dense_backend(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    q_lens, k_lens = np.array([2, 3, 4]), np.array([5, 3, 0])
    q = torch.randn(9, 2, 24, generator=gen, dtype=torch.float64)
    k = torch.randn(8, 2, 24, generator=gen, dtype=torch.float64)
    v = torch.randn(8, 2, 8, generator=gen, dtype=torch.float64)
    for causal in ("bottom_right", None):
        out, lse = mha_form.varlen_attention(
            "cudnn-dense", q, k, v, (q_lens, k_lens), causal, 0.3, True
        )
        want, want_lse = mha_backends.torch_varlen(q, k, v, q_lens, k_lens, causal, 0.3)
        torch.testing.assert_close(out[:5], want[:5], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:5], want_lse[:5].float(), rtol=1e-6, atol=1e-6)
        assert not out[5:].any() and (lse[5:] == -math.inf).all()


def test_dense_masked_calls_take_full_back_to_back_sequences_as_views(monkeypatch):
    """A chunk of 16 new tokens on 32 rows (both buckets): the batch is a view of the packed
    query, key and value rows (no gathered copies); the result plain torch's."""
    seen = []
    dense_backend(monkeypatch, seen)
    gen = torch.Generator().manual_seed(8)
    q_lens, k_lens = np.array([16]), np.array([32])
    q = torch.randn(16, 2, 24, generator=gen, dtype=torch.float64)
    k = torch.randn(32, 2, 24, generator=gen, dtype=torch.float64)
    v = torch.randn(32, 2, 8, generator=gen, dtype=torch.float64)
    (group,) = mha_dense.masked_groups(q_lens, k_lens, True, q.device, q.dtype)
    assert group.query_rows == slice(0, 16) and group.key_rows == slice(0, 32)
    out, lse = mha_form.varlen_attention(
        "cudnn-dense", q, k, v, (q_lens, k_lens), "bottom_right", 0.3, True
    )
    assert [(b, n, ptr, masked) for b, n, ptr, masked in seen] == [
        (1, 16, q.untyped_storage().data_ptr(), True)
    ]
    want, want_lse = mha_backends.torch_varlen(q, k, v, q_lens, k_lens, "bottom_right", 0.3)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)
    # Two sequences of a group, the second not full: gathered.
    (gathered,) = mha_dense.masked_groups(
        np.array([16, 12]), np.array([32, 30]), True, q.device, q.dtype
    )
    assert gathered.query_rows is None and gathered.key_rows is None
