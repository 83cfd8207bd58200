# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The ``cudnn-dense`` backend's calls: torch's dense cuDNN attention
(:data:`megatron_ext.internals.cudnn_dense_attention_forward`, whose execution plans torch keeps
by shape) on packed sequences batched by bucketed length.

* :func:`square_causal_attention`: square causal sequences (fresh prefills) with the entry's
  causal flag, batched by length bucket (:func:`dense_groups`); full sequences back to back are
  views, in batches of bucket sizes (:func:`bucket_pieces`), the others gathered into a padded
  batch.
* :func:`unmasked_attention`: any query and key lengths, unmasked (a chunk's queries over the
  cached rows before its own), batched by bucketed query and key lengths
  (:func:`unmasked_groups`); the keys' padding, where a group has any, masked by an additive
  bias, and no bias where every key length fills its bucket.

Causal calls of other shapes are not taken: the MHA form's plan for this backend masks only
square blocks (:func:`~megatron_ext.fusions.mla_latent.mha_chunks.plan_chunks`, top-left). A
bottom-right mask as a bias ran a 1024-token chunk behind 3072 rows at 128 heads 1.6x slower
than FlashAttention-2 on an H100, where the split calls run cuDNN's fast paths.

The groups (their device indices and masks) are the same for every layer of a step: built once
per lengths, device and stream, and kept (:func:`clear_groups` forgets them).
"""

import math
from typing import NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from megatron_ext import internals
from megatron_ext.fusions.launch_plans import PlanCache
from megatron_ext.fusions.mla_latent.mha_rows import (
    bucket,
    kept_for_step,
    offsets_within,
    to_device,
)
from megatron_ext.fusions.tensor_checks import check_disjoint, check_int, check_no_self_overlap

__all__ = [
    "DenseGroup",
    "UnmaskedGroup",
    "bucket_pieces",
    "clear_groups",
    "dense_groups",
    "square_causal_attention",
    "unmasked_attention",
    "unmasked_groups",
]


class DenseGroup(NamedTuple):
    """Sequences of one bucketed length run as one dense batch (:func:`dense_groups`).

    Attributes:
        length: the bucketed length (the batch's rows per sequence).
        count: the sequences.
        batch: the batch (a bucket: ``count`` itself for views, else ``count`` rounded up, the
            rest zero rows).
        rows: the packed rows where the sequences lie back to back and full (views, no copies;
            a bucket of them per group), else None.
        index: else [2, rows] int64 on the device: each packed row and its place in the batch.
    """

    length: int
    count: int
    batch: int
    rows: Optional[slice]
    index: Optional[Tensor]


# Dense groups by the lengths, kept as a step's plan is: every layer's call of a step has the
# same lengths (a group holds at most a small device index).
_DENSE_GROUPS = PlanCache(max_entries=16)


def bucket_pieces(count: int) -> Tuple[int, ...]:
    """``count`` as a sum of buckets (:func:`bucket`, minimum 1), largest first: each the largest
    bucket that fits what is left, so a few (``count`` itself where it is a bucket).

    Args:
        count: a size >= 0.

    Returns:
        Tuple[int, ...]: the buckets (empty for 0).

    Raises:
        TypeError, ValueError: for a count that is not an int >= 0.
    """
    count = check_int("count", count, 0)
    pieces = []
    while count:
        shift = max(count.bit_length() - 3, 0)
        piece = count >> shift << shift  # the largest m * 2**shift <= count, m in 4..7
        pieces.append(piece)
        count -= piece
    return tuple(pieces)


def _build_dense_groups(lengths: np.ndarray, device: torch.device) -> Tuple[DenseGroup, ...]:
    starts = np.cumsum(lengths) - lengths
    buckets = np.array([bucket(int(n)) for n in lengths], dtype=np.int64)
    groups = []
    for length in np.unique(buckets[lengths > 0]).tolist():
        members = np.flatnonzero((buckets == length) & (lengths > 0))
        count, sizes = len(members), lengths[members]
        within = offsets_within(sizes)
        src = np.repeat(starts[members], sizes) + within
        first = int(src[0])
        if (sizes == length).all() and src[-1] == first + count * length - 1:
            # Full sequences back to back: views, one batch per bucket of sequences (a padded
            # batch would copy every query, key and value row into zeroed buffers: in a large
            # prefill that costs more GPU time than the attention).
            for piece in bucket_pieces(count):
                rows = slice(first, first + piece * length)
                groups.append(DenseGroup(length, piece, piece, rows, None))
                first = rows.stop
            continue
        batch = bucket(count, minimum=1)
        dst = np.repeat(np.arange(count, dtype=np.int64) * length, sizes) + within
        index = to_device(np.stack([src, dst]), device).long()
        groups.append(DenseGroup(length, count, batch, None, index))
    return tuple(groups)


def dense_groups(lengths: np.ndarray, device: torch.device) -> Tuple[DenseGroup, ...]:
    """Square causal sequences grouped by bucketed length for dense batches (zero-length ones
    left out), built once per lengths, device and stream.

    Args:
        lengths: int64 sequence lengths (host).
        device: where the batches run.

    Returns:
        Tuple[DenseGroup, ...]: the groups, shortest bucket first.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    return kept_for_step(
        _DENSE_GROUPS, lengths.tobytes(), device, lambda: _build_dense_groups(lengths, device)
    )


def _batch(packed: Tensor, start: int, batch: int, length: int) -> Tensor:
    """Rows ``start .. start + batch * length`` of packed ``[rows, heads, width]`` as the dense
    entry's ``[batch, heads, length, width]``: one view (where slicing, reshaping and
    transposing took three, each a dispatch of host time).

    Args:
        packed: [rows, heads, width], any strides.
        start: the first row.
        batch, length: the sequences and the rows of each.

    Returns:
        Tensor: the view.
    """
    _, heads, width = packed.shape
    row, head, col = packed.stride()
    return packed.as_strided(
        (batch, heads, length, width),
        (length * row, head, row, col),
        packed.storage_offset() + start * row,
    )


def _dense_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Optional[Tensor],
    causal: bool,
    scale: float,
    want_lse: bool,
) -> Tuple[Tensor, Optional[Tensor]]:
    """One call of torch's dense cuDNN entry on batches ``[batch, heads, rows, width]``
    (:func:`_batch`).

    Returns:
        Tuple[Tensor, Optional[Tensor]]: the output as [batch * rows, heads, v] and the
        log-sum-exp as [batch * rows, heads] (or None).
    """
    batch, heads, rows = q.shape[:3]
    result = internals.cudnn_dense_attention_forward(
        q, k, v, bias, want_lse, 0.0, causal, False, scale=scale
    )
    out = result[0].transpose(1, 2).reshape(-1, heads, v.shape[-1])
    if not want_lse:
        return out, None
    # [batch, heads, rows] (or with a trailing 1) as torch returns it.
    return out, result[1].reshape(-1, heads, rows).transpose(1, 2).reshape(-1, heads)


