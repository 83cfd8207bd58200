# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA attention over the paged latent cache in the MHA form: decompress the rows, then attend.

The absorbed form (:func:`~megatron_ext.fusions.mla_latent.attention.mla_paged_latent_attention`)
costs ``2 * (latent + rope) + 2 * latent`` FLOPs per query-key pair and head (2176 at
DeepSeek-V3's widths). :func:`mla_paged_mha_attention` instead decompresses each attended latent
row once per head with ``linear_kv_up_proj``'s weight (``2 * latent * (qk + v)`` FLOPs per row and
head, 262144), builds keys ``[k_nope | k_pe]`` (``k_pe``, the cached rotated columns, shared by
the heads) and values, and runs dense ragged attention with query/key head size ``qk + rope``
and value head size ``v``: ``2 * (qk + rope) + 2 * v`` FLOPs per pair (640). It pays off where a
request has many new tokens per attended row (prefill, long chunks).

Rows are read through the block table from host-known lengths, packed without padding between
requests, and decompressed at most ``row_budget`` (:data:`ROW_BUDGET`: 6144, about 0.5 GB of keys
and values at 128 heads in bf16) at a time: the rows, request after request, are cut into chunks
(a request's rows split where they do not fit), every query attends each chunk and the partial
results are merged by their log-sum-exps (the chunks and calls:
:mod:`~megatron_ext.fusions.mla_latent.mha_chunks`; the merge:
:mod:`~megatron_ext.fusions.mla_latent.mha_merge`).
The attention runs on one of the backends of
:mod:`~megatron_ext.fusions.mla_latent.mha_backends` (:data:`BACKENDS`).

What a step's layers share is worked out once: the checks of the lengths' own values, the step's
plan (chunks, calls, the rows' cache addresses, the calls' offsets on the device and their
packed-sequence metadata: :mod:`~megatron_ext.fusions.mla_latent.mha_plan`), and per layer the
decompression weights' layout, kept while the weight is unchanged
(:mod:`~megatron_ext.fusions.mla_latent.mha_weights`). A layer's call then checks its tensors
(and the lengths against them) and launches its GPU work: the gather of the rows (one kernel:
:mod:`~megatron_ext.fusions.mla_latent.mha_gather`), two GEMMs, the attention.
"""

import functools
import math
from typing import Callable, NamedTuple, NoReturn, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from megatron_ext.fusions.launch_plans import PlanCache
from megatron_ext.fusions.mla_latent.checks import (
    check_block_table,
    check_cache_for_query,
    check_mha_softmax_scale,
    check_pow2,
)
from megatron_ext.fusions.mla_latent.mha_backends import (
    BACKENDS,
    CHECKED_BACKENDS,
    FLASH_MAX_HEAD_DIM,
    SPLIT_BACKENDS,
    device_problem,
    empty_sequences_supported,
    flash_head_dim,
    present_backends,
    ragged_check,
    varlen_attention,
)
from megatron_ext.fusions.mla_latent.mha_gather import gather_cache_rows
from megatron_ext.fusions.mla_latent.mha_merge import merge_partials_into
from megatron_ext.fusions.mla_latent.mha_plan import PlannedCall, mha_plan
from megatron_ext.fusions.mla_latent.mha_rows import bucket
from megatron_ext.fusions.mla_latent.mha_weights import cached_up_projections, up_projections
from megatron_ext.fusions.side_stream import side_by_side
from megatron_ext.fusions.tensor_checks import FLOAT_DTYPES, check_device, check_int, check_tensor

__all__ = [
    "BACKENDS",
    "CHECKED_BACKENDS",
    "FLASH_MAX_HEAD_DIM",
    "MAX_TABLE_ENTRIES",
    "ROW_BUDGET",
    "SPLIT_BACKENDS",
    "bucket",
    "check_mha_call",
    "decompressed_keys_values",
    "empty_sequences_supported",
    "flash_head_dim",
    "mla_paged_mha_attention",
    "present_backends",
    "ragged_check",
    "up_projections",
    "varlen_attention",
]

# Attended rows decompressed at once (before a fused backend's bucket padding). Per row and head
# the keys are qk + rope = 192 and the values v = 128 elements: at 128 heads in bf16 that is
# (192 + 128) * 2 * 128 = 80 KiB per row, so 6144 rows hold 480 MiB of keys and values (576 MiB
# with the flash backend's values padded to 192 columns). Unbounded, a 1024-token chunk behind
# 32768 cached rows would hold 33792 rows, 2.6 GB. 6144 is a bucket, so the cuDNN plans stay few.
ROW_BUDGET = 6144
# The step's plan addresses the block table with int32 indices (one host-to-device copy of them).
MAX_TABLE_ENTRIES = 2**31 - 1


_INT64_MAX = np.iinfo(np.int64).max


def _lengths(name: str, values: Sequence[int]) -> np.ndarray:
    array = _host_ints(values)
    if array is None:
        raise TypeError(f"{name} must be a sequence of ints on the host; got {values!r}")
    if (array < 0).any():
        raise ValueError(f"{name} must be >= 0; got {array.tolist()}")
    if array.dtype == np.uint64 and (array > _INT64_MAX).any():
        # int64 would wrap them negative.
        raise ValueError(f"{name} must be below 2**63; got {array.tolist()}")
    return array.astype(np.int64)


def _host_ints(values: Sequence[int]) -> Optional[np.ndarray]:
    """``values`` as a 1-d integer array (not copied where it is one), or None (also for a
    sequence holding a bool, which numpy would take as 0 or 1)."""
    if isinstance(values, torch.Tensor):
        # A tensor that requires grad has no numpy view; its values are what is asked about.
        values = values.detach()
    elif isinstance(values, (list, tuple)):
        if any(isinstance(value, (bool, np.bool_)) for value in values):
            return None
        if not values:
            return np.zeros(0, dtype=np.int64)
    try:
        array = np.asarray(values)
    except (TypeError, ValueError, RuntimeError):
        return None
    return array if array.ndim == 1 and array.dtype.kind in "iu" else None


class _Lengths(NamedTuple):
    """A step's lengths that passed the checks that depend on them alone (ints >= 0, as many
    of each, the new tokens within the rows): int64 and read-only, with their sums and the
    longest request's rows."""

    q_lens: np.ndarray
    kv_lens: np.ndarray
    used: int
    rows: int
    longest: int


