# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the fused key RoPE + paged latent-cache append
(megatron_ext.fusions.mla_latent.rope_cache_append).

The reference is megatron-core's own dynamic-inference path, run as ``MLASelfAttention`` runs it
with ``cache_mla_latents``: ``DynamicInferenceContext.apply_rotary_emb_key`` (the unfused torch
RoPE on rows gathered by position, yarn's mscale in cos/sin), ``torch.cat`` with the latent, and
``DynamicInferenceContext.append_key_value_cache`` (indexed assignment), called on a stand-in
context that holds just the tensors those methods read, with cos/sin tables and embeddings from
megatron-core's ``YarnRotaryEmbedding``. The rows must be bitwise equal. Without a GPU the kernel
runs in the Triton interpreter in fp32 and fp16; tests marked ``gpu`` add bf16 and CUDA graphs.
"""

import pytest
import torch

from megatron_ext.fusions import direct_launch
from megatron_ext.fusions.direct_launch import KernelLaunches
from megatron_ext.fusions.mla_latent import fused_mla_rope_cache_append
from megatron_ext.fusions.mla_latent import rope_cache_append as append
from megatron_ext.testing.latent_cache_baseline import yarn_rotary_embedding
from tests.unit_tests.fusions.mla_latent_cache_testlib import (
    assert_refused_after_a_call_of_its_layout,
    fresh_plan_caches,
    guarded_tensor,
    guards_intact,
    megatron_core_append,
    mla_rope_config,
    record_launches,
)
from tests.unit_tests.fusions.mla_rope_testlib import assert_bitwise_equal

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
LATENT, ROPE = 512, 64
POSITIONS = 300  # rows of the cos/sin tables (the context's rotary sequence length)


@pytest.fixture(scope="module")
def config():
    return mla_rope_config(LATENT, ROPE)


@pytest.fixture(scope="module")
def yarn(config):
    """megatron-core's RoPE module. Without a GPU, megatron's ``torch.cuda.current_device()``
    (where it puts the frequencies) answers "cpu" meanwhile."""
    with pytest.MonkeyPatch.context() as patch:
        if not ON_GPU:
            patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        yield yarn_rotary_embedding(config)


def make_tokens(kind, dtype, seed, blocks=9, block_size=16, padding=3):
    """New tokens of one step: [tokens, 1, width] inputs and their context indices.

    ``prefill``: positions 0.. of fresh requests, block after block; ``decode``: one token per
    request at a random position, each in its own block; ``mixed``: both. The last block is the
    dummy block megatron-core sends padding tokens to (position 0, offset 0).
    """
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm((blocks - 1) * block_size, generator=gen)  # any free row, shuffled
    if kind == "prefill":
        positions = torch.arange(37)
    elif kind == "decode":
        positions = torch.randint(0, POSITIONS, (11,), generator=gen)
    else:
        positions = torch.cat([torch.arange(20) + 100, torch.randint(0, POSITIONS, (5,))])
    n = positions.shape[0]
    block_idx = torch.cat([rows[:n] // block_size, torch.full((padding,), blocks - 1)])
    block_offset = torch.cat([rows[:n] % block_size, torch.zeros(padding, dtype=torch.long)])
    positions = torch.cat([positions, torch.zeros(padding, dtype=torch.long)])
    total = n + padding
    kv_latent = torch.randn(total, 1, LATENT, generator=gen).to(dtype)
    k_pos_emb = (torch.randn(total, 1, ROPE, generator=gen) * 4).to(dtype)
    cache = torch.randn(blocks, block_size, LATENT + ROPE, generator=gen).to(dtype)
    to = lambda *xs: [x.to(DEVICE) for x in xs]  # noqa: E731
    return to(kv_latent, k_pos_emb, cache) + [to(positions, block_idx, block_offset)]


def guarded_cache(cache):
    view, buffer = guarded_tensor(cache.shape, cache.dtype, cache.device, 0.0)
    view.copy_(cache)
    return view, buffer


@pytest.mark.parametrize("decode_only", [True, False], ids=["decode_only", "any_step"])
@pytest.mark.parametrize("table_dtype", ["like_k_pos_emb", "float32"])
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_bitwise_equal_to_megatron_core(config, yarn, dtype, kind, table_dtype, decode_only):
    kv_latent, k_pos_emb, cache, index = make_tokens(kind, dtype, seed=len(kind))
    expected = cache.clone().unsqueeze(0)  # megatron-core's memory_buffer: [layers, blocks, ...]
    megatron_core_append(
        config, yarn, POSITIONS, kv_latent, k_pos_emb, expected, index, decode_only
    )
    ours, buffer = guarded_cache(cache)
    tables = yarn.get_cached_cos_sin(
        POSITIONS, dtype=dtype if table_dtype == "like_k_pos_emb" else torch.float32
    )
    returned = fused_mla_rope_cache_append(
        kv_latent, k_pos_emb, *tables, index[0], ours, *index[1:]
    )
    assert returned.data_ptr() == ours.data_ptr()
    # The padding tokens all name the dummy block's row 0; which of them lands there is up to the
    # schedule in both. Every other row of the cache, written or not, must carry the same bits.
    expected, ours = expected[0].clone(), ours.clone()
    expected[-1, 0] = ours[-1, 0] = 0
    assert_bitwise_equal(ours, expected, f"{kind} {dtype}")
    assert guards_intact(buffer)


def test_latent_and_rope_parts_as_views_of_one_projection(config, yarn):
    # megatron-core splits kv_combined [tokens, 1, 576] into views; rows then have stride 576.
    kv_latent, k_pos_emb, cache, index = make_tokens("mixed", torch.float32, seed=3)
    combined = torch.cat([kv_latent, k_pos_emb], -1)
    latent_view, rope_view = torch.split(combined, [LATENT, ROPE], dim=-1)
    tables = yarn.get_cached_cos_sin(POSITIONS, dtype=torch.float32)
    from_views = fused_mla_rope_cache_append(
        latent_view, rope_view, *tables, index[0], cache.clone(), *index[1:]
    )
    dense = fused_mla_rope_cache_append(
        kv_latent[:, 0], k_pos_emb[:, 0], *tables, index[0], cache.clone(), *index[1:]
    )
    assert_bitwise_equal(from_views, dense, "views")


def test_rows_outside_the_cache_are_skipped_and_positions_clamped(yarn):
    # Values the host does not check: block ids and offsets outside the cache write nothing;
    # positions outside the tables rotate with their first or last row. Expected: the kernel on
    # the cleaned-up tokens (equal to megatron-core's rows, above).
    kv_latent, k_pos_emb, cache, (positions, block_idx, block_offset) = make_tokens(
        "decode", torch.float32, seed=4, padding=0
    )
    cos, sin = yarn.get_cached_cos_sin(POSITIONS, dtype=torch.float32)
    bad_positions, clamped = positions.clone(), positions.clone()
    bad_positions[0], clamped[0] = -5, 0
    bad_positions[1], clamped[1] = POSITIONS + 7, POSITIONS - 1
    bad_block, bad_offset = block_idx.clone(), block_offset.clone()
    bad_block[2], bad_block[3] = -1, cache.shape[0]
    bad_offset[4], bad_offset[5] = -1, cache.shape[1]
    keep = torch.ones(positions.shape[0], dtype=torch.bool, device=DEVICE)
    keep[2:6] = False
    expected = fused_mla_rope_cache_append(
        kv_latent[keep],
        k_pos_emb[keep],
        cos,
        sin,
        clamped[keep],
        cache.clone(),
        block_idx[keep],
        block_offset[keep],
    )
    view, buffer = guarded_cache(cache)
    fused_mla_rope_cache_append(
        kv_latent, k_pos_emb, cos, sin, bad_positions, view, bad_block, bad_offset
    )
    assert_bitwise_equal(view, expected, "skipped rows and clamped positions")
    assert guards_intact(buffer)


def test_no_tokens_is_no_launch(yarn, monkeypatch):
    kv_latent, k_pos_emb, cache, (positions, block_idx, block_offset) = make_tokens(
        "decode", torch.float32, seed=5
    )
    launches = record_launches(monkeypatch, append, "APPEND_LAUNCHES")
    tables = yarn.get_cached_cos_sin(POSITIONS, dtype=torch.float32)
    before = cache.clone()
    fused_mla_rope_cache_append(
        kv_latent[:0], k_pos_emb[:0], *tables, positions[:0], cache, block_idx[:0], block_offset[:0]
    )
    assert launches == [] and torch.equal(cache, before)


def _bad_inputs_good():
    kv_latent, k_pos_emb, cache, (positions, block_idx, block_offset) = make_tokens(
        "decode", torch.float32, seed=6, padding=0
    )
    cos, sin = torch.randn(2, POSITIONS, 1, 1, ROPE, device=DEVICE)
    return dict(
        kv_latent=kv_latent,
        k_pos_emb=k_pos_emb,
        cos=cos,
        sin=sin,
        positions=positions,
        kv_cache=cache,
        block_idx=block_idx,
        block_offset=block_offset,
    )


def _bad_inputs():
    good = _bad_inputs_good()
    kv_latent, k_pos_emb, cache = good["kv_latent"], good["k_pos_emb"], good["kv_cache"]
    cos, sin, positions = good["cos"], good["sin"], good["positions"]
    block_idx = good["block_idx"]
    n = kv_latent.shape[0]
    yield "latent list", dict(good, kv_latent=[1.0]), TypeError, "kv_latent must be a torch"
    yield "int latent", dict(good, kv_latent=kv_latent.long()), TypeError, "kv_latent must have"
    yield "latent 2 heads", dict(
        good, kv_latent=kv_latent.expand(n, 2, LATENT)
    ), ValueError, "kv_latent must be"
    yield "latent last stride", dict(
        good, kv_latent=kv_latent.transpose(0, 2).contiguous().transpose(0, 2)
    ), ValueError, "kv_latent must have unit stride"
    yield "token counts", dict(good, k_pos_emb=k_pos_emb[:-1]), ValueError, "k_pos_emb has"
    yield "odd rope width", dict(good, k_pos_emb=k_pos_emb[..., :63]), ValueError, "power of two"
    yield "cache width", dict(good, kv_cache=cache[..., :575]), ValueError, "kv_cache rows are 575"
    yield "4-d cache", dict(good, kv_cache=cache.unsqueeze(0)), ValueError, "kv_cache must be"
    yield "cache dtype", dict(good, kv_cache=cache.half()), TypeError, "kv_latent is torch.float32"
    yield "fp16 tables for fp32 rows", dict(
        good, cos=cos.half(), sin=sin.half()
    ), TypeError, "cos must be torch.float32"
    yield "narrow tables", dict(good, cos=cos[..., :32], sin=sin[..., :32]), ValueError, "cos must"
    yield "cos and sin rows", dict(good, sin=sin[:10]), ValueError, "cos and sin"
    yield "float positions", dict(good, positions=positions.float()), TypeError, "positions must"
    yield "short block_idx", dict(good, block_idx=block_idx[:-1]), ValueError, "block_idx must"
    yield "strided offsets", dict(
        good, block_offset=torch.zeros(2 * n, dtype=torch.long, device=DEVICE)[::2]
    ), ValueError, "block_offset must be contiguous"
    yield "meta positions", dict(good, positions=positions.to("meta")), ValueError, "positions is"
    yield "expanded cache", dict(
        good, kv_cache=cache[:1].expand(cache.shape)
    ), ValueError, "share memory"
    yield "cache holds the latent", dict(
        good, kv_latent=cache[0, :n].unsqueeze(1)[..., :LATENT]
    ), ValueError, "kv_cache overlaps kv_latent"


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda case: case[0])
def test_bad_input_is_refused_before_any_launch(case, monkeypatch):
    name, kwargs, error, match = case
    launches = record_launches(monkeypatch, append, "APPEND_LAUNCHES")
    before = kwargs["kv_cache"].clone()
    with pytest.raises(error, match=match):
        fused_mla_rope_cache_append(**kwargs)
    assert launches == [], name
    assert torch.equal(kwargs["kv_cache"], before), name


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda case: case[0])
def test_bad_input_is_refused_after_a_good_call_of_its_layout(case, monkeypatch):
    assert_refused_after_a_call_of_its_layout(
        fused_mla_rope_cache_append, append, ("APPEND_LAUNCHES",), case, monkeypatch
    )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_graph_replay_equals_eager_bitwise(config, yarn, dtype):
    # 256 decode tokens: captured once, replayed with new inputs, positions and rows each time.
    gen = torch.Generator().manual_seed(7)
    n, blocks, block_size = 256, 40, 64
    kv_latent = torch.empty(n, 1, LATENT, dtype=dtype, device=DEVICE)
    k_pos_emb = torch.empty(n, 1, ROPE, dtype=dtype, device=DEVICE)
    positions, block_idx, block_offset = (
        torch.zeros(n, dtype=torch.long, device=DEVICE) for _ in range(3)
    )
    cos, sin = yarn.get_cached_cos_sin(POSITIONS, dtype=dtype)
    cache = torch.zeros(blocks, block_size, LATENT + ROPE, dtype=dtype, device=DEVICE)
    args = (kv_latent, k_pos_emb, cos, sin, positions, cache, block_idx, block_offset)

    def refresh():
        kv_latent.copy_(torch.randn(kv_latent.shape, generator=gen).to(dtype))
        k_pos_emb.copy_(torch.randn(k_pos_emb.shape, generator=gen).to(dtype))
        positions.copy_(torch.randint(0, POSITIONS, (n,), generator=gen))
        rows = torch.randperm(blocks * block_size, generator=gen)[:n]
        block_idx.copy_(rows // block_size)
        block_offset.copy_(rows % block_size)

    refresh()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_mla_rope_cache_append(*args)  # compiles outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_mla_rope_cache_append(*args)
    for _ in range(3):
        refresh()
        start = cache.clone()
        graph.replay()
        eager = fused_mla_rope_cache_append(*args[:5], start.clone(), *args[6:])
        expected = start.unsqueeze(0)
        index = (positions, block_idx, block_offset)
        megatron_core_append(config, yarn, POSITIONS, kv_latent, k_pos_emb, expected, index, True)
        torch.cuda.synchronize()
        assert_bitwise_equal(cache, eager, "replay vs eager")
        assert_bitwise_equal(cache, expected[0], "replay vs megatron-core")


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 1024, 4096])
def test_gpu_bf16_rows_bitwise_equal_to_megatron_core_at_serving_sizes(
    config, yarn, tokens, monkeypatch
):
    """Through Triton's JIT (a specialisation's first call) and then the direct launch."""
    launches = append.APPEND_LAUNCHES
    fresh = KernelLaunches(launches.kernel, launches.unspecialized)
    monkeypatch.setattr(append, "APPEND_LAUNCHES", fresh)
    fresh_plan_caches(monkeypatch)  # plans launch what they were built with
    for launch in ("JIT launch", "direct launch"):
        _serving_size_rows_bitwise(config, yarn, tokens, launch)
    if direct_launch.verified(torch.device("cuda", torch.cuda.current_device())):
        assert [callable(x) for x in fresh.launches.values()] == [True]


def _serving_size_rows_bitwise(config, yarn, tokens, launch):
    gen = torch.Generator().manual_seed(tokens)
    block_size = 64
    blocks = tokens // block_size + 2
    rows = torch.randperm(blocks * block_size, generator=gen)[:tokens].to(DEVICE)
    index = (torch.randint(0, POSITIONS, (tokens,), generator=gen).to(DEVICE),)
    index += (rows // block_size, rows % block_size)
    dtype = torch.bfloat16
    kv_latent = torch.randn(tokens, 1, LATENT, generator=gen).to(dtype).to(DEVICE)
    k_pos_emb = (torch.randn(tokens, 1, ROPE, generator=gen) * 4).to(dtype).to(DEVICE)
    cache = torch.randn(blocks, block_size, LATENT + ROPE, generator=gen).to(dtype).to(DEVICE)
    expected = cache.clone().unsqueeze(0)
    megatron_core_append(config, yarn, POSITIONS, kv_latent, k_pos_emb, expected, index, False)
    tables = yarn.get_cached_cos_sin(POSITIONS, dtype=dtype)
    fused_mla_rope_cache_append(kv_latent, k_pos_emb, *tables, index[0], cache, *index[1:])
    assert_bitwise_equal(cache, expected[0], f"{tokens} tokens, {launch}")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["prefill", "decode", "mixed"])
def test_gpu_relaunch_gives_identical_bits(yarn, kind):
    """25 launches on fresh copies of one step's inputs and cache write one set of bits (the
    determinism manifest's race test for this kernel). Without padding tokens: megatron-core sends
    every padding token to the same dummy row, whose contents then depend on which write lands
    last; no request reads that row."""
    kv_latent, k_pos_emb, cache, index = make_tokens(kind, torch.bfloat16, seed=31, padding=0)
    cos, sin = yarn.get_cached_cos_sin(POSITIONS, dtype=torch.bfloat16)

    def launch():
        out = cache.clone()
        fused_mla_rope_cache_append(
            kv_latent.clone(), k_pos_emb.clone(), cos, sin, index[0], out, index[1], index[2]
        )
        return out.view(torch.int16)

    first = launch()
    differing = [i for i in range(25) if not torch.equal(launch(), first)]
    assert not differing, f"{kind}: launches {differing} wrote other bits"


def test_a_cached_layout_still_refuses_a_cache_that_holds_an_input(monkeypatch):
    """The second call of a layout skips the layout's checks but not the overlap test: an input
    laid out as before whose memory now lies inside the cache is refused before any launch."""
    good = dict(_bad_inputs_good())
    fused_mla_rope_cache_append(**good)
    launches = record_launches(monkeypatch, append, "APPEND_LAUNCHES")
    cache = good["kv_cache"]
    latent = good["kv_latent"]
    inside = cache.view(-1)[: latent.numel()].view(latent.shape)
    assert inside.stride() == latent.stride() and inside.data_ptr() % 16 == latent.data_ptr() % 16
    before = cache.clone()
    with pytest.raises(ValueError, match="kv_cache overlaps kv_latent"):
        fused_mla_rope_cache_append(**dict(good, kv_latent=inside))
    assert launches == []
    assert torch.equal(cache, before)
    fused_mla_rope_cache_append(**good)  # the layout's plan still serves disjoint calls
    assert len(launches) == 1
