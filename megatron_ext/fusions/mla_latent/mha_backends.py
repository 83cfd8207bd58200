# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Ragged attention backends of the MHA form: packed sequences of queries against packed keys
and values (:func:`varlen_attention`), each backend's once-per-device check
(:func:`ragged_check`), and the plain-torch reference. Backends (:data:`BACKENDS`):

* ``cudnn``: torch's ragged cuDNN attention (:data:`megatron_ext.internals.cudnn_attention_forward`)
  whose causal mask is aligned top-left: a request's new tokens attend their own rows with the
  causal mask (square, so top-left is bottom-right) and its cached prefix in a second, unmasked
  call; the two are merged by their log-sum-exps (per chunk: the new rows' square diagonal
  blocks masked, every other block unmasked). Sizes are rounded up to buckets
  (:func:`bucket`) because cuDNN builds one execution plan per shape (the request count only
  where cuDNN takes zero-length sequences: :func:`empty_sequences_supported`). Whether torch's
  release and the GPU run it at all is checked once per device (:func:`ragged_check`). Some
  torch releases build the ragged call's cuDNN graph anew on every call without keeping it
  (tens of milliseconds a call), which makes this backend slower than the absorbed form there.
* ``cudnn-dense``: torch's dense cuDNN attention
  (:data:`megatron_ext.internals.cudnn_dense_attention_forward`), whose plans torch keeps by
  shape, with the ``flash`` backend's bottom-right plan. Square causal sequences (fresh
  prefills) take its causal flag: batched by length, each padded with zero rows to its length's
  bucket (a query attends only keys at or before its own position, so the padding is seen only
  by padding), the batch to its bucket with empty sequences; sequences of one length laid out
  back to back go in as views. Others (a chunk behind cached rows, a chunk's unmasked rest) are
  batched by bucketed query and key lengths with the mask as an additive bias, built once per
  step (:func:`masked_groups`). Query/key and value head sizes stay apart (640 FLOPs per pair).
  Checked once per device as ``cudnn`` is, both ways.
* ``flash``: torch's FlashAttention-2 entry
  (:data:`megatron_ext.internals.flash_attention_forward`), packed with cumulative lengths, its
  causal mask aligned bottom-right: one call per chunk of rows over the requests' cached and
  new rows together, merged across chunks by the log-sum-exps it returns. It takes one head size
  for query, key and value, so the values are padded with zeros to the query's (128 to 192 at
  DeepSeek-V3's widths: 768 FLOPs per pair, not 640) and the padding dropped from the output.
  It builds no execution plan, so its sizes are not bucketed. Checked once per device as
  ``cudnn`` is (:func:`ragged_check`).
* ``te``: Transformer Engine's fused attention, packed (THD) with cumulative lengths and its
  bottom-right causal mask, one call over each request's whole context (it returns no
  log-sum-exp to merge, so the row budget does not apply to it).
* ``torch`` and ``torch-bottom-right``: plain torch, one request at a time, with the same
  semantics as ``cudnn`` and ``te`` respectively; any device and dtype (fp64 included). The
  reference and the tests' stand-ins for the two fused backends.
