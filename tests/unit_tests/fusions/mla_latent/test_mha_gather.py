# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the MHA form's gather of cache rows through the block table
(megatron_ext.fusions.mla_latent.mha_gather): the kernel against the torch gather bit for bit,
block ids and places outside the cache or table, strided caches, reads only inside the cache
(NaN guard rows around it), writes only inside ``out`` (guard rows and columns around it), bad
input refused before any launch, and graph replay on the GPU.
Without a GPU the kernel runs in the Triton interpreter (tests/conftest.py).
"""

import pytest
import torch

from megatron_ext.fusions.mla_latent import mha_gather
from megatron_ext.fusions.mla_latent.mha_gather import gather_cache_rows, gather_cache_rows_torch

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")


@pytest.fixture
def kernel_everywhere(monkeypatch):
    """The kernel on this machine's device (the interpreter's on CPU), as on CUDA."""
    if not ON_GPU:
        monkeypatch.setattr(mha_gather, "_kernel_takes", lambda *a: True)


def _case(block_size, width, pad, dtype, seed, rows=45, blocks=9, requests=3, max_blocks=5):
    """A cache inside a NaN buffer (a block before and after, ``pad`` rows between blocks), a
    table with -1 and ids past the cache, and every row's places."""
    gen = torch.Generator().manual_seed(seed)
    buffer = torch.full((blocks + 2, block_size + pad, width), float("nan"), dtype=dtype)
    buffer[1:-1, :block_size] = torch.randn(blocks, block_size, width, generator=gen).to(dtype)
    cache = buffer.to(DEVICE)[1:-1, :block_size]
    table = torch.randint(-1, blocks + 3, (requests, max_blocks), generator=gen, dtype=torch.int32)
    places = (
        torch.randint(0, requests * max_blocks, (rows,), generator=gen).to(DEVICE),
        torch.randint(0, block_size, (rows,), generator=gen).to(torch.int32).to(DEVICE),
    )
    return cache, table.to(DEVICE), places


