# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""GPU tests of the warp-specialized decode kernel of the latent attention
(megatron_ext.fusions.mla_latent.decode_gluon, launched by attention_plan where
``gluon_decode_refusal`` gives no reason).

The kernel replaces stage 1 for decode tiles on Hopper, so it has to honour everything the public
entry promises for them: float64's answer within stage 1's tolerances, padding and malformed
metadata handled as documented, rows a token does not attend to never reaching it, the cache left
bitwise unchanged and nothing written outside the output, the same bits on every launch and under
CUDA-graph replay, and the two-operand query giving the one-operand query's bits. Its summation
order is its own, so it is compared with stage 1 within a tolerance, never bitwise.

Every test turns the switch on and asserts that each plan the call made launched the Gluon kernel,
so a silent fallback to stage 1 fails instead of passing on stage 1's results. The module skips
where there is no CUDA device, and where the kernel is refused on this GPU or Triton (the
refusal's reason is the skip's).
"""

import pytest
import torch

from megatron_ext.fusions.launch_math import cdiv
from megatron_ext.fusions.mla_latent import (
    attention,
    attention_plan,
    mla_paged_latent_attention,
    tile_rules,
)
from tests.unit_tests.fusions.mla_latent.test_attention import (
    BF16_TOLERANCE,
    FP16_TOLERANCE,
    SCALE,
    graph_replays_equal_eager,
)
from tests.unit_tests.fusions.mla_latent_cache_testlib import (
    ALIGNED_CACHE_OFFSET,
    GUARD,
    attention_reference,
    build_step,
    check_attention_step,
    fresh_plan_caches,
    gluon_decode_refusal_here,
)

if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA GPU (the Gluon decode kernel is Hopper only)", allow_module_level=True
    )


_REASON = gluon_decode_refusal_here()
if _REASON is not None:
    pytest.skip(f"the Gluon decode kernel is refused here: {_REASON}", allow_module_level=True)

DEVICE = torch.device("cuda")
LATENT, ROPE = 512, 64
# Contexts (cached rows, the new one included) around the edges of 32- and 64-key tiles, one
# long one.
CONTEXTS = [1, 63, 64, 65, 1000, 4096]


@pytest.fixture(autouse=True)
def gluon_decode_on(monkeypatch):
    """The switch on and empty plan caches (a cached plan keeps the kernel it was made with)."""
    monkeypatch.setattr(attention_plan, "GLUON_DECODE", True)
    fresh_plan_caches(monkeypatch)


def assert_gluon_ran():
    """Every plan made since the caches were emptied launches the Gluon kernel (a fallback to
    stage 1 would otherwise pass on stage 1's results); returns the plans."""
    plans = attention.ATTENTION_PLANS.plans()
    assert plans, "no call was planned"
    for plan in plans:
        assert plan.kernel == "gluon", f"a plan fell back to {plan.kernel}"
        assert plan.stage1.launches is attention_plan.GLUON_DECODE_LAUNCHES, "stage 1 launched"
    return plans


def decode_step(contexts, heads, *, block_size=64, dtype=torch.bfloat16, seed=0, **kwargs):
    """A decode step at DeepSeek-V3's widths: one new token per request, whose ``contexts`` count
    the cached rows with the new one (build_step shuffles the blocks among spare ones)."""
    kwargs.setdefault("cache_offset", ALIGNED_CACHE_OFFSET)  # the kernel takes no other cache
    return build_step(
        [(context - 1, 1) for context in contexts],
        heads=heads,
        latent_dim=LATENT,
        rope_dim=ROPE,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        seed=seed,
        **kwargs,
    )


def run_and_check(step, *, splits=None, tolerance=BF16_TOLERANCE, scale=SCALE, poison=None):
    """The Gluon kernel against float64 through ``check_attention_step`` (guarded, poisoned
    output; the cache bitwise unchanged); asserts that the kernel ran and returns the output."""
    extra = {} if poison is None else dict(poison=poison)
    out = check_attention_step(
        step, scale, tolerance, max_query_len=1, num_kv_splits=splits, **extra
    )
    assert_gluon_ran()
    return out


def call(step, *, splits=None, scale=SCALE, **kwargs):
    """The public entry on ``step`` as a decode step (a new output unless ``out`` is given)."""
    return mla_paged_latent_attention(
        step.query,
        step.kv_cache,
        step.block_table,
        step.cu_query_lengths,
        step.kv_lengths,
        scale,
        rope_dim=step.rope_dim,
        max_query_len=1,
        num_kv_splits=splits,
        **kwargs,
    )


def bits(x):
    """A 16-bit tensor's elements as integers (a bitwise comparison, NaNs included)."""
    return x.view(torch.int16)


def cache_row(step, request, key):
    """The cache row holding key ``key`` of ``request`` (a view)."""
    block_size = step.kv_cache.shape[1]
    return step.kv_cache[int(step.block_table[request, key // block_size]), key % block_size]


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 16, 37, 64, 128])
@pytest.mark.parametrize("heads", [32, 40, 64, 65, 80, 128])
def test_decode_steps_match_float64(heads, block_size):
    """Head counts that fill 64-head programs or leave one partial, pages of one row to 128 rows
    (37: a key tile over several pages, not a divisor), contexts at the key tile's edges and 4k,
    shuffled pages, padded requests and tokens, the launcher's split count: float64's answer."""
    step = decode_step(
        CONTEXTS,
        heads,
        block_size=block_size,
        seed=heads + block_size,
        padding_requests=2,
        padding_tokens=3,
    )
    out = run_and_check(step)
    assert torch.equal(out[-3:], torch.zeros_like(out[-3:])), "padding tokens are not zeros"


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2, 5, None], ids=["1", "2", "5", "default"])
@pytest.mark.parametrize("heads", [40, 128])
def test_split_counts_match_float64(heads, splits):
    """Explicit split counts (5 leaves the short contexts' later splits empty) and the default,
    which for this kernel is the wave rule's (one program per SM): float64's answer, one program
    per token, 64 heads and split."""
    step = decode_step(CONTEXTS, heads, seed=7 + heads, padding_requests=1, padding_tokens=2)
    run_and_check(step, splits=splits)
    (plan,) = assert_gluon_ran()
    tokens = step.query.shape[0]
    expected = splits
    if splits is None:
        expected = tile_rules.wave_num_kv_splits(
            tokens * cdiv(heads, 64),
            tile_rules.launch_limits(DEVICE).sms,
            step.block_table.shape[1] * step.kv_cache.shape[1],
        )
    assert plan.stage1.args["NUM_SPLITS"] == expected
    groups = cdiv(heads, 64)
    first = (groups, tokens) if plan.stage1.args["HEADS_FIRST"] else (tokens, groups)
    assert plan.stage1.grid == (*first, expected)
    assert (plan.combine is None) == (expected == 1)