"""

import functools
import math
import threading
from typing import Dict, NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import Tensor

from megatron_ext import internals
from megatron_ext.fusions.launch_plans import PlanCache

__all__ = [
    "BACKENDS",
    "CHECKED_BACKENDS",
    "FLASH_MAX_HEAD_DIM",
    "SPLIT_BACKENDS",
    "WHOLE_BACKENDS",
    "DenseGroup",
    "MaskedGroup",
    "Ragged",
    "bucket",
    "clear_groups",
    "dense_groups",
    "masked_groups",
    "empty_sequences_supported",
    "flash_head_dim",
    "needs_offsets",
    "present_backends",
    "ragged_check",
    "ragged_offsets",
    "to_device",
    "torch_varlen",
    "varlen_attention",
    "offsets_within",
]

# Backends whose causal mask is top-left (a cached prefix is attended in a second call) and those
# with a bottom-right mask (a request's cached and new rows in one call).
SPLIT_BACKENDS = ("cudnn", "torch")
WHOLE_BACKENDS = ("te", "flash", "cudnn-dense", "torch-bottom-right")
# FlashAttention-2's largest head size.
FLASH_MAX_HEAD_DIM = 256
# The fused backends checked once per device before use (:func:`ragged_check`), by their causal
# alignment.
CHECKED_BACKENDS = {"cudnn": "top_left", "cudnn-dense": "bottom_right", "flash": "bottom_right"}
BACKENDS = SPLIT_BACKENDS + WHOLE_BACKENDS


def bucket(value: int, minimum: int = 16) -> int:
    """``value`` rounded up to ``m * 2**k`` with ``m`` in 4..7 (at most 25% more), at least
    ``minimum``: few distinct sizes, so that a backend that plans per shape replans rarely.

    Args:
        value: a size >= 0.
        minimum: the smallest bucket.

    Returns:
        int: the bucket.
    """
    value = max(int(value), minimum)
    shift = max(value.bit_length() - 3, 0)
    return -(-value >> shift) << shift


def offsets_within(lengths: np.ndarray) -> np.ndarray:
    """0..length-1 for each length, concatenated."""
    total = int(lengths.sum())
    starts = np.cumsum(lengths) - lengths
    return np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)


def _cumulative(lengths: np.ndarray, entries: int) -> np.ndarray:
    """[0, cumsum(lengths)...] padded to ``entries + 1`` values with zero-length sequences."""
    out = np.zeros(entries + 1, dtype=np.int64)
    out[1 : len(lengths) + 1] = np.cumsum(lengths)
    out[len(lengths) + 1 :] = out[len(lengths)]
    return out


def to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """One int32 host-to-device copy (pinned and asynchronous on CUDA: no host synchronisation)."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def torch_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lens: np.ndarray,
    k_lens: np.ndarray,
    causal: Optional[str],
    scale: float,
) -> Tuple[Tensor, Tensor]:
    """Plain torch, one request at a time: causal None, "top_left" or "bottom_right"."""
    tokens, heads, _ = q.shape
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(tokens, heads, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float32, device=q.device)
    q_start = k_start = 0
    for q_len, k_len in zip(q_lens.tolist(), k_lens.tolist()):
        q_end, k_end = q_start + q_len, k_start + k_len
        if q_len and k_len:
            scores = torch.einsum(
                "qhd,khd->hqk", q[q_start:q_end].to(compute), k[k_start:k_end].to(compute)
            )
            scores = scores * scale
            if causal is not None:
                shift = 0 if causal == "top_left" else k_len - q_len
                rows = torch.arange(q_len, device=q.device)[:, None]
                cols = torch.arange(k_len, device=q.device)[None, :]
                scores = scores.masked_fill(cols > rows + shift, -math.inf)
            request_lse = torch.logsumexp(scores, dim=-1)  # [H, q]
            weights = torch.exp(scores - request_lse[..., None]).nan_to_num_(0.0)
            result = torch.einsum("hqk,khd->qhd", weights, v[k_start:k_end].to(compute))
            out[q_start:q_end] = result.to(q.dtype)
            lse[q_start:q_end] = request_lse.t().float()
        q_start, k_start = q_end, k_end
    return out, lse


@functools.lru_cache(maxsize=None)
def empty_sequences_supported() -> bool:
    """Whether the loaded cuDNN takes zero-length packed sequences, which round a fused call's
    request count up to a bucket (from cuDNN 9.25; earlier releases may return NaN rows for them).

    Returns:
        bool: True from cuDNN 9.25 on; False without cuDNN.
    """
    version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return version is not None and version >= 92500


class Ragged(NamedTuple):
    """A fused backend's packed-sequence metadata: cumulative query and key lengths (int32, on
    the device) and their bucketed maxima."""

    cu_q: Tensor
    cu_k: Tensor
    max_q: int
    max_k: int


