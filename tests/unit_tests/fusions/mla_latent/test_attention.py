# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of the paged latent-cache MLA attention (megatron_ext.fusions.mla_latent.attention and
the plan and kernels it launches; the tile rules alone: test_tile_rules.py).

Without a GPU the kernels run in the Triton interpreter (tests/conftest.py) in fp32, mostly with
small widths (a 32-wide latent and 16 RoPE columns; the kernels take any power-of-two widths) and
once with DeepSeek-V3's 512 + 64, against a float64 reference that gathers each request's pages
explicitly. Tests marked ``gpu`` add bf16, 512 + 64 everywhere, up to 128 heads and 4k contexts,
and CUDA-graph replay.
"""

import math

import pytest
import torch

from megatron_ext.fusions import direct_launch
from megatron_ext.fusions.direct_launch import KernelLaunches
from megatron_ext.fusions.launch_plans import PlanCache
from megatron_ext.fusions.mla_latent import (
    MAX_KV_SPLITS,
    attention,
    attention_kernels,
    attention_plan,
    default_num_kv_splits,
    mla_paged_latent_attention,
    tile_rules,
)
from tests.unit_tests.fusions.mla_latent_cache_testlib import (
    GUARD,
    assert_refused_after_a_call_of_its_layout,
    attention_reference,
    build_step,
    check_attention_step,
    record_launches,
)

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda") if ON_GPU else torch.device("cpu")
# DeepSeek-V3's scale: mscale**2 / sqrt(qk_head_dim + qk_pos_emb_head_dim) (yarn factor 40).
SCALE = (0.1 * math.log(40) + 1) ** 2 / math.sqrt(192)
# fp32: on the GPU each logit is one fp32 FMA chain over 576 products, whose rounding error grows
# as sqrt(576) * 2**-24 times the logit's size (|q||k| ~ 24 here), so the scaled logits and the
# softmax weights move by up to ~1e-5 relative and the outputs (|out| <= ~4) by a few 1e-5
# absolute: measured on an H200 <= 2.6e-5 over contexts to 4k and 128 heads, in the interpreter
# (blocked BLAS dots) <= 3e-6 on the same inputs.
FP32_TOLERANCE = dict(rtol=1e-5, atol=6e-5)


@pytest.fixture(autouse=True)
def stage_1_everywhere(monkeypatch):
    """These tests are stage 1's (its tiles, launches and bits): on Hopper with Triton >= 3.7 the
    launcher gives decode launches of 32+ heads to the Gluon kernel by default, which
    test_decode_gluon_gpu.py tests through the same entry."""
    monkeypatch.setattr(attention_plan, "GLUON_DECODE", False)


def run_and_check(step, *, tolerance=FP32_TOLERANCE, **kwargs):
    """The kernel against float64, with its output poisoned and guarded and the cache checked
    bit for bit afterwards (attention only reads it)."""
    return check_attention_step(step, SCALE, tolerance, **kwargs)


# (cached tokens, new tokens) per request.
DECODE = [(0, 1), (15, 1), (16, 1), (40, 1), (7, 1)]
PREFILL = [(0, 37), (0, 1), (0, 16)]
CHUNKED = [(21, 11), (32, 5), (3, 30)]
MIXED = [(40, 1), (0, 19), (17, 9), (0, 1), (63, 1), (5, 3)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("heads", [1, 3, 16])
def test_decode_matches_float64(heads, splits, block_size):
    step = build_step(
        DECODE, heads=heads, block_size=block_size, seed=heads + splits, device=DEVICE
    )
    run_and_check(step, max_query_len=1, num_kv_splits=splits)


@pytest.mark.parametrize(
    "requests,kind",
    [(PREFILL, "prefill"), (CHUNKED, "chunked prefill"), (MIXED, "mixed prefill and decode")],
)
@pytest.mark.parametrize("splits", [1, 2])
def test_prefill_chunked_and_mixed_steps_match_float64(requests, kind, splits):
    step = build_step(requests, heads=5, block_size=16, seed=len(kind), device=DEVICE)
    run_and_check(step, num_kv_splits=splits)


@pytest.mark.parametrize("padding_tokens", [5, 6])
def test_padded_requests_and_tokens_get_zeros_and_nothing_else_is_written(padding_tokens):
    # As megatron-core pads a CUDA-graph step: requests of length 0 (table rows of -1) and tokens
    # past the last request. The padded rows must come out zero, not as the poison left there.
    # 34 real tokens in tiles of 8: 5 padding tokens end inside the last full tile of 8, 6 past
    # it.
    step = build_step(
        MIXED,
        heads=3,
        block_size=16,
        seed=5,
        padding_requests=3,
        padding_tokens=padding_tokens,
        device=DEVICE,
    )
    for splits in (1, 4):
        out = run_and_check(step, num_kv_splits=splits)
        pad = out[-padding_tokens:]
        assert torch.equal(pad, torch.zeros_like(pad))


def test_deepseek_v3_widths_and_a_non_power_of_two_head_shard():
    # 512 + 64 columns, 40 heads (a partial head tile), a chunked prefill beside two decodes.
    step = build_step(
        [(70, 1), (30, 4), (0, 1)],
        heads=40,
        latent_dim=512,
        rope_dim=64,
        block_size=64,
        seed=3,
        device=DEVICE,
    )
    run_and_check(step, num_kv_splits=2)


def test_block_size_256_and_int64_metadata():
    step = build_step(
        [(300, 1), (250, 7), (0, 2)],
        heads=2,
        block_size=256,
        seed=4,
        index_dtype=torch.int64,
        device=DEVICE,
    )
    run_and_check(step, num_kv_splits=2)


@pytest.mark.parametrize("max_query_len", [1, 2, 64, None])
def test_max_query_len_only_picks_the_tile_shape(max_query_len):
    # A bound below the real query lengths (1 and 2 here) gives tiles of one or a few tokens and
    # still the right answer.
    step = build_step(CHUNKED, heads=4, block_size=16, seed=6, device=DEVICE)
    run_and_check(step, max_query_len=max_query_len, num_kv_splits=1)


def test_strided_query_and_output():
    step = build_step(MIXED, heads=3, block_size=16, seed=7, device=DEVICE)
    wide = torch.randn(*step.query.shape[:2], step.query.shape[2] + 8, device=DEVICE)
    wide[..., 3 : 3 + step.query.shape[2]] = step.query
    query = wide[..., 3 : 3 + step.query.shape[2]]
    out_wide = torch.full((*query.shape[:2], step.latent_dim + 5), GUARD, device=DEVICE)
    out = out_wide[..., :-5]
    args = (step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths, SCALE)
    mla_paged_latent_attention(query, *args, rope_dim=step.rope_dim, out=out, num_kv_splits=2)
    torch.testing.assert_close(out.double(), attention_reference(step, SCALE), **FP32_TOLERANCE)
    assert (out_wide[..., -5:] == GUARD).all()


def _two_operand_query(step, qk_dim: int = 24):
    """The step's query as two operands, laid out as the dynamic MLA step passes them:
    ``q_nope @ W_UK`` a ``[heads, tokens, latent]`` matmul output viewed ``[tokens, heads,
    latent]``, the RoPE part the end of each row of a wider projected query (``q[..., qk_dim:]``,
    its first ``qk_dim`` columns guards)."""
    tokens, heads, _ = step.query.shape
    head_major = step.query[..., : step.latent_dim].transpose(0, 1).contiguous()
    projected = torch.full(
        (tokens, heads, qk_dim + step.rope_dim), GUARD, dtype=step.query.dtype, device=DEVICE
    )
    projected[..., qk_dim:] = step.query[..., step.latent_dim :]
    return head_major.transpose(0, 1), projected[..., qk_dim:]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """``x``'s elements as integers of their width (a bitwise comparison, NaNs included)."""
    return x.view({2: torch.int16, 4: torch.int32}[x.element_size()])


