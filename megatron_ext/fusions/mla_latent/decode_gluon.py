# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The warp-specialized decode kernel of the latent attention, in Gluon (Hopper, Triton >= 3.7).

Stage 1 (:mod:`.attention_kernels`) gives its 64-head decode tile to one ``tl.dot`` of 8 warps:
Triton lays the 64-row score product out as ``warpsPerCTA = [8, 1]``, so both warpgroups of a
program compute the same 64 x 32 score tile, and every variant spills. Plain Triton cannot be
told otherwise. This kernel writes the roles out instead, as FlashMLA and FlashInfer's Hopper MLA
kernel do, in Gluon (``triton.experimental.gluon``), where layouts, warpgroup MMAs, shared memory
and barriers are explicit:

* one program per (token, 64 heads, split); 12 warps in three partitions of one warpgroup each;
* the **producer** copies the program's query rows, then gathers each key tile's cache rows
  through the block table with ``cp.async`` (Hopper's TMA cannot gather rows by index, and one
  box per page would tie the block size to the key tile) into a ring of ``NUM_BUFFERS`` key
  tiles, and signals a barrier when they land;
* **consumer 0** computes each 64 x ``BLOCK_N`` score tile once (``wgmma``, K = latent + rope)
  and the online softmax, writes P (16-bit) and the rows' rescale factors to shared memory, and
  multiplies P by the first half of the value columns;
* **consumer 1** multiplies the same P by the second half, so the 64 x 512 fp32 accumulator is
  split between two warpgroups (128 registers a thread each) and no score is computed twice.

It computes what stage 1 computes for a decode tile (``BLOCK_Q = 1``, ``BLOCK_H = 64``): the same
positions, key ranges, masking of block ids outside the cache, non-finite rules (an attended
``-inf`` score gives NaN), scale modes and padding-token handling (its splits' bounds are
multiples of its key tiles, stage 1's of its own), and it writes
stage 1's outputs (the output itself with one split, else the fp32 split workspace and the
log-sum-exps that :func:`~.attention_kernels._combine_splits_kernel` merges). Its bits are its
own (another summation order), not stage 1's. The plan launches it where
:func:`~.attention_plan.gluon_decode_refusal` finds no reason not to; everywhere else stage 1 runs.

Graph safety as stage 1: no host synchronisation, grids and split counts from static sizes, the
lengths and block ids read on the device; no atomics, so a launch's bits do not depend on timing.

The barriers, each used once per key tile (phases alternate with the tile index ``j``) but the
query's, used once:

* ``q_ready``: the query's copies have landed (one arrival per producer thread, as below);
* ``kv_ready[b]``: the producer's copies into buffer ``b`` have landed (each producer thread's
  ``cp.async.mbarrier.arrive``, so the count is the producer's threads);
* ``score_ready[b * CHUNKS + c]``, in scores as they land only: 64 columns ``c`` of buffer ``b``
  have landed (the same count); consumer 0's score product waits on these, in the other orders
  on ``kv_ready``;
* ``kv_free[b]``: both consumers are done reading buffer ``b`` (count 2);
* ``p_ready[b]`` / ``p_free[b]``: consumer 0 has written P and the rescale factors into buffer
  ``b`` of ``P_BUFFERS`` / consumer 1 is done with them (shared memory holds the query, the key
  ring and P, 221 KiB of the 227 KiB an H100 or H200 gives a block with one P buffer); after the
  last tile the same handoff carries the final row sums that consumer 1 normalises with.
