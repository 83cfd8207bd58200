# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The latent attention's launch choices, from static sizes only (graph-safe): stage 1's tile,
head tile, key-tile addressing and pipelining stages, the split-KV count and stage 2's tile.

Every rule here is a host-side function of shapes, dtypes and the device (never of the lengths),
so a CUDA-graph replay launches what the eager call launched. The figures quoted are H200
measurements (``scripts/sweep_latent_attention.py``, ``scripts/compare_latent_attention.py``).
"""

import functools
from typing import NamedTuple, Optional, Tuple

import torch
import triton
from packaging.version import InvalidVersion, Version

from megatron_ext.fusions.launch_math import cdiv, next_power_of_2

__all__ = [
    "BLOCK_H",
    "COMBINE_BLOCK_D",
    "COMBINE_IN_FLIGHT",
    "LARGE_SCALE_LOG2",
    "LOG2E",
    "MAX_BLOCK_SIZE",
    "MAX_DECODE_BLOCK_H",
    "MAX_KV_SPLITS",
    "MIN_KEYS_PER_SPLIT",
    "ROW_OFFSET_LIMIT",
    "SEQ_BLOCK",
    "THREE_STAGE_SHARED_MEMORY",
    "TRITON_RELEASE",
    "WIDE_KEY_TILE",
    "CombineTile",
    "DeviceLaunchLimits",
    "TileShape",
    "combine_tile",
    "default_num_kv_splits",
    "head_tile",
    "launch_limits",
    "page_tiles",
    "pipeline_stages",
    "tile_shape",
    "triton_release",
]

# Upper bound of the split count (stage 2 combines at most this many partials per token).
MAX_KV_SPLITS = 64
# A split attends to at least this many rows of the longest context the block table can hold, so
# the partials' traffic stays small against the rows read.
MIN_KEYS_PER_SPLIT = 256
# wave_num_kv_splits' costs, in keys of one 64-head program's work: a program's fixed cost (its
# start, query, first tiles and output), and stage 2's read of one split's partial outputs. Fitted
# to the Gluon decode kernel's times at 1, 2 and 4 splits (H100, Triton 3.7.1, 128 heads, 1k-8k
# keys): a 1k-key program took about 38 us of keys and 14 us of the rest, a split's 131 KB of
# fp32 partials about 0.04 us of the combine's read.
PROGRAM_OVERHEAD_KEYS = 384
SPLIT_COMBINE_KEYS = 1.2
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


def triton_release() -> Tuple[int, ...]:
    """The installed Triton's (major, minor); (0, 0) for a version string packaging cannot read
    (a source build's, say), which keeps the choices made for the older releases."""
    try:
        return Version(triton.__version__).release[:2]
    except InvalidVersion:
        return (0, 0)


# The 64-head decode tile's addressing depends on it (page_tiles).
TRITON_RELEASE = triton_release()


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


class DeviceLaunchLimits(NamedTuple):
    """What the launcher reads of a device."""

    sms: int  # streaming multiprocessors
    stages: int  # stage 1's pipelining stages
    capability: Tuple[int, int] = (0, 0)  # compute capability; (0, 0) off CUDA
    shared_memory: int = 0  # bytes a block may opt into; 0 when unknown


@functools.lru_cache(maxsize=None)
def launch_limits(device: torch.device) -> DeviceLaunchLimits:
    """What the launcher reads of ``device``, looked up once per device (the interpreter: a few
    programs, and 3 stages as on the GPUs it stands in for)."""
    if device.type != "cuda":
        return DeviceLaunchLimits(2, 3)
    properties = torch.cuda.get_device_properties(device)
    shared_memory = getattr(properties, "shared_memory_per_block_optin", None)
    return DeviceLaunchLimits(
        properties.multi_processor_count,
        pipeline_stages(shared_memory),
        (properties.major, properties.minor),
        shared_memory or 0,
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
        target_programs = launch_limits(device).sms * (2 if num_warps <= 4 else 1)
    by_length = max(1, max_context // MIN_KEYS_PER_SPLIT)
    return max(1, min(MAX_KV_SPLITS, target_programs // programs, by_length))


def wave_num_kv_splits(
    programs: int, sms: int, max_context: int, *, max_splits: int = MAX_KV_SPLITS
) -> int:
    """The split count of a kernel that fits one program per SM, from static sizes only.

    A launch of ``programs * s`` programs runs in ``ceil(programs * s / sms)`` waves, each as
    long as one program: its share of the longest context the block table holds plus its fixed
    cost (:data:`PROGRAM_OVERHEAD_KEYS`); with more than one split stage 2 also reads every
    split's partial outputs back (:data:`SPLIT_COMBINE_KEYS` each). The count is the cheapest
    such launch, each split covering at least ``MIN_KEYS_PER_SPLIT`` rows. It fills a partial
    last wave where that pays: 192 programs on 132 SMs at 4k keys are 2 waves of whole programs,
    1.5 of halves; 400 at 1k keep 4 waves of whole programs (7 waves of halves cost more in
    fixed costs and partials than the quarter of a wave they save).

    Args:
        programs: programs of one split (query tiles times head tiles).
        sms: programs resident at once (one per SM).
        max_context: the longest context the block table can hold.
        max_splits: the most splits taken.

    Returns:
        int: the split count, >= 1.
    """
    programs, sms = max(1, programs), max(1, sms)
    by_length = max(1, min(max_splits, max_context // MIN_KEYS_PER_SPLIT))

    def cost(splits: int) -> float:
        waves = cdiv(programs * splits, sms)
        partials = SPLIT_COMBINE_KEYS * programs * splits if splits > 1 else 0.0
        return waves * (cdiv(max_context, splits) + PROGRAM_OVERHEAD_KEYS) + partials

    return min(range(1, by_length + 1), key=cost)


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
