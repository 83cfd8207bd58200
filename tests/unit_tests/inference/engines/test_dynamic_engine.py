# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Unit tests of megatron_ext.inference.engines.dynamic_engine: the engine's wrapped methods take
out exactly the failed requests' rows, and leave engines around megatron-core's own context
alone. The end-to-end runs (a refused request failed when it enters, a request whose logits are
not finite failed mid-run, the others finishing) are in
text_generation_controllers/test_text_generation_controller.py."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.inference.inference_request import DynamicInferenceRequest
from megatron.core.inference.sampling_params import SamplingParams

import megatron_ext.inference as inference_switch
from megatron_ext.inference.engines import dynamic_engine


def _result(ids, **extra):
    rows = len(ids)
    result = {
        "active_request_ids": torch.tensor(ids, dtype=torch.int32),
        "finished_request_ids": torch.tensor([ids[0], ids[2]], dtype=torch.int32),
        "sample": torch.arange(rows) * 10,
        "log_probs": [[float(r)] for r in range(rows)],
        "top_n_logprobs": {1: "one", 2: "two", 3: "three"},
        "cuda_graph_request_count": 8,
    }
    result.update(extra)
    return result


@pytest.mark.parametrize("line", ["0.16", "0.19"])
def test_the_failed_rows_leave_every_per_row_entry(line):
    ids = [5, 9, 2, 7]
    extra = {}
    if line == "0.19":
        extra = dict(accepted_tokens=None, finished_routing_block_ids={5: [1], 2: [3, 4]})
    result = _result(ids, **extra)
    kept = dynamic_engine._without_requests(result, {2: "why", 9: "why"})
    assert kept["active_request_ids"].tolist() == [5, 7]
    assert kept["sample"].tolist() == [0, 30]
    assert kept["log_probs"] == [[0.0], [3.0]]
    assert kept["top_n_logprobs"] == {1: "three"}  # re-keyed by the new row
    assert kept["finished_request_ids"].tolist() == [5]
    assert kept["cuda_graph_request_count"] == 8
    if line == "0.19":
        assert kept["accepted_tokens"] is None
        assert kept["finished_routing_block_ids"] == {5: [1]}
    # The engine's own result is not modified.
    assert result["active_request_ids"].tolist() == ids and len(result["log_probs"]) == 4


def test_the_flag_switches_the_engines_failure_path():
    assert not dynamic_engine.engine_fails_requests()
    inference_switch.enable_static_active_slices()
    try:
        assert dynamic_engine.engine_fails_requests()
    finally:
        inference_switch.disable_static_active_slices()
    assert not dynamic_engine.engine_fails_requests()


def test_engines_around_megatron_cores_own_context_are_unchanged():
    """Only the extension's context refuses requests; megatron-core's keeps its behaviour."""
    request = DynamicInferenceRequest(
        request_id=1,
        prompt_tokens=torch.tensor([1, 2]),
        sampling_params=SamplingParams(top_k=5, top_p=0.9),
    )
    calls = []
    wrapped = dynamic_engine.checked_add_request(lambda engine, req: calls.append(req) or "future")
    assert wrapped(SimpleNamespace(context=object()), request) == "future"
    assert calls == [request] and request.status is None and request.events == []
