# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of MLA attention over the paged latent cache in the MHA form
(megatron_ext.fusions.mla_latent.mha_form).

On CPU the plain-torch backends (``torch``: top-left causal and a separate prefix call merged by
log-sum-exp, as the cuDNN backends run; ``torch-bottom-right``: one call per context, as
FlashAttention's and Transformer Engine's) run against a float64 reference that decompresses each
request's rows page by page, and against the absorbed Triton kernel (interpreter) on the same
inputs; the refusal of bad input before any work.
"""

import numpy as np
import pytest
import torch

from megatron_ext.fusions.mla_latent import (
    mha_backends,
    mha_form,
    mla_paged_latent_attention,
)
from megatron_ext.fusions.mla_latent.mha_form import mla_paged_mha_attention
from tests.unit_tests.fusions.mla_latent.mha_testlib import (
    CHUNKED,
    CPU_BACKENDS,
    DEVICE,
    MIXED,
    PREFILL,
    SCALE,
    absorbed,
    attend,
    deepseek_step,
    flash_stand_in,
    mha_step,
    reference,
)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("requests", [PREFILL, CHUNKED, MIXED], ids=["prefill", "chunked", "mixed"])
@pytest.mark.parametrize("heads", [3, 16])
def test_steps_match_float64_and_the_absorbed_kernel(backend, requests, heads):
    step, query, cache, weight, lengths = mha_step(requests, heads, seed=heads)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, backend=backend, **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(got, absorbed(step, query, cache, weight), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("heads", [16, 128])
def test_deepseek_v3_widths_match_float64_and_the_absorbed_kernel(heads):
    """kv_lora_rank 512, qk 128, rope 64, v 128; a chunk behind a cached prefix, a fresh prefill
    and a decode, block size 64."""
    step, query, cache, weight, lengths = deepseek_step([(70, 3), (0, 4), (9, 1)], heads)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=64, **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)
    # bf16's bound between the two forms: both round their inputs; here both compute in fp32.
    torch.testing.assert_close(got, absorbed(step, query, cache, weight), rtol=1e-4, atol=1e-4)


def test_bf16_is_within_its_bound_of_float64():
    step, query, cache, weight, lengths = mha_step(CHUNKED, 4, seed=9, dtype=torch.bfloat16)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, **lengths
    )
    expected = reference(step, query, cache, weight, lengths)
    # Inputs in bf16 (8 bits), keys and values decompressed to bf16: a few 2^-8 of |out| <= ~3.
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=2**-4)


def test_padding_tokens_get_zeros_and_extra_table_rows_are_ignored():
    step, query, cache, weight, lengths = mha_step(
        MIXED, 2, seed=4, padding_requests=2, padding_tokens=5
    )
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, **lengths
    )
    assert torch.equal(got[-5:], torch.zeros_like(got[-5:]))
    torch.testing.assert_close(
        got.double(), reference(step, query, cache, weight, lengths), rtol=1e-5, atol=2e-5
    )


def test_no_tokens_gives_zeros():
    step, query, cache, weight, lengths = mha_step([(4, 0)], 2, seed=5, padding_tokens=3)
    got = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, **lengths
    )
    assert torch.equal(got, torch.zeros_like(got))


def _bad_inputs():
    step, query, cache, weight, lengths = mha_step([(5, 2), (0, 3)], 2, seed=12)
    good = dict(
        query=query,
        kv_cache=cache,
        block_table=step.block_table,
        kv_up_weight=weight,
        softmax_scale=SCALE,
        rope_dim=16,
        **lengths,
    )
    table = step.block_table
    # The arguments the absorbed kernel shares: its messages.
    yield "query list", dict(good, query=query.tolist()), TypeError, "query must be a torch.Tensor"
    yield "int query", dict(good, query=query.long()), TypeError, "query must have dtype"
    yield "4-d query", dict(good, query=query.unsqueeze(1)), ValueError, "query must be"
    yield "rope_dim not a power of two", dict(good, rope_dim=12), ValueError, "rope_dim must be"
    yield "latent width not a power of two", dict(
        good, kv_cache=torch.zeros(4, 16, 40, device=DEVICE)
    ), ValueError, "latent width"
    yield "cache dtype", dict(good, kv_cache=cache.half()), TypeError, "kv_cache is torch.float16"
    yield "2-d cache", dict(good, kv_cache=cache[0]), ValueError, "kv_cache must be"
    huge_blocks = cache[:1, :1].expand(1, 2**24 + 1, cache.shape[2])
    yield "block size", dict(good, kv_cache=huge_blocks), ValueError, "block size 16777217"
    yield "float table", dict(good, block_table=table.float()), TypeError, "block_table must"
    yield "1-d table", dict(good, block_table=table[0]), ValueError, "block_table must be"
    yield "tensor scale", dict(good, softmax_scale=torch.tensor(0.1)), TypeError, "softmax_scale"
    yield "negative scale", dict(good, softmax_scale=-1.0), ValueError, "softmax_scale must be"
    yield "nan scale", dict(good, softmax_scale=float("nan")), ValueError, "softmax_scale must be"
    yield "scale below float32", dict(good, softmax_scale=1e-300), ValueError, "normal range"
    # Finite for stage 1 (raw-unit logits), past what the MHA form's backends scale safely.
    yield "scale past the MHA form's", dict(good, softmax_scale=1e38), ValueError, "MHA form's"
    yield "table on the meta device", dict(
        good, block_table=table.to("meta")
    ), ValueError, "block_table is on meta"
    # The MHA form's own arguments.
    yield "weight dtype", dict(good, kv_up_weight=weight.double()), TypeError, "kv_up_weight"
    yield "weight width", dict(good, kv_up_weight=weight[:, :16]), ValueError, "kv_up_weight"
    yield "weight rows", dict(good, kv_up_weight=weight[:-1]), ValueError, "kv_up_weight"
    yield "no value rows", dict(good, kv_up_weight=weight[:64]), ValueError, "none left"
    yield "backend", dict(good, backend="flash-attn"), ValueError, "backend must be"
    yield "zero row budget", dict(good, row_budget=0), ValueError, "row_budget"
    yield "float row budget", dict(good, row_budget=8.0), TypeError, "row_budget"
    yield "overlap as a string", dict(good, overlap="off"), TypeError, "overlap must be a bool"
    yield "float lengths", dict(good, query_lengths=[2.0, 3.0]), TypeError, "query_lengths"
    yield "negative length", dict(good, kv_lengths=[7, -3]), ValueError, "kv_lengths must be"
    yield "length count", dict(good, kv_lengths=[7]), ValueError, "same requests"
    yield "more new than cached", dict(good, kv_lengths=[7, 2]), ValueError, "count its new"
    yield "too many tokens", dict(
        good, query_lengths=[2, 30], kv_lengths=[7, 30]
    ), ValueError, "over the"
    yield "over the table", dict(good, kv_lengths=[7, 300]), ValueError, "capacity"
    yield "no heads", dict(good, query=query[:, :0]), ValueError, "query has no heads"
    yield "query on the meta device", dict(
        good, query=query.to("meta"), kv_cache=cache.to("meta"), block_table=table.to("meta")
    ), ValueError, "meta tensor"
    yield "a cache without blocks", dict(good, kv_cache=cache[:0]), ValueError, "no blocks"
    # numpy would take these as 0/1, or wrap them negative in int64.
    yield "a bool among the lengths", dict(good, query_lengths=[True, 3]), TypeError, "query_len"
    yield "uint64 lengths past int64", dict(
        good,
        query_lengths=np.array([2**64 - 1, 3], dtype=np.uint64),
        kv_lengths=np.array([2**64 - 1, 3], dtype=np.uint64),
    ), ValueError, "below 2\\*\\*63"
    yield "lengths that require grad", dict(
        good, query_lengths=torch.tensor([2.0, 3.0], requires_grad=True)
    ), TypeError, "query_lengths must be a sequence of ints"


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda case: case[0])
def test_bad_input_is_refused_before_any_work(case, monkeypatch):
    _, kwargs, error, match = case
    calls = []
    monkeypatch.setattr(mha_form, "decompressed_keys_values", lambda *a, **k: calls.append(1))
    with pytest.raises(error, match=match):
        mla_paged_mha_attention(**kwargs)
    assert calls == []


@pytest.mark.parametrize("missing", [False, True], ids=["cpu_tensors", "operator_missing"])
@pytest.mark.parametrize("backend", ["cudnn", "cudnn-dense", "flash"])
def test_torchs_fused_operators_are_refused_where_they_cannot_run(backend, missing, monkeypatch):
    """torch's cuDNN and FlashAttention operators have CUDA kernels only: named for CPU tensors,
    or missing from this torch, the backend is refused with a ValueError that says so, before a
    plan is built."""
    step, query, cache, weight, lengths = mha_step([(5, 2), (0, 3)], 2, seed=12)
    entry = mha_backends._TORCH_ENTRIES[backend]
    if missing or getattr(mha_backends.internals, entry) is None:
        monkeypatch.setattr(mha_backends.internals, entry, None)
        match = "this torch has no operator"
    else:
        assert mha_backends.internals.is_torch_operator(getattr(mha_backends.internals, entry))
        match = "runs torch's CUDA-only operator; the query is on cpu"
    plans = []
    monkeypatch.setattr(mha_form, "mha_plan", lambda *a, **k: plans.append(a))
    with pytest.raises(ValueError, match=match):
        mla_paged_mha_attention(
            query.cpu(),
            cache.cpu(),
            step.block_table.cpu(),
            weight.cpu(),
            SCALE,
            rope_dim=16,
            backend=backend,
            **lengths,
        )
    assert plans == []


def test_a_function_in_an_operators_place_is_not_taken_for_torchs():
    assert not mha_backends.internals.is_torch_operator(lambda *a, **k: None)
    assert mha_backends.device_problem("torch", torch.device("cpu")) is None
    assert mha_backends.device_problem("te", torch.device("cpu")) is None


def test_no_requests_as_empty_lists_give_zeros():
    step, query, cache, weight, _ = mha_step([(5, 2), (0, 3)], 2, seed=12)
    out = mla_paged_mha_attention(
        query, cache, step.block_table, weight, SCALE, rope_dim=16, query_lengths=[], kv_lengths=[]
    )
    assert out.shape == (*query.shape[:2], out.shape[2]) and not out.any()


def test_int_tensors_of_lengths_give_the_lists_answer():
    step, query, cache, weight, lengths = mha_step([(5, 2), (0, 3)], 2, seed=12)
    args = (query, cache, step.block_table, weight, SCALE)
    given = {name: torch.tensor(list(value)) for name, value in lengths.items()}
    torch.testing.assert_close(
        mla_paged_mha_attention(*args, rope_dim=16, **given),
        mla_paged_mha_attention(*args, rope_dim=16, **lengths),
        rtol=0,
        atol=0,
    )


def _error(call) -> tuple:
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


def test_shared_arguments_are_refused_with_the_absorbed_kernels_messages():
    """Each shared argument's bad value raises the same type and message in both forms."""
    step, query, cache, weight, lengths = mha_step([(5, 2), (0, 3)], 2, seed=12)
    absorbed_query = torch.zeros(5, 2, 48, device=DEVICE)
    for name, value in (
        ("kv_cache", cache.half()),
        ("kv_cache", cache[0]),
        ("block_table", step.block_table.float()),
        ("softmax_scale", -1.0),
        ("softmax_scale", 1e-300),
    ):
        shared = dict(kv_cache=cache, block_table=step.block_table, softmax_scale=SCALE)
        shared[name] = value
        absorbed_error = _error(
            lambda shared=shared: mla_paged_latent_attention(
                absorbed_query,
                cu_query_lengths=step.cu_query_lengths,
                kv_lengths=step.kv_lengths,
                rope_dim=16,
                **shared,
            )
        )
        mha_error = _error(
            lambda shared=shared: mla_paged_mha_attention(
                query, kv_up_weight=weight, rope_dim=16, **shared, **lengths
            )
        )
        assert absorbed_error == mha_error, name


