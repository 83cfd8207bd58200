# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MLA serving benchmark's MHA-form operands and FLOP counts: both forms start from one
query, and the FLOPs are the forms' own."""

import torch

from megatron_ext.bench import mla_serving_cases as cases
from megatron_ext.bench import mla_serving_forms as forms
from megatron_ext.transformer.mla_prefill import absorbed_request_count

SMALL = dict(latent=32, rope=16, block_size=16, dtype=torch.float32, device="cpu")


def test_the_absorbed_query_is_the_mha_query_through_w_uk():
    step = cases.build_step([(20, 1), (3, 9)], 4, seed=3, **SMALL)
    rope_part = step.query[..., 32:].clone()
    mha = forms.mha_step(step, 4, seed=1)
    assert mha.query.shape == (10, 4, forms.QK_HEAD + 16)
    assert mha.weight.shape == (4 * (forms.QK_HEAD + forms.V_HEAD), 32)
    w_uk = mha.weight.view(4, -1, 32)[:, : forms.QK_HEAD]
    absorbed = torch.einsum("thd,hdc->thc", mha.query[..., : forms.QK_HEAD], w_uk)
    torch.testing.assert_close(step.query[..., :32], absorbed, rtol=1e-5, atol=1e-5)
    assert torch.equal(step.query[..., 32:], rope_part)
    assert torch.equal(mha.query[..., forms.QK_HEAD :], rope_part)
    assert mha.query_lengths.tolist() == [1, 9] and mha.kv_lengths.tolist() == [21, 12]
    widths = (32, 16, forms.QK_HEAD, forms.V_HEAD)
    assert mha.split == absorbed_request_count(mha.query_lengths, mha.kv_lengths, 4, widths)
    assert mha.split_tokens == int(mha.query_lengths[: mha.split].sum())


def test_flops_are_each_forms_own():
    requests, heads = [(4095, 1), (1024, 512)], 16
    step = cases.build_step(requests, heads, latent=32, rope=16, block_size=64, device="cpu")
    mha = forms.mha_step(step, heads)
    latent, rope = cases.LATENT, cases.ROPE
    # The absorbed FLOPs are the benchmark's own count of an absorbed call.
    assert forms.absorbed_flops(mha, heads, latent, rope, 2) == cases.step_flops(requests, heads)
    pairs = 512 * 1024 + 512 * 513 // 2
    mha_part = heads * (pairs * 640 + 1536 * 2 * 512 * 256)
    decode = cases.step_flops(requests[:1], heads)
    assert forms.mha_flops(mha, heads, latent, rope, 1) == decode + mha_part
    assert forms.mha_flops(mha, heads, latent, rope, 0) == (
        heads * (4096 * 640 + 4096 * 2 * 512 * 256) + mha_part
    )