# Checked lengths by their values (dtype and bytes, as given): every layer of a step passes the
# same lengths, and only the first pays for the checks of their values (a handful of numpy
# reductions); the other layers check them against their own tensors only.
_CHECKED_LENGTHS: PlanCache = PlanCache(max_entries=16)


def _checked_lengths(
    query_lengths: Sequence[int], kv_lengths: Sequence[int], requests: int
) -> _Lengths:
    """The lengths, checked by themselves (once per step's values) and against the block
    table's ``requests``, in the order and with the messages of :func:`check_mha_call`."""
    q_given, kv_given = _host_ints(query_lengths), _host_ints(kv_lengths)
    key = None
    if q_given is not None and kv_given is not None:
        key = (q_given.dtype.str, q_given.tobytes(), kv_given.dtype.str, kv_given.tobytes())
        kept = _CHECKED_LENGTHS.lookup(key)
        if kept is not None:
            if len(kept.q_lens) > requests:
                _count_error(kept.q_lens, kept.kv_lens, requests)
            return kept
    q_lens = _lengths("query_lengths", query_lengths)
    kv_lens = _lengths("kv_lengths", kv_lengths)
    if len(q_lens) != len(kv_lens) or len(q_lens) > requests:
        _count_error(q_lens, kv_lens, requests)
    if (q_lens > kv_lens).any():
        raise ValueError(
            "each request's kv length must count its new tokens too; got query lengths "
            f"{q_lens.tolist()}, kv lengths {kv_lens.tolist()}"
        )
    q_lens.setflags(write=False)
    kv_lens.setflags(write=False)
    checked = _Lengths(
        q_lens, kv_lens, int(q_lens.sum()), int(kv_lens.sum()), int(kv_lens.max(initial=0))
    )
    return checked if key is None else _CHECKED_LENGTHS.put(key, checked)