@pytest.mark.gpu
def test_fp16_decode_matches_float64():
    step = decode_step(CONTEXTS, 128, dtype=torch.float16, seed=3, padding_tokens=2)
    run_and_check(step, tolerance=FP16_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 37])
def test_inconsistent_block_ids_and_lengths_stay_in_bounds(block_size, splits):
    """Values the host cannot check without a sync: a -1 id and one past the cache where the
    lengths say rows are used (skipped, never read), lengths past the block table's capacity
    (cut there), negative and zero lengths (nothing attended: zeros)."""
    step = decode_step(
        [1000, 63, 4096, 100, 65, 200],
        80,
        block_size=block_size,
        seed=11 + block_size + splits,
        padding_requests=1,
        padding_tokens=2,
    )
    step.block_table[0, 500 // block_size] = -1
    step.block_table[2, 1000 // block_size] = step.kv_cache.shape[0]
    step.kv_lengths[1] = 2**31 - 1
    step.kv_lengths[3] = -(2**31)
    step.kv_lengths[4] = 0
    # A finite poison: a row left unwritten must not pass for an expected value.
    out = run_and_check(step, splits=splits, poison=GUARD)
    assert torch.equal(out[3:5], torch.zeros_like(out[3:5]))


# cu_query_lengths of a 6-token step over 6 requests the host cannot check: clamped into
# [0, tokens]; tokens outside [cu[0], cu[-1]) get zeros; all tokens inside NaN if the clamped
# values decrease. max_query_len=1 is only a bound: a request of several tokens is still right.
DECODE_CU = {
    "padded tail": [0, 1, 2, 3, 4, 4, 4],
    "negative first": [-2, 1, 2, 3, 4, 5, 6],
    "past the tokens": [0, 1, 2, 3, 4, 5, 40],
    "huge": [0, 1, 2**30, 2**30, 2**30, 2**30, 2**30],
    "starting late": [2, 2, 3, 3, 4, 5, 6],
    "three tokens in a request": [0, 3, 3, 4, 5, 6, 6],
    "decreasing": [0, 1, 3, 2, 4, 5, 6],
    "negative inside": [0, 1, -5, 3, 4, 5, 6],
}


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", list(DECODE_CU))
def test_any_cu_query_lengths_give_the_documented_output(case, splits):
    step = decode_step([40, 700, 63, 1, 64, 300], 80, block_size=16, seed=len(case))
    step.cu_query_lengths.copy_(torch.tensor(DECODE_CU[case], dtype=torch.int32))
    run_and_check(step, splits=splits, poison=GUARD)


def _many_requests_cu(case, requests):
    """cu_query_lengths of a decode step of ``requests`` tokens with ``case`` applied past the
    first rounds of the kernel's request search (``tile_rules.SEQ_BLOCK`` requests a round)."""
    cu = torch.arange(requests + 1, dtype=torch.int32)
    if case == "two tokens in a request":  # request 538 empty, 539 holds tokens 538 and 539
        cu[539] = 538
    elif case == "decreasing":
        cu[550], cu[551] = cu[551].item(), cu[550].item()
    elif case == "padded tail":
        cu[580:] = 580
    return cu


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("case", ["decode", "two tokens in a request", "decreasing", "padded tail"])
def test_steps_of_more_requests_than_a_round_of_the_search(case, splits):
    """600 requests: a token's request (also one that is not the token's index), its bounds and
    the lengths' order are found past the search's first rounds of loads."""
    requests = 600
    assert requests > 4 * tile_rules.SEQ_BLOCK, "the search must take several rounds"
    step = decode_step([1 + (7 * r) % 90 for r in range(requests)], 32, block_size=16, seed=5)
    step.cu_query_lengths.copy_(_many_requests_cu(case, requests))
    run_and_check(step, splits=splits, poison=GUARD)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("first", [0, 3])
def test_a_step_of_padding_only_writes_zeros_inside_its_output(first, splits):
    """No request, only padding tokens (a decode graph padded from zero requests): every token
    is zero, whether cu_query_lengths[0] puts them before or after the (empty) requests, and
    nothing outside the output is written."""
    tokens, heads, guard_rows = 6, 64, 5
    query = torch.randn(tokens, heads, LATENT + ROPE, device=DEVICE).to(torch.bfloat16)
    cache = torch.randn(2, 64, LATENT + ROPE, device=DEVICE).to(torch.bfloat16)
    block_table = torch.zeros(0, 2, dtype=torch.int32, device=DEVICE)
    cu_query_lengths = torch.tensor([first], dtype=torch.int32, device=DEVICE)
    kv_lengths = torch.zeros(0, dtype=torch.int32, device=DEVICE)
    buffer = torch.full(
        (guard_rows + tokens + guard_rows, heads, LATENT),
        GUARD,
        dtype=torch.bfloat16,
        device=DEVICE,
    )
    out = buffer[guard_rows : guard_rows + tokens]
    out.fill_(float("nan"))
    mla_paged_latent_attention(
        query, cache, block_table, cu_query_lengths, kv_lengths, SCALE,
        rope_dim=ROPE, max_query_len=1, num_kv_splits=splits, out=out,
    )  # fmt: skip
    assert_gluon_ran()
    assert torch.equal(out, torch.zeros_like(out))
    assert (buffer[:guard_rows] == GUARD).all() and (buffer[-guard_rows:] == GUARD).all()


def two_operands(step):
    """The step's query as the dynamic MLA step passes it in two operands: ``q_nope @ W_UK`` a
    head-major matmul output viewed token-major, the RoPE part the end of a wider projected
    query's rows (its first columns guards)."""
    tokens, heads, _ = step.query.shape
    latent = step.query[..., :LATENT].transpose(0, 1).contiguous().transpose(0, 1)
    projected = torch.full(
        (tokens, heads, 128 + ROPE), GUARD, dtype=step.query.dtype, device=DEVICE
    )
    projected[..., 128:] = step.query[..., LATENT:]
    return latent, projected[..., 128:]


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, None], ids=["1", "default"])
@pytest.mark.parametrize("heads", [40, 128])
def test_two_query_operands_give_the_bits_of_one(heads, splits):
    """The RoPE part through its own pointer and strides, into a head-major output: the kernel
    stages the same query in shared memory and runs the same arithmetic, so the one-operand
    call's bits."""
    step = decode_step(CONTEXTS, heads, seed=heads, padding_tokens=2)
    one = call(step, splits=splits)
    query, query_rope = two_operands(step)
    tokens = step.query.shape[0]
    out = torch.full((heads, tokens, LATENT), float("nan"), dtype=step.query.dtype, device=DEVICE)
    out = out.transpose(0, 1)
    args = (step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths, SCALE)
    got = mla_paged_latent_attention(
        query, *args, rope_dim=ROPE, max_query_len=1, num_kv_splits=splits,
        out=out, query_rope=query_rope,
    )  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    assert len(assert_gluon_ran()) == 2
    assert torch.equal(bits(out), bits(one)), "two operands moved bits"
    torch.testing.assert_close(one.double(), attention_reference(step, SCALE), **BF16_TOLERANCE)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("scale", [1.0, 2e38])
