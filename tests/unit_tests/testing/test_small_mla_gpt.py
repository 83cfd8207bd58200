# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The small MLA GPT of the static-inference functional case, generating on CPU (fp32, Triton
interpreter): the flag's generation agrees with megatron-core's unfused path and with float64, and
the float64 check would see a wrong position."""

import pytest
import torch

from megatron_ext.testing import small_mla_gpt
from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel
from megatron_ext.transformer import multi_latent_attention as ext_mla

SIZES = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=2,
    vocab_size=128,
    max_sequence_length=16,
    init_method_std=0.2,
    device="cpu",
)


@pytest.fixture
def cpu_stack():
    if torch.cuda.is_available():
        pytest.skip("the GPU runs this model in the functional case (bf16 and fp32)")
    with cpu_torch_compat():
        ensure_model_parallel()
        yield
    from megatron_ext import undo_megatron_ext

    undo_megatron_ext()


def generate(mode, prompts, new_tokens=4):
    model = small_mla_gpt.build_small_mla_gpt(mode, dtype=torch.float32, **SIZES)
    generation = small_mla_gpt.greedy_generate(model, prompts, new_tokens)
    reference = small_mla_gpt.float64_copy(model, **SIZES)
    logits = small_mla_gpt.float64_step_logits(reference, generation.tokens, prompts.shape[1])
    return generation, logits


def test_flag_on_generates_as_megatron_core_unfused(cpu_stack):
    prompts = small_mla_gpt.prompts_for(2, 6, SIZES["vocab_size"], 0, "cpu")
    generations, references = {}, {}
    for mode in small_mla_gpt.MODES:
        generations[mode], references[mode] = generate(mode, prompts)
    summary = small_mla_gpt.summarise(generations, references)
    assert summary["tokens_equal"]
    assert torch.equal(generations["on"].tokens[:, :6], prompts)
    assert generations["on"].step_logits.shape == (4, 2, SIZES["vocab_size"])
    assert len(generations["on"].decode_seconds) == 3
    for error in summary["max_abs_logit_error"].values():
        assert error < 1e-4 * summary["largest_abs_logit"]


def test_float64_check_sees_a_decode_step_rotated_at_the_wrong_position(cpu_stack, monkeypatch):
    prompts = small_mla_gpt.prompts_for(2, 6, SIZES["vocab_size"], 0, "cpu")
    right, right_reference = generate("on", prompts)
    rows_from = ext_mla._step_rotary_embedding
    # Every step rotated as if it started at position 0 (what megatron-core's fused path would do).
    monkeypatch.setattr(
        ext_mla, "_step_rotary_embedding", lambda rotary, offset, *rest: rows_from(rotary, 0, *rest)
    )
    wrong, wrong_reference = generate("on", prompts)
    errors = {
        name: float((gen.step_logits.double() - ref).abs().max())
        for name, gen, ref in (("right", right, right_reference), ("wrong", wrong, wrong_reference))
    }
    assert errors["wrong"] > 1e3 * errors["right"]


def test_bad_requests_are_refused_before_any_forward(cpu_stack):
    with pytest.raises(ValueError, match="mode must be one of"):
        small_mla_gpt.build_small_mla_gpt("fused", dtype=torch.float32, **SIZES)
    model = small_mla_gpt.build_small_mla_gpt("off", dtype=torch.float32, **SIZES)
    prompts = small_mla_gpt.prompts_for(1, 12, SIZES["vocab_size"], 0, "cpu")
    with pytest.raises(ValueError, match="exceed max_sequence_length 16"):
        small_mla_gpt.greedy_generate(model, prompts, 5)
    with pytest.raises(ValueError, match="at least one new token"):
        small_mla_gpt.greedy_generate(model, prompts, 0)


def test_the_float64_copy_leaves_the_flags_as_they_were(cpu_stack):
    """Building the reference (megatron-core's own MLA) must not undo the flags: an engine built
    after it would otherwise run megatron-core's context and controller, not megatron_ext's."""
    from megatron_ext import applied_megatron_ext

    model = small_mla_gpt.build_small_mla_gpt("on", dtype=torch.float32, **SIZES)
    before = applied_megatron_ext()
    assert before["mla_rope_contiguous_load"]
    reference = small_mla_gpt.float64_copy(model, **SIZES)
    assert applied_megatron_ext() == before
    assert next(reference.parameters()).dtype == torch.float64