def _count_error(q_lens: np.ndarray, kv_lens: np.ndarray, requests: int) -> NoReturn:
    raise ValueError(
        f"query_lengths ({len(q_lens)}) and kv_lengths ({len(kv_lens)}) must name the same "
        f"requests, at most the block table's {requests}"
    )


def check_mha_call(
    query: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    kv_up_weight: Tensor,
    softmax_scale: float,
    rope_dim: int,
    query_lengths: Sequence[int],
    kv_lengths: Sequence[int],
    backend: str,
) -> Tuple[np.ndarray, np.ndarray, int, int]:
    """Check every argument of :func:`mla_paged_mha_attention`, with the absorbed kernel's
    messages for the arguments the two share (cache, block table, scale, RoPE width).

    Returns:
        Tuple[np.ndarray, np.ndarray, int, int]: the query and KV lengths as int64 arrays
        (read-only: kept for the step's other layers), the latent width and the value head size.
    """
    lengths, latent_dim, v_dim = _checked_call(
        query,
        kv_cache,
        block_table,
        kv_up_weight,
        softmax_scale,
        rope_dim,
        query_lengths,
        kv_lengths,
        backend,
    )
    return lengths.q_lens, lengths.kv_lens, latent_dim, v_dim


def _checked_call(
    query: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    kv_up_weight: Tensor,
    softmax_scale: float,
    rope_dim: int,
    query_lengths: Sequence[int],
    kv_lengths: Sequence[int],
    backend: str,
) -> Tuple[_Lengths, int, int]:
    """:func:`check_mha_call`, returning the checked lengths with their sums."""
    check_tensor("query", query, FLOAT_DTYPES + (torch.float64,))
    device = query.device
    if query.dim() != 3:
        raise ValueError(
            "query must be [tokens, heads, qk_head_dim + rope_dim] (squeeze megatron-core's batch "
            f"dimension of 1); got shape {tuple(query.shape)}"
        )
    if device.type == "meta":
        raise ValueError("query is a meta tensor: it holds no values to attend with")
    tokens, heads, width = query.shape
    if heads < 1:
        raise ValueError(f"query has no heads: shape {tuple(query.shape)}")
    check_int("rope_dim", rope_dim, 1)
    check_pow2("rope_dim", rope_dim)
    if width <= rope_dim:
        raise ValueError(f"query's width {width} leaves no qk part beside rope_dim={rope_dim}")
    cache_width = check_cache_for_query(kv_cache, query)
    latent_dim = cache_width - rope_dim
    if latent_dim < 1:
        raise ValueError(f"kv_cache rows are {cache_width} wide: no latent part beside rope_dim")
    check_pow2(f"the latent width (kv_cache width {cache_width} - rope_dim {rope_dim})", latent_dim)
    requests = check_block_table(block_table, device)
    check_mha_softmax_scale(softmax_scale)
    check_tensor("kv_up_weight", kv_up_weight, (query.dtype,))
    check_device("kv_up_weight", kv_up_weight, device)
    qk_dim = width - rope_dim
    rows = kv_up_weight.shape[0] if kv_up_weight.dim() == 2 else 0
    if kv_up_weight.dim() != 2 or kv_up_weight.shape[1] != latent_dim or rows % heads:
        raise ValueError(
            f"kv_up_weight must be [heads * (qk_head_dim + v_head_dim), {latent_dim}] for "
            f"{heads} heads; got {tuple(kv_up_weight.shape)}"
        )
    v_dim = rows // heads - qk_dim
    if v_dim < 1:
        raise ValueError(
            f"kv_up_weight has {rows // heads} rows per head: none left for values beside "
            f"qk_head_dim={qk_dim}"
        )
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}; got {backend!r}")
    problem = device_problem(backend, device)
    if problem is not None:
        raise ValueError(problem)
    if backend in ("flash", "cudnn-dense") and flash_head_dim(width, v_dim) > FLASH_MAX_HEAD_DIM:
        raise ValueError(
            f"the {backend} backend runs head sizes up to {FLASH_MAX_HEAD_DIM}; query/key "
            f"width {width} and value width {v_dim} need {flash_head_dim(width, v_dim)}"
        )
    lengths = _checked_lengths(query_lengths, kv_lengths, requests)
    if lengths.used > tokens:
        raise ValueError(f"query_lengths sum to {lengths.used}, over the {tokens} tokens")
    if block_table.numel() > MAX_TABLE_ENTRIES:
        raise ValueError(
            f"block_table has {block_table.numel()} entries; the MHA form addresses it with "
            f"32-bit indices (at most {MAX_TABLE_ENTRIES})"
        )
    capacity = block_table.shape[1] * kv_cache.shape[1]
    if lengths.longest > capacity:
        raise ValueError(
            f"kv_lengths {lengths.kv_lens.tolist()} exceed the block table's capacity of "
            f"{capacity} rows"
        )
    if lengths.rows and kv_cache.shape[0] == 0:
        raise ValueError(
            f"kv_cache has no blocks, but kv_lengths {lengths.kv_lens.tolist()} attend rows"
        )
    return lengths, latent_dim, v_dim


