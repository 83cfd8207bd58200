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
requests. Backends (:data:`BACKENDS`):

* ``cudnn``: torch's ragged cuDNN attention (:data:`megatron_ext.internals.cudnn_attention_forward`)
  whose causal mask is aligned top-left: a request's new tokens attend their own rows with the
  causal mask (square, so top-left is bottom-right) and its cached prefix in a second, unmasked
  call; the two are merged by their log-sum-exps. Sizes are rounded up to buckets
  (:func:`bucket`) because cuDNN builds one execution plan per shape.
* ``te``: Transformer Engine's fused attention, packed (THD) with cumulative lengths and its
  bottom-right causal mask, one call over each request's whole context.
* ``torch`` and ``torch-bottom-right``: plain torch, one request at a time, with the same
  semantics as ``cudnn`` and ``te`` respectively; any device and dtype (fp64 included). The
  reference and the tests' stand-ins for the two fused backends.
"""

import math
from typing import Dict, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor

from megatron_ext import internals
from megatron_ext.fusions.mla_latent.checks import (
    check_block_table,
    check_cache_for_query,
    check_pow2,
    check_softmax_scale,
)
from megatron_ext.fusions.tensor_checks import FLOAT_DTYPES, check_device, check_int, check_tensor

__all__ = [
    "BACKENDS",
    "SPLIT_BACKENDS",
    "bucket",
    "check_mha_call",
    "decompressed_keys_values",
    "mla_paged_mha_attention",
    "varlen_attention",
]

# Backends whose causal mask is top-left (a cached prefix is attended in a second call) and those
# with a bottom-right mask (one call over each request's whole context).
SPLIT_BACKENDS = ("cudnn", "torch")
WHOLE_BACKENDS = ("te", "torch-bottom-right")
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


def _lengths(name: str, values: Sequence[int]) -> np.ndarray:
    try:
        array = np.asarray(values)
    except (TypeError, ValueError):
        array = np.asarray([], dtype=object)
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a sequence of ints on the host; got {values!r}")
    if (array < 0).any():
        raise ValueError(f"{name} must be >= 0; got {array.tolist()}")
    return array.astype(np.int64)


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
        Tuple[np.ndarray, np.ndarray, int, int]: the query and KV lengths as int64 arrays, the
        latent width and the value head size.
    """
    check_tensor("query", query, FLOAT_DTYPES + (torch.float64,))
    device = query.device
    if query.dim() != 3:
        raise ValueError(
            "query must be [tokens, heads, qk_head_dim + rope_dim] (squeeze megatron-core's batch "
            f"dimension of 1); got shape {tuple(query.shape)}"
        )
    tokens, heads, width = query.shape
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
    check_softmax_scale(softmax_scale)
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
    q_lens = _lengths("query_lengths", query_lengths)
    kv_lens = _lengths("kv_lengths", kv_lengths)
    if len(q_lens) != len(kv_lens) or len(q_lens) > requests:
        raise ValueError(
            f"query_lengths ({len(q_lens)}) and kv_lengths ({len(kv_lens)}) must name the same "
            f"requests, at most the block table's {requests}"
        )
    if (q_lens > kv_lens).any():
        raise ValueError(
            "each request's kv length must count its new tokens too; got query lengths "
            f"{q_lens.tolist()}, kv lengths {kv_lens.tolist()}"
        )
    if int(q_lens.sum()) > tokens:
        raise ValueError(f"query_lengths sum to {int(q_lens.sum())}, over the {tokens} tokens")
    capacity = block_table.shape[1] * kv_cache.shape[1]
    if (kv_lens > capacity).any():
        raise ValueError(
            f"kv_lengths {kv_lens.tolist()} exceed the block table's capacity of {capacity} rows"
        )
    return q_lens, kv_lens, latent_dim, v_dim


def _within(lengths: np.ndarray) -> np.ndarray:
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