def _empty_result(
    q: Tensor, v_dim: int, want_lse: bool, written: int, out: Optional[Tensor] = None
) -> Tuple[Tensor, Optional[Tensor]]:
    """A call's result before its groups write their rows ``0..written``: zeros and -inf after
    them (padding rows). Sequences without keys have no rows, so the groups write every row
    before ``written``.

    Args:
        q: the call's queries [tokens, heads, qk].
        v_dim: the values' width.
        want_lse: also make the log-sum-exps.
        written: the rows the groups write (the sum of the lengths).
        out: the output to use (the caller's), or None: a new one.

    Returns:
        Tuple[Tensor, Optional[Tensor]]: [tokens, heads, v_dim] and [tokens, heads] fp32 or None.
    """
    tokens, heads = q.shape[:2]
    if out is None:
        out = q.new_empty(tokens, heads, v_dim)
    if written < tokens:
        out[written:] = 0
    if not want_lse:
        return out, None
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=q.device)
    if written < tokens:
        lse[written:] = -math.inf
    return out, lse


def square_causal_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: np.ndarray,
    scale: float,
    want_lse: bool,
    out: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """torch's dense cuDNN attention of packed square causal sequences (query and key lengths
    equal, so top-left is bottom-right), one call per bucket of lengths (:func:`dense_groups`).

    Args:
        q, k, v: [tokens, heads, qk], [tokens, heads, qk], [tokens, heads, v]: sequence ``i``'s
            rows follow the earlier sequences' in each (rows past the lengths are ignored).
        lengths: the sequences' lengths (host).
        scale: the softmax scale.
        want_lse: also return the log-sum-exps.
        out: [tokens, heads, v] in q's dtype to write the result into (a caller's rows: one copy
            of each call's output fewer), apart from q, k and v (refused otherwise); None: a new
            tensor, or cuDNN's own output where one call covers every row.

    Returns:
        Tuple[Tensor, Optional[Tensor]]: [tokens, heads, v] (``out`` where given) and
        [tokens, heads] fp32 or None (zeros and -inf past the lengths).
    """
    tokens, heads = q.shape[:2]
    if out is not None and (out.shape != (tokens, heads, v.shape[-1]) or out.dtype != q.dtype):
        raise ValueError(
            f"out must be {(tokens, heads, v.shape[-1])} {q.dtype}; got {tuple(out.shape)} "
            f"{out.dtype}"
        )
    if out is not None:
        check_no_self_overlap("out", out)
        check_disjoint("out", out, [("q", q), ("k", k), ("v", v)])
    groups = dense_groups(lengths, q.device)
    # Every row in one group of back-to-back full sequences (a fresh prefill of equal prompts):
    # cuDNN's own output is the result, no output to copy it into. (Such a group holds every
    # nonzero length, all equal to its own: ``count * length`` rows in all.)
    alone = (
        out is None
        and len(groups) == 1
        and groups[0].rows is not None
        and groups[0].count * groups[0].length == tokens
    )
    lse = None
    if not alone:
        written = int(np.asarray(lengths).sum())
        out, lse = _empty_result(q, v.shape[-1], want_lse, written, out)
    for group in groups:
        length, rows = group.length, group.rows
        if rows is not None:
            qd, kd, vd = (_batch(x, rows.start, group.count, length) for x in (q, k, v))
        else:
            rows, padded = group.index[0], group.index[1]
            qd, kd, vd = (x.new_zeros(group.batch * length, heads, x.shape[-1]) for x in (q, k, v))
            for dense, packed in ((qd, q), (kd, k), (vd, v)):
                dense[padded] = packed[rows]
            qd, kd, vd = (_batch(x, 0, group.batch, length) for x in (qd, kd, vd))
        dense_out, dense_lse = _dense_call(qd, kd, vd, None, True, scale, want_lse)
        if alone:
            return dense_out, (dense_lse.float() if want_lse else None)
        out[rows] = dense_out if isinstance(rows, slice) else dense_out[padded]
        if want_lse:
            lse[rows] = (dense_lse if isinstance(rows, slice) else dense_lse[padded]).float()
    return out, lse