def test_large_softmax_scales_do_not_overflow(scale, splits):
    """Scales above LARGE_SCALE_LOG2 / LOG2E keep the logits in raw units and scale their
    differences; 2e38 (a hard maximum: the scaled logits overflow float32, the differences do
    not) must stay finite and right, across split-KV partials too."""
    assert scale * tile_rules.LOG2E > tile_rules.LARGE_SCALE_LOG2
    step = decode_step([300, 1, 64, 130], 64, seed=13 + splits, padding_tokens=1)
    out = run_and_check(step, splits=splits, scale=scale)
    (plan,) = assert_gluon_ran()
    assert plan.stage1.args["LARGE_SCALE"] is True
    assert torch.isfinite(out).all()


def _unattended_rows(step):
    """(block, first row) of every cache row no token of ``step`` attends to: the rows of the
    blocks no table row names, and each request's last page past its context."""
    blocks, block_size, _ = step.kv_cache.shape
    table = step.block_table.cpu()
    named = set(table[table >= 0].tolist())
    rows = [(block, 0) for block in range(blocks) if block not in named]
    for r, context in enumerate(step.kv_lengths.tolist()):
        if context > 0 and context % block_size:
            rows.append((int(table[r, (context - 1) // block_size]), context % block_size))
    return rows


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("block_size", [16, 37])
def test_non_finite_rows_no_token_attends_change_no_bit(block_size, splits):
    """NaN, inf and -inf in every row no token attends to (spare blocks, a block whose id the
    table replaced by -1, the last pages past the contexts: rows a key tile still covers) leave
    every output bit as it was."""
    step = decode_step(
        [1, 63, 65, 1000, 300],
        64,
        block_size=block_size,
        seed=17 + block_size,
        padding_requests=1,
        padding_tokens=2,
    )
    step.block_table[3, 200 // block_size] = -1  # its block is now no table row's
    run_and_check(step, splits=splits)
    clean = call(step, splits=splits)  # the layout (and launch) of the call compared below
    rows = _unattended_rows(step)
    assert any(first > 0 for _, first in rows), "no page with rows past a context"
    for i, (block, first) in enumerate(rows):
        step.kv_cache[block, first:] = (float("nan"), float("inf"), float("-inf"))[i % 3]
    dirty = call(step, splits=splits)
    assert torch.equal(bits(dirty), bits(clean)), "an unattended row reached a token"


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("column", ["latent", "rope"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=str)
def test_a_non_finite_attended_row_makes_exactly_its_token_nan(value, column, splits):
    """One attended row holding NaN or +-inf, in a value column or a key-only (RoPE) one, in the
    middle split of a 1000-row context: its token is NaN in every head (a -inf score too: no row
    silently dropped from the softmax), every other token finite and right."""
    step = decode_step([1000, 63, 200, 64], 40, block_size=16, seed=19, padding_tokens=1)
    cache_row(step, 0, 700)[3 if column == "latent" else LATENT + 5] = value
    out = run_and_check(step, splits=splits, poison=GUARD)
    assert torch.isnan(out[0]).all()
    assert torch.isfinite(out[1:]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 5, None], ids=["1", "5", "default"])
@pytest.mark.parametrize("heads", [40, 128])
def test_relaunch_gives_identical_bits(heads, splits):
    """10 launches on fresh copies of one input give one set of bits: no race between the
    producer and the consumers, between the programs, or with the fixed-order combine (the first
    launch goes through Triton's JIT, the others directly)."""
    step = decode_step(CONTEXTS + [2000, 17], heads, seed=21, padding_tokens=2)
    inputs = (step.query, step.kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths)

    def launch():
        fresh = [x.clone() for x in inputs]
        return mla_paged_latent_attention(
            *fresh, SCALE, rope_dim=ROPE, max_query_len=1, num_kv_splits=splits
        )

    first = bits(launch())
    differing = [i for i in range(9) if not torch.equal(bits(launch()), first)]
    assert not differing, f"launches {differing} gave other bits"
    assert_gluon_ran()


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, None], ids=["1", "default"])
def test_graph_replay_with_changing_lengths_equals_eager_bitwise(splits):
    """A decode graph captured on static buffers, replayed while the lengths, the queries and
    the number of real requests (the rest padding) change underneath, as the engine's graphs
    are: each replay gives the eager call's bits and float64's answer."""
    gen = torch.Generator().manual_seed(1)
    step = decode_step([3001] * 8 + [1] * 4, 128, seed=2)
    # Real requests per round: all 12, then 8 (4 padded requests and tokens), then 11.
    reals = (12, 8, 11)

    def refresh(round_):
        lengths = torch.randint(0, 3002, (12,), generator=gen, dtype=torch.int32)
        lengths[reals[round_] :] = 0
        step.kv_lengths.copy_(lengths)
        step.cu_query_lengths.copy_(torch.arange(13, dtype=torch.int32).clamp(max=reals[round_]))
        step.query.copy_(torch.randn(step.query.shape, generator=gen).to(step.query.dtype))

    def padding_is_zero(round_, out):
        assert torch.equal(out[reals[round_] :], torch.zeros_like(out[reals[round_] :]))

    graph_replays_equal_eager(step, 1, splits, refresh, BF16_TOLERANCE, check=padding_is_zero)
    assert len(assert_gluon_ran()) == 2  # the captured call's plan and the eager one's


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, None], ids=["1", "default"])
def test_int64_metadata_gives_the_bits_of_int32(splits):
    """The block table and lengths in int64: the same rows read, the same bits (a -1 id and a
    length past the table's capacity among them)."""
    outs = []
    for index_dtype in (torch.int32, torch.int64):
        step = decode_step(
            CONTEXTS, 80, block_size=16, seed=23, padding_requests=1, index_dtype=index_dtype
        )
        step.block_table[4, 300 // 16] = -1
        step.kv_lengths[2] = 2**31 - 1
        outs.append(run_and_check(step, splits=splits))
    assert torch.equal(bits(outs[1]), bits(outs[0])), "int64 metadata moved bits"
    assert len(assert_gluon_ran()) == 2


@pytest.mark.gpu
def test_gluon_agrees_with_stage1_on_a_128_head_4k_decode(monkeypatch):
    """The Gluon kernel and stage 1 on DeepSeek-V3's decode shape (128 heads, contexts to 4k):
    two kernels with two summation orders, so not the same bits; this checks that taking the
    switch changes a production step's outputs by no more than bf16 rounding (each is also
    compared with float64 elsewhere)."""
    gen = torch.Generator().manual_seed(29)
    contexts = torch.randint(1, 4097, (32,), generator=gen).tolist()
    contexts[0] = 4096
    step = decode_step(contexts, 128, seed=29)
    gluon = call(step)
    (plan,) = assert_gluon_ran()
    monkeypatch.setattr(attention_plan, "GLUON_DECODE", False)
    attention.ATTENTION_PLANS.clear()  # the plan cache is not keyed by the switch
    stage1 = call(step)
    (plan,) = attention.ATTENTION_PLANS.plans()
    assert plan.kernel == "stage1"
    assert torch.isfinite(gluon).all()
    torch.testing.assert_close(gluon.double(), stage1.double(), **BF16_TOLERANCE)
