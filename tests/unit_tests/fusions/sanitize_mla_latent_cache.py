# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Run the paged MLA latent-cache kernels on small shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python -m tests.unit_tests.fusions.sanitize_mla_latent_cache
    compute-sanitizer --tool racecheck --error-exitcode 1 \\
        python -m tests.unit_tests.fusions.sanitize_mla_latent_cache --quick

The RoPE + append (bf16, fp16, fp32; rows out of the cache and positions out of the tables among
the tokens) and the paged attention (DeepSeek-V3's 512 + 64 widths; 1, 32, 40 and 128 heads; block
sizes 16 and 64; decode with and without split-KV, a mixed prefill/chunked/decode step; padded
requests and tokens; a -1 block id where the lengths say a row is used; lengths that are
negative, past the tokens or decreasing, and NaN and inf rows behind the causal diagonal), and the
warp-specialized Gluon decode kernel in stage 1's place where this GPU and Triton take it
(``gluon_decode_refusal``; 128 and 40 heads, block sizes 16 and 64, one and three splits, padded
requests, a -1 block id; ``--quick`` runs one small case, for racecheck's view of its barriers;
``--gluon-only`` runs its cases alone), and the MHA form's kernels (``--mha-only`` alone): the
merge (16 and 128 heads, consecutive and indexed tokens, rows no earlier call wrote, a bf16 first
call's output read as the accumulator) and the gather of cache rows through the block table
(-1 and out-of-cache ids, a strided cache).
PyTorch's caching allocator is disabled so that every tensor is its own allocation and an
out-of-bounds access is one memcheck can see. Exits non-zero if an appended row differs from
megatron-core's or an attention output from float64 by more than the unit tests allow.
"""

import argparse
import math
import os
import sys

# Before torch initialises CUDA: one cudaMalloc per tensor, no slack shared with neighbours.
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

from megatron_ext.fusions.mla_latent import (  # noqa: E402
    attention,
    attention_plan,
    fused_mla_rope_cache_append,
    mha_gather,
    mha_merge,
)
from megatron_ext.testing.latent_cache_baseline import yarn_rotary_embedding
from tests.unit_tests.fusions.mla_latent.mha_testlib import float64_merge  # noqa: E402
from tests.unit_tests.fusions.mla_latent_cache_testlib import (  # noqa: E402
    ALIGNED_CACHE_OFFSET,
    GUARD_ELEMENTS,
    build_step,
    check_attention_step,
    gluon_decode_refusal_here,
    megatron_core_append,
    mla_rope_config,
)

SCALE = 1 / math.sqrt(192)
# As the unit tests (mla_latent/test_attention.py), where the bounds are justified.
TOLERANCE = {torch.float32: 6e-5, torch.float16: 1e-2, torch.bfloat16: 1.6e-2}
POSITIONS = 300


def check_append(config, yarn, tokens: int, dtype: torch.dtype, seed: int) -> bool:
    gen = torch.Generator().manual_seed(seed)
    blocks, block_size = tokens // 16 + 3, 16
    rows = torch.randperm(blocks * block_size, generator=gen)[:tokens]
    positions = torch.randint(0, POSITIONS, (tokens,), generator=gen)
    block_idx, block_offset = rows // block_size, rows % block_size
    kv_latent = torch.randn(tokens, 1, 512, generator=gen).to(dtype).cuda()
    k_pos_emb = torch.randn(tokens, 1, 64, generator=gen).to(dtype).cuda()
    cache = torch.randn(blocks, block_size, 576, generator=gen).to(dtype).cuda()
    index = [t.cuda() for t in (positions, block_idx, block_offset)]
    expected = cache.clone().unsqueeze(0)
    megatron_core_append(config, yarn, POSITIONS, kv_latent, k_pos_emb, expected, index, False)
    # Then the same tokens again with some rows outside the cache and positions off the tables:
    # nothing may be written out of bounds (memcheck) and the valid rows must stay equal.
    cos, sin = yarn.get_cached_cos_sin(POSITIONS, dtype=dtype)
    fused_mla_rope_cache_append(kv_latent, k_pos_emb, cos, sin, index[0], cache, *index[1:])
    same = torch.equal(cache, expected[0])
    bad_block, bad_positions = index[1].clone(), index[0].clone()
    bad_block[::3] = -1
    bad_block[1::7] = blocks
    bad_positions[::5] = POSITIONS + 11
    fused_mla_rope_cache_append(
        kv_latent, k_pos_emb, cos, sin, bad_positions, cache.clone(), bad_block, index[2]
    )
    torch.cuda.synchronize()
    return same


def check_attention(
    requests, heads, block_size, dtype, splits, seed, cache_offset=GUARD_ELEMENTS, gluon=False
) -> bool:
    """One step through the public entry against float64, with the Gluon decode kernel allowed
    (``gluon``) or not (stage 1's cases: the default takes the Gluon kernel for decode launches
    of 32+ heads on Hopper with Triton >= 3.7)."""
    switch = attention_plan.GLUON_DECODE
    attention_plan.GLUON_DECODE = gluon
    try:
        return _check_attention(requests, heads, block_size, dtype, splits, seed, cache_offset)
    finally:
        attention_plan.GLUON_DECODE = switch


def _check_attention(requests, heads, block_size, dtype, splits, seed, cache_offset) -> bool:
    step = build_step(
        requests,
        heads=heads,
        latent_dim=512,
        rope_dim=64,
        block_size=block_size,
        dtype=dtype,
        device="cuda",
        seed=seed,
        padding_requests=2,
        padding_tokens=3,
        cache_offset=cache_offset,
    )
    if step.block_table.shape[1] > 2:
        step.block_table[0, 1] = -1  # inconsistent metadata: skipped, never read out of bounds
    decode = all(new == 1 for _, new in requests)
    tolerance = dict(rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    try:
        check_attention_step(
            step, SCALE, tolerance, max_query_len=1 if decode else None, num_kv_splits=splits
        )
    except AssertionError as error:
        print(error)
        return False
    return True


def check_gluon_decode(requests, heads, block_size, splits, seed) -> bool:
    """One decode step (padded requests and tokens, a -1 block id in request 0's used rows)
    through the Gluon kernel against float64; False also if stage 1 ran instead."""
    attention.ATTENTION_PLANS.clear()
    try:
        # A 16-byte-aligned cache: the kernel copies its rows 16 bytes at a time and is refused
        # for any other (gluon_decode_refusal).
        if not check_attention(
            requests,
            heads,
            block_size,
            torch.bfloat16,
            splits,
            seed,
            ALIGNED_CACHE_OFFSET,
            gluon=True,
        ):
            return False
        kernels = [plan.kernel for plan in attention.ATTENTION_PLANS.plans()]
        if kernels != ["gluon"]:
            print(f"the Gluon decode kernel did not run: plans {kernels}")
            return False
        return True
    finally:
        attention.ATTENTION_PLANS.clear()


def check_bad_metadata(heads: int, dtype: torch.dtype, splits: int, seed: int) -> bool:
    """Lengths no host check sees (negative, past the tokens, decreasing; a NaN and an inf row
    behind the causal diagonal): memcheck sees every access, the outputs must follow the
    documented contract (:func:`attention_reference`)."""
    tolerance = dict(rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])
    ok = True
    for cu in ([-2, 1, 7, 10, 12], [1, 3, 6, 9, 2**30], [0, 6, 3, 9, 12]):
        for max_query_len in (1, None):
            step = build_step(
                [(20, 3), (5, 3), (0, 3), (70, 3)],
                heads=heads,
                latent_dim=512,
                rope_dim=64,
                block_size=16,
                dtype=dtype,
                device="cuda",
                seed=seed,
            )
            step.cu_query_lengths.copy_(torch.tensor(cu))
            step.kv_lengths[1] = -(2**31)
            block = int(step.block_table[3, 72 // 16])
            step.kv_cache[block, 72 % 16, 7] = float("nan")
            step.kv_cache[block, 71 % 16, 575] = float("inf")
            try:
                check_attention_step(
                    step,
                    SCALE,
                    tolerance,
                    poison=1234.5,
                    max_query_len=max_query_len,
                    num_kv_splits=splits,
                )
            except AssertionError as error:
                print(f"cu={cu} max_query_len={max_query_len}: {error}")
                ok = False
    return ok


def check_mha_merge(heads: int, tokens_kind: str, last: bool, seed: int) -> bool:
    """The MHA form's merge kernel on 96 of 200 accumulator rows (bf16 partials, a strided
    log-sum-exp), into the accumulator or (``last``) into a bf16 result, against float64."""
    gen = torch.Generator().manual_seed(seed)
    used, count, v = 200, 96, 128
    acc = torch.randn(used, heads, v, generator=gen).cuda()
    acc_lse = (torch.randn(used, heads, generator=gen) * 4).cuda()
    acc_lse[::3] = -math.inf  # rows no earlier call wrote: not read
    part = torch.randn(count, heads, v, generator=gen).to(torch.bfloat16).cuda()
    part_lse = (torch.randn(heads, count, generator=gen) * 4).cuda().t()
    if tokens_kind == "slice":
        tokens = slice(50, 50 + count)
    else:
        tokens = torch.randperm(used, generator=gen)[:count].to(torch.int32).cuda()
    want, _ = float64_merge(acc[tokens], acc_lse[tokens], part, part_lse)
    out = torch.empty(used, heads, v, dtype=torch.bfloat16, device="cuda") if last else None
    mha_merge.merge_partials_into(acc, acc_lse, part, part_lse, tokens, out)
    torch.cuda.synchronize()
    got, tolerance = (out[tokens], 2e-2) if last else (acc[tokens], 1e-5)
    return bool((got.double() - want).abs().max() <= tolerance)


def check_mha_merge_seeded(heads: int, seed: int) -> bool:
    """The merge kernel reading a bf16 first call's output (strided rows, log-sum-exps laid out
    head-major) as the accumulator and writing a bf16 result, against float64."""
    gen = torch.Generator().manual_seed(seed)
    used, v = 200, 128
    first = torch.randn(used, heads, v + 64, generator=gen).to(torch.bfloat16).cuda()[..., :v]
    first_lse = (torch.randn(heads, used, generator=gen) * 4).cuda().t()
    first_lse[::5] = -math.inf
    part = torch.randn(used, heads, v, generator=gen).to(torch.bfloat16).cuda()
    part_lse = (torch.randn(used, heads, generator=gen) * 4).cuda()
    want, _ = float64_merge(first, first_lse, part, part_lse)
    out = torch.empty(used, heads, v, dtype=torch.bfloat16, device="cuda")
    mha_merge.merge_partials_into(first, first_lse, part, part_lse, slice(0, used), out)
    torch.cuda.synchronize()
    return bool((out.double() - want).abs().max() <= 2e-2)


def check_mha_gather(block_size: int, strided: bool, seed: int) -> bool:
    """The MHA form's row gather: 300 rows through a table with -1 and out-of-cache ids, from a
    cache inside a larger buffer (``strided``: blocks padded apart), against the torch gather."""
    gen = torch.Generator().manual_seed(seed)
    blocks, width, requests, max_blocks = 40, 576, 3, 12
    pad = 7 if strided else 0
    buffer = torch.randn(blocks + 2, block_size + pad, width, generator=gen).to(torch.bfloat16)
    cache = buffer.cuda()[1:-1, :block_size]
    table = torch.randint(-1, blocks + 3, (requests, max_blocks), generator=gen, dtype=torch.int32)
    places = (
        torch.randint(0, requests * max_blocks, (300,), generator=gen).cuda(),
        torch.randint(0, block_size, (300,), generator=gen).to(torch.int32).cuda(),
    )
    table = table.cuda()
    got = mha_gather.gather_cache_rows(cache, table, places)
    want = mha_gather.gather_cache_rows_torch(cache, table, places)
    torch.cuda.synchronize()
    return bool(torch.equal(got, want))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes (for racecheck)")
    only = parser.add_mutually_exclusive_group()
    only.add_argument(
        "--gluon-only", action="store_true", help="only the Gluon decode kernel's cases"
    )
    only.add_argument(
        "--mha-only", action="store_true", help="only the MHA form's kernels (merge, gather)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    config = mla_rope_config()
    yarn = yarn_rotary_embedding(config)
    dtypes = (
        (torch.bfloat16, torch.float32)
        if args.quick
        else (
            torch.bfloat16,
            torch.float16,
            torch.float32,
        )
    )
    decode = [(0, 1), (700, 1), (63, 1), (64, 1)]
    mixed = [(100, 1), (0, 70), (65, 9), (0, 1)]
    attention_cases = [
        (decode, 1, 16, 1),
        (decode, 40, 64, None),
        (decode, 32, 64, 2),
        (mixed, 40, 16, 1),
        (mixed, 128, 64, 2),
    ]
    if args.quick:
        attention_cases = attention_cases[1:4]
    failures = checks = 0
    for dtype in () if args.gluon_only or args.mha_only else dtypes:
        for tokens in (1, 37) if args.quick else (1, 37, 300):
            checks += 1
            if not check_append(config, yarn, tokens, dtype, seed=tokens):
                failures += 1
                print(f"BAD append tokens={tokens} {dtype}")
        for requests, heads, block_size, splits in attention_cases:
            checks += 1
            if not check_attention(requests, heads, block_size, dtype, splits, seed=heads):
                failures += 1
                print(f"BAD attention heads={heads} block={block_size} splits={splits} {dtype}")
        for heads, splits in ((16, 1), (40, 3)) if not args.quick else ((40, 3),):
            checks += 1
            if not check_bad_metadata(heads, dtype, splits, seed=heads):
                failures += 1
                print(f"BAD metadata heads={heads} splits={splits} {dtype}")
    merges = [] if args.gluon_only else [(128, "index", False), (16, "slice", True)]
    if not (args.quick or args.gluon_only):
        merges += [(16, "index", False), (128, "slice", False), (128, "index", True)]
    for heads, tokens_kind, last in merges:
        checks += 1
        if not check_mha_merge(heads, tokens_kind, last, seed=heads):
            failures += 1
            print(f"BAD mha merge heads={heads} tokens={tokens_kind} last={last}")
    for heads in [] if args.gluon_only else [16, 128]:
        checks += 1
        if not check_mha_merge_seeded(heads, seed=heads):
            failures += 1
            print(f"BAD mha merge seeded heads={heads}")
    gathers = [] if args.gluon_only else [(64, False), (37, True)]
    for block_size, strided in gathers:
        checks += 1
        if not check_mha_gather(block_size, strided, seed=block_size):
            failures += 1
            print(f"BAD mha gather block={block_size} strided={strided}")
    # Request 0 spans several pages, so check_attention's -1 at its second is a used row.
    gluon_decode = [(700, 1), (0, 1), (63, 1), (64, 1), (129, 1)]
    gluon_cases = [(128, 16, 1), (128, 64, 3), (40, 16, 3), (40, 64, 1)]
    if args.quick:
        gluon_decode, gluon_cases = [(129, 1), (0, 1), (63, 1)], [(40, 16, 3)]
    refusal = gluon_decode_refusal_here()
    if args.mha_only:
        gluon_cases = []
    elif refusal is not None:
        print(f"Gluon decode cases skipped: {refusal}")
        gluon_cases = []
    for heads, block_size, splits in gluon_cases:
        checks += 1
        if not check_gluon_decode(gluon_decode, heads, block_size, splits, seed=heads + splits):
            failures += 1
            print(f"BAD gluon decode heads={heads} block={block_size} splits={splits}")
    print(f"{checks} checks, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
