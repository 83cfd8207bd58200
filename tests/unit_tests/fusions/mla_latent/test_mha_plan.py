# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the MHA form's step plan (megatron_ext.fusions.mla_latent.mha_plan): built once per
step's lengths and shared by the layers, each layer still getting its own answer."""

import numpy as np
import torch

from megatron_ext.fusions.mla_latent import mha_backends, mha_form, mha_plan
from tests.unit_tests.fusions.mla_latent.mha_testlib import (
    MIXED,
    attend,
    mha_step,
    reference,
)


def _plan(q_lens, kv_lens, backend="torch", budget=6144):
    return mha_plan.mha_plan(
        np.array(q_lens), np.array(kv_lens), backend, budget, 16, 8, torch.device("cpu")
    )


def test_a_steps_plan_is_built_once_and_followed_by_its_lengths():
    mha_plan.MHA_PLANS.clear()
    first = _plan([3, 5], [7, 5])
    assert _plan([3, 5], [7, 5]) is first
    assert len(mha_plan.MHA_PLANS) == 1
    # Other lengths, budget or backend: another plan.
    assert _plan([3, 5], [8, 5]) is not first
    assert _plan([3, 5], [7, 5], budget=4) is not first
    assert _plan([3, 5], [7, 5], backend="flash") is not first


def test_a_plan_lays_out_rows_tokens_and_calls():
    """Top-left (``torch``): a chunked request's prefix attended unmasked, its new rows causal;
    each row's table place and place in its block; the tokens merged where two calls take
    them."""
    plan = _plan([2, 3], [6, 3])
    assert plan.used == 5 and not plan.direct
    (chunk,) = plan.chunks
    # Section 0: request 0's 4 cached rows; section 1: its 2 new rows, then request 1's 3.
    places = chunk.rows[0].tolist()
    assert places == [0, 0, 0, 0, 0, 0, 8, 8, 8]  # request * 8 columns + position // 16
    assert chunk.rows[1].tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    prefix, diagonal = chunk.calls
    assert prefix.causal is None and prefix.tokens == slice(0, 2) and prefix.rows == slice(0, 4)
    assert diagonal.causal == "top_left" and diagonal.tokens == slice(0, 5)
    assert [c.tolist() for c in diagonal.lengths] == [[2, 3], [2, 3]]
    # The diagonal call is every token's last: its merge writes the answers.
    assert (prefix.last, diagonal.last, plan.merges_write_out) == (False, True, True)
    # The prefix call holds 2 of the 5 tokens: it cannot stand as the accumulator.
    assert not plan.first_seeds


def test_which_first_calls_stand_as_the_accumulator():
    """A chunk's prefix call that holds every token, followed by calls that each write their
    tokens' answers and between them hold every token: its output is the accumulator."""
    one = _plan([4], [10])
    assert [c.tokens for c in one.chunks[0].calls] == [slice(0, 4), slice(0, 4)]
    assert one.first_seeds
    assert _plan([4, 2], [10, 7]).first_seeds  # both requests have a prefix
    # A fresh prefill's one call is direct: nothing to merge.
    assert not _plan([4], [4]).first_seeds
    # Request 1 has no prefix: the prefix call holds only request 0's tokens.
    assert not _plan([4, 2], [10, 2]).first_seeds
    # Under a budget of 4 rows, 10 rows span chunks whose calls merge into the accumulator.
    split = _plan([4], [10], budget=4)
    calls = [c for chunk in split.chunks for c in chunk.calls]
    assert not all(c.last for c in calls[1:]) and not split.first_seeds