def assert_two_query_operands_give_the_bits_of_one(step, **kwargs) -> None:
    """The attention of ``step`` with its query as two operands (:func:`_two_operand_query`),
    into a token-major and a head-major output, bitwise equal to the one-operand call's (the
    concatenated query's)."""
    tokens, heads, _ = step.query.shape
    args = (step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths, SCALE)
    kwargs = dict(kwargs, rope_dim=step.rope_dim)
    one = mla_paged_latent_attention(step.query, *args, **kwargs)
    query, query_rope = _two_operand_query(step)
    shape = (heads, tokens, step.latent_dim)
    for name in ("new out", "head-major out"):
        out = None
        if name == "head-major out":
            out = torch.full(shape, float("nan"), dtype=step.query.dtype, device=DEVICE)
            out = out.transpose(0, 1)
        got = mla_paged_latent_attention(query, *args, out=out, query_rope=query_rope, **kwargs)
        assert got.shape == one.shape and (out is None or got.data_ptr() == out.data_ptr())
        assert torch.equal(_bits(got), _bits(one)), f"two operands, {name}: bits moved"


STEP_KINDS = {"decode": DECODE, "prefill": PREFILL, "chunked": CHUNKED, "mixed": MIXED}


@pytest.mark.parametrize(
    "kind,splits,dtype",
    [(kind, splits, torch.float32) for kind in STEP_KINDS for splits in (1, 3)]
    + [("mixed", 2, torch.float16)],
    ids=str,
)
def test_two_query_operands_give_the_bits_of_one(kind, splits, dtype):
    """The query's latent and RoPE parts through their own pointers and strides, and a
    head-major output: the same loads and arithmetic, so the same bits as the concatenated
    query's, for every step kind, with and without split-KV (padding tokens included)."""
    step = build_step(
        STEP_KINDS[kind],
        heads=3,
        block_size=16,
        dtype=dtype,
        seed=30 + splits,
        padding_tokens=2,
        device=DEVICE,
    )
    assert_two_query_operands_give_the_bits_of_one(
        step, max_query_len=1 if kind == "decode" else None, num_kv_splits=splits
    )


def test_two_query_operands_are_a_layout_of_their_own(monkeypatch):
    """The second operand is part of the plan's key: the one- and two-operand calls of one step
    get a plan each, and the two-operand plan reads the RoPE part from column 0 of its own
    pointer."""
    monkeypatch.setattr(attention, "ATTENTION_PLANS", PlanCache())
    step = build_step(MIXED, heads=2, block_size=16, seed=32, device=DEVICE)
    args = (step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths, SCALE)
    query, query_rope = _two_operand_query(step)
    mla_paged_latent_attention(step.query, *args, rope_dim=16, num_kv_splits=1)
    mla_paged_latent_attention(query, *args, rope_dim=16, num_kv_splits=1, query_rope=query_rope)
    one, two = attention.ATTENTION_PLANS.plans()
    assert one.stage1.args["Q_ROPE_COL"] == step.latent_dim and two.stage1.args["Q_ROPE_COL"] == 0
    assert two.stage1.args["q_rope_stride_h"] == query_rope.stride(1)
    assert two.stage1.args["q_stride_h"] == query.stride(1)


def test_inconsistent_metadata_never_reads_out_of_bounds():
    # The host cannot check the values without a sync: a -1 or too large block id where the
    # lengths say a row is used, and a length past the table's capacity. Those rows are skipped
    # and the context cut at the capacity (the reference follows the same rule).
    step = build_step([(40, 1), (20, 5)], heads=2, block_size=16, seed=8, device=DEVICE)
    step.block_table[0, 1] = -1
    step.block_table[1, 0] = step.kv_cache.shape[0]
    step.kv_lengths[0] = 1000
    run_and_check(step, num_kv_splits=2)


