# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The order of a bookkeeping graph's capture, on the CPU with recording stand-ins for torch's
CUDA streams and graphs: the warm-up and the capture run on one side stream, the caller's stream
waits for the capture before anything else (the first replay must not overtake torch's reset of
the generators' offsets on the capture stream), no garbage collection runs during the capture,
and a generator leaves the warm-up as it was and is registered with the graph."""

import contextlib
import gc

import pytest
import torch

from megatron_ext.inference.contexts import graph_replay


class _Stream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(f"{self.name} waits for {other.name}")


class _Graph:
    def __init__(self, log):
        self.log, self.generators = log, []

    def register_generator_state(self, generator):
        self.generators.append(generator)


class _Log(list):
    """What happened, in order; ``body`` logs the stream it runs on."""


@pytest.fixture
def cuda_log(monkeypatch):
    """torch.cuda's streams and graphs replaced by stand-ins that log what happens on which
    stream; yields the log."""
    log = _Log()
    current = _Stream("current", log)
    on = [current]

    @contextlib.contextmanager
    def stream(s):
        on.append(s)
        try:
            yield
        finally:
            on.pop()

    @contextlib.contextmanager
    def graph(g, pool=None, stream=None, capture_error_mode="global"):
        log.append(f"capture begins on {stream.name} ({capture_error_mode}, gc {gc.isenabled()})")
        on.append(stream)
        try:
            yield
        finally:
            on.pop()
            log.append(f"capture ends (gc {gc.isenabled()})")

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: _Stream("side", log))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: _Graph(log))
    log.body = lambda: log.append(f"body on {on[-1].name}")
    return log


def test_capture_runs_on_the_side_stream_and_the_caller_waits_for_it(cuda_log):
    assert gc.isenabled()
    graph_replay.capture_graph(cuda_log.body, torch.device("cuda"))
    assert cuda_log == [
        "side waits for current",
        "body on side",  # the warm-up
        "current waits for side",
        "capture begins on side (thread_local, gc False)",
        "body on side",
        "capture ends (gc False)",
        "current waits for side",  # before the first replay, on the current stream
    ]
    assert gc.isenabled()


def test_garbage_collection_comes_back_after_a_failed_capture(cuda_log):
    def body():
        if any(entry.startswith("capture begins") for entry in cuda_log):
            raise RuntimeError("operation not permitted when stream is capturing")

    with pytest.raises(RuntimeError, match="capturing"):
        graph_replay.capture_graph(body, torch.device("cuda"))
    assert gc.isenabled()
    gc.disable()
    try:  # a caller that had it off finds it off
        with pytest.raises(RuntimeError):
            graph_replay.capture_graph(body, torch.device("cuda"))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_generator_is_left_as_it_was_and_registered(cuda_log):
    generator = torch.Generator().manual_seed(3)
    drawn = []

    def body():
        drawn.append(torch.rand(1, generator=generator).item())

    graph = graph_replay.capture_graph(body, torch.device("cuda"), generator=generator)
    assert graph.generators == [generator]
    # The capture drew from the state the warm-up started from: the warm-up drew nothing.
    assert drawn[0] == drawn[1]
