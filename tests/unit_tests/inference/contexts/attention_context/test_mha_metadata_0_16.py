# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron-core 0.16's attention metadata updated from device-side counts: the same buffers as
megatron-core's ``update`` bit for bit, megatron-core's own update wherever the fast path does not
apply, errors before any write, and (GPU) no host synchronisation."""

import random
from typing import Any, Dict, List, Tuple

import pytest
import torch

from megatron_ext.inference.contexts.static_slices_context_base import (
    UPSTREAM_HAS_ACTIVE_SLICES,
)
from megatron_ext.testing.synthetic import cpu_torch_compat

pytestmark = pytest.mark.skipif(
    UPSTREAM_HAS_ACTIVE_SLICES,
    reason="megatron-core 0.19 computes its attention metadata on the host; nothing replaced",
)

MAX_REQUESTS, MAX_KV_BLOCKS, MAX_SEQLEN = 24, 6, 96
BUFFERS = (
    "_query_lengths_buf",
    "_cu_query_seq_lengths_buf",
    "_kv_seq_lengths_buf",
    "_block_table_buf",
    "_cu_kv_seq_lengths_buf",
)


@pytest.fixture(autouse=True)
def _cpu_compat():
    with cpu_torch_compat():
        yield


class _Context:
    """The part of a megatron-core 0.16 context that the metadata reads."""

    def __init__(self, device: torch.device, seed: int, decode: bool = True) -> None:
        gen = torch.Generator().manual_seed(seed)
        # In a decode-only step every request has one query token.
        lengths = torch.randint(1, 2 if decode else 9, (MAX_REQUESTS,), generator=gen)
        self.request_query_lengths = lengths.to(torch.int32).to(device)
        offsets = torch.randint(0, 80, (MAX_REQUESTS,), generator=gen, dtype=torch.int32)
        self.request_kv_length_offsets = offsets.to(device)
        blocks = torch.randint(-1, 500, (MAX_REQUESTS, MAX_KV_BLOCKS), generator=gen)
        self.request_to_kv_block_ids = blocks.to(torch.int32).to(device)
        self.paused_request_count = 0
        self.block_size_tokens = 16
        self.cuda_graph_active_slices = True


SIZES = dict(
    block_count_total=512,
    max_kv_block_count=MAX_KV_BLOCKS,
    max_requests=MAX_REQUESTS,
    block_size_tokens=16,
    max_seqlen=MAX_SEQLEN,
)


def _pair(stock_cls, ours_cls, device: torch.device, context: _Context, seed: int):
    with torch.device(device):
        stock, ours = stock_cls(**SIZES), ours_cls(**SIZES)
    ours.bind_context(context)
    # Both start from the same leftovers of an earlier step (rows past the padded count stay).
    gen = torch.Generator().manual_seed(seed)
    for name in BUFFERS:
        leftover = torch.randint(-5, 1000, getattr(stock, name).shape, generator=gen)
        getattr(stock, name).copy_(leftover)
        getattr(ours, name).copy_(leftover)
    return stock, ours


def _dims(real: int, padded: int, prefill: int = 0):
    from megatron.core.inference.batch_dimensions_utils import InferenceBatchDimensions

    real_dims = InferenceBatchDimensions(
        token_count=real + prefill * 3, prefill_req_count=prefill, decode_req_count=real - prefill
    )
    padded_dims = InferenceBatchDimensions(
        token_count=padded + prefill * 3,
        prefill_req_count=prefill,
        decode_req_count=padded - prefill,
    )
    return real_dims, padded_dims


def _views(context: _Context, real: int) -> Tuple[torch.Tensor, ...]:
    rows = slice(context.paused_request_count, context.paused_request_count + real)
    return (
        context.request_query_lengths[rows],
        context.request_kv_length_offsets[rows],
        context.request_to_kv_block_ids[rows],
    )


def _bits(metadata) -> Dict[str, Any]:
    state = {name: getattr(metadata, name).cpu().tolist() for name in BUFFERS}
    for key, value in metadata.state_data.items():
        state[f"state:{key}"] = value.cpu().tolist() if isinstance(value, torch.Tensor) else value
    return state


def _classes(graphed: bool):
    from megatron.core.inference.contexts.attention_context.mha_metadata import (
        GraphedMHAMetadata,
        NonGraphedMHAMetadata,
    )

    from megatron_ext.inference.contexts.attention_context.mha_metadata_0_16 import (
        DeviceCountsGraphedMHAMetadata,
        DeviceCountsNonGraphedMHAMetadata,
    )

    if graphed:
        return GraphedMHAMetadata, DeviceCountsGraphedMHAMetadata
    return NonGraphedMHAMetadata, DeviceCountsNonGraphedMHAMetadata


def _devices() -> List[Any]:
    devices = [pytest.param("cpu", id="cpu")]
    devices.append(
        pytest.param(
            "cuda",
            id="cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
            ],
        )
    )
    return devices


def _count_fast_path(metadata) -> List[int]:
    """Counts the decode-buffer writes of ``metadata`` (the fast path)."""
    calls = [0]
    write = metadata._write_decode_buffers

    def counted(context):
        calls[0] += 1
        write(context)

    metadata._write_decode_buffers = counted
    return calls


def _decode_cases(seed: int) -> List[Tuple[int, int, int]]:
    rng = random.Random(seed)
    cases = [(0, 1, 1), (0, MAX_REQUESTS, MAX_REQUESTS), (3, 0, 4), (5, 7, 7), (0, 1, 8)]
    for _ in range(30):
        paused = rng.randrange(0, MAX_REQUESTS)
        real = rng.randrange(0, MAX_REQUESTS - paused + 1)
        padded = rng.randrange(real, MAX_REQUESTS + 1)
        cases.append((paused, real, padded))
    return cases


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("graphed", [False, True], ids=["non-graphed", "graphed"])
def test_decode_update_writes_megatron_cores_buffers(device, graphed):
    """Decode steps over random counts (paused offset, real, padded rows), one after another on
    the same objects: all five buffers bitwise equal to megatron-core's, rows past the padded
    count included; the published views equal; max_seqlen_q 1 and max_seqlen_k the bound that
    megatron-core's graphed metadata reports."""
    stock_cls, ours_cls = _classes(graphed)
    context = _Context(torch.device(device), seed=3)
    stock, ours = _pair(stock_cls, ours_cls, torch.device(device), context, seed=4)
    calls = _count_fast_path(ours)
    cases = _decode_cases(seed=5)
    for paused, real, padded in cases:
        context.paused_request_count = paused
        stock.update(*_views(context, real), *_dims(real, padded))
        ours.update(*_views(context, real), *_dims(real, padded))
        mine, theirs = _bits(ours), _bits(stock)
        if real:
            assert mine["state:max_seqlen_q"] == theirs["state:max_seqlen_q"] == 1
            assert mine["state:max_seqlen_k"] == MAX_SEQLEN >= theirs["state:max_seqlen_k"]
            del mine["state:max_seqlen_k"], theirs["state:max_seqlen_k"]
        # Without requests megatron-core's own update runs, maxima included.
        assert mine == theirs, (paused, real, padded)
    # Eagerly every step with requests; on CUDA the first one's run and capture, then replays.
    expected = sum(1 for _, real, _ in cases if real) if device == "cpu" else 2
    assert calls[0] == expected
    if device == "cuda":
        assert ours._update_graph is not None