# Lengths the host cannot check without a sync (cu_query_lengths over 4 requests of 3 tokens
# each, 12 tokens): clamped into [0, tokens]; tokens outside [cu[0], cu[-1]) get zeros; if the
# clamped values decrease, every token inside them gets NaN. Never a read or write outside the
# tensors (the output's guards, the cache's bits).
BAD_CU = {
    "negative first": [-2, 1, 7, 10, 12],
    "past the tokens": [0, 3, 6, 9, 40],
    "huge": [0, 1, 2**30, 2**30, 2**30],
    "starting late": [1, 3, 6, 9, 12],
    "ending early": [0, 3, 6, 9, 10],
    "decreasing": [0, 6, 3, 9, 12],
    "negative inside": [0, 3, -5, 9, 12],
}


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("max_query_len", [1, None])
@pytest.mark.parametrize("case", sorted(BAD_CU))
def test_any_cu_query_lengths_stay_in_bounds_and_give_the_documented_output(
    case, max_query_len, splits
):
    step = build_step(
        [(20, 3), (5, 3), (0, 3), (40, 3)], heads=3, block_size=16, seed=9, device=DEVICE
    )
    step.cu_query_lengths.copy_(torch.tensor(BAD_CU[case], dtype=step.cu_query_lengths.dtype))
    # A finite poison: a token left unwritten must not pass for an expected NaN.
    run_and_check(step, max_query_len=max_query_len, num_kv_splits=splits, poison=GUARD)


@pytest.mark.parametrize("kv_lengths", [[-1, 8, 2**31 - 1, 3], [-(2**31), 0, 1, 2]])
def test_any_kv_lengths_stay_in_bounds(kv_lengths):
    # A negative length attends to nothing (zeros); one past the block table stops there.
    step = build_step(
        [(20, 3), (5, 3), (0, 3), (40, 3)], heads=2, block_size=16, seed=10, device=DEVICE
    )
    step.kv_lengths.copy_(torch.tensor(kv_lengths, dtype=step.kv_lengths.dtype))
    run_and_check(step, num_kv_splits=2, poison=GUARD)