def _cudnn_varlen(
    q: Tensor, k: Tensor, v: Tensor, ragged: Ragged, causal: bool, scale: float, want_lse: bool
) -> Tuple[Tensor, Optional[Tensor]]:
    """torch's ragged cuDNN attention (causal: top-left)."""
    result = internals.cudnn_attention_forward(
        q, k, v, None, *ragged, want_lse, 0.0, causal, False, scale=scale
    )
    out, lse = result[0], result[1]
    if not want_lse:
        return out, None
    # Releases differ: the stats come as [T, H, 1] (as read for 2.11) or [H, T] (newer).
    lse = lse.squeeze(-1) if lse.dim() == 3 else lse.t()
    return out, lse.float()


class DenseGroup(NamedTuple):
    """Sequences of one bucketed length run as one dense batch (:func:`dense_groups`).

    Attributes:
        length: the bucketed length (the batch's rows per sequence).
        count: the sequences.
        batch: the batch (``count`` rounded up to a bucket; the rest zero rows).
        rows: the packed rows where the sequences lie back to back and full (views, no copies),
            else None.
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


def _build_dense_groups(lengths: np.ndarray, device: torch.device) -> Tuple[DenseGroup, ...]:
    starts = np.cumsum(lengths) - lengths
    buckets = np.array([bucket(int(n)) for n in lengths], dtype=np.int64)
    groups = []
    for length in np.unique(buckets[lengths > 0]).tolist():
        members = np.flatnonzero((buckets == length) & (lengths > 0))
        count, sizes = len(members), lengths[members]
        batch = bucket(count, minimum=1)
        within = offsets_within(sizes)
        src = np.repeat(starts[members], sizes) + within
        first = int(src[0])
        if batch == count and (sizes == length).all() and src[-1] == first + count * length - 1:
            groups.append(
                DenseGroup(length, count, batch, slice(first, first + count * length), None)
            )
        else:
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
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    key = (np.asarray(lengths, dtype=np.int64).tobytes(), device, stream)
    groups = _DENSE_GROUPS.get(key)
    if groups is None:
        groups = _DENSE_GROUPS.put(key, _build_dense_groups(np.asarray(lengths), device))
    return groups


def _dense_call(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    bias: Optional[Tensor],
    causal: bool,
    scale: float,
    want_lse: bool,
) -> Tuple[Tensor, Optional[Tensor]]:
    """One call of torch's dense cuDNN entry on batches ``[batch, rows, heads, width]``.

    Returns:
        Tuple[Tensor, Optional[Tensor]]: the output as [batch * rows, heads, v] and the
        log-sum-exp as [batch * rows, heads] (or None).
    """
    batch, rows, heads = q.shape[:3]
    result = internals.cudnn_dense_attention_forward(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        bias,
        want_lse,
        0.0,
        causal,
        False,
        scale=scale,
    )
    out = result[0].transpose(1, 2).reshape(-1, heads, v.shape[-1])
    if not want_lse:
        return out, None
    # [batch, heads, rows] (or with a trailing 1) as torch returns it.
    return out, result[1].reshape(-1, heads, rows).transpose(1, 2).reshape(-1, heads)


def _cudnn_dense(
    q: Tensor, k: Tensor, v: Tensor, lengths: np.ndarray, scale: float, want_lse: bool
) -> Tuple[Tensor, Optional[Tensor]]:
    """torch's dense cuDNN attention of packed square causal sequences (query and key lengths
    equal, so top-left is bottom-right), one call per bucket of lengths (:func:`dense_groups`).

    Args:
        q, k, v: [tokens, heads, qk], [tokens, heads, qk], [tokens, heads, v]: sequence ``i``'s
            rows follow the earlier sequences' in each (rows past the lengths are ignored).
        lengths: the sequences' lengths (host).
        scale: the softmax scale.
        want_lse: also return the log-sum-exps.

    Returns:
        Tuple[Tensor, Optional[Tensor]]: [tokens, heads, v] and [tokens, heads] fp32 or None
        (zeros and -inf past the lengths).
    """
    tokens, heads = q.shape[:2]
    groups = dense_groups(lengths, q.device)
    # Every row in one group of back-to-back full sequences (a fresh prefill of equal prompts):
    # cuDNN's own output is the result, no zeroed output to copy it into.
    alone = len(groups) == 1 and groups[0].rows is not None and int(lengths.sum()) == tokens
    out = lse = None
    if not alone:
        out = q.new_zeros(tokens, heads, v.shape[-1])
        if want_lse:
            lse = torch.full((tokens, heads), -math.inf, dtype=torch.float32, device=q.device)
    for group in groups:
        length, rows = group.length, group.rows
        if rows is not None:
            qd, kd, vd = (x[rows].view(group.count, length, heads, -1) for x in (q, k, v))
        else:
            rows, padded = group.index[0], group.index[1]
            qd, kd, vd = (x.new_zeros(group.batch * length, heads, x.shape[-1]) for x in (q, k, v))
            for dense, packed in ((qd, q), (kd, k), (vd, v)):
                dense[padded] = packed[rows]
            qd, kd, vd = (x.view(group.batch, length, heads, -1) for x in (qd, kd, vd))
        dense_out, dense_lse = _dense_call(qd, kd, vd, None, True, scale, want_lse)
        if alone:
            return dense_out, (dense_lse.float() if want_lse else None)
        out[rows] = dense_out if isinstance(rows, slice) else dense_out[padded]
        if want_lse:
            lse[rows] = (dense_lse if isinstance(rows, slice) else dense_lse[padded]).float()
    return out, lse


class MaskedGroup(NamedTuple):
    """Sequences of one (bucketed query length, bucketed key length) run as one dense batch
    with an additive mask (:func:`masked_groups`).

    Attributes:
        query_length, key_length: the batch's rows per sequence.
        batch: the batch (the sequences rounded up to a bucket; the rest zero rows).
        queries, keys: [2, rows] int64 on the device: each packed row and its place in the
            batch.
        bias: [batch, 1, query_length, key_length] in the operands' dtype: 0 where a query
            attends a key, -inf elsewhere (padding queries attend the first key, their outputs
            dropped).
        query_rows, key_rows: the packed rows where that side's sequences lie back to back and
            full (the batch is a view of them, no copy), else None.
    """

    query_length: int
    key_length: int
    batch: int
    queries: Tensor
    keys: Tensor
    bias: Tensor
    query_rows: Optional[slice]
    key_rows: Optional[slice]


# A step's masks are the same for every layer: built once, kept like a step's plan (a mask is
# query rows x key rows; the bound keeps few).
_MASKED_GROUPS = PlanCache(max_entries=4)


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


def _build_masked_groups(
    q_lens: np.ndarray, k_lens: np.ndarray, causal: bool, device: torch.device, dtype: torch.dtype
) -> Tuple[MaskedGroup, ...]:
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
        lengths = np.zeros((2, batch), dtype=np.int64)
        lengths[0, : len(members)], lengths[1, : len(members)] = q_lens[members], k_lens[members]
        # Through pinned memory, asynchronously: a pageable copy would wait for the stream.
        q_len, k_len = to_device(lengths, device)[:, :, None, None, None]
        row = torch.arange(lq, device=device)[None, None, :, None]
        col = torch.arange(lk, device=device)[None, None, None, :]
        allowed = (col < k_len) & (row < q_len)
        if causal:  # bottom-right: query i of q sits at key position k - q + i
            allowed &= col <= k_len - q_len + row
        allowed |= (row >= q_len) & (col == 0)
        # Rows of the mask start on 16 bytes (cuDNN's alignment for its strides).
        width = -(-lk // 8) * 8
        bias = torch.zeros(batch, 1, lq, width, dtype=dtype, device=device)[..., :lk]
        bias.masked_fill_(~allowed, -math.inf)
        split = queries.shape[1]
        query_rows = _back_to_back(q_starts[members], q_lens[members], lq, batch)
        key_rows = _back_to_back(k_starts[members], k_lens[members], lk, batch)
        groups.append(
            MaskedGroup(
                lq, lk, batch, index[:, :split], index[:, split:], bias, query_rows, key_rows
            )
        )
    return tuple(groups)


def masked_groups(
    q_lens: np.ndarray, k_lens: np.ndarray, causal: bool, device: torch.device, dtype: torch.dtype
) -> Tuple[MaskedGroup, ...]:
    """Sequences grouped by bucketed query and key lengths for dense batches with an additive
    mask (bottom-right causal, or only the padding), built once per lengths, device and stream.

    Args:
        q_lens, k_lens: int64 query and key lengths per sequence (host).
        causal: mask the keys past each query's position (bottom-right).
        device, dtype: where the batches run, and the masks' dtype (the operands').

    Returns:
        Tuple[MaskedGroup, ...]: the groups.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None
    q_lens, k_lens = np.asarray(q_lens, dtype=np.int64), np.asarray(k_lens, dtype=np.int64)
    key = (q_lens.tobytes(), k_lens.tobytes(), causal, device, dtype, stream)
    groups = _MASKED_GROUPS.get(key)
    if groups is None:
        groups = _MASKED_GROUPS.put(
            key, _build_masked_groups(q_lens, k_lens, causal, device, dtype)
        )
    return groups