class UnmaskedGroup(NamedTuple):
    """Sequences of one (bucketed query length, bucketed key length) run as one dense batch,
    unmasked but for the keys' padding (:func:`unmasked_groups`).

    Attributes:
        query_length, key_length: the batch's rows per sequence.
        batch: the batch (the sequences rounded up to a bucket; the rest zero rows).
        queries, keys: [2, rows] int64 on the device: each packed row and its place in the
            batch.
        bias: [batch, 1, query_length, key_length] in the operands' dtype, 0 on a sequence's
            keys and -inf on the padding after them (padding queries attend the first key,
            their outputs dropped); None where every sequence's keys fill the key length (the
            empty sequences that round the batch up attend zero keys and values: zeros,
            dropped).
        query_rows, key_rows: the packed rows where that side's sequences lie back to back and
            full (the batch is a view of them, no copy), else None.
    """

    query_length: int
    key_length: int
    batch: int
    queries: Tensor
    keys: Tensor
    bias: Optional[Tensor]
    query_rows: Optional[slice]
    key_rows: Optional[slice]


# A step's groups are the same for every layer: built once, kept like a step's plan (a padding
# mask is query rows x key rows; the bound keeps few).
_UNMASKED_GROUPS = PlanCache(max_entries=4)


def _rows_into_batch(
    starts: np.ndarray, lengths: np.ndarray, stride: int
) -> Tuple[np.ndarray, np.ndarray]:
    """Packed rows of the sequences (``starts``, ``lengths``) and their places in a batch of
    ``stride`` rows per sequence."""
    within = offsets_within(lengths)
    places = np.repeat(np.arange(len(lengths), dtype=np.int64) * stride, lengths) + within
    return np.repeat(starts, lengths) + within, places