def decompressed_keys_values(
    kv_cache: Tensor,
    block_table: Tensor,
    rows: Union[Tensor, Tuple[Tensor, Tensor]],
    up_weights: Tuple[Tensor, Tensor],
    heads: int,
    rope_dim: int,
) -> Tuple[Tensor, Tensor]:
    """Keys and values of the given cache rows, decompressed per head.

    Args:
        kv_cache: [blocks, block_size, latent + rope].
        block_table: [requests, max_blocks], contiguous.
        rows: [2, rows] int32 or int64 (or its two rows, as a step's plan keeps them): each
            row's place in the block table (``request * max_blocks + position // block_size``)
            and in its block (``position % block_size``), worked out on the host where the
            positions are.
        up_weights: the keys' and the values' GEMM weights from
            :func:`~megatron_ext.fusions.mla_latent.mha_weights.up_projections`.
        heads: the query heads.
        rope_dim: the rotated columns at the end of each cache row.

    Returns:
        Tuple[Tensor, Tensor]: keys [rows, heads, key width] (``[k_nope | k_pe | zeros]``) and
        values [rows, heads, value width] (``[v | zeros]``), both packed: ragged attention
        kernels address a sequence's rows from the cumulative lengths times the packed row size
        in some releases (a strided view of the decompressed rows would be read at the wrong
        places there).
    """
    latent_dim = kv_cache.shape[2] - rope_dim
    # A block id outside the cache (the table's -1 padding) is clamped into it: such rows are
    # only bucket padding, which no query attends.
    cached = gather_cache_rows(kv_cache, block_table, (rows[0], rows[1]))
    # The decompression GEMMs (``linear``: ``x @ w.t()`` in one call from Python, the same
    # matmul). The zero rows' outputs are exact zeros for the finite rows a query attends (a
    # non-finite padding row's can be anything: no query reads it).
    keys = F.linear(cached, up_weights[0]).view(cached.shape[0], heads, -1)
    values = F.linear(cached[:, :latent_dim], up_weights[1]).view(cached.shape[0], heads, -1)
    return keys, values


def _each(attend: Callable, calls: Sequence[PlannedCall], keys: Tensor, values: Tensor) -> list:
    """``attend`` of each call, in order."""
    return [attend(call, keys, values) for call in calls]