@pytest.mark.parametrize(
    "block_size, width, pad",
    [(16, 576, 0), (1, 576, 0), (37, 96, 3), (64, 40, 5)],
    ids=["16x576", "1x576", "37x96-strided", "64x40-strided"],
)
def test_kernel_copies_the_torch_gathers_rows_bit_for_bit(
    kernel_everywhere, block_size, width, pad
):
    """Each row as the torch gather copies it (a -1 id reads block 0, an id past the cache its
    last block), never a guard row's NaN."""
    dtypes = [torch.float32, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
    for dtype in dtypes:
        cache, table, places = _case(block_size, width, pad, dtype, seed=block_size + width)
        got = gather_cache_rows(cache, table, places)
        want = gather_cache_rows_torch(cache, table, places)
        assert got.shape == (places[0].shape[0], width) and got.dtype == dtype
        assert not got.isnan().any(), "the gather read outside the cache"
        assert torch.equal(got, want), "the kernel's rows differ from the torch gather's"
        ids = table.view(-1)[places[0].long()].long().clamp(0, cache.shape[0] - 1)
        assert torch.equal(got, cache[ids, places[1].long()])


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_rows_written_into_out_touch_nothing_else(monkeypatch, path):
    """With ``out`` a view of a larger buffer (guard rows before and after, wider rows), the
    rows go there and every other element keeps its bits."""
    if path == "torch":
        monkeypatch.setattr(mha_gather, "_kernel_takes", lambda *a: False)
    elif not ON_GPU:
        monkeypatch.setattr(mha_gather, "_kernel_takes", lambda *a: True)
    cache, table, places = _case(16, 96, 0, torch.float32, seed=7)
    rows = places[0].shape[0]
    buffer = torch.full((rows + 2, 96 + 8), 1234.5, device=DEVICE)
    before = buffer.clone()
    out = buffer[1:-1, 4:-4]
    got = gather_cache_rows(cache, table, places, out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, gather_cache_rows_torch(cache, table, places))
    written = torch.zeros_like(buffer, dtype=torch.bool)
    written[1:-1, 4:-4] = True
    assert torch.equal(buffer[~written], before[~written]), "a write outside out's rows"


def test_places_outside_the_table_or_block_are_clamped_into_them(kernel_everywhere):
    """Places the plan never builds (past the table, past a block) read inside, clamped."""
    cache, table, _ = _case(8, 64, 0, torch.float32, seed=3)
    places = (
        torch.tensor([-4, 0, table.numel() + 9], device=DEVICE),
        torch.tensor([3, 99, -2], device=DEVICE),
    )
    got = gather_cache_rows(cache, table, places)
    flat = table.view(-1).long().clamp(0, cache.shape[0] - 1)
    want = torch.stack([cache[flat[0], 3], cache[flat[0], cache.shape[1] - 1], cache[flat[-1], 0]])
    assert torch.equal(got, want)


def test_no_rows_gives_an_empty_result(kernel_everywhere):
    cache, table, _ = _case(8, 64, 0, torch.float32, seed=4)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    got = gather_cache_rows(cache, table, (empty, empty))
    assert got.shape == (0, 64)


@pytest.mark.parametrize(
    "change, error, message",
    [
        ("float places", TypeError, "places"),
        ("places of two lengths", ValueError, "places\\[1\\] must have shape"),
        ("strided places", ValueError, "places\\[0\\] must be contiguous"),
        ("strided table", ValueError, "contiguous"),
        ("float table", TypeError, "block_table"),
        ("2-d cache", ValueError, "kv_cache must be"),
        ("out of another width", ValueError, "out must be"),
        ("out of strided columns", ValueError, "unit stride in its last dimension"),
        ("out in the cache", ValueError, "out overlaps kv_cache"),
        ("out of shared rows", ValueError, "share memory"),
    ],
)
def test_bad_input_is_refused_before_any_launch(monkeypatch, change, error, message):
    cache, table, places = _case(8, 64, 0, torch.float32, seed=5)
    if change == "float places":
        places = (places[0].float(), places[1])
    elif change == "places of two lengths":
        places = (places[0], places[1][:-1])
    elif change == "strided places":
        places = (torch.stack([places[0], places[0]], 1)[:, 0], places[1])
    elif change == "strided table":
        table = table.t()
    elif change == "float table":
        table = table.float()
    elif change == "2-d cache":
        cache = cache[0]
    out = None
    if change == "out of another width":
        out = cache.new_empty(places[0].shape[0], cache.shape[2] + 1)
    elif change == "out of strided columns":
        out = cache.new_empty(places[0].shape[0], 2 * cache.shape[2])[:, ::2]
    elif change == "out in the cache":
        rows = places[0].shape[0]
        out = cache.view(-1, cache.shape[2])[:rows]
    elif change == "out of shared rows":
        out = cache.new_empty(1, cache.shape[2]).expand(places[0].shape[0], -1)

    def no_launch(*args):
        raise AssertionError("a launch was planned for bad input")

    monkeypatch.setattr(mha_gather, "_plan", no_launch)
    with pytest.raises(error, match=message):
        gather_cache_rows(cache, table, places, out)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_gpu_the_gather_runs_the_kernel_and_replays_from_a_graph(monkeypatch):
    """On CUDA the kernel gathers (not the torch path), and a captured gather replays the same
    bits for new table contents written in place."""
    calls = []
    monkeypatch.setattr(mha_gather, "gather_cache_rows_torch", lambda *a: calls.append(a) or None)
    cache, table, places = _case(64, 576, 0, torch.bfloat16, seed=6)
    first = gather_cache_rows(cache, table, places)
    assert calls == [] and first is not None, "the torch gather ran on CUDA"
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gather_cache_rows(cache, table, places)  # warm on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            captured = gather_cache_rows(cache, table, places)
    torch.cuda.synchronize()
    table.copy_(table.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.undo()
    assert torch.equal(captured, gather_cache_rows_torch(cache, table, places))
