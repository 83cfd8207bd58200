# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Helpers of the tests that drive megatron-core's engine with the inference flag applied:
adding requests, stepping to the end, and reading a request's outcome."""

import contextlib
from typing import Any, Dict, Iterator, List, Tuple

from megatron.core.inference.inference_request import DynamicInferenceEventType, Status
from megatron.core.inference.sampling_params import SamplingParams

import megatron_ext.inference as inference_switch

__all__ = [
    "add_to_engine",
    "completed",
    "failure_reason",
    "inference_flag",
    "run_engine_records",
    "step_until_done",
]


@contextlib.contextmanager
def inference_flag() -> Iterator[None]:
    """The inference flag's patches of megatron-core (its engine fails single requests)."""
    inference_switch.enable_static_active_slices()
    try:
        yield
    finally:
        inference_switch.disable_static_active_slices()


def add_to_engine(engine, requests: Dict[int, Tuple[List[int], SamplingParams]]) -> None:
    """Add the requests (id -> prompt, params) through megatron-core's ``add_request``."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, list(prompt), params)


def run_engine_records(engine, requests: Dict[int, Tuple[List[int], SamplingParams]]):
    """Add the requests (id -> prompt, params), step until all are done; every request's merged
    record by id."""
    add_to_engine(engine, requests)
    return step_until_done(engine, set(requests))


def step_until_done(engine, request_ids) -> Dict[int, Any]:
    """Step the engine until it holds nothing and every id in ``request_ids`` has finished;
    each finished request's merged record by id."""
    records = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests() and set(records) >= request_ids:
            break
        result = engine.step_modern()
        for record in result["finished_request_records"]:
            request = record.merge() if hasattr(record, "merge") else record
            records[request.request_id] = request
    assert set(records) == request_ids, "the engine did not finish every request"
    return records


def failure_reason(request) -> str:
    """The message of the request's non-transient error event (it must have exactly one)."""
    assert request.status == Status.FAILED, request.status
    errors = [
        e.payload for e in request.events if e.type == DynamicInferenceEventType.ERROR_NONTRANSIENT
    ]
    assert len(errors) == 1, request.events
    assert errors[0].request_id == request.request_id and not errors[0].is_transient
    return errors[0].message


def completed(request) -> bool:
    """Whether the request finished normally."""
    return request.status == Status.COMPLETED