def _cache_row(step, request: int, key: int) -> torch.Tensor:
    """The cache row that holds key ``key`` of request ``request`` (a view)."""
    block_size = step.kv_cache.shape[1]
    block = int(step.block_table[request, key // block_size])
    return step.kv_cache[block, key % block_size]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("splits", [1, 2])
def test_a_non_finite_row_reaches_only_the_tokens_that_attend_to_it(value, splits):
    # Request 0: 5 cached rows and 8 new tokens (one query tile). Its last new token's own row
    # holds the value: only that token attends to it, and it alone is NaN; the 7 tokens before
    # it are finite and right (a masked row adds nothing, not 0 * NaN). In the rope columns, a
    # -inf gives a -inf score: NaN too, not a row dropped from the softmax.
    step = build_step([(5, 8), (9, 1)], heads=3, block_size=4, seed=11, device=DEVICE)
    _cache_row(step, 0, 12)[-1] = value
    _cache_row(step, 0, 12)[3] = value
    out = run_and_check(step, num_kv_splits=splits, poison=GUARD)
    assert torch.isnan(out[7]).all()
    assert torch.isfinite(out[:7]).all() and torch.isfinite(out[8:]).all()


@pytest.mark.parametrize("splits", [1, 3])
def test_a_non_finite_row_in_one_split_makes_the_decode_token_nan(splits):
    # One decode token over 64 rows, the value in the first split's rows: the combine must not
    # read the NaN log-sum-exp as "nothing attended" and return the other splits' answer.
    step = build_step([(63, 1)], heads=2, block_size=16, seed=12, device=DEVICE)
    _cache_row(step, 0, 2)[-1] = float("inf")
    out = run_and_check(step, max_query_len=1, num_kv_splits=splits, poison=GUARD)
    assert torch.isnan(out).all()


@pytest.mark.parametrize("scale", [1.0, 2e38])
@pytest.mark.parametrize("splits", [1, 3])
def test_large_softmax_scales_do_not_overflow(scale, splits):
    # 2e38 makes the softmax a hard maximum: the scaled logits overflow float32, their
    # differences (stage 1's raw units above LARGE_SCALE_LOG2) do not.
    step = build_step(MIXED, heads=2, block_size=16, seed=13, device=DEVICE)
    out = check_attention_step(step, scale, FP32_TOLERANCE, num_kv_splits=splits)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("block_size", [1, 3, 5])
@pytest.mark.parametrize("splits", [1, 2])
def test_contexts_over_several_block_table_groups_match_float64(block_size, splits):
    # The kernel takes the block ids of at most 63 pages at a time (one vector load, then a
    # gather per key tile), so small pages spread a context over several groups: 1-row pages give
    # 32-key groups, 3-row pages 160-key groups whose 32-key tiles span up to 12 pages. Decode,
    # a chunked prefill and a new request, with a -1 id in a later group of the first request.
    step = build_step(
        [(200, 1), (97, 3), (330, 1), (0, 9)],
        heads=2,
        block_size=block_size,
        seed=block_size + splits,
        device=DEVICE,
    )
    step.block_table[0, 150 // block_size] = -1
    run_and_check(step, num_kv_splits=splits)


@pytest.mark.parametrize("block_size", [16, 32])
def test_page_tiles_over_several_block_table_groups_match_float64(block_size):
    # Pages that hold whole key tiles (fp32: 16 keys) take one block id per tile; contexts past
    # one group of 63 pages, with a -1 id in a later group and one in a split's first tile.
    step = build_step(
        [(2100, 1), (1100, 2), (64, 1)], heads=2, block_size=block_size, seed=3, device=DEVICE
    )
    step.block_table[0, 1500 // block_size] = -1
    step.block_table[1, 1024 // block_size] = -1
    run_and_check(step, num_kv_splits=2)


def test_64_bit_row_offsets_give_the_same_bits(monkeypatch):
    """Row offsets that could overflow 32 bits (a row stride over ~2**26 elements) are counted in
    64 bits; forced here on a small cache, they must change nothing."""
    step = build_step(MIXED, heads=3, block_size=16, seed=13, device=DEVICE)
    args = (step.query, step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths)
    narrow = mla_paged_latent_attention(*args, SCALE, rope_dim=16, num_kv_splits=2)
    monkeypatch.setattr(attention, "ATTENTION_PLANS", PlanCache())
    monkeypatch.setattr(attention_plan, "ROW_OFFSET_LIMIT", 0)
    wide = mla_paged_latent_attention(*args, SCALE, rope_dim=16, num_kv_splits=2)
    (plan,) = attention.ATTENTION_PLANS.plans()
    assert plan.stage1.args["WIDE_ROWS"] is True
    assert torch.equal(wide, narrow), "the 64-bit row offsets moved bits against the 32-bit ones"


def test_same_bits_on_every_launch():
    step = build_step(MIXED, heads=3, block_size=16, seed=9, device=DEVICE)
    args = (step.query, step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths)
    first = mla_paged_latent_attention(*args, SCALE, rope_dim=16, num_kv_splits=3)
    again = mla_paged_latent_attention(*args, SCALE, rope_dim=16, num_kv_splits=3)
    assert torch.equal(first, again)


def test_default_split_count_comes_from_static_sizes():
    cpu = torch.device("cpu")  # the interpreter's target: 2 "SMs", so 4 programs of 4 warps
    assert default_num_kv_splits(8, 1, 4096, cpu) == 1  # the tiles fill the target
    assert default_num_kv_splits(1, 1, 4096, cpu) == 4
    assert default_num_kv_splits(1, 1, 4096, cpu, num_warps=8) == 2  # one 8-warp program per SM
    assert default_num_kv_splits(3, 1, 4096, cpu) == 1  # rounded down: never a second wave
    assert default_num_kv_splits(1, 1, 300, cpu) == 1  # too short a context to split
    assert 1 <= default_num_kv_splits(1, 1, 10**9, cpu) <= MAX_KV_SPLITS
    # A planned launch for another GPU: its programs instead of a device.
    assert default_num_kv_splits(64, 2, 4096, None, target_programs=264) == 2
    assert default_num_kv_splits(64, 1, 4096, None, target_programs=264) == 4  # not 5
    with pytest.raises(ValueError, match="device or target_programs"):
        default_num_kv_splits(1, 1, 4096, None)
    step = build_step(DECODE, heads=2, seed=10, device=DEVICE)
    run_and_check(step, max_query_len=1)  # the default split count, whatever it is


@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("splits", [1, 3])
def test_32_head_decode_steps_64_keys_and_matches_float64(block_size, splits, monkeypatch):
    # 32 heads (a tensor-parallel-4 shard of 128) in 16 bits: 64-key tiles, one block id per
    # tile where they fill pages; contexts over several tiles, a -1 id inside a used range.
    step = build_step(
        [(0, 1), (63, 1), (64, 1), (200, 1), (129, 1)],
        heads=32,
        block_size=block_size,
        dtype=torch.float16,
        seed=block_size + splits,
        device=DEVICE,
    )
    step.block_table[3, 150 // block_size] = -1
    monkeypatch.setattr(attention, "ATTENTION_PLANS", PlanCache())
    run_and_check(step, tolerance=FP16_TOLERANCE, max_query_len=1, num_kv_splits=splits)
    (plan,) = attention.ATTENTION_PLANS.plans()
    assert plan.stage1.args["BLOCK_N"] == tile_rules.WIDE_KEY_TILE == 64
    assert plan.stage1.args["PAGE_TILES"] is (block_size == 64)


def _combine_with_tiles(step, tiles, splits, rope_dim):
    """The attention of ``step`` through plans that differ only in stage 2's tile."""
    args = (step.query, step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths)
    latent_dim = step.query.shape[2] - rope_dim
    tokens, heads = step.query.shape[:2]
    outs = []
    for combine in tiles:
        out = torch.full((tokens, heads, latent_dim), float("nan"), dtype=step.query.dtype)
        out = out.to(step.query.device)
        plan = attention_plan.LatentAttentionPlan(
            *args,
            SCALE,
            out,
            latent_dim=latent_dim,
            tile=tile_rules.tile_shape(tokens, heads, latent_dim, None, False),
            num_kv_splits=splits,
            num_stages=3,
            combine=tile_rules.CombineTile(*combine),
        )
        plan(*args, out)
        outs.append(out)
    return outs


def test_combine_tiles_give_the_same_bits():
    """Stage 2's tile only groups the output elements into programs: each element's sum runs
    over the splits in the same order, so every tile gives the bits of every other."""
    step = build_step(MIXED, heads=3, block_size=16, seed=12, device=DEVICE)
    tiles = [(4, 32), (1, 16), (2, 32), (4, 16)]
    outs = _combine_with_tiles(step, tiles, splits=3, rope_dim=16)
    reference = attention_reference(step, SCALE)
    torch.testing.assert_close(outs[0].double(), reference, **FP32_TOLERANCE)
    for tile, out in zip(tiles[1:], outs[1:]):
        assert torch.equal(out, outs[0]), f"combine tile {tile} moved bits against {tiles[0]}"


# fp16 (the interpreter has no bf16 dot): the keys, the probabilities cast for the value product
# and the output are each rounded to 2**-11 relative, so outputs of magnitude <= ~3 stay within
# ~3e-3 of float64.
FP16_TOLERANCE = dict(rtol=4e-3, atol=4e-3)


@pytest.mark.parametrize("heads", [40, 128])
def test_wide_decode_tile_matches_float64(heads, monkeypatch):
    step = build_step(
        DECODE, heads=heads, block_size=16, dtype=torch.float16, seed=heads, device=DEVICE
    )
    launches = record_launches(monkeypatch, attention_plan, "STAGE1_LAUNCHES")
    run_and_check(step, tolerance=FP16_TOLERANCE, max_query_len=1, num_kv_splits=2)
    # Stage 1's grid is (query tiles, head tiles, splits): one head tile per 64 heads.
    assert [grid[1:] for grid in launches] == [(-(-heads // 64), 2)]


def test_no_tokens_is_no_launch(monkeypatch):
    step = build_step([(3, 1)], heads=2, seed=11, device=DEVICE)
    launches = _record_launches(monkeypatch)
    out = mla_paged_latent_attention(
        step.query[:0],
        step.kv_cache,
        step.block_table,
        step.cu_query_lengths,
        step.kv_lengths,
        SCALE,
        rope_dim=16,
    )
    assert out.shape == (0, 2, 32) and launches == []


def _record_launches(monkeypatch):
    return record_launches(monkeypatch, attention_plan, "STAGE1_LAUNCHES", "COMBINE_LAUNCHES")


def _bad_inputs():
    step = build_step([(5, 2), (0, 3)], heads=2, seed=12, device=DEVICE)
    q, cache, table, cu, kv = (
        step.query,
        step.kv_cache,
        step.block_table,
        step.cu_query_lengths,
        step.kv_lengths,
    )
    good = dict(
        query=q,
        kv_cache=cache,
        block_table=table,
        cu_query_lengths=cu,
        kv_lengths=kv,
        softmax_scale=SCALE,
        rope_dim=16,
    )
    out = torch.empty(q.shape[0], 2, 32, device=DEVICE)
    yield "query list", dict(good, query=q.tolist()), TypeError, "query must be a torch.Tensor"
    yield "int query", dict(good, query=q.long()), TypeError, "query must have dtype"
    yield "4-d query", dict(good, query=q.unsqueeze(1)), ValueError, "query must be"
    yield "query last stride", dict(
        good, query=q.transpose(1, 2).contiguous().transpose(1, 2)
    ), ValueError, "query must have unit stride"
    yield "rope_dim not a power of two", dict(good, rope_dim=12), ValueError, "rope_dim must be"
    yield "latent width not a power of two", dict(
        good,
        query=torch.zeros(5, 2, 40, device=DEVICE),
        kv_cache=torch.zeros(4, 16, 40, device=DEVICE),
    ), ValueError, "latent width"
    yield "cache dtype", dict(good, kv_cache=cache.half()), TypeError, "kv_cache is torch.float16"
    yield "cache width", dict(good, kv_cache=cache[..., :40]), ValueError, "kv_cache rows are 40"
    yield "2-d cache", dict(good, kv_cache=cache[0]), ValueError, "kv_cache must be"
    huge_blocks = cache[:1, :1].expand(1, 2**24 + 1, cache.shape[2])  # a view: no memory
    yield "block size", dict(good, kv_cache=huge_blocks), ValueError, "block size 16777217"
    yield "float table", dict(good, block_table=table.float()), TypeError, "block_table must"
    yield "1-d table", dict(good, block_table=table[0]), ValueError, "block_table must be"
    yield "short cu", dict(good, cu_query_lengths=cu[:-1]), ValueError, "cu_query_lengths must"
    yield "strided kv", dict(
        good, kv_lengths=torch.zeros(4, dtype=torch.int32, device=DEVICE)[::2]
    ), ValueError, "kv_lengths must be contiguous"
    yield "tensor scale", dict(good, softmax_scale=torch.tensor(0.1)), TypeError, "softmax_scale"
    yield "negative scale", dict(good, softmax_scale=-1.0), ValueError, "softmax_scale must be"
    yield "nan scale", dict(good, softmax_scale=float("nan")), ValueError, "softmax_scale must be"
    yield "scale below float32", dict(good, softmax_scale=1e-300), ValueError, "normal range"
    yield "scale above float32", dict(good, softmax_scale=1e39), ValueError, "normal range"
    yield "scale above float", dict(good, softmax_scale=10**400), ValueError, "softmax_scale"
    yield "max_query_len 0", dict(good, max_query_len=0), ValueError, "max_query_len must be"
    yield "too many splits", dict(
        good, num_kv_splits=MAX_KV_SPLITS + 1
    ), ValueError, "num_kv_splits must be"
    yield "out dtype", dict(good, out=out.half()), TypeError, "out must have dtype"
    yield "out shape", dict(good, out=out[:, :1]), ValueError, "out must have shape"
    yield "expanded out", dict(
        good, out=torch.zeros(1, 2, 32, device=DEVICE).expand(q.shape[0], 2, 32)
    ), ValueError, "share memory"
    yield "out inside the query", dict(good, out=q[..., :32]), ValueError, "out overlaps query"
    yield "out inside the cache", dict(
        good, out=step.cache_buffer[: out.numel()].view(out.shape)
    ), ValueError, "out overlaps kv_cache"
    yield "table on the meta device", dict(
        good, block_table=table.to("meta")
    ), ValueError, "block_table is on meta"
    # The query as two operands: the second gets every check the first gets.
    two = dict(good, query=q[..., :32], query_rope=q[..., 32:])
    yield "query_rope list", dict(
        two, query_rope=q[..., 32:].tolist()
    ), TypeError, "query_rope must be a torch.Tensor"
    yield "int query_rope", dict(
        two, query_rope=q[..., 32:].long()
    ), TypeError, "query_rope must have dtype"
    yield "query_rope dtype", dict(
        two, query_rope=q[..., 32:].half()
    ), TypeError, "query_rope is torch.float16"
    yield "query_rope on the meta device", dict(
        two, query_rope=q[..., 32:].to("meta")
    ), ValueError, "query_rope is on meta"
    yield "query_rope tokens", dict(two, query_rope=q[1:, :, 32:]), ValueError, "query_rope must be"
    yield "query_rope heads", dict(two, query_rope=q[:, :1, 32:]), ValueError, "query_rope must be"
    yield "query_rope width", dict(two, query_rope=q[..., 40:]), ValueError, "query_rope must be"
    yield "query_rope 2-d", dict(two, query_rope=q[:, 0, 32:]), ValueError, "query_rope must be"
    yield "query_rope last stride", dict(
        two, query_rope=q[..., 32:].transpose(1, 2).contiguous().transpose(1, 2)
    ), ValueError, "query_rope must have unit stride"
    yield "two-operand query width", dict(
        two, query=q[..., :24]
    ), ValueError, "latent width \\(query width 24"
    yield "two-operand 2-d query", dict(
        two, query=q[:, 0, :32]
    ), ValueError, "query must be \\[tokens, heads, latent_dim\\] \\(query_rope given"
    yield "two-operand query last stride", dict(
        two, query=q[..., :32].transpose(1, 2).contiguous().transpose(1, 2)
    ), ValueError, "query must have unit stride"
    yield "two-operand cache width", dict(
        two, kv_cache=cache[..., :40]
    ), ValueError, "kv_cache rows are 40 wide, query \\+ query_rope rows 32 \\+ 16"

    # Heads 2**30 elements apart in a batch of no tokens (no memory): the last of three heads
    # starts 2**31 elements past the first, past the kernel's 32-bit head offsets.
    def far_heads(width):
        return torch.empty(0, device=DEVICE).as_strided((0, 3, width), (width, 2**30, 1))

    empty = dict(good, query=torch.zeros(0, 3, 48, device=DEVICE))
    yield "query heads 2**31 apart", dict(empty, query=far_heads(48)), ValueError, "query's head"
    yield "out heads 2**31 apart", dict(empty, out=far_heads(32)), ValueError, "out's head"
    yield "query_rope heads 2**31 apart", dict(
        empty, query=torch.zeros(0, 3, 32, device=DEVICE), query_rope=far_heads(16)
    ), ValueError, "query_rope's head"
    rope_and_out = torch.zeros(q.shape[0], 2, 48, device=DEVICE)
    yield "out beside query_rope in one buffer", dict(
        two, query_rope=rope_and_out[..., :16], out=rope_and_out[..., 16:]
    ), ValueError, "out overlaps query_rope"


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda case: case[0])
def test_bad_input_is_refused_before_any_launch(case, monkeypatch):
    _, kwargs, error, match = case
    launches = _record_launches(monkeypatch)
    with pytest.raises(error, match=match):
        mla_paged_latent_attention(**kwargs)
    assert launches == []


@pytest.mark.parametrize("case", list(_bad_inputs()), ids=lambda case: case[0])
def test_bad_input_is_refused_after_a_good_call_of_its_layout(case, monkeypatch):
    assert_refused_after_a_call_of_its_layout(
        mla_paged_latent_attention,
        attention_plan,
        ("STAGE1_LAUNCHES", "COMBINE_LAUNCHES"),
        case,
        monkeypatch,
    )


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch):
    from megatron_ext.fusions import tensor_checks

    monkeypatch.setattr(tensor_checks, "INTERPRETED", False)
    step = build_step([(3, 1)], heads=1, seed=13)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        mla_paged_latent_attention(
            step.query, step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths, 1.0
        )


# --------------------------------------------------------------------------------------------------
# GPU: bf16, DeepSeek-V3 widths, large head counts and contexts, CUDA graphs.
# --------------------------------------------------------------------------------------------------

# bf16 inputs are exact in the float64 reference; the kernel rounds the softmax weights to bf16
# for the value product (2**-9 relative each) and the output to bf16 (2**-9 relative), so an
# output of magnitude <= ~3 is within about 1e-2 (measured on an H200: <= 4e-3).
BF16_TOLERANCE = dict(rtol=1.6e-2, atol=1.6e-2)


def _v3_step(requests, heads, seed):
    """A bf16 step at DeepSeek-V3's widths, page size 64 ((cached, new) tokens per request)."""
    return build_step(
        requests,
        heads=heads,
        latent_dim=512,
        rope_dim=64,
        block_size=64,
        dtype=torch.bfloat16,
        device=DEVICE,
        seed=seed,
    )


GPU_DTYPES = {"bf16": (torch.bfloat16, BF16_TOLERANCE), "fp32": (torch.float32, FP32_TOLERANCE)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_DTYPES), ids=str)
@pytest.mark.parametrize("heads", [1, 3, 16, 32, 40, 128])
@pytest.mark.parametrize("block_size", [16, 64, 256])
@pytest.mark.parametrize(
    "requests",
    [
        [(0, 1), (1000, 1), (63, 1), (64, 1), (2047, 1)],
        [(0, 300), (0, 1), (0, 65)],
        [(500, 37), (64, 64), (1, 200)],
        [(2000, 1), (0, 129), (300, 17), (0, 1), (4000, 1), (77, 3)],
    ],
    ids=["decode", "prefill", "chunked", "mixed"],
)
def test_gpu_step_kinds_match_float64(requests, block_size, heads, dtype):
    """Every tile the launcher picks (decode head tiles of 16, 32 and 64 with their key tiles,
    prefill tiles of 1 to 64 tokens, 4 and 8 warps, one block id per key tile or one per row):
    float64's answer, and with the query as two operands and a head-major output the
    concatenated query's bits, with one split and with the launcher's count."""
    torch_dtype, tolerance = GPU_DTYPES[dtype]
    step = build_step(
        requests,
        heads=heads,
        latent_dim=512,
        rope_dim=64,
        block_size=block_size,
        dtype=torch_dtype,
        device=DEVICE,
        seed=heads + block_size,
        padding_requests=2,
        padding_tokens=5,
    )
    decode_only = all(new == 1 for _, new in requests)
    max_query_len = 1 if decode_only else None
    run_and_check(step, tolerance=tolerance, max_query_len=max_query_len)
    for splits in (1, None):
        assert_two_query_operands_give_the_bits_of_one(
            step, max_query_len=max_query_len, num_kv_splits=splits
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", list(GPU_DTYPES), ids=str)
@pytest.mark.parametrize("heads", [16, 32, 128])
@pytest.mark.parametrize("batch", [1, 16, 64, 128])
def test_gpu_decode_batches_with_contexts_to_4k(batch, heads, dtype):
    torch_dtype, tolerance = GPU_DTYPES[dtype]
    gen = torch.Generator().manual_seed(batch * heads)
    contexts = torch.randint(0, 4096, (batch,), generator=gen).tolist()
    contexts[0] = 4095  # one request at the full 4k
    step = build_step(
        [(c, 1) for c in contexts],
        heads=heads,
        latent_dim=512,
        rope_dim=64,
        block_size=64,
        dtype=torch_dtype,
        device=DEVICE,
        seed=batch,
    )
    run_and_check(step, tolerance=tolerance, max_query_len=1)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, None])
@pytest.mark.parametrize("heads", [16, 32, 128])
def test_gpu_decode_over_several_full_block_table_groups(heads, splits):
    # Contexts past 63 pages per split fill whole groups of block ids: the software pipeline
    # then computes the next tiles' page indices past the group's last page. With 64-head tiles
    # on an H200 an unclamped index read outside the gather's scratch (illegal address, seen in
    # the benchmark at batch 64, context 16k, 128 heads).
    contexts = [12000, 4031, 4032, 4033, 8100, 16383]
    step = _v3_step([(c, 1) for c in contexts], heads, seed=heads + (splits or 0))
    run_and_check(step, tolerance=BF16_TOLERANCE, max_query_len=1, num_kv_splits=splits)


def graph_replays_equal_eager(step, max_query_len, num_kv_splits, refresh, tolerance, check=None):
    """Capture one call on static buffers, change the step's contents in place (``refresh``, 3
    rounds), replay, and compare with an eager call on the same contents, bitwise, and with float64
    within ``tolerance``; ``check(round_, out)``, where given, asserts more of each replay."""
    args = (step.query, step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths)
    kwargs = dict(rope_dim=step.rope_dim, max_query_len=max_query_len, num_kv_splits=num_kv_splits)
    out = torch.empty(*step.query.shape[:2], step.latent_dim, dtype=step.query.dtype, device=DEVICE)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        mla_paged_latent_attention(*args, SCALE, out=out, **kwargs)  # compiles outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_paged_latent_attention(*args, SCALE, out=out, **kwargs)
    as_int = {2: torch.int16, 4: torch.int32}[out.element_size()]
    for round_ in range(3):
        refresh(round_)
        out.fill_(float("nan"))
        graph.replay()
        eager = mla_paged_latent_attention(*args, SCALE, **kwargs)
        torch.cuda.synchronize()
        assert torch.equal(out.view(as_int), eager.view(as_int)), f"replay {round_} moved bits"
        torch.testing.assert_close(out.double(), attention_reference(step, SCALE), **tolerance)
        if check is not None:
            check(round_, out)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_graph_replay_with_changing_lengths_equals_eager_bitwise(dtype):
    # A decode graph (split-KV) and a mixed-step graph (one split), replayed while the requests'
    # lengths, block tables and queries change underneath, as the engine's graphs are.
    gen = torch.Generator().manual_seed(1)
    tolerance = GPU_DTYPES["bf16" if dtype == torch.bfloat16 else "fp32"][1]
    decode = build_step(
        [(3000, 1)] * 8 + [(0, 1)] * 4,
        heads=16,
        latent_dim=512,
        rope_dim=64,
        block_size=64,
        dtype=dtype,
        device=DEVICE,
        seed=2,
    )

    def refresh_decode(round_):
        lengths = torch.randint(1, 3002, (8,), generator=gen, dtype=torch.int32)
        decode.kv_lengths[:8].copy_(lengths.to(DEVICE))
        decode.query.copy_(torch.randn(decode.query.shape, generator=gen).to(dtype))

    graph_replays_equal_eager(decode, 1, None, refresh_decode, tolerance)
    # Every request has room for 300 cached + 64 new rows; the rounds move the 130 new tokens
    # between the requests and the cached counts with them.
    mixed = build_step(
        [(300, 64), (300, 64), (300, 1), (300, 1)],
        heads=40,
        latent_dim=512,
        rope_dim=64,
        block_size=64,
        dtype=dtype,
        device=DEVICE,
        seed=3,
        padding_tokens=4,
    )

    def refresh_mixed(round_):
        new = torch.tensor([(30, 98, 1, 1), (1, 1, 64, 64), (64, 1, 1, 64)][round_])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), new.cumsum(0)])
        mixed.cu_query_lengths.copy_(cu.to(torch.int32).to(DEVICE))
        cached = torch.tensor([250, 7, 300, 0])
        mixed.kv_lengths.copy_((cached + new).to(torch.int32).to(DEVICE))
        mixed.query.copy_(torch.randn(mixed.query.shape, generator=gen).to(dtype))

    graph_replays_equal_eager(mixed, None, 1, refresh_mixed, tolerance)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4, None], ids=["1_split", "4_splits", "default_splits"])
