# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The Triton kernels of the paged attention over MLA's latent cache, in the absorbed form.

With ``cache_mla_latents`` each cached token is one row ``[latent (kv_lora_rank) | rope(k_pe)]``
(576 wide for DeepSeek-V3) shared by every head. Absorbing the key up-projection into the query
(``q_nope @ W_UK``) makes the row the key of every head, and its first ``kv_lora_rank`` columns the
value (projected by ``W_UV`` afterwards), so attention reads the cache as it is: multi-query
attention with one 576-wide key head and a 512-wide value. Stage 1 reads the query's latent and
RoPE parts through two pointers with their own token and head strides, so the query can be one
``[tokens, heads, 576]`` tensor or two (``q_nope @ W_UK`` as a head-major matmul output and the
RoPE slice of the projected query), with no copy to join them.
:func:`~megatron_ext.fusions.mla_latent.attention.mla_paged_latent_attention` computes it for one
step of megatron-core's dynamic batching: prefill, chunked prefill (new tokens behind earlier
cached ones), decode and any mix of them in one batch, with causal masking among a request's new
tokens. It reads only the cache rows each token attends to, through the block table; nothing
decompresses the cache.

Kernel design (the tile rules named here are in :mod:`megatron_ext.fusions.mla_latent.tile_rules`):

* Stage 1 (:func:`_latent_attention_kernel`), grid ``(query tiles, head tiles, kv splits)``. A
  query tile is up to ``BLOCK_Q`` consecutive new tokens of one request times ``BLOCK_H`` heads
  (rows of one ``tl.dot``; ``head_tile``: decode tiles of up to 64 heads, so each cache row
  is read once per 64 heads); its program walks the request's cache rows ``BLOCK_N`` at a time
  (their block ids looked up in the block table: one per key tile where tiles divide pages,
  ``page_tiles``, else one per row, so any block size works), with an online softmax in
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
  slice of latent columns, ``combine_tile``) combines them in split order. The split count
  comes from static sizes only (tokens, heads, the block table's width and the GPU's SM count),
  never from the lengths.

Metadata the host does not read (a sync) is made safe on the device: whatever
``cu_query_lengths``, ``kv_lengths`` and the block ids hold, no program reads or writes outside
the tensors, and every output row is written (see
:func:`~megatron_ext.fusions.mla_latent.attention.mla_paged_latent_attention`).

Non-finite values: a token's output depends only on the cache rows it attends to; a NaN or inf
in one of them (or a score that overflows float32) makes it NaN, also across split-KV partials.

Graph safety: no host synchronisation, no ``.item()``, grids and the split count from shapes
only; the lengths, block ids and positions are read on the device. The same inputs give the same
bits on every launch (no atomics; the splits are combined in a fixed order), so a CUDA-graph
replay equals an eager call. The first call of a shape compiles: make it outside capture.

The tile, split count and stage count are the host's choices (:mod:`.tile_rules`), launched as
:mod:`.attention_plan` lays out. The ``@triton.jit`` functions here are those of the former
``megatron_ext/fusions/mla_paged_latent_attention.py``, stage 1 with the query's RoPE part read
through its own pointer (the same loads and arithmetic).
"""

import triton
import triton.language as tl

from megatron_ext.fusions.direct_launch import KernelLaunches

__all__ = ["COMBINE_LAUNCHES", "STAGE1_LAUNCHES"]


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
    q_rope_ptr,
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
    q_rope_stride_t,
    q_rope_stride_h,
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
    Q_ROPE_COL: tl.constexpr,
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
            # Past the last request, or one of the tiles before request 0's first: with no
            # request at all both hold, and the tiles before the first (tile_start < 0, tokens
            # below cu_query_lengths[0]) write their own tokens (>= 0), never the ones before
            # out's; a tile past the last request starts at or after its end (>= 0 too).
            after = (request == num_requests) & (tile_start >= 0)
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

    # The query's two parts through two row pointers: one operand (q_rope_ptr is q_ptr, the
    # RoPE columns at Q_ROPE_COL = LATENT_DIM) or two (Q_ROPE_COL = 0). The loads and the
    # arithmetic after them are the same either way.
    q_rows = q_ptr + tokens * q_stride_t + heads * q_stride_h
    q_rope_rows = q_rope_ptr + tokens * q_rope_stride_t + heads * q_rope_stride_h
    q_lat = tl.load(q_rows[:, None] + lat[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(
        q_rope_rows[:, None] + Q_ROPE_COL + rope[None, :], mask=row_ok[:, None], other=0.0
    )

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
# Their bound C launchers are per specialisation: host profiles read them (``.launches``).
STAGE1_LAUNCHES = KernelLaunches(_latent_attention_kernel, _RUNTIME_SIZES)
COMBINE_LAUNCHES = KernelLaunches(_combine_splits_kernel, _COMBINE_RUNTIME_SIZES)