"""

try:  # Gluon's API as of Triton 3.7 (unchanged through 3.9); older releases lack it.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )

    GLUON_IMPORT_ERROR = None
except ImportError as error:  # the kernel is not defined; the plan keeps stage 1
    GLUON_IMPORT_ERROR = f"{type(error).__name__}: {error}"

from megatron_ext.fusions.direct_launch import KernelLaunches
from megatron_ext.fusions.mla_latent.attention_kernels import STAGE1_LAUNCHES

__all__ = [
    "GLUON_DECODE_LAUNCHES",
    "GLUON_IMPORT_ERROR",
    "GLUON_WARPS",
    "HEADS_FIRST",
    "HEADS_PER_PROGRAM",
    "KEY_TILE",
    "NUM_BUFFERS",
    "ORDER",
    "ORDER_SCORES_AHEAD",
    "ORDER_VALUES_FIRST",
    "ORDER_VALUES_LAG",
    "ORDER_RELEASE_FIRST",
    "ORDER_SCORES_AS_THEY_LAND",
    "P_BUFFERS",
    "SHARED_BUFFERS",
    "SHARED_KEY_TILE",
    "SHARED_ORDER",
    "TRACE_EVENTS",
    "TRACE_TILES",
    "gluon_shared_memory",
]

# Query rows of one program: a warpgroup MMA's M.
HEADS_PER_PROGRAM = 64
# Keys per tile and tiles in flight: the query (64 x 576) and four 32-key tiles take 216 KiB of
# the 227 KiB a block may have (16-bit, DeepSeek-V3's widths).
KEY_TILE = 32
NUM_BUFFERS = 4
# Consumer 0's order of a key tile's work (see _consumer_scores):
# values first: the tile's value product issued after its softmax, waited for while the next
#   tile's scores run, so its key tile goes back to the producer a score product earlier (5-10%
#   off the 128-head rows on an H100, where consumer 0 had waited for the next tile's copy);
# values lag: the value product issued behind the next tile's scores, running during that tile's
#   softmax (on an H100, Triton 3.7.1, 0-4% faster than values first at 32-128 heads with two
#   64-key tiles, which lost up to 18% at 128 heads in the lagged order);
# scores ahead: the next tile's scores issued before this tile's softmax, so the tensor cores
#   run them (and the previous value product) while the softmax waits on registers; both are
#   waited for together (waiting for the value product alone and reading its accumulator while
#   the scores ran made ptxas serialize every MMA of the kernel, C7514). 0-3% slower than the
#   lagged order on an H100 (Triton 3.7.1), 2-7% with two P buffers: the combined wait delays
#   P's handoff. The tensor pipe was 41% busy in the lagged order at 128 heads (H200, Nsight
#   Compute). A fourth warpgroup for the softmax alone does not compile: Triton caps 16 warps'
#   registers at 128 a thread, below a 64 x 256 fp32 accumulator's (ptxas allocates every
#   partition within the kernel's cap; a partition's setmaxnreg does not raise it). With the
#   producer's copies moved into two value warpgroups instead (12 warps), it compiles and gives
#   the same bits, but was 15-22% slower at 128 heads on an H100: each warpgroup's copies issue
#   behind its value product, so the next tile lands late (perf notes). FlashMLA's seesaw (both
#   consumers computing the scores of alternate tiles, exchanging row maxima and P) ran within 3%
#   of the lagged order at 32-128 heads on an H100, so it was not kept (perf notes).
# release first: values first, but the previous tile's buffer goes back as soon as its value
#   product completes, before the wait for this tile's copy. With two 64-key buffers a tile's
#   copy could otherwise start only once the next tile had landed: the kernel's own timeline
#   (scripts/trace_gluon_decode.py, H100) put the ring's period at the copy's issue and latency
#   (about 1,000 and 2,500 cycles) plus that wait, not at the tile's MMAs or softmax. Running
#   either consumer's value product beside the softmax instead (the consumers taking turns at
#   the scores, or consumer 1's product deferred behind the next scores) gave the same bits and
#   was 11-70% slower on an H100: beside a value product the softmax took about the product's
#   length longer (perf notes).
# scores as they land: release first, with the score product issued 64 columns at a time, each
#   part once its columns' copies have landed (a barrier per 64 columns and buffer), so the
#   product starts on the first columns instead of the whole tile (FlashMLA's fine-grained copy
#   and GEMM pipelining); the same k-steps and bits as release first, but 7-16% slower at 128
#   heads and up to 1% at 32-64 on an H100 (Triton 3.7.1): the nine waits and fences between the
#   product's parts cost more than the earlier start gains (perf notes). A sweep variant only.
ORDER_VALUES_FIRST, ORDER_VALUES_LAG, ORDER_SCORES_AHEAD = 0, 1, 2
ORDER_RELEASE_FIRST, ORDER_SCORES_AS_THEY_LAND = 3, 4
ORDER = ORDER_VALUES_LAG
# Program order: the head groups of a token (128 heads: two programs reading the same key tiles)
# on the grid's first axis, so they start together and the second reads the tiles from L2 while
# the first's copies are fresh, instead of a wave of other tokens apart. On an H100 (Triton
# 3.7.1), 11-13% faster at 128 heads in rows of two waves or more, within 2% at 32 and 64 heads,
# and 2-4% slower or faster at 128 heads in one wave of splits; on an H200 3-10% faster at 128
# heads in most rows. The plan keeps tokens first past 65,535 tokens (the second axis's limit).
HEADS_FIRST = True
# The launcher's ring at every head count (attention_plan.gluon_ring): two 64-key tiles, which
# halve the query's shared-memory reads per key; first chosen where a token's head groups (more
# than 64 heads) read the same key tiles, the second mostly from L2. At 128 heads, on an H100,
# 5-13% faster than the 32-key ring in 6 of 6 rows under Triton 3.9 and 3-6% in 4 of 6 under
# 3.7.1 (the others within 1%); on an H200 (3.7.1) 17-25% in 9 of 9. At 32 and 64 heads, timed
# in turns, 1-18% faster on an H200 (3.7.1) in 7 of 7 rows and 0.1-1.6% on an H100 in 11 of 11
# (timed one after the other it had been 0-4% slower). Release first, not values first: the same
# bits, 2-8% faster in 9 of 9 rows at 96-128 heads on an H100 (Triton 3.7.1).
SHARED_KEY_TILE = 64
SHARED_BUFFERS = 2
SHARED_ORDER = ORDER_RELEASE_FIRST
# Buffers of P and the rescale factors: with two, consumer 0 writes a tile's while consumer 1 still
# multiplies the previous one (two 32-key P buffers fit beside the ring; two 64-key ones do not).
P_BUFFERS = 1
# Three partitions of one warpgroup each (the default partition is the launch's num_warps=4).
PARTITION_WARPS = 4
# The timeline (off in every launch the plan makes; scripts/trace_gluon_decode.py turns it on):
# per program and partition, the SM clock at up to TRACE_EVENTS points of each of the first
# TRACE_TILES key tiles, and a last row with the partition's start and end (the SM clock, the SM's
# id and the global timer; consumer 0's also the global timer at the program's entry and fork).
TRACE_TILES = 64
TRACE_EVENTS = 8
GLUON_WARPS = 3 * PARTITION_WARPS


def gluon_shared_memory(
    latent_dim: int,
    rope_dim: int,
    key_tile: int = KEY_TILE,
    buffers: int = NUM_BUFFERS,
    p_buffers: int = P_BUFFERS,
) -> int:
    """Shared memory one program takes (16-bit inputs), against a device's limit per block.

    Args:
        latent_dim: the latent width.
        rope_dim: the RoPE width.
        key_tile: keys per tile.
        buffers: key tiles in the ring.
        p_buffers: buffers of P and the rescale factors.

    Returns:
        int: bytes: the query, the key ring, P and a row vector, plus 1 KiB for the barriers
        and the buffers' alignment (226,560 with the default ring at DeepSeek-V3's widths; an
        H100 or H200 block may opt into 232,448).
    """
    row = (latent_dim + rope_dim) * 2
    return (
        HEADS_PER_PROGRAM * row
        + buffers * key_tile * row
        + p_buffers * HEADS_PER_PROGRAM * (key_tile * 2 + 4)
        + 1024
    )


# Sizes that change from step to step: not specialised (stage 1's, the same arguments).
_RUNTIME_SIZES = sorted(STAGE1_LAUNCHES.unspecialized)

if GLUON_IMPORT_ERROR is None:
    # The sizes above as the kernels see them (a kernel reads module globals only as constexprs).
    _HEADS = gl.constexpr(HEADS_PER_PROGRAM)
    _PWARPS = gl.constexpr(PARTITION_WARPS)
    # The row vectors handed between the consumers (rescale factors, row sums) cross shared
    # memory in a blocked layout, converted from and to the MMA row layout inside each
    # warpgroup: stored from that layout (each row on a quad's four threads), racecheck reports
    # the mbarrier-ordered handoff as a hazard (scripts/racecheck_mbarrier_handoff.py
    # reproduces it on a kernel that does nothing else); stored from this one, it reports none.
    _HANDOFF = gl.constexpr(gl.BlockedLayout([1], [32], [PARTITION_WARPS], [0]))
    # The one call whose name differs between the Gluon releases taken: Triton 3.7's cp.async
    # copy is async_copy_global_to_shared, 3.9's async_load (where the old name raises). Bound
    # here: a kernel's source may not name an attribute its Triton lacks, even in a branch it
    # does not take (the JIT resolves every name it reads to hash the kernel).
    _copy_rows = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
    CONSUMER_REGS = gl.constexpr(208)
    PRODUCER_REGS = gl.constexpr(40)
    _TRACE_TILES = gl.constexpr(TRACE_TILES)
    _TRACE_EVENTS = gl.constexpr(TRACE_EVENTS)
    _TRACE_ROW = gl.constexpr((TRACE_TILES + 1) * TRACE_EVENTS)
    # Consumer 0's own row past its span's stamps: the global timer at the program's entry and
    # at its fork into the partitions.
    _ENTRY = gl.constexpr(5)
    _FORK = gl.constexpr(6)

    @gluon.jit
    def _clock(dep, GLOBAL: gl.constexpr = False):
        """The SM clock (cycles), or with ``GLOBAL`` the global timer (ns), read once ``dep`` (a
        1-D fp32 tensor, the asm's operand) is computed."""
        if GLOBAL:
            asm: gl.constexpr = "mov.u64 $0, %globaltimer;"
        else:
            asm: gl.constexpr = "mov.u64 $0, %clock64;"
        return gl.inline_asm_elementwise(asm, "=l,f", [dep], dtype=gl.int64, is_pure=False, pack=1)

    @gluon.jit
    def _stamp(trace, j, EVENT: gl.constexpr, dep, TRACE: gl.constexpr):
        """Write the SM clock into slot ``EVENT`` of tile ``j``'s row of a partition's timeline,
        once ``dep`` is computed. Compiled out without ``TRACE`` (every launch of the plan).

        Args:
            trace: the partition's timeline (int64; any pointer without ``TRACE``).
            j: the key tile (tiles past the timeline's rows are not written, so a long program
                leaves the partition's own row alone).
            EVENT: the slot.
            dep: a 1-D fp32 tensor the clock read waits for (the asm's operand), so the read
                lands after the work that computes it.
            TRACE: whether the timeline is on.
        """
        if TRACE:
            now = _clock(dep)
            one = gl.arange(0, dep.shape[0], layout=dep.type.layout) == 0
            slot = trace + gl.minimum(j, _TRACE_TILES - 1) * _TRACE_EVENTS + EVENT
            gl.store(slot + one.to(gl.int32) * 0, now, mask=one & (j < _TRACE_TILES))

    @gluon.jit
    def _own_row(trace, dep):
        """A partition's own row of the timeline as a pointer in ``dep``'s layout, and the mask
        of the one element that writes it."""
        one = gl.arange(0, dep.shape[0], layout=dep.type.layout) == 0
        return trace + _TRACE_TILES * _TRACE_EVENTS + one.to(gl.int32) * 0, one

    @gluon.jit
    def _stamp_span(trace, AT_END: gl.constexpr, dep, TRACE: gl.constexpr):
        """Write a partition's start (``AT_END`` false) or end into its own row of the timeline:
        the SM clock (slot 0 or 1) and the global timer in ns (slot 3 or 4), and at the start the
        SM's id (slot 2), so the trace can line up programs that ran one after another on an SM.
        Compiled out without ``TRACE``.

        Args:
            trace: the partition's timeline (int64; any pointer without ``TRACE``).
            AT_END: the end's stamps, not the start's.
            dep: a 1-D fp32 tensor the reads wait for.
            TRACE: whether the timeline is on.
        """
        if TRACE:
            own, one = _own_row(trace, dep)
            clock = _clock(dep)
            ns = _clock(dep, GLOBAL=True)
            if AT_END:
                gl.store(own + 1, clock, mask=one)
                gl.store(own + 4, ns, mask=one)
            else:
                sm = gl.inline_asm_elementwise(
                    "mov.u32 $0, %smid;", "=r,f", [dep], dtype=gl.int32, is_pure=False, pack=1
                )
                gl.store(own, clock, mask=one)
                gl.store(own + 2, sm.to(gl.int64), mask=one)
                gl.store(own + 3, ns, mask=one)

    @gluon.jit
    def _stamp_entry(trace, SLOT: gl.constexpr, dep, TRACE: gl.constexpr):
        """Write the global timer (ns) into slot ``SLOT`` of consumer 0's own row, from the code
        before the partitions (a program's entry, or its fork), so the trace can split the gap
        between programs into launch, the metadata before the fork, and the fork itself.
        Compiled out without ``TRACE``.

        Args:
            trace: consumer 0's timeline (int64; any pointer without ``TRACE``).
            SLOT: the slot (``_ENTRY`` or ``_FORK``).
            dep: a 1-D fp32 tensor the read waits for.
            TRACE: whether the timeline is on.
        """
        if TRACE:
            own, one = _own_row(trace, dep)
            gl.store(own + SLOT, _clock(dep, GLOBAL=True), mask=one)

    @gluon.jit
    def _load_cu(cu_q_ptr, idx, mask, num_tokens):
        """``cu_query_lengths[idx]`` clamped into ``[0, num_tokens]`` (as stage 1's)."""
        cu_q = gl.load(cu_q_ptr + idx, mask=mask, other=0).to(gl.int64)
        return gl.minimum(gl.maximum(cu_q, 0), num_tokens)

    @gluon.jit
    def _token_request(token, cu_q_ptr, num_tokens, num_requests, SEQ_BLOCK: gl.constexpr):
        """The request holding ``token`` (``num_requests`` past the last) and whether the clamped
        ``cu_query_lengths`` are non-decreasing: stage 1's ``_tile_request`` at ``BLOCK_Q = 1``."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [_PWARPS], [0])
        request = gl.to_tensor(0)
        decreases = gl.to_tensor(0)
        for start in range(1, num_requests + 1, SEQ_BLOCK):
            idx = start + gl.arange(0, SEQ_BLOCK, layout=layout)
            valid = idx <= num_requests
            cu_q = _load_cu(cu_q_ptr, idx, valid, num_tokens)
            before = _load_cu(cu_q_ptr, idx - 1, valid, num_tokens)
            request += gl.sum((valid & (cu_q <= token)).to(gl.int32), axis=0)
            decreases += gl.sum((valid & (cu_q < before)).to(gl.int32), axis=0)
        return request, decreases == 0

    @gluon.jit
    def _fill_rows(
        out_ptr, token, heads, out_stride_t, out_stride_h, row_mask, value, LATENT_DIM: gl.constexpr
    ):
        """Write ``value`` into the output rows (token, head) where ``row_mask``, 64 columns at a
        time (``heads`` and ``row_mask`` in the rows' slice of the fill layout)."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_PWARPS, 1], [1, 0])
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        rows = out_ptr + token * out_stride_t + heads * out_stride_h
        fill = gl.full([_HEADS, 64], value, out_ptr.dtype.element_ty, layout)
        for c in gl.static_range(LATENT_DIM // 64):
            gl.store(rows[:, None] + c * 64 + cols[None, :], fill, mask=row_mask[:, None])

    @gluon.jit
    def _tile_pages(first, hi, tile_keys, BLOCK_SIZE: gl.constexpr):
        """The table column and row in its page of each key ``first + tile_keys``, and which
        are below ``hi``.

        One 64-bit division per tile (a scalar), the rest in 32 bits: a 64-bit division by an
        odd block size per key spilled the producer's 40 registers.
        """
        page0 = first // BLOCK_SIZE
        in_tile = (first - page0 * BLOCK_SIZE).to(gl.int32) + tile_keys
        # hi is at most the block table's capacity, so a key below it has its page in the row.
        in_range = first + tile_keys < hi
        return page0 + in_tile // BLOCK_SIZE, in_tile % BLOCK_SIZE, in_range

    @gluon.jit
    def _tile_blocks(
        table_row,
        first,
        hi,
        tile_keys,
        num_blocks,
        BLOCK_SIZE: gl.constexpr,
        BLOCK_N: gl.constexpr,
    ):
        """The block id of each key ``first + tile_keys``, its row in the page, and whether it is
        attended (below ``hi``, in a block inside the cache)."""
        if BLOCK_SIZE % BLOCK_N == 0:
            # Tiles start at multiples of BLOCK_N, so a tile lies in one page: one block id, a
            # scalar (a vector of 64-bit ids and pointers per key cost the consumer its
            # registers).
            page = first // BLOCK_SIZE
            block = gl.load(table_row + page, mask=first < hi, other=-1).to(gl.int64)
            in_page = (first - page * BLOCK_SIZE).to(gl.int32) + tile_keys
            in_range = first + tile_keys < hi
        else:
            page, in_page, in_range = _tile_pages(first, hi, tile_keys, BLOCK_SIZE)
            block = gl.load(table_row + page, mask=in_range, other=-1).to(gl.int64)
        return block, in_page, in_range & (block >= 0) & (block < num_blocks)

    @gluon.jit
    def _copy_query(
        q_smem,
        q_rope_smem,
        q_ready,
        q_ptr,
        q_rope_ptr,
        token,
        head0,
        num_heads,
        q_stride_t,
        q_stride_h,
        q_rope_stride_t,
        q_rope_stride_h,
        LATENT_DIM: gl.constexpr,
        ROPE_DIM: gl.constexpr,
        Q_ROPE_COL: gl.constexpr,
    ):
        """Copy the program's query rows into shared memory, 64 columns per copy, every copy in
        flight at once (rows past the heads are zeros); ``q_ready`` fires when they land."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_PWARPS, 1], [1, 0])
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        heads = head0 + gl.arange(0, _HEADS, layout=gl.SliceLayout(1, layout))
        head_ok = (heads < num_heads)[:, None]
        rows = q_ptr + token * q_stride_t + heads.to(gl.int64) * q_stride_h
        for c in gl.static_range(LATENT_DIM // 64):
            _copy_rows(
                q_smem.slice(c * 64, 64, dim=1), rows[:, None] + c * 64 + cols[None, :], head_ok
            )
        rows = q_rope_ptr + token * q_rope_stride_t + heads.to(gl.int64) * q_rope_stride_h
        for c in gl.static_range(ROPE_DIM // 64):
            _copy_rows(
                q_rope_smem.slice(c * 64, 64, dim=1),
                rows[:, None] + Q_ROPE_COL + c * 64 + cols[None, :],
                head_ok,
            )
        async_copy.mbarrier_arrive(q_ready, increment_count=False)

    @gluon.jit
    def _producer(
        q_smem,
        q_rope_smem,
        q_ready,
        q_ptr,
        q_rope_ptr,
        token,
        head0,
        num_heads,
        q_stride_t,
        q_stride_h,
        q_rope_stride_t,
        q_rope_stride_h,
        kv_smem,
        rope_smem,
        kv_ready,
        kv_free,
        cache_ptr,
        table_row,
        lo,
        hi,
        num_tiles,
        num_blocks,
        cache_stride_b,
        cache_stride_o,
        BLOCK_SIZE: gl.constexpr,
        LATENT_DIM: gl.constexpr,
        ROPE_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BUFFERS: gl.constexpr,
        Q_ROPE_COL: gl.constexpr,
        score_ready,
        CHUNKS: gl.constexpr,
        trace,
        TRACE: gl.constexpr,
        IDS_AHEAD: gl.constexpr,
    ):
        """Copy the query, then gather key tile after key tile into the ring (latent and RoPE
        columns in buffers of their own: shared memory shapes are powers of two), 64 columns per
        copy. The query's copies are in flight beside the first tiles', where loading it before
        the partitions started left the ring empty until it landed. With ``IDS_AHEAD`` each
        tile's block ids are loaded a tile ahead."""
        # 16-byte copies: a warp covers 4 rows of 64 columns.
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_PWARPS, 1], [1, 0])
        cols = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
        tile_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        clock_dep = tile_keys.to(gl.float32)
        # Release first's producer loads each tile's block ids a tile ahead, in flight while it
        # waits for the buffer, so their latency is not between the buffer's release and its
        # copies (1-4% off the 128-head rows on an H100, the same bits). Under values lag on the
        # 32-key ring it cost 0.2-0.8% at 32 and 64 heads and 6% at 128 (ids held across the
        # wait), so that ring keeps loading them after the wait. The first tile's are loaded
        # before the query's copies: behind them, their load returned only once the query had
        # landed, and the first tile's copies started about 3,900 cycles into the program (an
        # H200's timeline).
        if IDS_AHEAD:
            block, in_page, ok = _tile_blocks(
                table_row, lo, hi, tile_keys, num_blocks, BLOCK_SIZE, BLOCK_N
            )
        _copy_query(
            q_smem,
            q_rope_smem,
            q_ready,
            q_ptr,
            q_rope_ptr,
            token,
            head0,
            num_heads,
            q_stride_t,
            q_stride_h,
            q_rope_stride_t,
            q_rope_stride_h,
            LATENT_DIM,
            ROPE_DIM,
            Q_ROPE_COL,
        )
        _stamp_span(trace, False, clock_dep, TRACE)
        for j in range(num_tiles):
            buf = j % BUFFERS
            _stamp(trace, j, 0, clock_dep, TRACE)
            # The first round finds every buffer free (the phase before a barrier's first one
            # counts as complete).
            mbarrier.wait(kv_free.index(buf), ((j // BUFFERS) & 1) ^ 1)
            _stamp(trace, j, 1, clock_dep, TRACE)
            if not IDS_AHEAD:
                block, in_page, ok = _tile_blocks(
                    table_row, lo + j * BLOCK_N, hi, tile_keys, num_blocks, BLOCK_SIZE, BLOCK_N
                )
            # A block id outside the cache is skipped, never read (stage 1's rule); the copies
            # of masked rows write zeros.
            rows = (
                cache_ptr
                + gl.where(ok, block, 0) * cache_stride_b
                + in_page.to(gl.int64) * cache_stride_o
            )
            dst = kv_smem.index(buf)
            for c in gl.static_range(LATENT_DIM // 64):
                _copy_rows(
                    dst.slice(c * 64, 64, dim=1),
                    rows[:, None] + c * 64 + cols[None, :],
                    mask=ok[:, None],
                )
                if CHUNKS > 1:
                    # Fires once this thread's copies so far, these columns' included, land.
                    async_copy.mbarrier_arrive(
                        score_ready.index(buf * CHUNKS + c), increment_count=False
                    )
            dst = rope_smem.index(buf)
            for c in gl.static_range(ROPE_DIM // 64):
                _copy_rows(
                    dst.slice(c * 64, 64, dim=1),
                    rows[:, None] + LATENT_DIM + c * 64 + cols[None, :],
                    mask=ok[:, None],
                )
                if CHUNKS > 1:
                    async_copy.mbarrier_arrive(
                        score_ready.index(buf * CHUNKS + LATENT_DIM // 64 + c),
                        increment_count=False,
                    )
            # Each thread's arrival fires when its own copies have landed.
            async_copy.mbarrier_arrive(kv_ready.index(buf), increment_count=False)
            _stamp(trace, j, 2, clock_dep, TRACE)
            if IDS_AHEAD:
                first = lo + (j + 1) * BLOCK_N
                block, in_page, ok = _tile_blocks(
                    table_row, first, hi, tile_keys, num_blocks, BLOCK_SIZE, BLOCK_N
                )
        _stamp_span(trace, True, clock_dep, TRACE)

    @gluon.jit
    def _consumer_values(
        kv_smem,
        p_smem,
        alpha_smem,
        kv_ready,
        kv_free,
        p_ready,
        p_free,
        out_ptr,
        token,
        head0,
        split,
        num_heads,
        num_tiles,
        out_stride_s,
        out_stride_t,
        out_stride_h,
        LATENT_DIM: gl.constexpr,
        BUFFERS: gl.constexpr,
        P_BUFFERS: gl.constexpr,
        STAGED: gl.constexpr,
        trace,
        TRACE: gl.constexpr,
    ):
        """Consumer 1: the second half of the value columns, with consumer 0's P."""
        HALF: gl.constexpr = LATENT_DIM // 2
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[_PWARPS, 1], instr_shape=[16, HALF, 16]
        )
        row_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
        acc = gl.zeros([_HEADS, HALF], gl.float32, o_layout)
        clock_dep = gl.zeros([_HEADS], gl.float32, row_layout)
        _stamp_span(trace, False, clock_dep, TRACE)
        for j in range(num_tiles):
            buf = j % BUFFERS
            _stamp(trace, j, 0, clock_dep, TRACE)
            mbarrier.wait(kv_ready.index(buf), (j // BUFFERS) & 1)
            _stamp(trace, j, 1, clock_dep, TRACE)
            pb = j % P_BUFFERS
            mbarrier.wait(p_ready.index(pb), (j // P_BUFFERS) & 1)
            _stamp(trace, j, 2, clock_dep, TRACE)
            # cp.async and st.shared wrote through the generic proxy; wgmma reads through the
            # async one.
            fence_async_shared()
            alpha = gl.convert_layout(alpha_smem.index(pb).load(_HANDOFF), row_layout)
            acc = acc * alpha[:, None]
            acc = warpgroup_mma(
                p_smem.index(pb), kv_smem.index(buf).slice(HALF, HALF, dim=1), acc, is_async=True
            )
            _stamp(trace, j, 3, alpha, TRACE)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            _stamp(trace, j, 4, alpha, TRACE)
            mbarrier.arrive(p_free.index(pb), count=1)
            mbarrier.arrive(kv_free.index(buf), count=1)
        # The row sums come through the rescale factors' buffer, as one more tile's would.
        pb = num_tiles % P_BUFFERS
        mbarrier.wait(p_ready.index(pb), (num_tiles // P_BUFFERS) & 1)
        l_i = gl.convert_layout(alpha_smem.index(pb).load(_HANDOFF), row_layout)
        # Every MMA is done (consumer 0 waited for its last before handing over the sums).
        stage = kv_smem.index(_stage_buffer(num_tiles, BUFFERS, P_BUFFERS)).slice(HALF, HALF, 1)
        _store_half(
            acc,
            l_i,
            out_ptr,
            token,
            head0,
            split,
            num_heads,
            out_stride_s,
            out_stride_t,
            out_stride_h,
            HALF,
            HALF,
            stage,
            STAGED,
        )
        _stamp_span(trace, True, l_i, TRACE)

    @gluon.jit
    def _stage_buffer(num_tiles, BUFFERS: gl.constexpr, P_BUFFERS: gl.constexpr):
        """The key buffer the consumers stage their output in: the one the value product of
        tile ``num_tiles - P_BUFFERS`` read, which consumer 0's last wait for a free P buffer
        says consumer 1 is done with (with one P buffer: the last tile's, so every buffer);
        a buffer no tile used where there are fewer tiles."""
        return (num_tiles + BUFFERS - P_BUFFERS) % BUFFERS

    @gluon.jit
    def _store_half(
        acc,
        l_i,
        out_ptr,
        token,
        head0,
        split,
        num_heads,
        out_stride_s,
        out_stride_t,
        out_stride_h,
        COL0: gl.constexpr,
        HALF: gl.constexpr,
        stage,
        STAGED: gl.constexpr,
    ):
        """Normalise a consumer's accumulator by the row sums and store its columns.

        Args:
            stage: a ``[_HEADS, HALF]`` view of a key buffer that no MMA reads any more.
            STAGED: store through ``stage`` (the output's dtype is the buffer's): the rows go out
                as whole-row 16-byte stores, not as the accumulator's layout gives them (a quad's
                16 bytes of a row, half a sector each: at the end of a wave, with every SM
                storing, a program's two halves took about 10,000 cycles on an H200).
        """
        # Nothing attended (l = 0) gives zeros; a NaN l (a non-finite attended row) stays NaN.
        o = (acc / gl.where(l_i == 0.0, 1.0, l_i)[:, None]).to(out_ptr.dtype.element_ty)
        if STAGED:
            stage.store(o)
            gl.barrier()  # the partition's warps read rows the others wrote
            rows_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [_PWARPS, 1], [1, 0])
            o = stage.load(rows_layout)
        _store_rows(
            o,
            out_ptr + split * out_stride_s + token * out_stride_t,
            head0,
            num_heads,
            out_stride_h,
            COL0,
        )

    @gluon.jit
    def _store_rows(o, out_row, head0, num_heads, out_stride_h, COL0: gl.constexpr):
        """Store ``o`` (``[_HEADS, columns]``, any layout) at column ``COL0`` of heads
        ``head0 ...`` of one token's output row ``out_row``, the heads past ``num_heads`` left
        out."""
        layout: gl.constexpr = o.type.layout
        heads = head0 + gl.arange(0, o.shape[0], layout=gl.SliceLayout(1, layout))
        cols = COL0 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, layout))
        rows = out_row + heads * out_stride_h
        gl.store(rows[:, None] + cols[None, :], o, mask=(heads < num_heads)[:, None])

    # MMA groups of a score product (_issue_scores): the latent and the RoPE columns.
    _SCORE_GROUPS = gl.constexpr(2)

    @gluon.jit
    def _issue_scores(
        q_smem,
        q_rope_smem,
        q_ready,
        kv_smem,
        rope_smem,
        kv_ready,
        s_zero,
        j,
        BUFFERS: gl.constexpr,
        CHUNKS: gl.constexpr = 1,
    ):
        """Wait for the query and key tile ``j`` and issue its score product, in flight: two MMA
        groups once the tile has landed, or with ``CHUNKS`` barriers a buffer (scores as they
        land; ``kv_ready`` then holds them) one group of 64 columns at a time, each once its
        columns have landed, the same k-steps in the same order. The query's barrier completes
        once; later waits return at once."""
        mbarrier.wait(q_ready, 0)
        buf = j % BUFFERS
        phase = (j // BUFFERS) & 1
        if CHUNKS == 1:
            mbarrier.wait(kv_ready.index(buf), phase)
            # cp.async wrote through the generic proxy; wgmma reads through the async one.
            fence_async_shared()
            kv = kv_smem.index(buf)
            scores = warpgroup_mma(q_smem, kv.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            scores = warpgroup_mma(
                q_rope_smem, rope_smem.index(buf).permute((1, 0)), scores, is_async=True
            )
        else:
            latent: gl.constexpr = q_smem.shape[1] // 64
            kv = kv_smem.index(buf)
            rope = rope_smem.index(buf)
            scores = s_zero
            for c in gl.static_range(CHUNKS):
                mbarrier.wait(kv_ready.index(buf * CHUNKS + c), phase)
                fence_async_shared()
                if c < latent:
                    q_part = q_smem.slice(c * 64, 64, dim=1)
                    k_part = kv.slice(c * 64, 64, dim=1)
                else:
                    q_part = q_rope_smem.slice((c - latent) * 64, 64, dim=1)
                    k_part = rope.slice((c - latent) * 64, 64, dim=1)
                scores = warpgroup_mma(
                    q_part, k_part.permute((1, 0)), scores, use_acc=c > 0, is_async=True
                )
        return scores

    @gluon.jit
    def _tile_softmax(scores, m_i, l_i, attend, scale_log2, LARGE_SCALE: gl.constexpr):
        """A key tile's online-softmax step over its attended keys: P, the rescale factors and
        the new row maxima and sums."""
        if not LARGE_SCALE:
            scores = scores * scale_log2
        # An attended score of -inf (a non-finite key element) would drop its key from the
        # softmax, a finite answer from a row that is not finite: NaN instead (stage 1's rule).
        scores = gl.where(scores == float("-inf"), float("nan"), scores)
        scores = gl.where(attend[None, :], scores, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(scores, axis=1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
        if LARGE_SCALE:
            # Raw units, scaled after the subtraction (stage 1's overflow rule).
            p = gl.exp2((scores - m_use[:, None]) * scale_log2)
            alpha = gl.exp2((m_i - m_use) * scale_log2)
        else:
            p = gl.exp2(scores - m_use[:, None])
            alpha = gl.exp2(m_i - m_use)
        return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)

    @gluon.jit
    def _hand_over_p(p, alpha, p_smem, alpha_smem, p_ready, p_free, j, P_BUFFERS: gl.constexpr):
        """Write tile ``j``'s P and rescale factors for consumer 1 into their buffer once it is
        done with the tile's that last used it."""
        pb = j % P_BUFFERS
        mbarrier.wait(p_free.index(pb), ((j // P_BUFFERS) & 1) ^ 1)
        p_smem.index(pb).store(p.to(p_smem.dtype))
        alpha_smem.index(pb).store(gl.convert_layout(alpha, _HANDOFF))
        fence_async_shared()
        mbarrier.arrive(p_ready.index(pb), count=1)

    @gluon.jit
    def _consumer_scores(
        q_smem,
        q_rope_smem,
        q_ready,
        kv_smem,
        rope_smem,
        p_smem,
        alpha_smem,
        ready,
        kv_free,
        p_ready,
        p_free,
        out_ptr,
        lse_ptr,
        table_row,
        token,
        head0,
        split,
        lo,
        hi,
        num_tiles,
        num_heads,
        num_blocks,
        scale_log2,
        out_stride_s,
        out_stride_t,
        out_stride_h,
        lse_stride_s,
        lse_stride_t,
        BLOCK_SIZE: gl.constexpr,
        LATENT_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        NUM_SPLITS: gl.constexpr,
        LARGE_SCALE: gl.constexpr,
        BUFFERS: gl.constexpr,
        ORDER: gl.constexpr,
        P_BUFFERS: gl.constexpr,
        CHUNKS: gl.constexpr,
        STAGED: gl.constexpr,
        trace,
        TRACE: gl.constexpr,
    ):
        """Consumer 0 (the default partition): scores, online softmax, P, first value half.

        ``ORDER`` places a tile's MMAs around its softmax (the module's ``ORDER_*``): scores
        ahead issues the next tile's scores before this tile's softmax and this tile's value
        product after it; values lag issues the previous tile's value product behind this
        tile's scores; values first issues this tile's value product after its softmax and waits
        for it while the next tile's scores run; release first waits for it before the next
        tile's copy.
        """
        HALF: gl.constexpr = LATENT_DIM // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[_PWARPS, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[_PWARPS, 1], instr_shape=[16, HALF, 16]
        )
        s_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
        tile_keys = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        m_i = gl.full([_HEADS], float("-inf"), gl.float32, s_rows)
        l_i = gl.zeros([_HEADS], gl.float32, s_rows)
        s_zero = gl.zeros([_HEADS, BLOCK_N], gl.float32, s_layout)
        _stamp_span(trace, False, m_i, TRACE)
        if ORDER == 2:
            # At the top of iteration j: tile j's scores done, its value product not issued,
            # tile j - 1's in flight (an accumulator handle from the start).
            acc = warpgroup_mma_init(gl.zeros([_HEADS, HALF], gl.float32, o_layout))
            if num_tiles > 0:
                scores = _issue_scores(
                    q_smem, q_rope_smem, q_ready, kv_smem, rope_smem, ready, s_zero, 0, BUFFERS
                )
                _, _, attend = _tile_blocks(
                    table_row, lo, hi, tile_keys, num_blocks, BLOCK_SIZE, BLOCK_N
                )
                scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
                for j in range(num_tiles - 1):
                    nxt = _issue_scores(
                        q_smem,
                        q_rope_smem,
                        q_ready,
                        kv_smem,
                        rope_smem,
                        ready,
                        s_zero,
                        j + 1,
                        BUFFERS,
                    )
                    _, _, attend_nxt = _tile_blocks(
                        table_row,
                        lo + (j + 1) * BLOCK_N,
                        hi,
                        tile_keys,
                        num_blocks,
                        BLOCK_SIZE,
                        BLOCK_N,
                    )
                    p, alpha, m_i, l_i = _tile_softmax(
                        scores, m_i, l_i, attend, scale_log2, LARGE_SCALE
                    )
                    if P_BUFFERS > 1:
                        # P goes to the buffer the previous value product does not read.
                        _hand_over_p(p, alpha, p_smem, alpha_smem, p_ready, p_free, j, P_BUFFERS)
                    # Both groups, not the value product alone: reading its accumulator while
                    # the scores run made ptxas serialize every MMA of the kernel (C7514).
                    acc, scores = warpgroup_mma_wait(num_outstanding=0, deps=(acc, nxt))
                    if j > 0:
                        mbarrier.arrive(kv_free.index((j - 1) % BUFFERS), count=1)
                    if P_BUFFERS == 1:
                        _hand_over_p(p, alpha, p_smem, alpha_smem, p_ready, p_free, j, P_BUFFERS)
                    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                    kv = kv_smem.index(j % BUFFERS)
                    acc = warpgroup_mma(
                        p_smem.index(j % P_BUFFERS), kv.slice(0, HALF, dim=1), acc, is_async=True
                    )
                    attend = attend_nxt
                last = num_tiles - 1
                p, alpha, m_i, l_i = _tile_softmax(
                    scores, m_i, l_i, attend, scale_log2, LARGE_SCALE
                )
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                if last > 0:
                    mbarrier.arrive(kv_free.index((last - 1) % BUFFERS), count=1)
                _hand_over_p(p, alpha, p_smem, alpha_smem, p_ready, p_free, last, P_BUFFERS)
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                kv = kv_smem.index(last % BUFFERS)
                acc = warpgroup_mma(
                    p_smem.index(last % P_BUFFERS), kv.slice(0, HALF, dim=1), acc, is_async=True
                )
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if num_tiles > 0:
                mbarrier.arrive(kv_free.index((num_tiles - 1) % BUFFERS), count=1)
        elif ORDER == 1:
            acc = gl.zeros([_HEADS, HALF], gl.float32, o_layout)
            if num_tiles > 0:
                scores = _issue_scores(
                    q_smem, q_rope_smem, q_ready, kv_smem, rope_smem, ready, s_zero, 0, BUFFERS
                )
                # The key mask's block-id load in flight beside the MMAs, not after them.
                _, _, attend = _tile_blocks(
                    table_row, lo + 0 * BLOCK_N, hi, tile_keys, num_blocks, BLOCK_SIZE, BLOCK_N
                )
                scores = warpgroup_mma_wait(num_outstanding=0, deps=(scores,))
                p, alpha, m_i, l_i = _tile_softmax(
                    scores, m_i, l_i, attend, scale_log2, LARGE_SCALE
                )
                _hand_over_p(p, alpha, p_smem, alpha_smem, p_ready, p_free, 0, P_BUFFERS)
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            for j in range(1, num_tiles):
                scores = _issue_scores(
                    q_smem, q_rope_smem, q_ready, kv_smem, rope_smem, ready, s_zero, j, BUFFERS
                )
                # The key mask's block-id load in flight beside the MMAs, not after them.
                _, _, attend = _tile_blocks(
                    table_row, lo + j * BLOCK_N, hi, tile_keys, num_blocks, BLOCK_SIZE, BLOCK_N
                )
                prev = kv_smem.index((j - 1) % BUFFERS)
                p_prev = p_smem.index((j - 1) % P_BUFFERS)
                acc = warpgroup_mma(p_prev, prev.slice(0, HALF, dim=1), acc, is_async=True)
                # Groups complete in order: the scores are done, the value product runs on.
                scores = warpgroup_mma_wait(num_outstanding=1, deps=(scores,))
                p, alpha, m_i, l_i = _tile_softmax(
                    scores, m_i, l_i, attend, scale_log2, LARGE_SCALE
                )
                # P's buffer and the previous key tile are read until the product completes.
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(kv_free.index((j - 1) % BUFFERS), count=1)
                _hand_over_p(p, alpha, p_smem, alpha_smem, p_ready, p_free, j, P_BUFFERS)
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            if num_tiles > 0:
                last = kv_smem.index((num_tiles - 1) % BUFFERS)
                p_last = p_smem.index((num_tiles - 1) % P_BUFFERS)
                acc = warpgroup_mma(p_last, last.slice(0, HALF, dim=1), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(kv_free.index((num_tiles - 1) % BUFFERS), count=1)
        else:
            # An accumulator handle from the start: the loop leaves each tile's value product
            # in flight and waits for it while the next tile's scores run.
            acc = warpgroup_mma_init(gl.zeros([_HEADS, HALF], gl.float32, o_layout))
            for j in range(num_tiles):
                _stamp(trace, j, 0, m_i, TRACE)
                if ORDER >= 3:  # release first (and scores as they land)
                    if j > 0:
                        # Only the previous value product is in flight: its buffer goes back
                        # before this tile's copy is waited for (the next copy starts a tile's
                        # landing earlier than in values first).
                        warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                        mbarrier.arrive(kv_free.index((j - 1) % BUFFERS), count=1)
                scores = _issue_scores(
                    q_smem,
                    q_rope_smem,
                    q_ready,
                    kv_smem,
                    rope_smem,
                    ready,
                    s_zero,
                    j,
                    BUFFERS,
                    CHUNKS,
                )
                _stamp(trace, j, 1, m_i, TRACE)
                # The key mask's block-id load in flight beside the MMAs, not after them.
                _, _, attend = _tile_blocks(
                    table_row, lo + j * BLOCK_N, hi, tile_keys, num_blocks, BLOCK_SIZE, BLOCK_N
                )
                if (ORDER == 0) & (j > 0):
                    # Groups complete in order, the previous value product before this tile's
                    # _SCORE_GROUPS: its key tile goes back to the producer while the scores
                    # run, not after them. With two 64-key buffers the next tile's copy
                    # otherwise starts a score product late, and consumer 0 waited for it.
                    # (Its accumulator is taken from the full wait below: a loop-carried
                    # handle cannot become a tensor in one branch.)
                    warpgroup_mma_wait(num_outstanding=_SCORE_GROUPS, deps=(acc,))
                    mbarrier.arrive(kv_free.index((j - 1) % BUFFERS), count=1)
                _stamp(trace, j, 2, m_i, TRACE)
                scores, acc = warpgroup_mma_wait(num_outstanding=0, deps=(scores, acc))
                _stamp(trace, j, 3, m_i, TRACE)
                p, alpha, m_i, l_i = _tile_softmax(
                    scores, m_i, l_i, attend, scale_log2, LARGE_SCALE
                )
                _stamp(trace, j, 4, l_i, TRACE)
                _hand_over_p(p, alpha, p_smem, alpha_smem, p_ready, p_free, j, P_BUFFERS)
                _stamp(trace, j, 5, l_i, TRACE)
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
                kv = kv_smem.index(j % BUFFERS)
                p_j = p_smem.index(j % P_BUFFERS)
                acc = warpgroup_mma(p_j, kv.slice(0, HALF, dim=1), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if num_tiles > 0:
                mbarrier.arrive(kv_free.index((num_tiles - 1) % BUFFERS), count=1)
        # The row sums to consumer 1 through the rescale factors' buffer, once it has read the
        # last tile's (the handoff of every tile, one more time).
        pb = num_tiles % P_BUFFERS
        mbarrier.wait(p_free.index(pb), ((num_tiles // P_BUFFERS) & 1) ^ 1)
        alpha_smem.index(pb).store(gl.convert_layout(l_i, _HANDOFF))
        mbarrier.arrive(p_ready.index(pb), count=1)
        stage = kv_smem.index(_stage_buffer(num_tiles, BUFFERS, P_BUFFERS)).slice(0, HALF, 1)
        _store_half(
            acc,
            gl.convert_layout(l_i, o_rows),
            out_ptr,
            token,
            head0,
            split,
            num_heads,
            out_stride_s,
            out_stride_t,
            out_stride_h,
            0,
            HALF,
            stage,
            STAGED,
        )
        if NUM_SPLITS > 1:
            nothing = l_i == 0.0
            m_fin = gl.where(m_i == float("-inf"), 0.0, m_i)
            if LARGE_SCALE:
                lse = m_fin + gl.log2(gl.where(nothing, 1.0, l_i)) / scale_log2  # raw units
            else:
                lse = m_fin + gl.log2(gl.where(nothing, 1.0, l_i))
            lse = gl.where(nothing, float("-inf"), lse)
            heads = head0 + gl.arange(0, _HEADS, layout=s_rows)
            gl.store(
                lse_ptr + split * lse_stride_s + token * lse_stride_t + heads,
                lse,
                mask=heads < num_heads,
            )
        _stamp_span(trace, True, l_i, TRACE)

    @gluon.jit(do_not_specialize=_RUNTIME_SIZES)
    def _gluon_decode_kernel(
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
        BLOCK_SIZE: gl.constexpr,
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
        LATENT_DIM: gl.constexpr,
        ROPE_DIM: gl.constexpr,
        Q_ROPE_COL: gl.constexpr,
        NUM_SPLITS: gl.constexpr,
        SEQ_BLOCK: gl.constexpr,
        LARGE_SCALE: gl.constexpr,
        KEY_TILE: gl.constexpr,
        BUFFERS: gl.constexpr,
        ORDER: gl.constexpr,
        P_BUFFERS: gl.constexpr,
        HEADS_FIRST: gl.constexpr,
        trace_ptr,
    ):
        gl.static_assert(LATENT_DIM % 128 == 0, "the value columns split in two 64-column halves")
        gl.static_assert(ROPE_DIM % 64 == 0, "the producer copies 64 columns at a time")
        # Scores ahead waits for tile j + 1 before it frees tile j - 1: two buffers would hang.
        gl.static_assert((ORDER != 2) | (BUFFERS >= 3), "scores ahead needs 3 or more buffers")
        BLOCK_N: gl.constexpr = KEY_TILE
        # The grid's first two axes: head groups and tokens, in the order HEADS_FIRST says.
        if HEADS_FIRST:
            head0 = gl.program_id(0) * _HEADS
            token = gl.program_id(1).to(gl.int64)
        else:
            token = gl.program_id(0).to(gl.int64)
            head0 = gl.program_id(1) * _HEADS
        split = gl.program_id(2).to(gl.int64)
        fill_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [_PWARPS, 1], [1, 0])
        fill_rows: gl.constexpr = gl.SliceLayout(1, fill_layout)
        heads = head0 + gl.arange(0, _HEADS, layout=fill_rows)
        head_ok = heads < num_heads

        # Each partition's timeline: consumer 0's, consumer 1's, the producer's rows in turn.
        TRACE: gl.constexpr = trace_ptr is not None
        if TRACE:
            program = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
            program = program.to(gl.int64) * gl.num_programs(2) + gl.program_id(2)
            trace0 = trace_ptr + program * (3 * _TRACE_ROW)
            trace1 = trace0 + _TRACE_ROW
            trace2 = trace0 + 2 * _TRACE_ROW
        else:
            # A partition's arguments are values (not None): a pointer the stamps compile out.
            trace0 = out_ptr
            trace1 = out_ptr
            trace2 = out_ptr
        _stamp_entry(trace0, _ENTRY, heads.to(gl.float32), TRACE)

        # Which request the token is, and the padding and malformed-metadata cases, as stage 1
        # decides them for a one-token tile.
        request, ordered = _token_request(token, cu_q_ptr, num_tokens, num_requests, SEQ_BLOCK)
        q_start = _load_cu(cu_q_ptr, request, True, num_tokens)
        local = token - q_start
        cu_first = _load_cu(cu_q_ptr, 0, True, num_tokens)
        cu_last = _load_cu(cu_q_ptr, num_requests, True, num_tokens)
        if not ordered:
            inside = (token >= cu_first) & (token < cu_last)
            if NUM_SPLITS == 1:
                _fill_rows(
                    out_ptr,
                    token,
                    heads,
                    out_stride_t,
                    out_stride_h,
                    head_ok & inside,
                    float("nan"),
                    LATENT_DIM,
                )
                _fill_rows(
                    out_ptr,
                    token,
                    heads,
                    out_stride_t,
                    out_stride_h,
                    head_ok & (token < num_tokens) & ~inside,
                    0.0,
                    LATENT_DIM,
                )
            else:
                nan = gl.full([_HEADS], float("nan"), gl.float32, fill_rows)
                lse_rows = lse_ptr + split * lse_stride_s + token * lse_stride_t + heads
                gl.store(lse_rows, nan, mask=head_ok & inside)
            return
        if (request == num_requests) | (local < 0):
            if NUM_SPLITS == 1:
                after = (request == num_requests) & (local >= 0)
                pad = head_ok & (token < gl.where(after, num_tokens, cu_first))
                _fill_rows(out_ptr, token, heads, out_stride_t, out_stride_h, pad, 0.0, LATENT_DIM)
            return
        q_len = _load_cu(cu_q_ptr, request + 1, True, num_tokens) - q_start
        if local >= q_len:
            return
        kv_len = gl.minimum(gl.maximum(gl.load(kv_len_ptr + request).to(gl.int64), 0), 2**62)
        capacity = gl.minimum(kv_len, max_blocks * BLOCK_SIZE)
        tile_end = gl.minimum(kv_len - q_len + local + 1, capacity)
        chunk = gl.cdiv(gl.cdiv(tile_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = gl.minimum(lo + chunk, tile_end)
        num_tiles = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N).to(gl.int32)
        table_row = block_table_ptr + request.to(gl.int64) * table_stride

        dtype: gl.constexpr = q_ptr.dtype.element_ty
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, LATENT_DIM], dtype)
        q_rope_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(
            [_HEADS, ROPE_DIM], dtype
        )
        kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, LATENT_DIM], dtype)
        rope_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE_DIM], dtype)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([_HEADS, BLOCK_N], dtype)
        vec_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        q_smem = gl.allocate_shared_memory(dtype, [_HEADS, LATENT_DIM], q_layout)
        q_rope_smem = gl.allocate_shared_memory(dtype, [_HEADS, ROPE_DIM], q_rope_layout)
        kv_smem = gl.allocate_shared_memory(dtype, [BUFFERS, BLOCK_N, LATENT_DIM], kv_layout)
        rope_smem = gl.allocate_shared_memory(dtype, [BUFFERS, BLOCK_N, ROPE_DIM], rope_layout)
        p_smem = gl.allocate_shared_memory(dtype, [P_BUFFERS, _HEADS, BLOCK_N], p_layout)
        alpha_smem = gl.allocate_shared_memory(gl.float32, [P_BUFFERS, _HEADS], vec_layout)
        kv_ready = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
        # What consumer 0's score product waits for: in scores as they land a barrier per 64
        # columns of each buffer (CHUNKS a buffer), in the other orders the whole tile's.
        CHUNKS: gl.constexpr = (LATENT_DIM + ROPE_DIM) // 64 if ORDER == 4 else 1
        if CHUNKS > 1:
            score_ready = gl.allocate_shared_memory(
                gl.int64, [BUFFERS * CHUNKS, 1], mbarrier.MBarrierLayout()
            )
            for b in gl.static_range(BUFFERS * CHUNKS):
                mbarrier.init(score_ready.index(b), count=_PWARPS * 32)
        else:
            score_ready = kv_ready
        kv_free = gl.allocate_shared_memory(gl.int64, [BUFFERS, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [P_BUFFERS, 1], mbarrier.MBarrierLayout())
        p_free = gl.allocate_shared_memory(gl.int64, [P_BUFFERS, 1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(q_ready, count=_PWARPS * 32)
        for b in gl.static_range(BUFFERS):
            mbarrier.init(kv_ready.index(b), count=_PWARPS * 32)
            mbarrier.init(kv_free.index(b), count=2)
        for b in gl.static_range(P_BUFFERS):
            mbarrier.init(p_ready.index(b), count=1)
            mbarrier.init(p_free.index(b), count=1)

        # The barriers' initialisation before any partition's copies arrive on them.
        fence_async_shared()

        # The output goes out through a key buffer where it is the buffer's dtype (not a split's
        # fp32 partials, whose quads already store whole sectors) and has its rows.
        STAGED: gl.constexpr = (
            (NUM_SPLITS == 1) & (BLOCK_N == _HEADS) & (out_ptr.dtype.element_ty == dtype)
        )

        _stamp_entry(trace0, _FORK, heads.to(gl.float32), TRACE)

        gl.warp_specialize(
            [
                (
                    _consumer_scores,
                    (
                        q_smem,
                        q_rope_smem,
                        q_ready,
                        kv_smem,
                        rope_smem,
                        p_smem,
                        alpha_smem,
                        score_ready,
                        kv_free,
                        p_ready,
                        p_free,
                        out_ptr,
                        lse_ptr,
                        table_row,
                        token,
                        head0,
                        split,
                        lo,
                        hi,
                        num_tiles,
                        num_heads,
                        num_blocks,
                        scale_log2,
                        out_stride_s,
                        out_stride_t,
                        out_stride_h,
                        lse_stride_s,
                        lse_stride_t,
                        BLOCK_SIZE,
                        LATENT_DIM,
                        BLOCK_N,
                        NUM_SPLITS,
                        LARGE_SCALE,
                        BUFFERS,
                        ORDER,
                        P_BUFFERS,
                        CHUNKS,
                        STAGED,
                        trace0,
                        TRACE,
                    ),
                ),
                (
                    _consumer_values,
                    (
                        kv_smem,
                        p_smem,
                        alpha_smem,
                        kv_ready,
                        kv_free,
                        p_ready,
                        p_free,
                        out_ptr,
                        token,
                        head0,
                        split,
                        num_heads,
                        num_tiles,
                        out_stride_s,
                        out_stride_t,
                        out_stride_h,
                        LATENT_DIM,
                        BUFFERS,
                        P_BUFFERS,
                        STAGED,
                        trace1,
                        TRACE,
                    ),
                ),
                (
                    _producer,
                    (
                        q_smem,
                        q_rope_smem,
                        q_ready,
                        q_ptr,
                        q_rope_ptr,
                        token,
                        head0,
                        num_heads,
                        q_stride_t,
                        q_stride_h,
                        q_rope_stride_t,
                        q_rope_stride_h,
                        kv_smem,
                        rope_smem,
                        kv_ready,
                        kv_free,
                        cache_ptr,
                        table_row,
                        lo,
                        hi,
                        num_tiles,
                        num_blocks,
                        cache_stride_b,
                        cache_stride_o,
                        BLOCK_SIZE,
                        LATENT_DIM,
                        ROPE_DIM,
                        BLOCK_N,
                        BUFFERS,
                        Q_ROPE_COL,
                        score_ready,
                        CHUNKS,
                        trace2,
                        TRACE,
                        ORDER >= 3,  # the block ids a tile ahead under release first
                    ),
                ),
            ],
            [_PWARPS, _PWARPS],
            [CONSUMER_REGS, PRODUCER_REGS],
        )

    GLUON_DECODE_LAUNCHES = KernelLaunches(_gluon_decode_kernel, _RUNTIME_SIZES)
else:
    GLUON_DECODE_LAUNCHES = None