@pytest.mark.parametrize("heads", [1, 16, 32, 128])
def test_gpu_relaunch_gives_identical_bits(heads, splits):
    """25 launches on fresh copies of one input give one set of bits: no race between a launch's
    programs, nor between the split-KV partials and their fixed-order combine (the determinism
    manifest's race test for this kernel)."""
    step = _v3_step(MIXED, heads, seed=21)
    inputs = (step.query, step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths)

    def launch():
        fresh = [x.clone() for x in inputs]
        return mla_paged_latent_attention(*fresh, SCALE, rope_dim=64, num_kv_splits=splits)

    first = launch().view(torch.int16)
    differing = [i for i in range(25) if not torch.equal(launch().view(torch.int16), first)]
    assert not differing, f"{heads} heads, splits {splits}: launches {differing} gave other bits"


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_combine_tiles_give_the_same_bits(heads):
    """The launcher's stage-2 tile against the one-program-per-16-heads tile it replaced and the
    narrowest, on the GPU's compiled code (bf16, DeepSeek-V3 widths, 16 splits)."""
    step = _v3_step([(4000, 1), (63, 1), (1500, 1), (0, 1)], heads, seed=heads)
    default = tuple(tile_rules.combine_tile(heads, 512, 16))
    tiles = [default, (16, 512), (1, 64), (16, 64)]
    outs = _combine_with_tiles(step, tiles, splits=16, rope_dim=64)
    for tile, out in zip(tiles[1:], outs[1:]):
        assert torch.equal(
            out.view(torch.int16), outs[0].view(torch.int16)
        ), f"combine tile {tile} moved bits against the launcher's {default}"


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 4])
def test_gpu_direct_launches_equal_jit_launches_bitwise(splits, monkeypatch):
    """After a specialisation's first call the kernels launch through their C launchers; those
    launches write a JIT launch's bits, for decode batches of other sizes (unspecialised) too."""
    if not direct_launch.verified(torch.device("cuda", torch.cuda.current_device())):
        pytest.skip("the direct launch is off on this Triton (its probe warned why)")
    steps = [
        _v3_step([(context, 1) for context in contexts], 128, seed=len(contexts))
        # Other batch sizes and lengths, one block-table width (a context's table is fixed).
        for contexts in ([100, 2000, 63, 64, 1], [2000] + [700] * 8, [2000, 5, 300])
    ]

    def run(step):
        args = (step.query, step.kv_cache, step.block_table, step.cu_query_lengths)
        return mla_paged_latent_attention(
            *args, step.kv_lengths, SCALE, rope_dim=64, max_query_len=1, num_kv_splits=splits
        )

    def fresh_launches():
        for name in ("STAGE1_LAUNCHES", "COMBINE_LAUNCHES"):
            launches = getattr(attention_kernels, name)
            fresh = KernelLaunches(launches.kernel, launches.unspecialized)
            monkeypatch.setattr(attention_plan, name, fresh)
        monkeypatch.setattr(
            attention, "ATTENTION_PLANS", PlanCache()
        )  # plans launch what they hold

    fresh_launches()
    run(steps[0])  # binds
    direct = [run(step) for step in steps]
    # One specialisation per stage for the three steps: the later calls were direct.
    stage1, combine = attention_plan.STAGE1_LAUNCHES, attention_plan.COMBINE_LAUNCHES
    bound = list(stage1.launches.values()) + list(combine.launches.values())
    assert len(bound) == (1 if splits == 1 else 2), bound
    assert all(callable(launch) for launch in bound), bound
    for i, step in enumerate(steps):
        fresh_launches()  # a specialisation's first call: Triton's JIT
        assert torch.equal(run(step).view(torch.int16), direct[i].view(torch.int16)), i


