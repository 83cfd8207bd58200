# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the dense cuDNN calls (megatron_ext.fusions.mla_latent.mha_dense) with a stand-in for
torch's operator: square causal sequences batched by length (views where back to back), any
lengths unmasked with the keys' padding masked by a bias (views where they fill the batch), the
groups built once per lengths. Their GPU runs are in test_mha_backends.py (the fused backends
against float64).
"""

import math

import numpy as np
import pytest
import torch

from megatron_ext.fusions.mla_latent import mha_backends, mha_dense, mha_form
from megatron_ext.fusions.mla_latent.mha_rows import bucket
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
    assert sorted((b, n) for b, n, _, _, _ in seen) == [(1, 16), (2, 32)]
    views = [ptr for b, n, ptr, _, _ in seen if n == 32]
    assert views == [q.untyped_storage().data_ptr()]
    want, want_lse = mha_backends.torch_varlen(q, k, v, lengths, lengths, "top_left", 0.3)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 170, 1023, 4096, 100_003])
def test_bucket_pieces_sum_to_the_count_in_a_few_buckets(count):
    pieces = mha_dense.bucket_pieces(count)
    assert sum(pieces) == count
    assert all(p == bucket(p, minimum=1) for p in pieces)
    assert list(pieces) == sorted(pieces, reverse=True)
    # Each piece leaves less than a quarter of what it took from (m * 2**k, m >= 4).
    assert len(pieces) <= max(1, count.bit_length())
    if count == bucket(count, minimum=1):
        assert pieces == ((count,) if count else ())


@pytest.mark.parametrize("count, error", [(-1, ValueError), (True, TypeError), (2.0, TypeError)])
def test_bucket_pieces_refuse_a_count_that_is_not_a_size(count, error):
    with pytest.raises(error, match="count must be"):
        mha_dense.bucket_pieces(count)


def test_cudnn_dense_takes_a_count_between_buckets_as_views(monkeypatch):
    """Nine fresh prefills of one length back to back (9 is between the buckets 8 and 10): two
    dense calls, of 8 and 1 sequences, both views of the packed rows (no padded batch gathered
    into zeroed buffers); the result and log-sum-exps plain torch's, every row written."""
    seen = []
    dense_backend(monkeypatch, seen)
    gen = torch.Generator().manual_seed(3)
    lengths = np.array([16] * 9)
    q = torch.randn(144, 2, 24, generator=gen, dtype=torch.float64)
    k = torch.randn(144, 2, 24, generator=gen, dtype=torch.float64)
    v = torch.randn(144, 2, 8, generator=gen, dtype=torch.float64)
    groups = mha_dense.dense_groups(lengths, q.device)
    assert [(g.count, g.batch, g.rows, g.index) for g in groups] == [
        (8, 8, slice(0, 128), None),
        (1, 1, slice(128, 144), None),
    ]
    out, lse = mha_form.varlen_attention(
        "cudnn-dense", q, k, v, (lengths, lengths), "top_left", 0.3, True
    )
    assert [(b, n) for b, n, _, _, _ in seen] == [(8, 16), (1, 16)]
    assert {ptr for _, _, ptr, _, _ in seen} == {q.untyped_storage().data_ptr()}
    want, want_lse = mha_backends.torch_varlen(q, k, v, lengths, lengths, "top_left", 0.3)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)
    # Padding rows past the lengths still come back as zeros and -inf.
    padded_q = torch.cat([q, q.new_ones(5, 2, 24)])
    out, lse = mha_form.varlen_attention(
        "cudnn-dense", padded_q, k, v, (lengths, lengths), "top_left", 0.3, True
    )
    torch.testing.assert_close(out[:144], want, rtol=1e-12, atol=1e-12)
    assert not out[144:].any() and (lse[144:] == -math.inf).all()


def test_square_calls_write_into_a_given_output_and_refuse_a_wrong_one(monkeypatch):
    """Given an output, the groups write the result there (padding rows zeroed) and return it;
    one of another shape or dtype is refused before any call."""
    seen = []
    dense_backend(monkeypatch, seen)
    gen = torch.Generator().manual_seed(4)
    lengths = np.array([16] * 3)
    q = torch.randn(50, 2, 24, generator=gen, dtype=torch.float64)
    k, v = torch.randn_like(q), torch.randn(50, 2, 8, generator=gen, dtype=torch.float64)
    given = torch.full((50, 2, 8), float("nan"), dtype=torch.float64)
    out, lse = mha_dense.square_causal_attention(q, k, v, lengths, 0.3, True, out=given)
    assert out is given
    want, want_lse = mha_backends.torch_varlen(q, k, v, lengths, lengths, "top_left", 0.3)
    torch.testing.assert_close(out[:48], want[:48], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse[:48], want_lse[:48].float(), rtol=1e-6, atol=1e-6)
    assert not out[48:].any() and (lse[48:] == -math.inf).all()
    calls = len(seen)
    for wrong in (given[:49], given.float()):
        with pytest.raises(ValueError, match="out must be"):
            mha_dense.square_causal_attention(q, k, v, lengths, 0.3, True, out=wrong)
    # An output over the queries' memory, or with elements that share memory: refused too.
    on_q = q[..., :8]
    with pytest.raises(ValueError, match="out overlaps q"):
        mha_dense.square_causal_attention(q, k, v, lengths, 0.3, True, out=on_q)
    folded = torch.zeros(16, dtype=torch.float64).as_strided((50, 2, 8), (0, 8, 1))
    with pytest.raises(ValueError, match="has elements that"):
        mha_dense.square_causal_attention(q, k, v, lengths, 0.3, True, out=folded)
    assert len(seen) == calls