def clear_groups() -> None:
    """Forget the kept dense and masked groups (their index tensors and masks)."""
    _DENSE_GROUPS.clear()
    _MASKED_GROUPS.clear()


def _cudnn_dense_masked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_lens: np.ndarray,
    k_lens: np.ndarray,
    causal: bool,
    scale: float,
    want_lse: bool,
) -> Tuple[Tensor, Optional[Tensor]]:
    """torch's dense cuDNN attention of packed sequences of any query and key lengths, the mask
    (bottom-right causal, or only the padding) an additive bias, one call per group of bucketed
    lengths (:func:`masked_groups`: cuDNN plans per shape, and buckets keep the shapes few).

    Args:
        q, k, v: [tokens, heads, qk], [rows, heads, qk], [rows, heads, v], packed.
        q_lens, k_lens: the sequences' lengths (host).
        causal: bottom-right causal, else unmasked.
        scale: the softmax scale.
        want_lse: also return the log-sum-exps.

    Returns:
        Tuple[Tensor, Optional[Tensor]]: [tokens, heads, v] and [tokens, heads] fp32 or None
        (zeros and -inf for a query without keys and past the lengths).
    """
    tokens, heads = q.shape[:2]
    out = q.new_zeros(tokens, heads, v.shape[-1])
    lse = None
    if want_lse:
        lse = torch.full((tokens, heads), -math.inf, dtype=torch.float32, device=q.device)
    for group in masked_groups(q_lens, k_lens, causal, q.device, q.dtype):
        lq, lk, batch = group.query_length, group.key_length, group.batch
        dense = []
        sides = (
            (q, group.queries, lq, group.query_rows),
            (k, group.keys, lk, group.key_rows),
            (v, group.keys, lk, group.key_rows),
        )
        for packed, index, rows, view in sides:
            if view is not None:  # back to back and full: the packed rows are the batch
                dense.append(packed[view].view(batch, rows, heads, -1))
                continue
            x = packed.new_zeros(batch * rows, heads, packed.shape[-1])
            x[index[1]] = packed[index[0]]
            dense.append(x.view(batch, rows, heads, -1))
        bias = group.bias.expand(batch, heads, lq, lk)
        dense_out, dense_lse = _dense_call(*dense, bias, False, scale, want_lse)
        if group.query_rows is not None:
            out[group.query_rows] = dense_out
            if want_lse:
                lse[group.query_rows] = dense_lse.float()
            continue
        out[group.queries[0]] = dense_out[group.queries[1]]
        if want_lse:
            lse[group.queries[0]] = dense_lse[group.queries[1]].float()
    return out, lse