def mla_paged_mha_attention(
    query: Tensor,
    kv_cache: Tensor,
    block_table: Tensor,
    kv_up_weight: Tensor,
    softmax_scale: float,
    *,
    query_lengths: Sequence[int],
    kv_lengths: Sequence[int],
    rope_dim: int = 64,
    backend: str = "torch",
    row_budget: Optional[int] = None,
    overlap: bool = False,
) -> Tensor:
    """MLA attention of a step's new tokens over their requests' paged latent rows, in the MHA
    form (decompressed keys and values, dense ragged attention).

    Request ``r`` has the new tokens ``sum(query_lengths[:r])`` to ``sum(query_lengths[:r + 1])``
    of ``query`` and ``kv_lengths[r]`` cached rows including them (appended already); its row
    ``n`` is ``kv_cache[block_table[r, n // block_size], n % block_size]``. New token ``i`` sits at
    position ``kv_lengths[r] - query_lengths[r] + i`` and attends to rows ``0..position``
    (causal, aligned bottom-right), with key ``[row[:latent] @ W_UK^T | row[latent:]]`` and value
    ``row[:latent] @ W_UV^T`` per head. Tokens past the last request get zeros. The lengths are
    host integers (they size the packed tensors) and are checked; the block ids are device values
    and are not (a check would synchronise): an attended row whose id lies outside the cache is
    read clamped into it (block 0 below, the last block above), where the absorbed kernel skips
    the row. A non-finite value in a row can reach the request's tokens that do not attend it
    (the dense kernels multiply masked values by zero weights); the absorbed kernel keeps such a
    row from them. megatron-core's context hands neither to a step.

    The attended rows (request after request) are decompressed ``row_budget`` at a time, a
    request's rows split across chunks where they do not fit; each chunk's partial attentions
    are merged by their log-sum-exps into an fp32 (fp64 for fp64 inputs) accumulator. The
    ``te`` backend returns no log-sum-exp to merge: it runs one chunk whatever the budget.
    With ``overlap``, where a chunk has calls to merge, its first (on cuDNN: its queries over the
    rows before their own) runs on a side stream beside its others
    (:func:`~megatron_ext.fusions.side_stream.side_by_side`); the merges keep the calls' order,
    so the bits are those of the calls run in order.

    Args:
        query (Tensor): [tokens, heads, qk_head_dim + rope_dim], ``[q_nope | rope(q_pe)]``.
        kv_cache (Tensor): [num_blocks, block_size, latent + rope_dim] in query's dtype.
        block_table (Tensor): [requests, max_blocks] int32/int64.
        kv_up_weight (Tensor): [heads * (qk_head_dim + v_head_dim), latent], ``linear_kv_up_proj``'s
            weight (this rank's heads).
        softmax_scale (float): the logits' scale.
        query_lengths (Sequence[int]): new tokens per request, on the host.
        kv_lengths (Sequence[int]): cached rows per request (new ones included), on the host.
        rope_dim (int): the rotated columns (a power of two >= 16, as the absorbed kernel takes).
        backend (str): one of :data:`BACKENDS`.
        row_budget (Optional[int]): the most rows decompressed at once, before the fused
            backends' bucket padding (:func:`bucket`: at most a quarter more, 16 rows at least
            per section); default :data:`ROW_BUDGET`.
        overlap (bool): a chunk's merged calls side by side on two streams (less GPU time
            where one call leaves SMs idle, more host time); False: in order on the current
            stream, the same bits.

    Returns:
        Tensor: [tokens, heads, v_head_dim] in query's dtype.

    Raises:
        TypeError, ValueError: for arguments of other types, dtypes, shapes or devices, or
            lengths that do not fit, before any launch.
    """
    if not isinstance(overlap, bool):
        # A truthy string ("off") would otherwise mean on.
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
    lengths, _, v_dim = _checked_call(
        query,
        kv_cache,
        block_table,
        kv_up_weight,
        softmax_scale,
        rope_dim,
        query_lengths,
        kv_lengths,
        backend,
    )
    budget = ROW_BUDGET if row_budget is None else row_budget
    check_int("row_budget", budget, 1)
    tokens, heads, width = query.shape
    qk_dim = width - rope_dim
    used = lengths.used
    if used == 0:
        return query.new_zeros(tokens, heads, v_dim)
    if backend == "te":
        budget = max(lengths.rows, 1)
    block_size = kv_cache.shape[1]
    plan = mha_plan(
        lengths.q_lens,
        lengths.kv_lens,
        backend,
        budget,
        block_size,
        block_table.shape[1],
        query.device,
    )
    direct = plan.direct
    if backend == "te" and not direct:
        raise RuntimeError(
            "the te backend's plan put a token in two calls; it has nothing to merge"
        )
    # A step in one call that covers every token (a fresh prefill, on a backend whose output
    # comes packed at v_dim) returns the call's own output: no result to allocate and copy into.
    whole = direct and plan.single and used == tokens
    # Otherwise every used token's row is written below (straight, or from the accumulator).
    out = None if whole else query.new_empty(tokens, heads, v_dim)
    if used < tokens:
        out[used:] = 0
    acc_out = acc_lse = None
    if not direct and not plan.first_seeds:
        accumulate = torch.float64 if query.dtype == torch.float64 else torch.float32
        # Rows are read only where a call wrote them (their log-sum-exp no longer -inf).
        acc_out = torch.empty(used, heads, v_dim, dtype=accumulate, device=query.device)
        acc_lse = torch.full((used, heads), -math.inf, dtype=torch.float32, device=query.device)
    if backend == "flash":
        key_width = value_width = flash_head_dim(width, v_dim)
    else:
        key_width, value_width = width, v_dim
    up_weights = cached_up_projections(
        kv_up_weight, heads, qk_dim, rope_dim, key_width, value_width
    )
    scale = float(softmax_scale)
    table = block_table if block_table.is_contiguous() else block_table.contiguous()

    def attend(
        call: PlannedCall, keys: Tensor, values: Tensor, dest: Optional[Tensor] = None
    ) -> Tuple[Tensor, Optional[Tensor]]:
        ids, n = call.tokens, call.count
        q = query[ids]
        if call.padded != n or not q.is_contiguous():
            q = torch.cat([q, q.new_zeros(call.padded - n, heads, width)])
        part, part_lse = varlen_attention(
            backend,
            q,
            keys[call.rows],
            values[call.rows],
            call.lengths,
            call.causal,
            scale,
            not direct,
            call.offsets,
            call.ragged,
            out=dest if dest is not None and call.padded == n else None,
        )
        # The flash backend's values carry zero columns past v_dim (and the fused backends
        # that plan per shape return bucket padding past n).
        if part.shape[0] != n or part.shape[2] != v_dim:
            part = part[:n, :, :v_dim]
        return part, None if part_lse is None else part_lse[:n]

    for chunk in plan.chunks:
        keys, values = decompressed_keys_values(
            kv_cache, table, chunk.places, up_weights, heads, rope_dim
        )
        if direct:
            for call in chunk.calls:
                # A backend that writes into the result's rows saves copying its output there.
                dest = out[call.tokens] if isinstance(call.tokens, slice) and not whole else None
                part, _ = attend(call, keys, values, dest)
                if whole:
                    # The one call's output is the result (copied where it is a strided view).
                    return part if part.is_contiguous() else part.contiguous()
                if part is not dest:
                    out[call.tokens] = part
            continue
        first, rest = chunk.calls[0], chunk.calls[1:]
        if overlap and rest:
            # Each call alone leaves SMs idle at few heads and short chunks; the parts are
            # independent until the merges below, which run in order on the current stream.
            side, others = side_by_side(
                functools.partial(attend, first, keys, values),
                functools.partial(_each, attend, rest, keys, values),
                query.device,
            )
            parts = [side, *others]
        else:
            # In order, each call merged before the next runs (one partial alive at a time).
            parts = (attend(call, keys, values) for call in chunk.calls)
        for call, (part, part_lse) in zip(chunk.calls, parts):
            if acc_out is None:
                # The first call's output is what its merge into an empty accumulator would
                # leave there; the later merges only read it (the plan's first_seeds).
                acc_out, acc_lse = part, part_lse
                continue
            # A call after which its tokens have no other writes their answers.
            final = out if call.last else None
            merge_partials_into(acc_out, acc_lse, part, part_lse, call.tokens, final)
    if not direct and not plan.merges_write_out:
        out[:used].copy_(acc_out)
    return out