def test_a_step_in_one_call_returns_the_calls_output_without_a_copy(monkeypatch):
    """A fresh prefill over every token, in one bottom-right call: the result is the call's
    own output (no result allocated and copied into); with padding tokens after the requests,
    a result is allocated, the padding zeroed and the call's output copied in."""
    parts = []
    original = mha_form.varlen_attention

    def spy(*args, **kwargs):
        part, lse = original(*args, **kwargs)
        parts.append(part)
        return part, lse

    monkeypatch.setattr(mha_form, "varlen_attention", spy)
    for padding, shared in ((0, True), (3, False)):
        parts.clear()
        mha = mha_step([(0, 9)], 2, seed=4, padding_tokens=padding)
        got = attend(mha, "torch-bottom-right")
        (part,) = parts
        assert (got.data_ptr() == part.data_ptr()) == shared
        assert torch.equal(got[:9], part[:9]) and not got[9:].any()
        expected = reference(*mha)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=2e-5)


def test_a_table_past_32_bit_indices_is_refused(monkeypatch):
    """The plan's int32 table indices: a table with more entries is refused before any work
    (the limit lowered here: a real one would take 8 GB)."""
    step, query, cache, weight, lengths = mha_step([(5, 2), (0, 3)], 2, seed=12)
    monkeypatch.setattr(mha_form, "MAX_TABLE_ENTRIES", step.block_table.numel() - 1)
    calls = []
    monkeypatch.setattr(mha_form, "decompressed_keys_values", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError, match="32-bit indices"):
        mla_paged_mha_attention(
            query, cache, step.block_table, weight, SCALE, rope_dim=16, **lengths
        )
    assert calls == []