def _back_to_back(
    starts: np.ndarray, lengths: np.ndarray, rows: int, batch: int
) -> Optional[slice]:
    """The packed rows of sequences that fill a batch of ``rows`` per sequence back to back
    (a view of them is the batch), else None."""
    count = len(lengths)
    if batch != count or not (lengths == rows).all():
        return None
    if not (starts == starts[0] + rows * np.arange(count)).all():
        return None
    return slice(int(starts[0]), int(starts[0]) + count * rows)


def _build_unmasked_groups(
    q_lens: np.ndarray, k_lens: np.ndarray, device: torch.device, dtype: torch.dtype
) -> Tuple[UnmaskedGroup, ...]:
    q_starts, k_starts = np.cumsum(q_lens) - q_lens, np.cumsum(k_lens) - k_lens
    q_buckets = np.array([bucket(int(n)) for n in q_lens], dtype=np.int64)
    k_buckets = np.array([bucket(int(n)) for n in k_lens], dtype=np.int64)
    # A sequence without keys (or queries) is left out: its rows keep zeros and -inf.
    live = (q_lens > 0) & (k_lens > 0)
    groups = []
    for lq, lk in sorted(set(zip(q_buckets[live].tolist(), k_buckets[live].tolist()))):
        members = np.flatnonzero(live & (q_buckets == lq) & (k_buckets == lk))
        batch = bucket(len(members), minimum=1)
        queries = np.stack(_rows_into_batch(q_starts[members], q_lens[members], lq))
        keys = np.stack(_rows_into_batch(k_starts[members], k_lens[members], lk))
        index = to_device(np.concatenate([queries, keys], axis=1), device).long()
        bias = None
        if (k_lens[members] != lk).any():
            bias = _padding_bias(q_lens[members], k_lens[members], batch, lq, lk, device, dtype)
        split = queries.shape[1]
        query_rows = _back_to_back(q_starts[members], q_lens[members], lq, batch)
        key_rows = _back_to_back(k_starts[members], k_lens[members], lk, batch)
        groups.append(
            UnmaskedGroup(
                lq, lk, batch, index[:, :split], index[:, split:], bias, query_rows, key_rows
            )
        )
    return tuple(groups)