def flash_head_dim(qk: int, v: int) -> int:
    """The one head size the ``flash`` backend runs query/key width ``qk`` and value width ``v``
    at: the larger, rounded up to FlashAttention's multiple of 8 (zero columns change neither the
    logits nor the kept outputs).

    Args:
        qk: the query/key head width (RoPE included).
        v: the value head width.

    Returns:
        int: the padded head size.
    """
    return -(-max(qk, v) // 8) * 8


def _flash_varlen(
    q: Tensor, k: Tensor, v: Tensor, ragged: Ragged, causal: bool, scale: float, want_lse: bool
) -> Tuple[Tensor, Optional[Tensor]]:
    """torch's ragged FlashAttention-2 (causal: bottom-right), its operands zero-padded to one
    head size (:func:`flash_head_dim`) and the padding dropped from the output; the log-sum-exp
    as [tokens, heads] where wanted (its layout checked either way)."""
    v_dim = v.shape[-1]
    width = flash_head_dim(q.shape[-1], v_dim)
    q, k, v = (
        x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        for x in (q, k, v)
    )
    result = internals.flash_attention_forward(q, k, v, *ragged, 0.0, causal, False, scale=scale)
    out, lse = result[0], result[1]
    # [heads, tokens] from FlashAttention 2.6 on; earlier releases (and ROCm's) pad it per
    # sequence.
    if tuple(lse.shape) != (q.shape[1], q.shape[0]):
        raise RuntimeError(
            f"FlashAttention's log-sum-exp has shape {tuple(lse.shape)}, not [heads, tokens] = "
            f"{(q.shape[1], q.shape[0])}"
        )
    if not want_lse:
        return out[..., :v_dim], None
    # A query with no key gets +inf (and zeros): -inf is what the merge takes for "nothing".
    lse = lse.t().float()
    return out[..., :v_dim], lse.masked_fill(lse == math.inf, -math.inf)


# TE's attention modules by shape and scale: built once per process (threads serving one model
# share them; the lock keeps one module per key).
_TE_MODULES: Dict[Tuple, object] = {}
_TE_MODULES_LOCK = threading.Lock()


def _te_module(heads: int, qk: int, v_dim: int, scale: float, device: torch.device) -> object:
    """Transformer Engine's ``DotProductAttention`` for THD, bottom-right causal, one per key."""
    key = (heads, qk, v_dim, scale, device)
    with _TE_MODULES_LOCK:
        module = _TE_MODULES.get(key)
        if module is None:
            from transformer_engine.pytorch import DotProductAttention

            module = DotProductAttention(
                heads,
                (qk, v_dim),
                attention_dropout=0.0,
                qkv_format="thd",
                attn_mask_type="padding_causal_bottom_right",
                softmax_scale=scale,
            )
            _TE_MODULES[key] = module
    return module


def _te_varlen(q: Tensor, k: Tensor, v: Tensor, ragged: Ragged, scale: float) -> Tensor:
    """Transformer Engine's fused attention, THD with cumulative lengths, bottom-right causal."""
    heads, qk, v_dim = q.shape[1], q.shape[2], v.shape[2]
    module = _te_module(heads, qk, v_dim, scale, q.device)
    out = module(
        q,
        k,
        v.contiguous(),
        cu_seqlens_q=ragged.cu_q,
        cu_seqlens_kv=ragged.cu_k,
        max_seqlen_q=ragged.max_q,
        max_seqlen_kv=ragged.max_k,
    )
    return out.view(q.shape[0], heads, v_dim)


def _offsets_layout(backend: str, q_lens: np.ndarray) -> Tuple[int, int]:
    """(sequences, index where the keys' offsets start) in a ragged call's offsets array."""
    requests = max(len(q_lens), 1)
    if backend == "cudnn" and requests > 1 and empty_sequences_supported():
        requests = bucket(requests, minimum=1)
    # The keys' offsets start on 16 bytes as the queries' do: the fused kernels may hand them to
    # cuDNN as ragged offsets, whose descriptors assume it.
    return requests, -(-(requests + 1) // 4) * 4


def ragged_offsets(backend: str, q_lens: np.ndarray, k_lens: np.ndarray) -> np.ndarray:
    """A ragged call's cumulative query and key lengths in one host array (the keys' on 16
    bytes, the whole a multiple of 16 bytes, so that arrays put end to end stay aligned)."""
    requests, k_start = _offsets_layout(backend, q_lens)
    offsets = np.zeros(2 * k_start, dtype=np.int64)
    offsets[: requests + 1] = _cumulative(q_lens, requests)
    offsets[k_start : k_start + requests + 1] = _cumulative(k_lens, requests)
    return offsets


def needs_offsets(backend: str, causal: Optional[str]) -> bool:
    """Whether a call of ``backend`` with mask ``causal`` takes cumulative lengths."""
    return backend not in ("torch", "torch-bottom-right", "cudnn-dense")


def varlen_attention(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tuple[np.ndarray, np.ndarray],
    causal: Optional[str],
    scale: float,
    want_lse: bool,
    cu: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Ragged attention of packed sequences: request ``r``'s queries and keys follow the earlier
    requests' in ``q`` and in ``k``/``v`` (rows past the lengths are ignored).

    Args:
        backend: one of :data:`BACKENDS`.
        q, k, v: [tokens, heads, qk], [rows, heads, qk], [rows, heads, v].
        lengths: host query and key lengths per request.
        causal: None, ``"top_left"`` (``cudnn``, ``torch``; ``cudnn-dense``: square sequences
            only) or ``"bottom_right"`` (``te``, ``flash``, ``cudnn-dense``,
            ``torch-bottom-right``).
        scale: the softmax scale.
        want_lse: also return the natural log-sum-exp of each query's scaled logits (split
            backends only).
        cu: the call's cumulative lengths already on the device (a copy of
            ``ragged_offsets(backend, *lengths)``, made with others in one transfer); None:
            copied here.

    Returns:
        Tuple[Tensor, Optional[Tensor]]: [tokens, heads, v] and [tokens, heads] fp32 (-inf for a
        query that attends to nothing) or None.
    """
    q_lens, k_lens = lengths
    if backend in ("torch", "torch-bottom-right"):
        out, lse = torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
        return out, (lse if want_lse else None)
    if backend == "cudnn-dense":
        if causal is not None and np.array_equal(q_lens, k_lens):
            # Square: the causal flag (no mask to read; cuDNN skips the masked tiles).
            return _cudnn_dense(q, k, v, q_lens, scale, want_lse)
        if causal == "top_left":
            raise ValueError(
                "the cudnn-dense backend masks top-left square sequences only; got query "
                f"lengths {q_lens.tolist()} and key lengths {k_lens.tolist()}"
            )
        return _cudnn_dense_masked(q, k, v, q_lens, k_lens, causal is not None, scale, want_lse)
    if cu is None:
        cu = to_device(ragged_offsets(backend, q_lens, k_lens), q.device)
    requests, k_start = _offsets_layout(backend, q_lens)
    ragged = Ragged(
        cu[: requests + 1],
        cu[k_start : k_start + requests + 1],
        # At least 2: newer cuDNN releases take a single-query ragged call for a decode and
        # refuse it on some GPUs; the maximum only has to bound the lengths.
        bucket(int(q_lens.max(initial=1)), minimum=2),
        bucket(int(k_lens.max(initial=1)), minimum=1),
    )
    if backend == "te":
        return _te_varlen(q, k, v, ragged, scale), None
    if backend == "flash":
        out, lse = _flash_varlen(q, k, v, ragged, causal is not None, scale, want_lse)
    else:
        out, lse = _cudnn_varlen(q, k, v, ragged, causal is not None, scale, want_lse)
    if want_lse:
        # A request with no keys (a fresh one beside a chunked one) attends to nothing.
        empty = np.repeat(k_lens == 0, q_lens)
        if empty.any():
            mask = to_device(np.pad(empty, (0, q.shape[0] - len(empty))), q.device).bool()
            lse = lse.masked_fill(mask[:, None], -math.inf)
            out = out.masked_fill(mask[:, None, None], 0.0)
    return out, lse


def present_backends() -> Tuple[str, ...]:
    """The fused backends whose operators this torch has (and ``te`` where Transformer Engine
    imports); whether one runs on a device is :func:`ragged_check`'s to say.

    Returns:
        Tuple[str, ...]: a subset of ``("flash", "cudnn-dense", "te", "cudnn")``.
    """
    found = []
    if internals.flash_attention_forward is not None:
        found.append("flash")
        if internals.cudnn_dense_attention_forward is not None:
            found.append("cudnn-dense")
    try:
        import transformer_engine.pytorch  # noqa: F401

        found.append("te")
    except Exception:  # noqa: BLE001 (any import failure: not present)
        pass
    if internals.cudnn_attention_forward is not None:
        found.append("cudnn")
    return tuple(found)


def ragged_check(backend: str, device: torch.device) -> Optional[str]:
    """Why torch's ragged ``backend`` entry (one of :data:`CHECKED_BACKENDS`) cannot run on
    ``device``, or None.

    Two small calls in the backend's layout (bf16, query/key head size 192 and value 128 as at
    DeepSeek-V3's widths, nine short sequences: a causal call in the backend's alignment, square
    blocks for ``cudnn``, two cached rows before the new ones for ``flash`` and ``cudnn-dense``
    (square blocks too for ``cudnn-dense``, which takes them another way), and an unmasked one),
    compared with the plain-torch backend. torch releases and GPUs differ in what the
    operators take (some releases refuse ragged queries of 128 rows or fewer on an older cuDNN;
    GPUs before Hopper have no ragged cuDNN attention, before Ampere no FlashAttention), and a
    refusal mid-step, or a result that disagrees (a mask aligned otherwise, another log-sum-exp
    layout), must not reach a user's step. Not graph-safe (it allocates and compares on the
    host): call it outside capture, once per device.

    Args:
        backend: one of :data:`CHECKED_BACKENDS`.
        device: where to run the two calls.

    Returns:
        Optional[str]: None where both calls ran and agreed; otherwise what went wrong.
    """
    names = {
        "cudnn": "torch's ragged cuDNN attention",
        "cudnn-dense": "torch's dense cuDNN attention",
        "flash": "torch's ragged FlashAttention",
    }
    if backend not in CHECKED_BACKENDS:
        raise ValueError(f"backend must be one of {tuple(CHECKED_BACKENDS)}; got {backend!r}")
    name, mask = names[backend], CHECKED_BACKENDS[backend]
    gen = torch.Generator(device=device).manual_seed(0)
    q_lens = np.array([1, 2, 3] * 3, dtype=np.int64)
    tokens = int(q_lens.sum())

    def randn(rows: int, width: int) -> Tensor:
        return torch.randn(rows, 2, width, generator=gen, device=device).to(torch.bfloat16)

    q, scale = randn(tokens, 192), 0.1
    causal_keys = q_lens if mask == "top_left" else q_lens + 2
    calls = [(mask, causal_keys), (None, q_lens + 2)]
    if backend == "cudnn-dense":  # square sequences take the causal flag, not the mask
        calls.append((mask, q_lens))
    for causal, k_lens in calls:
        k, v = randn(int(k_lens.sum()), 192), randn(int(k_lens.sum()), 128)
        try:
            out, lse = varlen_attention(backend, q, k, v, (q_lens, k_lens), causal, scale, True)
        except (RuntimeError, TypeError) as error:  # refused, or another operator signature
            return f"{name} refused a {causal or 'unmasked'} call: {error}"
        want, want_lse = torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
        gap = (out.float() - want.float()).abs().max().item()
        lse_gap = (lse - want_lse).abs().max().item()
        # bf16 outputs of O(1) values: a wrong mask or layout moves them by O(0.1) or more.
        if not (gap <= 2e-2 and lse_gap <= 1e-2):
            return (
                f"{name} disagreed with plain torch on a {causal or 'unmasked'} call (output "
                f"off by {gap:.3g}, log-sum-exp by {lse_gap:.3g})"
            )
    return None
