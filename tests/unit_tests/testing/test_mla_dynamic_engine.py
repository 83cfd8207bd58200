# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The dynamic-engine MLA harness: the recorded rows name the right requests and positions, and
the teacher-forced comparison finds a wrong row."""

import pytest
import torch
from megatron.core.inference.sampling_params import SamplingParams

from megatron_ext import undo_megatron_ext
from megatron_ext.inference.contexts.static_slices_context_base import UPSTREAM_HAS_ACTIVE_SLICES
from megatron_ext.testing import small_mla_gpt
from megatron_ext.testing.mla_dynamic_engine import (
    TINY_MLA_SIZES,
    build_dynamic_mla_model,
    build_mla_dynamic_engine,
    teacher_forced_errors,
)
from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel, run_engine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The context sizes every engine here is built with.
ENGINE_SIZES = dict(
    max_requests=4,
    max_tokens=64,
    max_sequence_length=TINY_MLA_SIZES["max_sequence_length"],
    block_size_tokens=16,
    kv_blocks=16,
)


@pytest.fixture
def generation():
    """Three requests generated through the engine; (model, requests, outputs, wrapper)."""
    with cpu_torch_compat():
        ensure_model_parallel()
        model = build_dynamic_mla_model(TINY_MLA_SIZES, torch.float32, DEVICE)
        engine, _, wrapper = build_mla_dynamic_engine(
            model,
            **ENGINE_SIZES,
        )
        params = dict(
            num_tokens_to_generate=3,
            termination_id=-1,
            top_k=1,
            return_log_probs=True,
            skip_prompt_log_probs=True,
        )
        requests = [(list(range(1, 1 + n)), SamplingParams(**params)) for n in (4, 9, 2)]
        outputs, _ = run_engine(engine, requests)
        yield model, requests, outputs, wrapper
    undo_megatron_ext()


def test_rows_name_each_request_and_position(generation):
    _, requests, outputs, wrapper = generation
    seen = {(row.request_id, row.position) for row in wrapper.rows}
    for request_id, (prompt, _) in enumerate(requests):
        generated = len(outputs[request_id]["generated_tokens"])
        # The row that chose each generated token: the prompt's last position, then each new one.
        expected = {(request_id, len(prompt) - 1 + i) for i in range(generated)}
        assert expected <= seen, (request_id, sorted(seen))
    assert wrapper.steps == max(row.step for row in wrapper.rows) + 1
    assert any(row.decode_only for row in wrapper.rows)


def test_teacher_forced_errors_find_a_wrong_row(generation):
    model, requests, outputs, wrapper = generation
    sequences = {i: requests[i][0] + outputs[i]["generated_tokens"] for i in outputs}
    reference = small_mla_gpt.float64_copy(model, device=DEVICE, **TINY_MLA_SIZES)
    clean = teacher_forced_errors(wrapper.rows, reference, sequences)
    assert clean["rows"] == len(wrapper.rows) and not clean["argmax_mismatches"]
    assert clean["max_abs_error"] < 1e-4 * clean["largest_abs_logit"]
    wrong = wrapper.rows[-1]
    wrong.logits = wrong.logits.flip(0)
    found = teacher_forced_errors(wrapper.rows, reference, sequences)
    assert found["worst"] == (wrong.step, wrong.request_id, wrong.position)
    assert found["max_abs_error"] > 0.1 * found["largest_abs_logit"]


def test_recording_wrapper_generates_as_megatron_cores(generation):
    """The harness's wrapper runs the forward megatron-core's GPTInferenceWrapper runs: the same
    tokens and log-probs, bitwise."""
    model, requests, outputs, _ = generation
    with cpu_torch_compat():
        engine, _, wrapper = build_mla_dynamic_engine(
            model,
            **ENGINE_SIZES,
            megatron_wrapper=True,
        )
        assert type(wrapper).__name__ == "GPTInferenceWrapper"
        theirs, _ = run_engine(engine, requests)
    for request_id, ours in outputs.items():
        assert theirs[request_id]["generated_tokens"] == ours["generated_tokens"], request_id
        assert theirs[request_id]["generated_log_probs"] == ours["generated_log_probs"], request_id


@pytest.mark.skipif(
    not UPSTREAM_HAS_ACTIVE_SLICES,
    reason="megatron-core 0.16's context takes the dtype it is given (the weights')",
)
def test_config_dtype_other_than_the_weights_is_refused_on_0_19():
    """megatron-core 0.19 allocates the latent cache in the config's params_dtype: a model cast
    after it was built (fp32 config, bf16 weights) is refused before the context is made."""
    with cpu_torch_compat():
        ensure_model_parallel()
        model = build_dynamic_mla_model(TINY_MLA_SIZES, torch.float32, DEVICE).to(torch.bfloat16)
        try:
            with pytest.raises(ValueError, match="params_dtype=torch.float32 but its weights"):
                build_mla_dynamic_engine(
                    model,
                    **ENGINE_SIZES,
                )
        finally:
            undo_megatron_ext()