def _padding_bias(
    q_lens: np.ndarray,
    k_lens: np.ndarray,
    batch: int,
    lq: int,
    lk: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Tensor:
    """[batch, 1, lq, lk]: 0 on each sequence's keys, -inf on the padding (a padding query row
    attends the first key, so that no row is all -inf)."""
    lengths = np.zeros((2, batch), dtype=np.int64)
    lengths[0, : len(q_lens)], lengths[1, : len(k_lens)] = q_lens, k_lens
    # Through pinned memory, asynchronously: a pageable copy would wait for the stream.
    q_len, k_len = to_device(lengths, device)[:, :, None, None, None]
    row = torch.arange(lq, device=device)[None, None, :, None]
    col = torch.arange(lk, device=device)[None, None, None, :]
    allowed = ((col < k_len) & (row < q_len)) | ((row >= q_len) & (col == 0))
    # Rows of the mask start on 16 bytes (cuDNN's alignment for its strides).
    width = -(-lk // 8) * 8
    bias = torch.zeros(batch, 1, lq, width, dtype=dtype, device=device)[..., :lk]
    return bias.masked_fill_(~allowed, -math.inf)


def unmasked_groups(
    q_lens: np.ndarray, k_lens: np.ndarray, device: torch.device, dtype: torch.dtype
) -> Tuple[UnmaskedGroup, ...]:
    """Sequences grouped by bucketed query and key lengths for unmasked dense batches (the
    keys' padding masked by a bias where there is any), built once per lengths, device and
    stream.

    Args:
        q_lens, k_lens: int64 query and key lengths per sequence (host).
        device, dtype: where the batches run, and the biases' dtype (the operands').

    Returns:
        Tuple[UnmaskedGroup, ...]: the groups.
    """
    q_lens, k_lens = np.asarray(q_lens, dtype=np.int64), np.asarray(k_lens, dtype=np.int64)
    return kept_for_step(
        _UNMASKED_GROUPS,
        (q_lens.tobytes(), k_lens.tobytes(), dtype),
        device,
        lambda: _build_unmasked_groups(q_lens, k_lens, device, dtype),
    )


def clear_groups() -> None:
    """Forget the kept dense and unmasked groups (their index tensors and biases)."""
    _DENSE_GROUPS.clear()
    _UNMASKED_GROUPS.clear()


def unmasked_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lens: np.ndarray,
    k_lens: np.ndarray,
    scale: float,
    want_lse: bool,
) -> Tuple[Tensor, Optional[Tensor]]:
    """torch's dense cuDNN attention of packed sequences of any query and key lengths, unmasked,
    one call per group of bucketed lengths (:func:`unmasked_groups`: cuDNN plans per shape, and
    buckets keep the shapes few).

    Args:
        q, k, v: [tokens, heads, qk], [rows, heads, qk], [rows, heads, v], packed.
        q_lens, k_lens: the sequences' lengths (host).
        scale: the softmax scale.
        want_lse: also return the log-sum-exps.

    Returns:
        Tuple[Tensor, Optional[Tensor]]: [tokens, heads, v] and [tokens, heads] fp32 or None
        (zeros and -inf for a query without keys and past the lengths).
    """
    tokens, heads = q.shape[:2]
    groups = unmasked_groups(q_lens, k_lens, q.device, q.dtype)
    # One group whose batch is a view of every query row (a chunk over the rows before it):
    # cuDNN's own output is the result, no zeroed output to copy it into.
    alone = len(groups) == 1 and groups[0].query_rows == slice(0, tokens)
    out, lse = (None, None) if alone else _empty_result(q, v.shape[-1], want_lse, 0)
    for group in groups:
        lq, lk, batch = group.query_length, group.key_length, group.batch
        dense = []
        sides = (
            (q, group.queries, lq, group.query_rows),
            (k, group.keys, lk, group.key_rows),
            (v, group.keys, lk, group.key_rows),
        )
        for packed, index, rows, view in sides:
            if view is not None:  # back to back and full: the packed rows are the batch
                dense.append(_batch(packed, view.start, batch, rows))
                continue
            x = packed.new_zeros(batch * rows, heads, packed.shape[-1])
            x[index[1]] = packed[index[0]]
            dense.append(_batch(x, 0, batch, rows))
        bias = None if group.bias is None else group.bias.expand(batch, heads, lq, lk)
        dense_out, dense_lse = _dense_call(*dense, bias, False, scale, want_lse)
        if alone:
            return dense_out, (dense_lse.float() if want_lse else None)
        if group.query_rows is not None:
            out[group.query_rows] = dense_out
            if want_lse:
                lse[group.query_rows] = dense_lse.float()
            continue
        out[group.queries[0]] = dense_out[group.queries[1]]
        if want_lse:
            lse[group.queries[0]] = dense_lse[group.queries[1]].float()
    return out, lse