@pytest.mark.parametrize("first", [0, 3])
@pytest.mark.parametrize("max_query_len", [None, 1, 8])
@pytest.mark.parametrize("splits", [1, 2])
def test_a_step_of_padding_only_writes_zeros_inside_its_output(first, max_query_len, splits):
    """No request, only padding tokens (a CUDA-graph step padded from zero requests, or any
    ``block_table`` with zero rows): every token of ``out`` is zero and nothing outside ``out``
    is written, with query tiles of one token or several (the tiles before the first request's
    must not be read as tiles past the last)."""
    tokens, heads, latent, rope, guard_rows = 6, 2, 16, 16, 24
    query = torch.randn(tokens, heads, latent + rope, device=DEVICE)
    cache = torch.randn(2, 16, latent + rope, device=DEVICE)
    block_table = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    cu_query_lengths = torch.tensor([first], dtype=torch.int32, device=DEVICE)
    kv_lengths = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    buffer = torch.full((guard_rows + tokens + guard_rows, heads, latent), 7.0, device=DEVICE)
    out = buffer[guard_rows : guard_rows + tokens]
    result = mla_paged_latent_attention(
        query,
        cache,
        block_table,
        cu_query_lengths,
        kv_lengths,
        SCALE,
        rope_dim=rope,
        max_query_len=max_query_len,
        num_kv_splits=splits,
        out=out,
    )
    assert result.data_ptr() == out.data_ptr()
    assert torch.equal(out, torch.zeros_like(out))
    before, after = buffer[:guard_rows], buffer[guard_rows + tokens :]
    assert torch.equal(before, torch.full_like(before, 7.0)), "wrote before out"
    assert torch.equal(after, torch.full_like(after, 7.0)), "wrote past out"