def test_a_steps_lengths_are_checked_once_and_against_every_calls_tensors(monkeypatch):
    """The checks of the lengths' own values run once per step (its other layers pass the same
    lengths); every call still checks them against its own query and block table, before any
    work, and lengths of other values (int32 halves with the same bytes) are checked anew."""
    mha = mha_step([(5, 2), (0, 3)], 2, seed=12)
    step, query, cache, weight, lengths = mha
    first = attend(mha, "torch")
    checked = []
    original = mha_form._lengths
    monkeypatch.setattr(mha_form, "_lengths", lambda *args: checked.append(args) or original(*args))
    assert torch.equal(attend(mha, "torch"), first)
    assert checked == [], "a later layer checked the step's lengths again"
    q_lens, kv_lens, _, _ = mha_form.check_mha_call(
        query, cache, step.block_table, weight, SCALE, 16, backend="torch", **lengths
    )
    assert not q_lens.flags.writeable and not kv_lens.flags.writeable  # kept: read-only

    calls = []
    monkeypatch.setattr(mha_form, "decompressed_keys_values", lambda *a, **k: calls.append(1))
    good = dict(query=query, block_table=step.block_table)
    for change, match in (
        (dict(block_table=step.block_table[:1]), "same requests"),
        (dict(query=query[:4]), "over the 4 tokens"),
        (dict(block_table=step.block_table[:, :0]), "capacity of 0 rows"),
    ):
        with pytest.raises(ValueError, match=match):
            arguments = {**good, **change, **lengths}
            mla_paged_mha_attention(
                kv_cache=cache, kv_up_weight=weight, softmax_scale=SCALE, rope_dim=16, **arguments
            )
    halves = {name: np.array(value).view(np.int32) for name, value in lengths.items()}
    assert halves["kv_lengths"].tobytes() == np.array(lengths["kv_lengths"]).tobytes()
    with pytest.raises(ValueError, match="same requests"):
        mla_paged_mha_attention(
            query, cache, step.block_table, weight, SCALE, rope_dim=16, **halves
        )
    assert calls == []


def test_a_step_in_one_strided_call_returns_a_packed_copy_of_it(monkeypatch):
    """A fresh prefill in one FlashAttention call whose values are padded to the query's head
    size: the result is the call's output without the padding columns, packed."""
    parts = []
    stand_in = flash_stand_in([])

    def operator(*args, **kwargs):
        result = stand_in(*args, **kwargs)
        parts.append(result[0])
        return result

    monkeypatch.setattr(mha_backends.internals, "flash_attention_forward", operator)
    mha = mha_step([(0, 9), (0, 4)], 2, seed=6, qk_dim=32, v_dim=16)
    got = attend(mha, "flash")
    (part,) = parts
    assert part.shape[-1] == 48 and got.shape == (13, 2, 16) and got.is_contiguous()
    assert torch.equal(got, part[..., :16])
    torch.testing.assert_close(got.double(), reference(*mha), rtol=1e-5, atol=2e-5)
