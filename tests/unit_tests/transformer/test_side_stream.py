# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Two parts of a step side by side: in order off CUDA, an error still joined, and on the GPU the
current stream waiting for the side stream's writes (eagerly, under graph replay, per thread)."""

import threading

import pytest
import torch

from megatron_ext.transformer import side_stream
from megatron_ext.transformer.side_stream import side_by_side


@pytest.mark.parametrize("overlap", [True, False])
def test_off_cuda_the_parts_run_in_order(overlap):
    order = []
    side_by_side(lambda: order.append("side"), lambda: order.append("main"), torch.device("cpu"))
    side_by_side(
        lambda: order.append("side"), lambda: order.append("main"), torch.device("cpu"), overlap
    )
    assert order == ["side", "main", "side", "main"]
    assert side_by_side(lambda: None, lambda: 7, torch.device("cpu"), overlap) == 7


def test_an_error_in_the_side_part_propagates_and_the_main_part_does_not_run():
    ran = []

    def side():
        raise ValueError("side failed")

    with pytest.raises(ValueError, match="side failed"):
        side_by_side(side, lambda: ran.append("main"), torch.device("cpu"))
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
    assert returned is main_out  # what the main part returns
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