def test_a_first_call_standing_as_the_accumulator_gives_the_same_bits(monkeypatch):
    """A step whose plan seeds the accumulator with its first call's output against the same
    step merging that output into an accumulator first: the same bits, one merge fewer and no
    accumulator of its own."""
    mha = mha_step([(12, 5), (30, 2)], 3, seed=4)
    assert mha_plan.mha_plan(
        np.array([5, 2]), np.array([12, 30]), "torch", 6144, 16, 8, torch.device("cpu")
    ).first_seeds
    merges = []
    merge = mha_form.merge_partials_into
    monkeypatch.setattr(
        mha_form, "merge_partials_into", lambda *a: merges.append(len(a)) or merge(*a)
    )
    seeded = attend(mha, "torch")
    seeded_merges, merges[:] = list(merges), []
    mha_plan.MHA_PLANS.clear()
    build = mha_plan._build
    monkeypatch.setattr(mha_plan, "_build", lambda *a: build(*a)._replace(first_seeds=False))
    merged = attend(mha, "torch")
    mha_plan.MHA_PLANS.clear()
    assert torch.equal(seeded, merged), "seeding the accumulator moved the answers' bits"
    # Two calls: one merge (reading the first call's output) against two (the first into the
    # step's own accumulator).
    assert len(seeded_merges) == 1 and len(merges) == 2, (seeded_merges, merges)
    torch.testing.assert_close(seeded.double(), reference(*mha), rtol=1e-5, atol=2e-5)


def test_which_merges_write_the_answers():
    """A call writes its tokens' answers only where none of them is in a later call and every
    token's last call is such a call; otherwise every call merges into the accumulator."""
    assert mha_plan._last_calls([np.array([0, 1]), np.array([0, 1, 2])], 3) == [False, True]
    # Token 2's last call (the second) also holds token 0, which the third takes again.
    calls = [np.array([0, 1, 2]), np.array([0, 2]), np.array([0, 1])]
    assert mha_plan._last_calls(calls, 3) == [False, False, False]
    # A token in no call: nothing may skip the cast.
    assert mha_plan._last_calls([np.array([0])], 2) == [False]
    # Under a budget of 4 rows request 0's 6 rows span two chunks; the flags hold per call.
    plan = _plan([2, 3], [6, 3], budget=4)
    calls = [c for chunk in plan.chunks for c in chunk.calls]
    assert len(plan.chunks) == 3 and plan.merges_write_out == any(c.last for c in calls)


def test_layers_sharing_a_plan_get_their_own_answers():
    """Two layers of one step (same lengths, other caches and weights) through one plan: each
    matches its float64 reference."""
    mha_plan.MHA_PLANS.clear()
    for seed in (1, 2):
        mha = mha_step(MIXED, 3, seed=seed)
        got = attend(mha, "torch")
        torch.testing.assert_close(got.double(), reference(*mha), rtol=1e-5, atol=2e-5)
    assert len(mha_plan.MHA_PLANS) == 1, "the second layer planned the step again"


def test_threads_sharing_the_caches_get_their_own_answers():
    """Threads stepping at once (one model, several engines): each step's plan and each
    weight's layout come from the shared caches, every answer its own step's."""
    import threading

    steps = [mha_step(requests, 2, seed=seed) for seed, requests in enumerate([MIXED, [(3, 4)]])]
    expected = [reference(*step) for step in steps]
    failures = []

    def work(index):
        for _ in range(5):
            got = attend(steps[index % 2], "torch")
            if not torch.allclose(got.double(), expected[index % 2], rtol=1e-5, atol=2e-5):
                failures.append(index)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def test_a_plan_keeps_each_fused_calls_metadata(monkeypatch):
    """A fused backend's calls carry their packed-sequence metadata, built once with the plan
    (views of the offsets on the device, the bucketed maxima); for the cuDNN backend laid out by
    whether cuDNN takes empty sequences, which is part of the plan's key."""
    nine = ([2 + 3 * i for i in range(9)], [9 + 10 * i for i in range(9)])
    for backend in ("flash", "cudnn"):
        for call in _plan(*nine, backend=backend).chunks[0].calls:
            built = mha_backends.ragged_metadata(backend, *call.lengths, call.offsets)
            assert call.ragged[2:] == built[2:]
            for kept, fresh in zip(call.ragged[:2], built[:2]):
                assert kept.data_ptr() == fresh.data_ptr() and torch.equal(kept, fresh)
    assert _plan(*nine, backend="torch").chunks[0].calls[0].ragged is None
    sequences = {}
    for supported in (True, False):
        monkeypatch.setattr(mha_backends, "empty_sequences_supported", lambda s=supported: s)
        call, *_ = _plan(*nine, backend="cudnn").chunks[0].calls
        sequences[supported] = len(call.ragged.cu_q) - 1
    assert sequences == {True: 10, False: 9}