def _to_device(array: np.ndarray, device: torch.device) -> Tensor:
    """One int32 host-to-device copy (pinned and asynchronous on CUDA: no host synchronisation)."""
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int32))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def decompressed_keys_values(
    kv_cache: Tensor,
    block_table: Tensor,
    requests: Tensor,
    positions: Tensor,
    kv_up_weight: Tensor,
    heads: int,
    qk_dim: int,
    rope_dim: int,
) -> Tuple[Tensor, Tensor]:
    """Keys and values of the given cache rows, decompressed per head.

    Args:
        kv_cache: [blocks, block_size, latent + rope].
        block_table: [requests, max_blocks].
        requests, positions: [rows] the request and position of each row to read.
        kv_up_weight: [heads * (qk + v), latent], ``linear_kv_up_proj``'s weight.
        heads: the query heads.
        qk_dim: the non-rotated key width per head (``qk_head_dim``).
        rope_dim: the rotated columns at the end of each cache row.

    Returns:
        Tuple[Tensor, Tensor]: keys [rows, heads, qk + rope] (``[k_nope | k_pe]``) and values
        [rows, heads, v] (a view).
    """
    blocks, block_size, width = kv_cache.shape
    latent_dim = width - rope_dim
    positions = positions.long()
    # A block id outside the cache (the table's -1 padding) reads block 0: such rows are only
    # bucket padding, which no query attends.
    ids = block_table[requests.long(), positions // block_size].long().clamp_(0, blocks - 1)
    rows = kv_cache[ids, positions % block_size]  # [rows, latent + rope]
    kv = rows[:, :latent_dim] @ kv_up_weight.t()  # the decompression GEMM
    kv = kv.view(rows.shape[0], heads, kv_up_weight.shape[0] // heads)
    k_pe = rows[:, None, latent_dim:].expand(-1, heads, rope_dim)
    return torch.cat([kv[..., :qk_dim], k_pe], dim=-1), kv[..., qk_dim:]


# --------------------------------------------------------------------------------------------------
# Ragged attention backends: (out [T, H, v], log-sum-exp [T, H] fp32 or None)
# --------------------------------------------------------------------------------------------------


def _torch_varlen(
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


_TE_MODULES: Dict[Tuple, object] = {}


def _te_varlen(q: Tensor, k: Tensor, v: Tensor, ragged: Ragged, scale: float) -> Tensor:
    """Transformer Engine's fused attention, THD with cumulative lengths, bottom-right causal."""
    heads, qk, v_dim = q.shape[1], q.shape[2], v.shape[2]
    key = (heads, qk, v_dim, scale, q.device)
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


def varlen_attention(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tuple[np.ndarray, np.ndarray],
    causal: Optional[str],
    scale: float,
    want_lse: bool,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Ragged attention of packed sequences: request ``r``'s queries and keys follow the earlier
    requests' in ``q`` and in ``k``/``v`` (rows past the lengths are ignored).

    Args:
        backend: one of :data:`BACKENDS`.
        q, k, v: [tokens, heads, qk], [rows, heads, qk], [rows, heads, v].
        lengths: host query and key lengths per request.
        causal: None, ``"top_left"`` (``cudnn``, ``torch``) or ``"bottom_right"`` (``te``,
            ``torch-bottom-right``).
        scale: the softmax scale.
        want_lse: also return the natural log-sum-exp of each query's scaled logits (split
            backends only).

    Returns:
        Tuple[Tensor, Optional[Tensor]]: [tokens, heads, v] and [tokens, heads] fp32 (-inf for a
        query that attends to nothing) or None.
    """
    q_lens, k_lens = lengths
    if backend in ("torch", "torch-bottom-right"):
        out, lse = _torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
        return out, (lse if want_lse else None)
    requests = bucket(len(q_lens), minimum=1) if len(q_lens) > 1 else 1
    cu = _to_device(
        np.concatenate([_cumulative(q_lens, requests), _cumulative(k_lens, requests)]), q.device
    )
    ragged = Ragged(
        cu[: requests + 1],
        cu[requests + 1 :],
        bucket(int(q_lens.max(initial=1)), minimum=1),
        bucket(int(k_lens.max(initial=1)), minimum=1),
    )
    if backend == "te":
        return _te_varlen(q, k, v, ragged, scale), None
    out, lse = _cudnn_varlen(q, k, v, ragged, causal is not None, scale, want_lse)
    if want_lse:
        # A request with no keys (a fresh one beside a chunked one) attends to nothing.
        empty = np.repeat(k_lens == 0, q_lens)
        if empty.any():
            mask = _to_device(np.pad(empty, (0, q.shape[0] - len(empty))), q.device).bool()
            lse = lse.masked_fill(mask[:, None], -math.inf)
            out = out.masked_fill(mask[:, None, None], 0.0)
    return out, lse


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tensor:
    """Softmax-weighted merge of two attentions of the same queries over disjoint keys."""
    top = torch.maximum(lse_a, lse_b)
    # lse_b is finite for every query (each attends at least to its own row); lse_a may be -inf.
    w_a = torch.exp(lse_a - top)[..., None]
    w_b = torch.exp(lse_b - top)[..., None]
    merged = (out_a.float() * w_a + out_b.float() * w_b) / (w_a + w_b)
    return merged.to(out_b.dtype)


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
) -> Tensor:
    """MLA attention of a step's new tokens over their requests' paged latent rows, in the MHA
    form (decompressed keys and values, dense ragged attention).

    Request ``r`` has the new tokens ``sum(query_lengths[:r])`` to ``sum(query_lengths[:r + 1])``
    of ``query`` and ``kv_lengths[r]`` cached rows including them (appended already); its row
    ``n`` is ``kv_cache[block_table[r, n // block_size], n % block_size]``. New token ``i`` sits at
    position ``kv_lengths[r] - query_lengths[r] + i`` and attends to rows ``0..position``
    (causal, aligned bottom-right), with key ``[row[:latent] @ W_UK^T | row[latent:]]`` and value
    ``row[:latent] @ W_UV^T`` per head. Tokens past the last request get zeros. The lengths are
    host integers (they size the packed tensors); a block id outside the cache reads block 0.

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

    Returns:
        Tensor: [tokens, heads, v_head_dim] in query's dtype.

    Raises:
        TypeError, ValueError: for arguments of other types, dtypes, shapes or devices, or
            lengths that do not fit, before any launch.
    """
    q_lens, kv_lens, _, v_dim = check_mha_call(
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
    tokens, heads, width = query.shape
    qk_dim = width - rope_dim
    used = int(q_lens.sum())
    out = torch.zeros(tokens, heads, v_dim, dtype=query.dtype, device=query.device)
    if used == 0:
        return out
    prefix = kv_lens - q_lens
    requests = np.arange(len(q_lens), dtype=np.int64)
    # Fused backends plan per shape: each packed section is padded to a bucket (rows no query
    # attends).
    size = bucket if backend in ("cudnn", "te") else int
    if backend in SPLIT_BACKENDS:
        # Every request's cached prefix rows, then every request's new rows (one per new token).
        sections = [
            (np.repeat(requests, prefix), _within(prefix)),
            (np.repeat(requests, q_lens), np.repeat(prefix, q_lens) + _within(q_lens)),
        ]
    else:
        sections = [(np.repeat(requests, kv_lens), _within(kv_lens))]
    starts, index_parts = [], []
    for section_requests, section_positions in sections:
        padded = np.zeros((2, size(len(section_requests))), dtype=np.int64)
        padded[0, : len(section_requests)] = section_requests
        padded[1, : len(section_requests)] = section_positions
        starts.append(sum(part.shape[1] for part in index_parts))
        index_parts.append(padded)
    index = _to_device(np.concatenate(index_parts, axis=1), query.device)
    keys, values = decompressed_keys_values(
        kv_cache, block_table, index[0], index[1], kv_up_weight, heads, qk_dim, rope_dim
    )
    q = query[:used]
    padded_tokens = size(used)
    if padded_tokens != used or not q.is_contiguous():
        q = torch.cat([q, q.new_zeros(padded_tokens - used, heads, width)])
    scale = float(softmax_scale)
    if backend in WHOLE_BACKENDS:
        result, _ = varlen_attention(
            backend, q, keys, values, (q_lens, kv_lens), "bottom_right", scale, False
        )
    else:
        own = slice(starts[1], None)
        has_prefix = bool(prefix.any())
        result, own_lse = varlen_attention(
            backend, q, keys[own], values[own], (q_lens, q_lens), "top_left", scale, has_prefix
        )
        if has_prefix:
            cached = slice(0, starts[1])
            prefix_out, prefix_lse = varlen_attention(
                backend, q, keys[cached], values[cached], (q_lens, prefix), None, scale, True
            )
            result = _merge(prefix_out, prefix_lse, result, own_lse)
    out[:used] = result[:used]
    return out