@pytest.mark.parametrize("graphed", [False, True], ids=["non-graphed", "graphed"])
def test_prefill_and_foreign_views_run_megatron_cores_update(graphed):
    """A step with prefill requests, an unbound object and views that are not the bound
    context's rows from the paused row on all take megatron-core's own update: equal to it in
    every field, the maxima included."""
    stock_cls, ours_cls = _classes(graphed)
    context = _Context(torch.device("cpu"), seed=6, decode=False)
    stock, ours = _pair(stock_cls, ours_cls, torch.device("cpu"), context, seed=7)
    calls = _count_fast_path(ours)
    context.paused_request_count = 2
    views = _views(context, 5)
    for call in (
        lambda m: m.update(*views, *_dims(5, 6, prefill=2)),
        lambda m: m.update(*(v.clone() for v in views), *_dims(5, 6)),
        lambda m: m.update(*_views(context, 5)[:2], views[2].clone(), *_dims(5, 8)),
    ):
        call(stock)
        call(ours)
        assert _bits(ours) == _bits(stock)
    assert calls[0] == 0
    unbound = ours_cls(**SIZES)
    for name in BUFFERS:
        getattr(unbound, name).copy_(getattr(stock, name))
    unbound.update(*views, *_dims(5, 6))
    stock.update(*views, *_dims(5, 6))
    assert _bits(unbound) == _bits(stock)


@pytest.mark.parametrize(
    "real, padded, view_rows, match",
    [
        (5, 4, 5, r"requests \(5\) <= padded requests \(4\)"),
        (5, MAX_REQUESTS + 1, 5, "max_requests"),
        (5, 6, 4, "has 4 rows, the step has 5 requests"),
    ],
)
def test_bad_counts_raise_before_any_write(real, padded, view_rows, match):
    _, ours_cls = _classes(False)
    stock_cls, _ = _classes(False)
    context = _Context(torch.device("cpu"), seed=8)
    _, ours = _pair(stock_cls, ours_cls, torch.device("cpu"), context, seed=9)
    before = _bits(ours)
    views = _views(context, view_rows)
    with pytest.raises(ValueError, match=match):
        ours.update(*views, *_dims(real, padded))
    assert _bits(ours) == before


