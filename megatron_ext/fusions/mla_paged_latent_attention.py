# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Paged attention over MLA's latent cache, in the absorbed form, in Triton.

With ``cache_mla_latents`` each cached token is one row ``[latent (kv_lora_rank) | rope(k_pe)]``
(576 wide for DeepSeek-V3) shared by every head. Absorbing the key up-projection into the query
(``q_nope @ W_UK``) makes the row the key of every head, and its first ``kv_lora_rank`` columns the
value (projected by ``W_UV`` afterwards), so attention reads the cache as it is: multi-query
attention with one 576-wide key head and a 512-wide value. :func:`mla_paged_latent_attention`
computes it for one step of megatron-core's dynamic batching: prefill, chunked prefill (new tokens
behind earlier cached ones), decode and any mix of them in one batch, with causal masking among
a request's new tokens. It reads only the cache rows each token attends to, through the block
table; nothing decompresses the cache.

Kernel design:

* Stage 1 (:func:`_latent_attention_kernel`), grid ``(query tiles, head tiles, kv splits)``. A
  query tile is up to ``BLOCK_Q`` consecutive new tokens of one request times ``BLOCK_H`` heads
  (rows of one ``tl.dot``; :func:`head_tile`: decode tiles of up to 64 heads, so each cache row
  is read once per 64 heads); its program walks the request's cache rows ``BLOCK_N`` at a time
  (their block ids looked up in the block table: one per key tile where tiles divide pages,
  :func:`page_tiles`, else one per row, so any block size works), with an online softmax in
  fp32. The number of query tiles is bounded by static sizes
  (``tokens // BLOCK_Q + requests + 1``: each request's tiles start at
  ``cu_query_lengths[r] // BLOCK_Q + r + 1``, one tile per token in decode); a program finds its
  request by counting those starts, and idle programs (past a request's last token) return at
  once. A multi-token tile whose rows skip a key row holding NaN or inf on its causal diagonal
  (which reaches them through ``0 * NaN`` in ``P @ V``) computes those rows again, reading
  non-finite values as zeros: a row a token does not attend to never reaches it.
* Split-KV: with few query tiles (decode) the rows each tile attends to are split across
  ``num_kv_splits`` programs, each writing a partial output and its log-sum-exp to an fp32
  workspace; stage 2 (:func:`_combine_splits_kernel`, one program per token, head tile and
  slice of latent columns, :func:`combine_tile`) combines them in split order. The split count
  comes from static sizes only (tokens, heads, the block table's width and the GPU's SM count),
  never from the lengths.

Metadata the host does not read (a sync) is made safe on the device: whatever
``cu_query_lengths``, ``kv_lengths`` and the block ids hold, no program reads or writes outside
the tensors, and every output row is written (see :func:`mla_paged_latent_attention`).

Non-finite values: a token's output depends only on the cache rows it attends to; a NaN or inf
in one of them (or a score that overflows float32) makes it NaN, also across split-KV partials.

Graph safety: no host synchronisation, no ``.item()``, grids and the split count from shapes
only; the lengths, block ids and positions are read on the device. The same inputs give the same
bits on every launch (no atomics; the splits are combined in a fixed order), so a CUDA-graph
replay equals an eager call. The first call of a shape compiles: make it outside capture.

Launches: a call layout's first call checks every argument and keeps the launch plan it gives
(:mod:`megatron_ext.fusions.launch_plans`; later calls of the layout check only that the output
shares no memory with an input). A specialisation's first launch goes through Triton's JIT, later
ones through the compiled kernel's C launcher
(:class:`megatron_ext.fusions.direct_launch.PreparedLaunch`), which skips Triton's Python dispatch.
"""

import functools
import numbers
from typing import NamedTuple, Optional, Tuple

import torch
import triton
import triton.language as tl
from packaging.version import InvalidVersion, Version
from torch import Tensor

from megatron_ext.fusions.direct_launch import KernelLaunches, PreparedLaunch
from megatron_ext.fusions.latent_cache_checks import check_paged_cache
from megatron_ext.fusions.launch_math import cdiv, next_power_of_2
from megatron_ext.fusions.launch_plans import LaunchPlan, PlanCache, layout_key
from megatron_ext.fusions.tensor_checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_disjoint,
    check_index_vector,
    check_int,
    check_no_self_overlap,
    check_runnable,
    check_tensor,
    check_unit_last_stride,
)

__all__ = [
    "MAX_KV_SPLITS",
    "CombineTile",
    "combine_tile",
    "default_num_kv_splits",
    "TileShape",
    "head_tile",
    "mla_paged_latent_attention",
    "page_tiles",
    "pipeline_stages",
    "tile_shape",
]

# Upper bound of the split count (stage 2 combines at most this many partials per token).
MAX_KV_SPLITS = 64
# A split attends to at least this many rows of the longest context the block table can hold, so
# the partials' traffic stays small against the rows read.
MIN_KEYS_PER_SPLIT = 256
# Stage 1 pipelines its key tiles in 3 stages (the tiles after the one being computed in flight
# during its dots) where a block may use this much shared memory: the widest tile (64 rows of 576
# 16-bit columns, 32 keys) takes about 180 KiB with 3 stages, 144 KiB with 2. Hopper's 227 KiB
# holds it; an A100's 163 KiB does not (2 stages there).
THREE_STAGE_SHARED_MEMORY = 200 * 1024
# The largest block size: stage 1 counts keys across a group of up to 64 pages in 32 bits.
MAX_BLOCK_SIZE = 2**24
# Stage 1 counts a key tile's row offsets in 32 bits below this (BLOCK_N rows of the cache's row
# stride, plus a row), in 64 bits from it.
ROW_OFFSET_LIMIT = 2**31
# block-table starts counted per vector load in the request lookup.
SEQ_BLOCK = 128
# Heads per query tile: the smallest row count of a tensor-core dot at one token per tile.
BLOCK_H = 16
# Heads per decode tile with 16-bit inputs: each head tile reads the request's cache rows once,
# so wider tiles read the cache fewer times (twice, not eight times, at 128 heads). 64 rows of a
# 512-wide fp32 accumulator is what fits in registers; fp32 inputs keep BLOCK_H.
MAX_DECODE_BLOCK_H = 64
LOG2E = 1.4426950408889634
# Above this scale (times log2(e)) stage 1 keeps its logits in raw units and scales differences
# (score - max), which cannot overflow; up to it scale * score cannot overflow float32 for any
# finite score, nor can the difference of two such products, and the logits are scaled first.
LARGE_SCALE_LOG2 = 0.5
# Keys per step of the 32-head decode tile (a tensor-parallel-4 shard of 128 heads; its dots are
# mma.sync with the query in registers) where 3 stages fit: three 72 KiB key buffers.
WIDE_KEY_TILE = 64
# Stage 2's latent columns per program, and the partial values (fp32, over all splits) one
# 4-warp program may keep in flight: 64 registers a thread.
COMBINE_BLOCK_D = 64
COMBINE_IN_FLIGHT = 64 * 128


def _triton_release() -> Tuple[int, ...]:
    """The installed Triton's (major, minor); (0, 0) for a version string packaging cannot read
    (a source build's, say), which keeps the choices made for the older releases."""
    try:
        return Version(triton.__version__).release[:2]
    except InvalidVersion:
        return (0, 0)


# The 64-head decode tile's addressing depends on it (page_tiles).
TRITON_RELEASE = _triton_release()


@triton.jit
def _first_tile(cu_q, request, BLOCK_Q: tl.constexpr):
    """Index of the first query tile of ``request`` (tiles of BLOCK_Q tokens, per request).

    With BLOCK_Q > 1 the tiles before request 0's first one (at least one) hold the tokens before
    ``cu_query_lengths[0]``; with BLOCK_Q == 1 tile ``t`` is token ``t``.
    """
    if BLOCK_Q == 1:
        return cu_q
    else:
        return cu_q // BLOCK_Q + request + 1


@triton.jit
def _load_cu(cu_q_ptr, idx, mask, num_tokens):
    """``cu_query_lengths[idx]`` clamped into ``[0, num_tokens]`` (the host never reads them)."""
    cu_q = tl.load(cu_q_ptr + idx, mask=mask, other=0).to(tl.int64)
    return tl.minimum(tl.maximum(cu_q, 0), num_tokens)


@triton.jit
def _tile_request(
    tile, cu_q_ptr, num_tokens, num_requests, BLOCK_Q: tl.constexpr, SEQ_BLOCK: tl.constexpr
):
    """The request holding query tile ``tile`` (``num_requests`` for the tiles past the last),
    and whether the clamped ``cu_query_lengths`` are non-decreasing.

    The first tiles are non-decreasing in the request, so the request is the number of requests
    1..num_requests (the last an end marker) whose first tile is at or before ``tile``.
    """
    request = tl.full((), 0, dtype=tl.int32)
    decreases = tl.full((), 0, dtype=tl.int32)
    for start in range(1, num_requests + 1, SEQ_BLOCK):
        idx = start + tl.arange(0, SEQ_BLOCK)
        valid = idx <= num_requests
        cu_q = _load_cu(cu_q_ptr, idx, valid, num_tokens)
        before = _load_cu(cu_q_ptr, idx - 1, valid, num_tokens)
        first = _first_tile(cu_q, idx.to(tl.int64), BLOCK_Q)
        request += tl.sum((valid & (first <= tile)).to(tl.int32), axis=0)
        decreases += tl.sum((valid & (cu_q < before)).to(tl.int32), axis=0)
    return request, decreases == 0


@triton.jit
def _attend_keys(
    m_i,
    l_i,
    acc,
    q_lat,
    q_rope,
    lo,
    hi,
    row_end,
    cache_ptr,
    table_row,
    num_blocks,
    max_blocks,
    cache_stride_b,
    cache_stride_o,
    scale_log2,
    BLOCK_SIZE: tl.constexpr,
    LATENT_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAGE_TILES: tl.constexpr,
    WIDE_ROWS: tl.constexpr,
    LARGE_SCALE: tl.constexpr,
    PARTIAL_ROWS: tl.constexpr,
):
    """The online softmax over keys ``lo..hi`` (``lo`` on a key tile) of one query tile; returns
    the updated ``(m_i, l_i, acc)``.

    ``PARTIAL_ROWS``: read the values' non-finite elements as zeros, so that a key row a query
    row does not attend to cannot reach it through ``0 * inf`` in ``P @ V`` (the causal
    diagonal of a multi-token tile). An attended row's non-finite element still makes its query
    row NaN, through the score (every element of a key row enters its score).
    """
    lat = tl.arange(0, LATENT_DIM)
    rope = tl.arange(0, ROPE_DIM)
    # The block ids come from a register vector loaded once per group of up to PAGES pages
    # (tl.gather), not from a load inside the key loop: with an in-loop load feeding the key
    # rows' addresses, Triton (3.6 to 3.9) keeps one key-tile buffer and waits for every copy
    # before each tile's dots, so no key load overlaps compute. Without it, and with 3 stages,
    # the next tiles' copies stay in flight during the dots (scripts/mla_latent_attention_code.py
    # prints both). A group spans whole key tiles, at most (PAGES - 1) pages: every key of a tile
    # (masked ones too) has its page among the group's.
    PAGES: tl.constexpr = 64
    GROUP: tl.constexpr = max(((PAGES - 1) * BLOCK_SIZE) // BLOCK_N, 1) * BLOCK_N
    pages = tl.arange(0, PAGES)
    # A tile's row offsets from its first row, in 32 bits unless they could overflow them.
    tile_rows = tl.arange(0, BLOCK_N)
    if WIDE_ROWS:
        tile_rows = tile_rows.to(tl.int64)
    tile_rows = tile_rows * cache_stride_o
    for g0 in range(lo, hi, GROUP):
        first = g0 // BLOCK_SIZE
        ids = tl.load(table_row + first + pages, mask=first + pages < max_blocks, other=-1)
        g1 = tl.minimum(g0 + GROUP, hi)
        for n0 in range(g0, g1, BLOCK_N):
            keys = n0 + tl.arange(0, BLOCK_N)
            # Keys counted from the group's first page in 32 bits, the block size a constexpr:
            # the page and the row in it by shifts (or a multiply), where 64-bit division by a
            # runtime block size took about 20 emulated divisions per thread and tile.
            key0 = (n0 - first * BLOCK_SIZE).to(tl.int32)
            if PAGE_TILES:
                # The tile is on one page: one block id, and the rows' addresses one base plus
                # the offsets computed before the loop. The 16-head decode tile compiles to 622
                # instructions a thread and 8 block barriers per key tile, against 1011 and 12
                # with a block id and address per row (SASS, Triton 3.9).
                block = tl.sum(tl.where(pages == key0 // BLOCK_SIZE, ids, 0), axis=0)
                block = block.to(tl.int64)
                block_ok = (block >= 0) & (block < num_blocks)
                # A skipped block ends the tile's range before its first key.
                ok = keys < tl.where(block_ok, g1, n0)
                kv_rows = (
                    cache_ptr
                    + tl.where(block_ok, block, 0) * cache_stride_b
                    + (key0 % BLOCK_SIZE).to(tl.int64) * cache_stride_o
                    + tile_rows
                )
            else:
                # Clamped into the group's PAGES ids: the software pipeline computes the
                # addresses of the next tiles ahead of the loop's bound, up to two tiles past a
                # full group, and an index past the vector read outside the gather's
                # shared-memory scratch (an illegal address on an H200 with 64-head tiles).
                # Those keys are masked off by in_range.
                in_range = keys < g1
                in_group = key0 + tl.arange(0, BLOCK_N)
                page = tl.minimum(in_group // BLOCK_SIZE, PAGES - 1)
                block = tl.gather(ids, page, 0).to(tl.int64)
                # A block id outside the cache (-1 padding in a row the lengths say is used) is
                # skipped, never read out of bounds.
                ok = in_range & (block >= 0) & (block < num_blocks)
                # The block id clamped, not the row offset: with a select around the offset, Triton
                # 3.9 loses the rows' 16-byte alignment and loads the keys as scalar 2-byte loads,
                # outside the software pipeline (the masked-off rows' addresses are never read).
                kv_rows = (
                    cache_ptr
                    + tl.where(ok, block, 0) * cache_stride_b
                    + (in_group % BLOCK_SIZE).to(tl.int64) * cache_stride_o
                )
            k_lat = tl.load(kv_rows[:, None] + lat[None, :], mask=ok[:, None], other=0.0)
            k_rope = tl.load(
                kv_rows[:, None] + LATENT_DIM + rope[None, :], mask=ok[:, None], other=0.0
            )
            scores = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PRECISION)
            scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
            attend = ok[None, :] & (keys[None, :] < row_end[:, None])
            if not LARGE_SCALE:
                scores = scores * scale_log2
            # An attended score of -inf (a non-finite key element) would drop its row from the
            # softmax, a finite answer from a row that is not finite: NaN instead, as +inf and
            # NaN scores give.
            scores = tl.where(scores == float("-inf"), float("nan"), scores)
            scores = tl.where(attend, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            # Rows with nothing attended yet keep m = -inf; subtract 0 there instead (no NaN).
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            if LARGE_SCALE:
                # Logits in raw units, scaled after the subtraction: scale * score could
                # overflow float32 where (score - max) * scale cannot.
                p = tl.exp2((scores - m_use[:, None]) * scale_log2)
                alpha = tl.exp2((m_i - m_use) * scale_log2)
            else:
                p = tl.exp2(scores - m_use[:, None])
                alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            if PARTIAL_ROWS:
                k_lat = tl.where(k_lat - k_lat == 0, k_lat, 0.0)
            acc += tl.dot(p.to(k_lat.dtype), k_lat, input_precision=DOT_PRECISION)
            m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _fill_rows(out_ptr, tokens, heads, out_stride_t, out_stride_h, mask, value, ROWS, LATENT_DIM):
    """Write ``value`` into the output rows (token, head) where ``mask``."""
    lat = tl.arange(0, LATENT_DIM)
    rows = out_ptr + tokens * out_stride_t + heads * out_stride_h
    fill = tl.full((ROWS, LATENT_DIM), value, dtype=out_ptr.dtype.element_ty)
    tl.store(rows[:, None] + lat[None, :], fill, mask=mask[:, None])


# Sizes that change from step to step: not specialised (no recompiles when one happens to be 1 or
# a multiple of 16).
_RUNTIME_SIZES = ["num_tokens", "num_heads", "num_requests", "num_blocks", "max_blocks"]


@triton.jit(do_not_specialize=_RUNTIME_SIZES)
def _latent_attention_kernel(
    q_ptr,
    cache_ptr,
    block_table_ptr,
    cu_q_ptr,
    kv_len_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    num_tokens,
    num_heads,
    num_requests,
    num_blocks,
    BLOCK_SIZE: tl.constexpr,
    max_blocks,
    q_stride_t,
    q_stride_h,
    cache_stride_b,
    cache_stride_o,
    table_stride,
    out_stride_s,
    out_stride_t,
    out_stride_h,
    lse_stride_s,
    lse_stride_t,
    LATENT_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SEQ_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PAGE_TILES: tl.constexpr,
    WIDE_ROWS: tl.constexpr,
    LARGE_SCALE: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2).to(tl.int64)
    ROWS: tl.constexpr = BLOCK_Q * BLOCK_H
    rows = tl.arange(0, ROWS)
    heads = head_block * BLOCK_H + rows % BLOCK_H
    head_ok = heads < num_heads
    lat = tl.arange(0, LATENT_DIM)
    rope = tl.arange(0, ROPE_DIM)

    request, ordered = _tile_request(tile, cu_q_ptr, num_tokens, num_requests, BLOCK_Q, SEQ_BLOCK)
    q_start = _load_cu(cu_q_ptr, request, True, num_tokens)
    tile_start = (tile - _first_tile(q_start, request.to(tl.int64), BLOCK_Q)) * BLOCK_Q
    local = tile_start + rows // BLOCK_H
    tokens = q_start + local
    # Tokens outside [cu_query_lengths[0], cu_query_lengths[-1]) (CUDA-graph padding) get zeros,
    # so no row of the output is left as it was; with split-KV, stage 2 writes them.
    own = tile * BLOCK_Q + rows // BLOCK_H  # the tokens of this tile index, whatever the requests
    cu_first = _load_cu(cu_q_ptr, 0, True, num_tokens)
    cu_last = _load_cu(cu_q_ptr, num_requests, True, num_tokens)
    if not ordered:
        # Request boundaries that go backwards mean nothing: NaN for every token inside them
        # (no plausible answer), from the programs that own each token by index.
        inside = head_ok & (own >= cu_first) & (own < cu_last)
        if NUM_SPLITS == 1:
            _fill_rows(
                out_ptr,
                own,
                heads,
                out_stride_t,
                out_stride_h,
                inside,
                float("nan"),
                ROWS,
                LATENT_DIM,
            )
            outside = head_ok & (own < num_tokens) & ~inside
            _fill_rows(
                out_ptr, own, heads, out_stride_t, out_stride_h, outside, 0.0, ROWS, LATENT_DIM
            )
        else:
            lse_rows = lse_ptr + split * lse_stride_s + own * lse_stride_t + heads
            tl.store(lse_rows, tl.full((ROWS,), float("nan"), tl.float32), mask=inside)
        return
    if (request == num_requests) | (tile_start < 0):
        if NUM_SPLITS == 1:
            # Past the last request, or one of the tiles before request 0's first.
            after = request == num_requests
            pad_tokens = tl.where(after, tokens, own)
            pad = head_ok & (pad_tokens < tl.where(after, num_tokens, cu_first))
            _fill_rows(
                out_ptr, pad_tokens, heads, out_stride_t, out_stride_h, pad, 0.0, ROWS, LATENT_DIM
            )
        return

    q_len = _load_cu(cu_q_ptr, request + 1, True, num_tokens) - q_start
    if tile_start >= q_len:
        return  # an idle tile: past the request's last new token
    # Clamped so that no position below can overflow (a length past the block table's capacity
    # still sets the positions; the keys stop at the capacity).
    kv_len = tl.minimum(tl.maximum(tl.load(kv_len_ptr + request).to(tl.int64), 0), 2**62)
    row_ok = (local < q_len) & (tokens < num_tokens) & head_ok
    # New token `local` of the request sits at position kv_len - q_len + local and attends to the
    # cached positions up to it (the step's own rows are in the cache already).
    positions = kv_len - q_len + local
    capacity = tl.minimum(kv_len, max_blocks * BLOCK_SIZE)
    row_end = tl.minimum(positions + 1, capacity)
    # The tile's key bound from scalars, not a reduction over row_end: Triton 3.7 turns a bound
    # derived from a reduction into scalar 16-bit loads of the key rows (no async copies,
    # register spills), 3-5x slower. Rows end in position order, so the tile's last valid row
    # has the largest end.
    last = tl.minimum(tl.minimum(tile_start + BLOCK_Q, q_len), num_tokens - q_start) - 1
    tile_end = tl.where(last >= tile_start, tl.minimum(kv_len - q_len + last + 1, capacity), 0)
    chunk = tl.cdiv(tl.cdiv(tile_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, tile_end)

    q_rows = q_ptr + tokens * q_stride_t + heads * q_stride_h
    q_lat = tl.load(q_rows[:, None] + lat[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_rows[:, None] + LATENT_DIM + rope[None, :], mask=row_ok[:, None], other=0.0)

    table_row = block_table_ptr + request.to(tl.int64) * table_stride
    # Every row of a decode tile (the heads of one token) attends to the same keys. In a
    # multi-token tile some rows skip keys of the causal diagonal that others attend to; a value
    # that is not finite in such a key reaches the rows that skip it as 0 * inf = NaN in P @ V.
    # Such a row (its weights finite, its accumulator not) is rare: one loop as before, then the
    # rows it spoiled again in a second pass that reads non-finite values as zeros (which
    # changes nothing for the rows that attend to them: their scores are NaN already). The
    # second pass runs no key tile when no row was spoiled.
    todo = row_ok
    for attempt in tl.static_range(min(BLOCK_Q, 2)):
        m_i = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((ROWS,), dtype=tl.float32)
        acc = tl.zeros((ROWS, LATENT_DIM), dtype=tl.float32)
        end = hi
        if attempt == 1:
            end = tl.where(tl.max(todo.to(tl.int32), axis=0) > 0, hi, lo)
        m_i, l_i, acc = _attend_keys(
            m_i=m_i,
            l_i=l_i,
            acc=acc,
            q_lat=q_lat,
            q_rope=q_rope,
            lo=lo,
            hi=end,
            row_end=row_end,
            cache_ptr=cache_ptr,
            table_row=table_row,
            num_blocks=num_blocks,
            max_blocks=max_blocks,
            cache_stride_b=cache_stride_b,
            cache_stride_o=cache_stride_o,
            scale_log2=scale_log2,
            BLOCK_SIZE=BLOCK_SIZE,
            LATENT_DIM=LATENT_DIM,
            ROPE_DIM=ROPE_DIM,
            BLOCK_N=BLOCK_N,
            DOT_PRECISION=DOT_PRECISION,
            PAGE_TILES=PAGE_TILES,
            WIDE_ROWS=WIDE_ROWS,
            LARGE_SCALE=LARGE_SCALE,
            PARTIAL_ROWS=attempt == 1,
        )
        done = todo
        if attempt < min(BLOCK_Q, 2) - 1:  # the first of two passes
            spoiled = (l_i - l_i == 0) & (tl.max((acc - acc != 0).to(tl.int32), axis=1) > 0)
            done = todo & ~spoiled
            todo = todo & spoiled
        # Nothing attended (l = 0) gives zeros; a NaN l (a non-finite attended row) stays NaN.
        nothing = l_i == 0.0
        o = acc / tl.where(nothing, 1.0, l_i)[:, None]
        out_rows = out_ptr + split * out_stride_s + tokens * out_stride_t + heads * out_stride_h
        o = o.to(out_ptr.dtype.element_ty)
        tl.store(out_rows[:, None] + lat[None, :], o, mask=done[:, None])
        if NUM_SPLITS > 1:
            m_fin = tl.where(m_i == float("-inf"), 0.0, m_i)
            if LARGE_SCALE:
                lse = m_fin + tl.log2(tl.where(nothing, 1.0, l_i)) / scale_log2  # raw units
            else:
                lse = m_fin + tl.log2(tl.where(nothing, 1.0, l_i))
            lse = tl.where(nothing, float("-inf"), lse)
            lse_rows = lse_ptr + split * lse_stride_s + tokens * lse_stride_t + heads
            tl.store(lse_rows, lse, mask=done)


_COMBINE_RUNTIME_SIZES = ["num_tokens", "num_heads", "num_requests"]


@triton.jit(do_not_specialize=_COMBINE_RUNTIME_SIZES)
def _combine_splits_kernel(
    partial_ptr,
    lse_ptr,
    cu_q_ptr,
    out_ptr,
    num_tokens,
    num_heads,
    num_requests,
    partial_stride_s,
    partial_stride_t,
    partial_stride_h,
    lse_stride_s,
    lse_stride_t,
    out_stride_t,
    out_stride_h,
    lse_scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    LARGE_SCALE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    # A program combines BLOCK_D of the latent columns: each output element is the same sum in
    # the same split order whatever BLOCK_D is, so the column split only adds programs.
    lat = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    out_rows = out_ptr + token * out_stride_t + heads * out_stride_h
    # Every token inside the requests' span was written by stage 1 (for every split); the ones
    # outside it are padding and get zeros.
    inside = (token >= _load_cu(cu_q_ptr, 0, True, num_tokens)) & (
        token < _load_cu(cu_q_ptr, num_requests, True, num_tokens)
    )
    if inside:
        # Pointers advance split by split: no index product that could overflow 32 bits.
        lse_rows = lse_ptr + token * lse_stride_t + heads
        lse_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        # Unrolled: every split's loads are issued before the sums that wait for them, where a
        # loop waited out each split's loads in turn.
        for _ in tl.static_range(NUM_SPLITS):
            lse_max = tl.maximum(lse_max, tl.load(lse_rows, mask=head_ok, other=float("-inf")))
            lse_rows += lse_stride_s
        lse_use = tl.where(lse_max == float("-inf"), 0.0, lse_max)
        lse_rows = lse_ptr + token * lse_stride_t + heads
        part_rows = partial_ptr + token * partial_stride_t + heads[:, None] * partial_stride_h
        part_rows += lat[None, :]
        total = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        # A NaN log-sum-exp (a split that attended a non-finite row) makes the token NaN
        # whatever the maximum above made of it.
        not_finite = tl.zeros((BLOCK_H,), dtype=tl.int1)
        for _ in tl.static_range(NUM_SPLITS):
            lse = tl.load(lse_rows, mask=head_ok, other=float("-inf"))
            not_finite |= lse != lse
            if LARGE_SCALE:
                weight = tl.exp2((lse - lse_use) * lse_scale)  # stage 1's raw units
            else:
                weight = tl.exp2(lse - lse_use)
            part = tl.load(part_rows, mask=head_ok[:, None] & (weight > 0)[:, None], other=0.0)
            total += weight
            acc += weight[:, None] * part
            lse_rows += lse_stride_s
            part_rows += partial_stride_s
        o = acc / tl.where(total > 0, total, 1.0)[:, None]
        o = tl.where(not_finite[:, None], float("nan"), o)
    else:
        o = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    tl.store(
        out_rows[:, None] + lat[None, :], o.to(out_ptr.dtype.element_ty), mask=head_ok[:, None]
    )


# The two stages' launches: Triton's JIT on a specialisation's first call, then the direct launch.
_STAGE1 = KernelLaunches(_latent_attention_kernel, _RUNTIME_SIZES)
_COMBINE = KernelLaunches(_combine_splits_kernel, _COMBINE_RUNTIME_SIZES)
# Checked call layouts -> their launches (megatron_ext.fusions.launch_plans).
_PLANS: PlanCache["_AttentionPlan"] = PlanCache()


def pipeline_stages(shared_memory_per_block: Optional[int]) -> int:
    """Stage 1's software-pipelining stages on a GPU.

    Args:
        shared_memory_per_block: the shared memory one block may opt into (bytes), or None if
            unknown.

    Returns:
        int: 3 from ``THREE_STAGE_SHARED_MEMORY`` on, else 2 (and 2 when unknown).
    """
    if shared_memory_per_block is None or shared_memory_per_block < THREE_STAGE_SHARED_MEMORY:
        return 2
    return 3


class _DeviceLaunchLimits(NamedTuple):
    sms: int  # streaming multiprocessors
    stages: int  # stage 1's pipelining stages


@functools.lru_cache(maxsize=None)
def _launch_limits(device: torch.device) -> _DeviceLaunchLimits:
    """What the launcher reads of ``device``, looked up once per device (the interpreter: a few
    programs, and 3 stages as on the GPUs it stands in for)."""
    if device.type != "cuda":
        return _DeviceLaunchLimits(2, 3)
    properties = torch.cuda.get_device_properties(device)
    return _DeviceLaunchLimits(
        properties.multi_processor_count,
        pipeline_stages(getattr(properties, "shared_memory_per_block_optin", None)),
    )


def default_num_kv_splits(
    query_tiles: int,
    head_tiles: int,
    max_context: int,
    device: Optional[torch.device],
    *,
    num_warps: int = 4,
    target_programs: Optional[int] = None,
) -> int:
    """The split count for a launch, from static sizes only (graph-safe).

    The most splits that keep the launch to one wave of resident programs (two per SM for tiles
    of up to 4 warps, one for 8: stage 1 takes about 255 registers a thread either way), each
    covering at least ``MIN_KEYS_PER_SPLIT`` rows of the longest context the block table holds,
    at most ``MAX_KV_SPLITS``; one split when the query tiles alone fill the device. Rounding down
    matters: one split more starts a second wave that is mostly idle (on an H200, 64 decode tiles
    of 16 heads took 162.6 us with 5 splits, 111.4 us with 4).

    Args:
        query_tiles: query tiles of the launch (at most one per token).
        head_tiles: head tiles of the launch.
        max_context: the longest context the block table can hold (its width times the block
            size).
        device: the device the kernels run on (its SM count sets the target).
        num_warps: stage 1's warps (:func:`tile_shape`), which set the programs per SM.
        target_programs: the programs that fill the device, instead of ``device``'s (for
            tools that plan a launch for a GPU they do not run on).

    Returns:
        int: the split count, >= 1.

    Raises:
        ValueError: if neither ``device`` nor ``target_programs`` is given.
    """
    if device is None and target_programs is None:
        raise ValueError("default_num_kv_splits needs a device or target_programs")
    programs = max(1, query_tiles * head_tiles)
    if target_programs is None:
        target_programs = _launch_limits(device).sms * (2 if num_warps <= 4 else 1)
    by_length = max(1, max_context // MIN_KEYS_PER_SPLIT)
    return max(1, min(MAX_KV_SPLITS, target_programs // programs, by_length))


class CombineTile(NamedTuple):
    """Stage 2's tile: ``block_h`` heads x ``block_d`` latent columns of one token."""

    block_h: int
    block_d: int


def combine_tile(heads: int, latent_dim: int, num_kv_splits: int) -> CombineTile:
    """Stage 2's tile for a launch, from static sizes only (never the token count, so a decode
    batch size of its own compiles nothing new).

    ``COMBINE_BLOCK_D`` columns of up to ``BLOCK_H`` heads: narrow enough that a small decode
    batch spreads over many SMs (one program per token and 16 heads of all 512 columns left a
    16-head batch of 1 to one SM, reading every split's partial), and fewer heads where many
    splits would keep more than ``COMBINE_IN_FLIGHT`` partial values in flight in a program.

    Args:
        heads: query heads of the launch.
        latent_dim: the latent width (a power of two).
        num_kv_splits: the split count.

    Returns:
        CombineTile: powers of two, ``block_d`` dividing ``latent_dim``.
    """
    block_d = min(latent_dim, COMBINE_BLOCK_D)
    block_h = min(BLOCK_H, next_power_of_2(heads))
    while block_h > 1 and block_h * block_d * num_kv_splits > COMBINE_IN_FLIGHT:
        block_h //= 2
    return CombineTile(block_h, block_d)


class TileShape(NamedTuple):
    """Stage 1's tile: ``BLOCK_Q`` tokens x ``BLOCK_H`` heads, ``BLOCK_N`` keys per step."""

    block_q: int
    block_h: int
    block_n: int
    num_warps: int


def tile_shape(
    tokens: int,
    heads: int,
    latent_dim: int,
    max_query_len: Optional[int],
    fp32: bool,
    num_stages: int = 3,
) -> TileShape:
    """Stage 1's tile for a launch, from static sizes only.

    Args:
        tokens: new tokens of the step.
        heads: query heads of the launch.
        latent_dim: the latent width (sets the accumulator's size).
        max_query_len: the static bound on new tokens per request (None: ``tokens``).
        fp32: whether the inputs are fp32.
        num_stages: stage 1's pipelining stages on the device (:func:`pipeline_stages`).

    Returns:
        TileShape: the tile and its warp count.
    """
    decode = max_query_len == 1
    block_h = head_tile(heads, decode, fp32)
    # Rows of one dot: BLOCK_Q tokens x BLOCK_H heads, at least 16 (a tensor-core tile) and at
    # most what keeps the fp32 accumulator [rows, latent_dim] in registers.
    max_rows = 32 if fp32 else 64
    bound = tokens if max_query_len is None else max_query_len
    block_q = 1 if decode else min(max(next_power_of_2(bound), 16 // block_h), max_rows // block_h)
    warps = 8 if block_q * block_h * latent_dim > 16 * 512 else 4
    block_n = 16 if fp32 else 32
    if decode and not fp32 and block_h == 32 and num_stages >= 3:
        # On an H200 64-key steps (with one block id per tile) made the 32-head decode 1.45-1.86x
        # faster under Triton 3.6 and 3.9 (batch 1-128; scripts/compare_latent_attention.py).
        # The 64-head tile keeps 32 keys: its query sits in shared memory beside the keys, so 64
        # leaves room for 2 stages only, and it spills twice as much.
        block_n = WIDE_KEY_TILE
    return TileShape(block_q, block_h, block_n, warps)


def page_tiles(block_size: int, tile: TileShape) -> bool:
    """Whether stage 1 addresses each key tile from one block id (a tile on one page).

    Splits and groups start on whole key tiles, so where tiles divide pages no tile crosses one
    (megatron-core's block sizes, 64 and 256, with 16- to 64-key tiles). Taken where it was
    measured faster on an H200: 4-warp tiles (16-head decode 1.15-1.9x, with 38% fewer
    instructions per key tile), the 8-warp 32-head decode tile (1.13-1.2x) and, from Triton 3.9,
    the 8-warp 64-head decode tile (1.12-1.2x). Under Triton 3.6 and 3.7.1 that tile ran 13-25%
    slower with it (its loop spills more of the registers that hold the row offsets), so it keeps
    the per-row block ids there, as do the other 8-warp tiles (not measured).

    Args:
        block_size: the cache's block size.
        tile: stage 1's tile.

    Returns:
        bool: True for the one-block-id addressing.
    """
    if block_size % tile.block_n:
        return False
    if tile.num_warps <= 4:
        return True
    if tile.block_q != 1:
        return False
    return tile.block_h <= 32 or TRITON_RELEASE >= (3, 9)


def head_tile(heads: int, decode: bool, fp32: bool) -> int:
    """Heads per query tile of a launch.

    Args:
        heads: query heads of the launch (a tensor-parallel shard's count).
        decode: whether every request has one new token (``max_query_len == 1``).
        fp32: whether the inputs are fp32.

    Returns:
        int: a power of two. Decode: ``BLOCK_H`` with fp32 inputs; with 16-bit inputs the heads
        rounded up to a power of two, from ``BLOCK_H`` to ``MAX_DECODE_BLOCK_H``. Other steps:
        the heads rounded up to a power of two, at most ``BLOCK_H`` (tokens fill the tile).
    """
    if not decode:
        return min(BLOCK_H, next_power_of_2(heads))
    if fp32:
        return BLOCK_H
    return min(MAX_DECODE_BLOCK_H, max(BLOCK_H, next_power_of_2(heads)))


def _check_pow2(name: str, value: int) -> None:
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16; got {value}")


def _check(
    query,
    kv_cache,
    block_table,
    cu_query_lengths,
    kv_lengths,
    softmax_scale,
    rope_dim,
    max_query_len,
    num_kv_splits,
    out,
) -> Tuple[int, int, int]:
    """Check every argument; return (tokens, heads, latent_dim)."""
    function = "mla_paged_latent_attention"
    check_tensor("query", query, FLOAT_DTYPES)
    check_runnable(function, "query", query)
    device = query.device
    if query.dim() != 3:
        raise ValueError(
            f"query must be [tokens, heads, latent_dim + rope_dim] (squeeze megatron-core's batch "
            f"dimension of 1); got shape {tuple(query.shape)}"
        )
    check_unit_last_stride("query", query)
    tokens, heads, width = query.shape
    check_int("rope_dim", rope_dim, 1)
    _check_pow2("rope_dim", rope_dim)
    latent_dim = width - rope_dim
    if latent_dim < 1:
        raise ValueError(f"query's width {width} leaves no latent part beside rope_dim={rope_dim}")
    _check_pow2(f"the latent width (query width {width} - rope_dim {rope_dim})", latent_dim)
    _, block_size, cache_width = check_paged_cache("kv_cache", kv_cache, device)
    if block_size > MAX_BLOCK_SIZE:
        raise ValueError(
            f"kv_cache's block size {block_size} is over {MAX_BLOCK_SIZE} (the kernel counts a "
            "key's page and row in 32 bits across up to 64 pages)"
        )
    if kv_cache.dtype != query.dtype:
        raise TypeError(f"kv_cache is {kv_cache.dtype}, query {query.dtype}: they must match")
    if cache_width != width:
        raise ValueError(f"kv_cache rows are {cache_width} wide, query rows {width}")
    check_tensor("block_table", block_table, INDEX_DTYPES)
    check_device("block_table", block_table, device)
    if block_table.dim() != 2:
        raise ValueError(
            "block_table must be [requests, max_blocks_per_request]; got "
            f"{tuple(block_table.shape)}"
        )
    check_unit_last_stride("block_table", block_table)
    requests = block_table.shape[0]
    check_index_vector("cu_query_lengths", cu_query_lengths, requests + 1, device)
    check_index_vector("kv_lengths", kv_lengths, requests, device)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
    try:
        scale = float(softmax_scale)
    except OverflowError:
        raise ValueError(f"softmax_scale {softmax_scale} is too large for a float") from None
    if not (0 < scale < float("inf")):
        raise ValueError(f"softmax_scale must be positive and finite; got {softmax_scale}")
    # The kernel takes scale * log2(e) as an fp32 argument: outside fp32's normal range it would
    # arrive as 0 (uniform attention) or inf (NaN logits), a plausible wrong answer. Inside it,
    # no logit overflows (LARGE_SCALE_LOG2).
    fp32 = torch.finfo(torch.float32)
    if not (fp32.tiny <= scale * LOG2E <= fp32.max):
        raise ValueError(
            f"softmax_scale {softmax_scale} times log2(e) is outside float32's normal range "
            f"[{fp32.tiny:.3g}, {fp32.max:.3g}]: the kernel scales its logits in float32"
        )
    if max_query_len is not None:
        check_int("max_query_len", max_query_len, 1)
    if num_kv_splits is not None:
        check_int("num_kv_splits", num_kv_splits, 1)
        if num_kv_splits > MAX_KV_SPLITS:
            raise ValueError(f"num_kv_splits must be <= {MAX_KV_SPLITS}; got {num_kv_splits}")
    check_tensor("out", out, (query.dtype,))
    check_device("out", out, device)
    if tuple(out.shape) != (tokens, heads, latent_dim):
        raise ValueError(
            f"out must have shape {(tokens, heads, latent_dim)}; got {tuple(out.shape)}"
        )
    check_unit_last_stride("out", out)
    check_no_self_overlap("out", out)
    _check_disjoint_output(query, kv_cache, block_table, cu_query_lengths, kv_lengths, out)
    return tokens, heads, latent_dim


def mla_paged_latent_attention(
    query: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    cu_query_lengths: Tensor,
    kv_lengths: Tensor,
    softmax_scale: float,
    *,
    rope_dim: int = 64,
    max_query_len: Optional[int] = None,
    num_kv_splits: Optional[int] = None,
    out: Optional[Tensor] = None,
) -> Tensor:
    """Absorbed MLA attention of one dynamic-batching step over the paged latent cache.
    GRAPH-SAFE (no host synchronisation; grids and the split count from static sizes; idle
    programs exit early).

    Request ``r`` has the new tokens ``cu_query_lengths[r]:cu_query_lengths[r + 1]`` of
    ``query`` and ``kv_lengths[r]`` cached rows including them (append first:
    :func:`megatron_ext.fusions.fused_mla_rope_cache_append.fused_mla_rope_cache_append`); its
    row ``n`` is ``kv_cache[block_table[r, n // block_size], n % block_size]``. New token ``i`` of
    the request is at position ``kv_lengths[r] - q_len + i`` and attends to rows ``0..position``
    with keys the whole rows and values their first ``latent_dim`` columns:
    ``out = softmax(scale * q . k) @ v``, accumulated in fp32.

    The lengths and block ids are not checked on the host (each check needs a sync); whatever
    they hold, the kernels stay inside the tensors and write every output row:
    ``cu_query_lengths`` is read clamped into ``[0, tokens]``; tokens outside
    ``[cu_query_lengths[0], cu_query_lengths[-1])`` get zeros (CUDA-graph padding); if the
    clamped values decrease anywhere, every token inside that span gets NaN (no request
    boundary can be trusted). A negative ``kv_lengths`` entry attends to nothing (zeros); one
    past the block table's capacity keeps its positions and is cut at the capacity; a row whose
    block id lies outside the cache is skipped. A token that attends to a row holding NaN or
    inf gets NaN; rows it does not attend to never affect it.

    In megatron-core's ``DynamicInferenceContext`` terms: ``kv_cache`` is
    ``memory_buffer[layer]`` (``key_value_cache(layer)[0]``), ``block_table``,
    ``cu_query_lengths`` and ``kv_lengths`` the attention metadata's ``block_table``,
    ``cu_query_seq_lengths`` and ``kv_seq_lengths`` (padded requests have length 0), and
    ``max_query_len`` its ``max_seqlen_q``.

    Args:
        query (Tensor): [tokens, heads, latent_dim + rope_dim], ``[q_nope @ W_UK | rope(q_pe)]``
            per head; fp32, fp16 or bf16, unit last stride. ``heads`` may be a tensor-parallel
            shard (any count >= 1).
        kv_cache (Tensor): [num_blocks, block_size, latent_dim + rope_dim] in query's dtype, unit
            last stride; any block size.
        block_table (Tensor): [requests, max_blocks] int32/int64, unit last stride.
        cu_query_lengths (Tensor): [requests + 1] int32/int64 cumulative new-token counts.
        kv_lengths (Tensor): [requests] int32/int64 cached rows per request, the new ones
            included.
        softmax_scale (float): the logits' scale (MLA's is ``mscale**2 / sqrt(qk_head_dim +
            qk_pos_emb_head_dim)``, the unabsorbed head size's).
        rope_dim (int): the RoPE columns at the end of each row; it and the latent width
            (``kv_lora_rank``) must be powers of two >= 16.
        max_query_len (Optional[int]): a static bound on the new tokens per request (1 in
            decode-only steps); it picks the tile shape, so any value is correct. None: tokens.
        num_kv_splits (Optional[int]): split-KV count, 1 to ``MAX_KV_SPLITS``; None picks one
            from static sizes (:func:`default_num_kv_splits`).
        out (Optional[Tensor]): [tokens, heads, latent_dim] in query's dtype, unit last stride,
            to write to (a new tensor if None).

    Returns:
        Tensor: ``out``, [tokens, heads, latent_dim].

    Raises:
        TypeError, ValueError: for arguments of other types, dtypes, shapes, devices or layouts,
            widths the kernels do not take, or an ``out`` that overlaps an input, before any
            launch.
    """
    key = layout_key(
        (query, kv_cache, block_table, cu_query_lengths, kv_lengths, out),
        (softmax_scale, rope_dim, max_query_len, num_kv_splits),
    )
    plan = _PLANS.get(key)
    if plan is None:
        # First call of this layout: every check, then the plan (cached once they passed).
        if out is None and isinstance(query, Tensor) and query.dim() == 3:
            width = query.shape[2] - rope_dim if isinstance(rope_dim, int) else 0
            out = torch.empty(
                (*query.shape[:2], max(width, 0)), dtype=query.dtype, device=query.device
            )
        tokens, heads, latent_dim = _check(
            query,
            kv_cache,
            block_table,
            cu_query_lengths,
            kv_lengths,
            softmax_scale,
            rope_dim,
            max_query_len,
            num_kv_splits,
            out,
        )
        plan = _PLANS.put(
            key,
            _plan(
                query,
                kv_cache,
                block_table,
                cu_query_lengths,
                kv_lengths,
                softmax_scale,
                out,
                latent_dim=latent_dim,
                max_query_len=max_query_len,
                num_kv_splits=num_kv_splits,
            ),
        )
    elif out is None:
        out = torch.empty(plan.out_shape, dtype=query.dtype, device=query.device)
    else:
        # What the layout cannot tell: whether this call's output shares memory with an input.
        _check_disjoint_output(query, kv_cache, block_table, cu_query_lengths, kv_lengths, out)
    plan(query, kv_cache, block_table, cu_query_lengths, kv_lengths, out)
    return out


def _check_disjoint_output(query, kv_cache, block_table, cu_query_lengths, kv_lengths, out):
    check_disjoint(
        "out",
        out,
        (
            ("query", query),
            ("kv_cache", kv_cache),
            ("block_table", block_table),
            ("cu_query_lengths", cu_query_lengths),
            ("kv_lengths", kv_lengths),
        ),
    )


def _plan(
    query: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    cu_query_lengths: Tensor,
    kv_lengths: Tensor,
    softmax_scale: float,
    out: Tensor,
    *,
    latent_dim: int,
    max_query_len: Optional[int],
    num_kv_splits: Optional[int],
) -> "_AttentionPlan":
    """The launcher's tile, split count and stage count for a checked call, as a plan."""
    tokens, heads = query.shape[:2]
    stages = _launch_limits(query.device).stages
    fp32 = query.dtype == torch.float32
    tile = tile_shape(tokens, heads, latent_dim, max_query_len, fp32, num_stages=stages)
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(
            cdiv(tokens, tile.block_q),
            cdiv(heads, tile.block_h),
            block_table.shape[1] * kv_cache.shape[1],
            query.device,
            num_warps=tile.num_warps,
        )
    return _AttentionPlan(
        query,
        kv_cache,
        block_table,
        cu_query_lengths,
        kv_lengths,
        softmax_scale,
        out,
        latent_dim=latent_dim,
        tile=tile,
        num_kv_splits=num_kv_splits,
        num_stages=stages,
    )


class _AttentionPlan(LaunchPlan):
    """Both stages of one checked call layout, prepared (:class:`PreparedLaunch`): a call
    allocates the split-KV workspace and launches them with its tensors. Holds no tensor.

    The tile, split count and stage count are explicit (the launcher's choices, :func:`_plan`,
    or a tuning script's: any tile whose sizes are powers of two with ``block_q * block_h >= 16``
    computes the same attention), and so may stage 2's tile be (by default
    :func:`combine_tile`'s; any gives the same bits). The tensors given here only set the layout.
    """

    __slots__ = ("out_shape", "stage1", "combine", "workspace", "device")

    def __init__(
        self,
        query: Tensor,
        kv_cache: Tensor,
        block_table: Tensor,
        cu_query_lengths: Tensor,
        kv_lengths: Tensor,
        softmax_scale: float,
        out: Tensor,
        *,
        latent_dim: int,
        tile: TileShape,
        num_kv_splits: int,
        num_stages: int,
        combine: Optional[CombineTile] = None,
    ):
        tokens, heads = query.shape[:2]
        self.out_shape = (tokens, heads, latent_dim)
        self.device = query.device
        self.stage1: Optional[PreparedLaunch] = None
        self.combine: Optional[PreparedLaunch] = None
        self.workspace: Optional[Tuple[Tuple[int, ...], Tuple[int, ...]]] = None
        if tokens == 0 or heads == 0:
            return
        requests, max_blocks = block_table.shape
        rope_dim = query.shape[2] - latent_dim
        fp32 = query.dtype == torch.float32
        block_q, block_h, block_n, warps = tile
        head_tiles = cdiv(heads, block_h)
        # Decode: tile t is token t. Otherwise each request's tiles start at
        # cu_query_lengths[r] // block_q + r + 1 (_first_tile), the tiles before request 0's
        # holding the tokens before it, and the padding tokens' tiles follow the last request's.
        query_tiles = tokens if block_q == 1 else tokens // block_q + requests + 2
        scale_log2 = float(softmax_scale) * LOG2E
        large_scale = scale_log2 > LARGE_SCALE_LOG2
        if num_kv_splits == 1:
            partial, lse = out, out  # stage 1 writes the output; lse is not used
            partial_strides = (0, out.stride(0), out.stride(1))
            lse_strides = (0, 0)
        else:
            # Token-major, so that no stride varies with the step's token count: the strides are
            # specialised arguments, and a varying one would give each decode batch size its own
            # launch key (a JIT launch, not the direct one, on each new size).
            self.workspace = (
                (tokens, num_kv_splits, heads, latent_dim),
                (tokens, num_kv_splits, heads),
            )
            # Stand-ins for the dtype; each call passes its own workspace.
            partial = lse = query.new_empty(0, dtype=torch.float32)
            partial_strides = (heads * latent_dim, num_kv_splits * heads * latent_dim, latent_dim)
            lse_strides = (heads, num_kv_splits * heads)
        stage1 = dict(
            q_ptr=query,
            cache_ptr=kv_cache,
            block_table_ptr=block_table,
            cu_q_ptr=cu_query_lengths,
            kv_len_ptr=kv_lengths,
            out_ptr=partial,
            lse_ptr=lse,
            scale_log2=scale_log2,
            num_tokens=tokens,
            num_heads=heads,
            num_requests=requests,
            num_blocks=kv_cache.shape[0],
            BLOCK_SIZE=kv_cache.shape[1],
            max_blocks=max_blocks,
            q_stride_t=query.stride(0),
            q_stride_h=query.stride(1),
            cache_stride_b=kv_cache.stride(0),
            cache_stride_o=kv_cache.stride(1),
            table_stride=block_table.stride(0),
            out_stride_s=partial_strides[0],
            out_stride_t=partial_strides[1],
            out_stride_h=partial_strides[2],
            lse_stride_s=lse_strides[0],
            lse_stride_t=lse_strides[1],
            LATENT_DIM=latent_dim,
            ROPE_DIM=rope_dim,
            BLOCK_Q=block_q,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            NUM_SPLITS=num_kv_splits,
            SEQ_BLOCK=SEQ_BLOCK,
            # fp32 products in full precision, not TF32 (16-bit inputs: tensor cores either way).
            DOT_PRECISION="ieee" if fp32 else "tf32",
            PAGE_TILES=page_tiles(kv_cache.shape[1], tile),
            WIDE_ROWS=block_n * kv_cache.stride(1) + kv_cache.shape[2] >= ROW_OFFSET_LIMIT,
            LARGE_SCALE=large_scale,
        )
        self.stage1 = PreparedLaunch(
            _STAGE1,
            (query_tiles, head_tiles, num_kv_splits),
            stage1,
            dict(num_warps=warps, num_stages=num_stages),
        )
        if num_kv_splits > 1:
            combine_h, combine_d = combine or combine_tile(heads, latent_dim, num_kv_splits)
            combine = dict(
                partial_ptr=partial,
                lse_ptr=lse,
                cu_q_ptr=cu_query_lengths,
                out_ptr=out,
                num_tokens=tokens,
                num_heads=heads,
                num_requests=requests,
                partial_stride_s=partial_strides[0],
                partial_stride_t=partial_strides[1],
                partial_stride_h=partial_strides[2],
                lse_stride_s=lse_strides[0],
                lse_stride_t=lse_strides[1],
                out_stride_t=out.stride(0),
                out_stride_h=out.stride(1),
                lse_scale=scale_log2,
                BLOCK_H=combine_h,
                BLOCK_D=combine_d,
                NUM_SPLITS=num_kv_splits,
                LARGE_SCALE=large_scale,
            )
            self.combine = PreparedLaunch(
                _COMBINE,
                (tokens, cdiv(heads, combine_h), latent_dim // combine_d),
                combine,
                dict(num_warps=4),
            )

    def __call__(
        self,
        query: Tensor,
        kv_cache: Tensor,
        block_table: Tensor,
        cu_query_lengths: Tensor,
        kv_lengths: Tensor,
        out: Tensor,
    ) -> None:
        """Launch with this call's tensors (of the plan's layout)."""
        if self.stage1 is None:
            return
        if self.workspace is None:
            self.stage1(query, kv_cache, block_table, cu_query_lengths, kv_lengths, out, out)
            return
        partial_shape, lse_shape = self.workspace
        partial = torch.empty(partial_shape, dtype=torch.float32, device=self.device)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=self.device)
        self.stage1(query, kv_cache, block_table, cu_query_lengths, kv_lengths, partial, lse)
        self.combine(partial, lse, cu_query_lengths, out)