def test_a_batch_view_is_the_sliced_reshaped_and_transposed_rows():
    """One view of packed rows as [batch, heads, length, width] holds the rows that slicing,
    reshaping and transposing give, with their strides, also for rows that are not packed
    contiguously (a narrower part of each row)."""
    wide = torch.arange(40 * 3 * 10, dtype=torch.float32).view(40, 3, 10)
    for packed in (wide, wide[..., 2:8]):
        got = mha_dense._batch(packed, 5, 4, 8)
        want = packed[5:37].unflatten(0, (4, 8)).transpose(1, 2)
        assert got.shape == want.shape == (4, 3, 8, packed.shape[2])
        assert got.stride() == want.stride() and torch.equal(got, want)


@pytest.mark.parametrize(
    "causal, keys, message",
    [("top_left", 6, "square sequences only"), ("bottom_right", 4, "bottom_right call")],
    ids=["top_left_not_square", "bottom_right"],
)
def test_cudnn_dense_refuses_the_causal_calls_its_plan_never_makes(
    monkeypatch, causal, keys, message
):
    """Its plan is top-left: a causal call that is not square, or one aligned bottom-right (even
    square), is named and refused."""
    dense_backend(monkeypatch)
    q = torch.randn(4, 2, 24, dtype=torch.float64)
    k = torch.randn(keys, 2, 24, dtype=torch.float64)
    v = torch.randn(keys, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=message):
        mha_form.varlen_attention(
            "cudnn-dense", q, k, v, (np.array([4]), np.array([keys])), causal, 0.3, True
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


def test_unmasked_groups_mask_only_the_keys_padding_and_are_built_once():
    """Chunks of 2 and 3 queries over 3 rows: grouped by bucketed lengths, the bias 0 on each
    sequence's keys and -inf on the padding after them (no causal mask); padding queries
    attend the first key; a sequence without keys left out; one build per lengths."""
    cpu = torch.device("cpu")
    q_lens, k_lens = np.array([2, 3, 4]), np.array([3, 3, 0])
    groups = mha_dense.unmasked_groups(q_lens, k_lens, cpu, torch.float32)
    assert mha_dense.unmasked_groups(q_lens, k_lens, cpu, torch.float32) is groups
    (group,) = groups  # both live sequences bucket to (16, 16)
    assert (group.query_length, group.key_length, group.batch) == (16, 16, 2)
    allowed = group.bias[:, 0] == 0
    assert allowed[0, :2, :3].all() and allowed[1, :3, :3].all()
    assert allowed[0, 2:].sum(-1).tolist() == [1] * 14 and allowed[0, 2:, 0].all()
    assert not allowed[:, :, 3:].any()
    # Packed rows 0-1 and 2-4 to batch places 0-1 and 16-18; keys 0-2 and 3-5 likewise.
    assert group.queries.tolist() == [[0, 1, 2, 3, 4], [0, 1, 16, 17, 18]]
    assert group.keys.tolist() == [[0, 1, 2, 3, 4, 5], [0, 1, 2, 16, 17, 18]]
    # Keys that fill their bucket (however many queries): no bias.
    (full,) = mha_dense.unmasked_groups(np.array([2, 3]), np.array([16, 16]), cpu, torch.float32)
    assert full.bias is None and full.batch == 2


def test_dense_unmasked_calls_match_plain_torch_with_a_keyless_sequence(monkeypatch):
    dense_backend(monkeypatch)
    gen = torch.Generator().manual_seed(7)
    for k_lens in (np.array([5, 3, 0]), np.array([16, 16, 0])):
        q_lens = np.array([2, 3, 4])
        q = torch.randn(9, 2, 24, generator=gen, dtype=torch.float64)
        k = torch.randn(int(k_lens.sum()), 2, 24, generator=gen, dtype=torch.float64)
        v = torch.randn(int(k_lens.sum()), 2, 8, generator=gen, dtype=torch.float64)
        out, lse = mha_form.varlen_attention(
            "cudnn-dense", q, k, v, (q_lens, k_lens), None, 0.3, True
        )
        want, want_lse = mha_backends.torch_varlen(q, k, v, q_lens, k_lens, None, 0.3)
        torch.testing.assert_close(out[:5], want[:5], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:5], want_lse[:5].float(), rtol=1e-6, atol=1e-6)
        assert not out[5:].any() and (lse[5:] == -math.inf).all()


def test_dense_unmasked_calls_take_full_back_to_back_sequences_as_views(monkeypatch):
    """16 queries over 32 rows (both buckets): the batch is a view of the packed query, key and
    value rows (no gathered copies) and runs without a bias; the result plain torch's."""
    seen = []
    dense_backend(monkeypatch, seen)
    gen = torch.Generator().manual_seed(8)
    q_lens, k_lens = np.array([16]), np.array([32])
    q = torch.randn(16, 2, 24, generator=gen, dtype=torch.float64)
    k = torch.randn(32, 2, 24, generator=gen, dtype=torch.float64)
    v = torch.randn(32, 2, 8, generator=gen, dtype=torch.float64)
    (group,) = mha_dense.unmasked_groups(q_lens, k_lens, q.device, q.dtype)
    assert group.query_rows == slice(0, 16) and group.key_rows == slice(0, 32)
    out, lse = mha_form.varlen_attention("cudnn-dense", q, k, v, (q_lens, k_lens), None, 0.3, True)
    assert seen == [(1, 16, q.untyped_storage().data_ptr(), False, False)]
    want, want_lse = mha_backends.torch_varlen(q, k, v, q_lens, k_lens, None, 0.3)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse.float(), rtol=1e-6, atol=1e-6)
    # Two sequences of a group, the second not full: gathered.
    (gathered,) = mha_dense.unmasked_groups(
        np.array([16, 12]), np.array([32, 30]), q.device, q.dtype
    )
    assert gathered.query_rows is None and gathered.key_rows is None