@pytest.mark.parametrize("device", _devices())
def test_reset_is_megatron_cores_reset(device):
    stock_cls, ours_cls = _classes(False)
    context = _Context(torch.device(device), seed=10)
    stock, ours = _pair(stock_cls, ours_cls, torch.device(device), context, seed=11)
    for _ in range(2):
        for metadata in (stock, ours):
            metadata.update(*_views(context, 4), *_dims(4, 6))
            metadata.reset()
        # reset leaves state_data as it was, in megatron-core too.
        for name in BUFFERS:
            assert torch.equal(getattr(ours, name), getattr(stock, name)), name
        assert (ours._max_seqlen_q, ours._max_seqlen_k) == (0, 0)
        assert (stock._max_seqlen_q, stock._max_seqlen_k) == (0, 0)
        assert all(not getattr(ours, name).any() for name in BUFFERS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_decode_update_and_reset_do_not_synchronize():
    stock_cls, ours_cls = _classes(False)
    context = _Context(torch.device("cuda"), seed=12)
    _, ours = _pair(stock_cls, ours_cls, torch.device("cuda"), context, seed=13)
    context.paused_request_count = 1
    ours.update(*_views(context, 3), *_dims(3, 4))  # captures the graphs
    ours.reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # A step without requests is megatron-core's own update, which reads back its maxima.
        for paused, real, padded in [case for case in _decode_cases(seed=14) if case[1]][:10]:
            context.paused_request_count = paused
            ours.update(*_views(context, real), *_dims(real, padded))
            ours.reset()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert ours._update_graph is not None and ours._reset_graph is not None


def test_the_context_builds_and_rebinds_its_metadata():
    """The 0.16 context holds the device-counts classes bound to itself, and forgets their
    graphs when its request tensors are reallocated."""
    from megatron_ext.inference.contexts.attention_context.mha_metadata_0_16 import (
        DeviceCountsGraphedMHAMetadata,
        DeviceCountsNonGraphedMHAMetadata,
    )
    from megatron_ext.testing.synthetic import build_synthetic_stack

    context = build_synthetic_stack(extension=True).context
    graphed = context.graph_attn_metadata["mha_metadata"]
    non_graphed = context.non_graph_attn_metadata["mha_metadata"]
    assert type(graphed) is DeviceCountsGraphedMHAMetadata
    assert type(non_graphed) is DeviceCountsNonGraphedMHAMetadata
    assert graphed._context_ref() is context and non_graphed._context_ref() is context
    assert graphed.max_seqlen == context.max_sequence_length
    non_graphed._update_graph = object()
    context.deallocate_all_tensors()
    assert non_graphed._update_graph is None


def test_a_context_pickles_and_its_copy_decodes_as_the_original():
    """megatron-core's context pickles; the extension's did not (its metadata holds the context
    weakly). The copy's metadata is bound to the copy, and a decode step of each sets up the
    same attention buffers."""
    import pickle

    from megatron.core.inference.inference_request import DynamicInferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_ext.testing.synthetic import build_synthetic_stack

    context = build_synthetic_stack(extension=True, max_requests=8, max_tokens=64).context
    device = context.request_ids.device
    for request_id, prompt in enumerate([[3, 4, 5], [6], [7, 8]]):
        params = SamplingParams(num_tokens_to_generate=5, termination_id=-1)
        tokens = torch.tensor(prompt, device=device)
        context.add_request(
            DynamicInferenceRequest(
                request_id=request_id, prompt_tokens=tokens, sampling_params=params
            )
        )
    context.initialize_attention_state()
    context.update_requests(
        torch.ones(3, dtype=torch.uint8, device=device), torch.tensor([1, 2, 3], device=device)
    )
    # A stand-in for a captured graph (which does not pickle): the copy recaptures.
    context.non_graph_attn_metadata["mha_metadata"]._update_graph = object()

    copy = pickle.loads(pickle.dumps(context))
    for table in ("graph_attn_metadata", "non_graph_attn_metadata"):
        metadata = getattr(copy, table)["mha_metadata"]
        assert metadata._context_ref() is copy, table
        assert metadata._update_graph is None and metadata._reset_graph is None
    assert context.non_graph_attn_metadata["mha_metadata"]._update_graph is not None
    assert copy.sampling_requirements() == context.sampling_requirements()
    for ctx in (context, copy):
        ctx.initialize_attention_state()
        assert ctx.is_decode_only()
    ours = _bits(context.non_graph_attn_metadata["mha_metadata"])
    theirs = _bits(copy.non_graph_attn_metadata["mha_metadata"])
    assert ours == theirs
