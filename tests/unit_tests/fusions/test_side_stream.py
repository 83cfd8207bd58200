# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Two parts of a step side by side: in order off CUDA, an error still joined, and on the GPU the
current stream waiting for the side stream's writes (eagerly, under graph replay, per thread, per
nesting level, call after call with the events re-recorded) and the side part's tensors handed
over to it."""

import functools
import threading

import pytest
import torch

from megatron_ext.fusions import side_stream
from megatron_ext.fusions.side_stream import side_by_side


@pytest.mark.parametrize("overlap", [True, False])
def test_off_cuda_the_parts_run_in_order(overlap):
    order = []
    side_by_side(lambda: order.append("side"), lambda: order.append("main"), torch.device("cpu"))
    side_by_side(
        lambda: order.append("side"), lambda: order.append("main"), torch.device("cpu"), overlap
    )
    assert order == ["side", "main", "side", "main"]
    assert side_by_side(lambda: 3, lambda: 7, torch.device("cpu"), overlap) == (3, 7)


def test_an_error_in_the_side_part_propagates_and_the_main_part_does_not_run():
    ran = []

    def side():
        raise ValueError("side failed")

    with pytest.raises(ValueError, match="side failed"):
        side_by_side(side, lambda: ran.append("main"), torch.device("cpu"))
    assert not ran


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(device="cuda"), "device must be a torch.device"),
        (dict(overlap="off"), "overlap must be a bool"),
        (dict(side=None), "side must be callable"),
        (dict(main=3), "main must be callable"),
    ],
)
def test_bad_arguments_are_refused_before_either_part_runs(kwargs, match):
    ran = []
    args = dict(
        side=lambda: ran.append("side"),
        main=lambda: ran.append("main"),
        device=torch.device("cpu"),
        overlap=True,
    )
    with pytest.raises(TypeError, match=match):
        side_by_side(**{**args, **kwargs})
    assert not ran


# ------------------------------------------------------------------------------- GPU

SLEEP_CYCLES = 50_000_000  # tens of milliseconds: the side's write lands long after the launch


def _slow_fill(out: torch.Tensor, value: float) -> None:
    torch.cuda._sleep(SLEEP_CYCLES)
    out.fill_(value)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [True, False])
def test_gpu_the_current_stream_waits_for_the_side_part(overlap):
    """The side part sleeps, then writes; the current stream's next read (no synchronisation in
    between) sees the write, and the main part's own write is there too."""
    device = torch.device("cuda")
    side_out = torch.zeros(1024, device=device)
    main_out = torch.zeros(1024, device=device)
    returned = side_by_side(
        lambda: _slow_fill(side_out, 3.0), lambda: main_out.fill_(5.0), device, overlap
    )
    assert returned == (None, main_out)  # what the parts return
    total = side_out.sum() + main_out.sum()  # queued on the current stream
    assert total.item() == 1024 * 8.0, "the current stream read before the side part's write"


@pytest.mark.gpu
def test_gpu_an_error_in_the_main_part_still_joins_the_side_stream():
    device = torch.device("cuda")
    side_out = torch.zeros(1024, device=device)

    def main():
        raise RuntimeError("main failed")

    with pytest.raises(RuntimeError, match="main failed"):
        side_by_side(lambda: _slow_fill(side_out, 2.0), main, device)
    assert side_out.sum().item() == 2048.0, "the current stream did not wait for the side part"


@pytest.mark.gpu
def test_gpu_side_by_side_under_graph_capture_replays_both_parts():
    device = torch.device("cuda")
    source = torch.arange(4096, dtype=torch.float32, device=device)
    side_out, main_out = torch.zeros_like(source), torch.zeros_like(source)

    def run():
        side_by_side(
            lambda: torch.mul(source, 2.0, out=side_out),
            lambda: torch.add(source, 1.0, out=main_out),
            device,
        )

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    source.copy_(torch.arange(4096, 0, -1, dtype=torch.float32, device=device))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(side_out, source * 2.0) and torch.equal(main_out, source + 1.0)


@pytest.mark.gpu
def test_gpu_each_thread_has_its_own_side_stream():
    device = torch.device("cuda")
    streams = {}

    def take(name):
        streams[name] = side_stream._side_stream(device)

    threads = [threading.Thread(target=take, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    take("here")
    assert len({s.cuda_stream for s in streams.values()}) == 3
    assert side_stream._side_stream(device) is streams["here"]  # kept for the thread


@pytest.mark.gpu
def test_gpu_a_tensor_the_side_part_returns_is_safe_on_the_current_stream():
    """The side part allocates its result on the side stream and returns it; the caller drops
    it while the current stream's read is still queued. Later side-stream work must not take its
    memory before that read: the read sees the side part's values."""
    device = torch.device("cuda")
    total = torch.zeros((), device=device)

    def side():
        return torch.full((1 << 20,), 2.0, device=device)

    def main():
        torch.cuda._sleep(SLEEP_CYCLES)  # the current stream lags behind the side stream

    for _ in range(3):
        result, _ = side_by_side(side, main, device)
        total += result.sum()  # queued behind the sleep
        del result  # freed while the read is still queued
        # Side-stream work that would reuse the freed block at once without the hand-over.
        stream = side_stream._side_stream(device)
        with torch.cuda.stream(stream):
            torch.full((1 << 20,), -1.0, device=device)
    assert total.item() == 3 * 2.0 * (1 << 20), "the side part's result was overwritten"


@pytest.mark.gpu
def test_gpu_a_nested_call_takes_a_side_stream_of_its_own():
    device = torch.device("cuda")
    seen = {}

    def inner_side():
        seen["inner"] = torch.cuda.current_stream(device).cuda_stream

    def outer_main():
        side_by_side(inner_side, lambda: None, device)

    def outer_side():
        seen["outer"] = torch.cuda.current_stream(device).cuda_stream

    side_by_side(outer_side, outer_main, device)
    current = torch.cuda.current_stream(device).cuda_stream
    assert len({seen["outer"], seen["inner"], current}) == 3
    assert seen["outer"] == side_stream._side_stream(device, 0).cuda_stream
    assert seen["inner"] == side_stream._side_stream(device, 1).cuda_stream
    # The level is restored: the next call at the top takes the first side stream again.
    side_by_side(outer_side, lambda: None, device)
    assert seen["outer"] == side_stream._side_stream(device, 0).cuda_stream


@pytest.mark.gpu
def test_gpu_calls_in_a_row_keep_both_edges_with_the_events_re_recorded():
    """Each fork and join re-records the same two events. Call after call, the side part must
    still read what the current stream wrote just before (it lags behind a sleep), and the
    current stream's next write must wait for that read (the side part sleeps before it)."""
    device = torch.device("cuda")
    buffer = torch.zeros(1 << 16, device=device)
    seen = torch.zeros(4, 1 << 16, device=device)

    def side(row: int):
        torch.cuda._sleep(SLEEP_CYCLES)
        seen[row].copy_(buffer)

    for row in range(4):
        _slow_fill(buffer, float(row + 1))  # current stream: the fork must wait for it
        side_by_side(
            functools.partial(side, row), lambda: None, device
        )  # the next fill waits for the join
    expected = torch.arange(1, 5, dtype=torch.float32, device=device)[:, None].expand_as(seen)
    moved = (seen != expected).any(dim=1).nonzero().flatten().tolist()
    assert not moved, f"the side part read another call's value in rows {moved}"
