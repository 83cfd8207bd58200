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
results are merged by their log-sum-exps. Backends (:data:`BACKENDS`):

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
* ``cudnn-dense``: the same top-left plan, its causal (square) calls through torch's dense cuDNN
  attention (:data:`megatron_ext.internals.cudnn_dense_attention_forward`), whose plans torch
  keeps by shape: the sequences of a call batched by length, each padded with zero rows to its
  length's bucket (a query attends only keys at or before its own position, so the padding is
  seen only by padding), the batch to its bucket with empty sequences; sequences of one length
  laid out back to back go in as views. Its unmasked calls (a cached prefix) go to the ``flash``
  backend's entry, where the mask alignment does not matter. Query/key and value head sizes stay
  apart (640 FLOPs per pair). Checked once per device as ``cudnn`` is.
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
    "CHECKED_BACKENDS",
    "FLASH_MAX_HEAD_DIM",
    "ROW_BUDGET",
    "SPLIT_BACKENDS",
    "bucket",
    "check_mha_call",
    "decompressed_keys_values",
    "empty_sequences_supported",
    "flash_head_dim",
    "mla_paged_mha_attention",
    "ragged_check",
    "varlen_attention",
]

# Backends whose causal mask is top-left (a cached prefix is attended in a second call) and those
# with a bottom-right mask (a request's cached and new rows in one call).
SPLIT_BACKENDS = ("cudnn", "cudnn-dense", "torch")
WHOLE_BACKENDS = ("te", "flash", "torch-bottom-right")
# FlashAttention-2's largest head size.
FLASH_MAX_HEAD_DIM = 256
# The fused backends checked once per device before use (:func:`ragged_check`), by their causal
# alignment.
CHECKED_BACKENDS = {"cudnn": "top_left", "cudnn-dense": "top_left", "flash": "bottom_right"}
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
    if backend in ("flash", "cudnn-dense") and flash_head_dim(width, v_dim) > FLASH_MAX_HEAD_DIM:
        raise ValueError(
            f"the {backend} backend runs FlashAttention's head sizes, up to "
            f"{FLASH_MAX_HEAD_DIM}; query/key width "
            f"{width} and value width {v_dim} need {flash_head_dim(width, v_dim)}"
        )
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


def up_projections(
    kv_up_weight: Tensor, heads: int, qk_dim: int, rope_dim: int, key_width: int, value_width: int
) -> Tuple[Tensor, Tensor]:
    """``linear_kv_up_proj``'s weight as two GEMM weights whose outputs are the keys and the
    values in the attention's layout. The keys' GEMM reads whole cache rows (latent and RoPE
    part): per head, W_UK's rows (zero on the RoPE columns), an identity that copies the row's
    RoPE part, then zero rows to ``key_width``. The values' GEMM reads the latent part: per head,
    W_UV's rows, then zero rows to ``value_width``.

    The extra rows and columns cost GEMM work (at DeepSeek-V3's widths 320 output columns per head
    where W_UK and W_UV have 256, 384 at FlashAttention's one head size) but no copy: the keys
    and values come out packed at their final width, where concatenating the RoPE part, packing
    the values and padding them took three copies of every row. The identity is exact: one
    product by 1.0 and sums of zeros (TF32 GEMMs of fp32 inputs round the RoPE part as they
    round the rest).

    Args:
        kv_up_weight: [heads * (qk + v), latent].
        heads: the query heads.
        qk_dim: the non-rotated key width per head.
        rope_dim: the key's rotated width.
        key_width: the keys' width per head (at least ``qk_dim + rope_dim``).
        value_width: the values' width per head (at least ``v``).

    Returns:
        Tuple[Tensor, Tensor]: [heads * key_width, latent + rope] and
        [heads * value_width, latent].
    """
    latent_dim = kv_up_weight.shape[1]
    v_dim = kv_up_weight.shape[0] // heads - qk_dim
    per_head = kv_up_weight.view(heads, qk_dim + v_dim, latent_dim)
    keys = kv_up_weight.new_zeros(heads, key_width, latent_dim + rope_dim)
    keys[:, :qk_dim, :latent_dim] = per_head[:, :qk_dim]
    keys[:, qk_dim : qk_dim + rope_dim, latent_dim:].diagonal(dim1=1, dim2=2).fill_(1)
    values = kv_up_weight.new_zeros(heads, value_width, latent_dim)
    values[:, :v_dim] = per_head[:, qk_dim:]
    return keys.view(-1, latent_dim + rope_dim), values.view(-1, latent_dim)


def decompressed_keys_values(
    kv_cache: Tensor,
    block_table: Tensor,
    rows: Tensor,
    up_weights: Tuple[Tensor, Tensor],
    heads: int,
    qk_dim: int,
    rope_dim: int,
) -> Tuple[Tensor, Tensor]:
    """Keys and values of the given cache rows, decompressed per head.

    Args:
        kv_cache: [blocks, block_size, latent + rope].
        block_table: [requests, max_blocks].
        rows: [3, rows] int32 or int64: each row's request, block-table column and place in its
            block (``position // block_size`` and ``position % block_size``, worked out on the
            host where the positions are).
        up_weights: the keys' and the values' GEMM weights from :func:`up_projections`.
        heads: the query heads.
        qk_dim: the non-rotated key width per head (``qk_head_dim``).
        rope_dim: the rotated columns at the end of each cache row.

    Returns:
        Tuple[Tensor, Tensor]: keys [rows, heads, key width] (``[k_nope | k_pe | zeros]``) and
        values [rows, heads, value width] (``[v | zeros]``), both packed: ragged attention
        kernels address a sequence's rows from the cumulative lengths times the packed row size
        in some releases (a strided view of the decompressed rows would be read at the wrong
        places there).
    """
    blocks = kv_cache.shape[0]
    latent_dim = kv_cache.shape[2] - rope_dim
    # A block id outside the cache (the table's -1 padding) reads block 0: such rows are only
    # bucket padding, which no query attends.
    ids = block_table[rows[0], rows[1]].clamp_(0, blocks - 1)
    cached = kv_cache[ids, rows[2]]  # [rows, latent + rope]
    # The decompression GEMMs. The zero rows' outputs are exact zeros for the finite rows a
    # query attends (a non-finite padding row's can be anything: no query reads it).
    keys = (cached @ up_weights[0].t()).view(cached.shape[0], heads, -1)
    values = (cached[:, :latent_dim] @ up_weights[1].t()).view(cached.shape[0], heads, -1)
    return keys, values


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


def _cudnn_dense(
    q: Tensor, k: Tensor, v: Tensor, lengths: np.ndarray, scale: float, want_lse: bool
) -> Tuple[Tensor, Optional[Tensor]]:
    """torch's dense cuDNN attention of packed square causal sequences (query and key lengths
    equal, so top-left is bottom-right), one call per bucket of lengths.

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
    out = q.new_zeros(tokens, heads, v.shape[-1])
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float32, device=q.device)
    starts = np.cumsum(lengths) - lengths
    buckets = np.array([bucket(int(n)) for n in lengths], dtype=np.int64)
    for length in np.unique(buckets[lengths > 0]).tolist():
        members = np.flatnonzero((buckets == length) & (lengths > 0))
        count, sizes = len(members), lengths[members]
        batch = bucket(count, minimum=1)
        within = _within(sizes)
        src = np.repeat(starts[members], sizes) + within
        first = int(src[0])
        if batch == count and (sizes == length).all() and src[-1] == first + count * length - 1:
            # Back to back and full: views of the packed rows, no copies.
            rows = slice(first, first + count * length)
            qd, kd, vd = (x[rows].view(count, length, heads, -1) for x in (q, k, v))
        else:
            dst = np.repeat(np.arange(count, dtype=np.int64) * length, sizes) + within
            index = _to_device(np.stack([src, dst]), q.device).long()
            rows, padded = index[0], index[1]
            qd, kd, vd = (x.new_zeros(batch * length, heads, x.shape[-1]) for x in (q, k, v))
            for dense, packed in ((qd, q), (kd, k), (vd, v)):
                dense[padded] = packed[rows]
            qd, kd, vd = (x.view(batch, length, heads, -1) for x in (qd, kd, vd))
        result = internals.cudnn_dense_attention_forward(
            qd.transpose(1, 2),
            kd.transpose(1, 2),
            vd.transpose(1, 2),
            None,
            want_lse,
            0.0,
            True,
            False,
            scale=scale,
        )
        dense_out = result[0].transpose(1, 2).reshape(-1, heads, v.shape[-1])
        out[rows] = dense_out if isinstance(rows, slice) else dense_out[padded]
        if want_lse:
            # [batch, heads, length] (or with a trailing 1) as torch returns it.
            dense_lse = result[1].reshape(-1, heads, length).transpose(1, 2).reshape(-1, heads)
            lse[rows] = (dense_lse if isinstance(rows, slice) else dense_lse[padded]).float()
    return out, (lse if want_lse else None)


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


def _ragged_offsets(backend: str, q_lens: np.ndarray, k_lens: np.ndarray) -> np.ndarray:
    """A ragged call's cumulative query and key lengths in one host array (the keys' on 16
    bytes, the whole a multiple of 16 bytes, so that arrays put end to end stay aligned)."""
    requests, k_start = _offsets_layout(backend, q_lens)
    offsets = np.zeros(2 * k_start, dtype=np.int64)
    offsets[: requests + 1] = _cumulative(q_lens, requests)
    offsets[k_start : k_start + requests + 1] = _cumulative(k_lens, requests)
    return offsets


def _needs_offsets(backend: str, causal: Optional[str]) -> bool:
    """Whether a call of ``backend`` with mask ``causal`` takes cumulative lengths."""
    if backend in ("torch", "torch-bottom-right"):
        return False
    return not (backend == "cudnn-dense" and causal is not None)


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
        causal: None, ``"top_left"`` (``cudnn``, ``cudnn-dense``: square sequences only,
            ``torch``) or ``"bottom_right"`` (``te``, ``flash``, ``torch-bottom-right``).
        scale: the softmax scale.
        want_lse: also return the natural log-sum-exp of each query's scaled logits (split
            backends only).
        cu: the call's cumulative lengths already on the device (a copy of
            ``_ragged_offsets(backend, *lengths)``, made with others in one transfer); None:
            copied here.

    Returns:
        Tuple[Tensor, Optional[Tensor]]: [tokens, heads, v] and [tokens, heads] fp32 (-inf for a
        query that attends to nothing) or None.
    """
    q_lens, k_lens = lengths
    if backend in ("torch", "torch-bottom-right"):
        out, lse = _torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
        return out, (lse if want_lse else None)
    if backend == "cudnn-dense":
        if causal is not None:
            if not np.array_equal(q_lens, k_lens):
                raise ValueError(
                    "the cudnn-dense backend masks square sequences only; got query lengths "
                    f"{q_lens.tolist()} and key lengths {k_lens.tolist()}"
                )
            return _cudnn_dense(q, k, v, q_lens, scale, want_lse)
        # Unmasked: no mask to align, so FlashAttention's entry takes it.
        backend = "flash"
    if cu is None:
        cu = _to_device(_ragged_offsets(backend, q_lens, k_lens), q.device)
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
            mask = _to_device(np.pad(empty, (0, q.shape[0] - len(empty))), q.device).bool()
            lse = lse.masked_fill(mask[:, None], -math.inf)
            out = out.masked_fill(mask[:, None, None], 0.0)
    return out, lse


def ragged_check(backend: str, device: torch.device) -> Optional[str]:
    """Why torch's ragged ``backend`` entry (one of :data:`CHECKED_BACKENDS`) cannot run on
    ``device``, or None.

    Two small calls in the backend's layout (bf16, query/key head size 192 and value 128 as at
    DeepSeek-V3's widths, nine short sequences: a causal call in the backend's alignment, square
    blocks for ``cudnn`` and ``cudnn-dense``, two cached rows before the new ones for ``flash``,
    and an unmasked
    one), compared with the plain-torch backend. torch releases and GPUs differ in what the
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
        "cudnn-dense": "torch's dense cuDNN attention (unmasked: its ragged FlashAttention)",
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
    for causal, k_lens in ((mask, causal_keys), (None, q_lens + 2)):
        k, v = randn(int(k_lens.sum()), 192), randn(int(k_lens.sum()), 128)
        try:
            out, lse = varlen_attention(backend, q, k, v, (q_lens, k_lens), causal, scale, True)
        except (RuntimeError, TypeError) as error:  # refused, or another operator signature
            return f"{name} refused a {causal or 'unmasked'} call: {error}"
        want, want_lse = _torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
        gap = (out.float() - want.float()).abs().max().item()
        lse_gap = (lse - want_lse).abs().max().item()
        # bf16 outputs of O(1) values: a wrong mask or layout moves them by O(0.1) or more.
        if not (gap <= 2e-2 and lse_gap <= 1e-2):
            return (
                f"{name} disagreed with plain torch on a {causal or 'unmasked'} call (output "
                f"off by {gap:.3g}, log-sum-exp by {lse_gap:.3g})"
            )
    return None


def _merge(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Softmax-weighted merge of two attentions of the same queries over disjoint keys.

    Args:
        out_a, out_b: [tokens, heads, v] the two partial outputs.
        lse_a, lse_b: [tokens, heads] their log-sum-exps (-inf where a query attended nothing).

    Returns:
        Tuple[Tensor, Tensor]: the merged output in ``out_a``'s dtype and its log-sum-exp.
    """
    top = torch.maximum(lse_a, lse_b)
    # Either side, or both, may be -inf (a query with no keys in a chunk, or none so far).
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w_a, w_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = w_a + w_b
    dtype = out_a.dtype
    merged = out_a * w_a[..., None].to(dtype) + out_b.to(dtype) * w_b[..., None].to(dtype)
    merged = torch.where(total[..., None] > 0, merged / total[..., None].to(dtype), 0.0)
    return merged, top + torch.log(total)


# --------------------------------------------------------------------------------------------------
# Chunks of attended rows
# --------------------------------------------------------------------------------------------------

# Attended rows decompressed at once (before a fused backend's bucket padding). Per row and head
# the keys are qk + rope = 192 and the values v = 128 elements: at 128 heads in bf16 that is
# (192 + 128) * 2 * 128 = 80 KiB per row, so 6144 rows hold 480 MiB of keys and values (the
# decompression GEMM's output, whose value half the values view, adds its 32 KiB per row of
# non-rotated keys: 672 MiB in all; the flash backend's values padded to 192 columns add 288 MiB).
# Unbounded, a 1024-token chunk behind 32768 cached rows would hold 33792 rows, 3.7 GB. 6144 is a
# bucket, so the cuDNN plans stay few.
ROW_BUDGET = 6144


class _Call(NamedTuple):
    """One attention call of a chunk: its mask, where its keys start in the chunk's packed
    rows, and its sequences as (first token, tokens, keys)."""

    causal: Optional[str]
    section: int
    offset: int
    sequences: Tuple[Tuple[int, int, int], ...]


class _Chunk(NamedTuple):
    """A chunk's packed rows per section (requests, positions) and its attention calls."""

    sections: Tuple[Tuple[np.ndarray, np.ndarray], ...]
    calls: Tuple[_Call, ...]


def _rows(parts: Sequence[Tuple[int, int, int]]) -> Tuple[np.ndarray, np.ndarray]:
    """The (request, position) of each row of the (request, start, end) parts, in order."""
    requests = [np.full(end - start, r, dtype=np.int64) for r, start, end in parts]
    positions = [np.arange(start, end, dtype=np.int64) for _, start, end in parts]
    empty = np.zeros(0, dtype=np.int64)
    return np.concatenate(requests or [empty]), np.concatenate(positions or [empty])


def _tokens(call: _Call) -> np.ndarray:
    """The query tokens of an attention call, sequence after sequence."""
    first, q_counts = (np.array(c, dtype=np.int64) for c in list(zip(*call.sequences))[:2])
    return np.repeat(first, q_counts) + _within(q_counts)


def _each_token_once(call_tokens: Sequence[Sequence[np.ndarray]], used: int) -> bool:
    """Whether each of the ``used`` tokens is in exactly one call (per chunk, per call, its
    tokens)."""
    tokens = np.concatenate([t for chunk in call_tokens for t in chunk])
    return len(tokens) == used and bool((np.bincount(tokens, minlength=used) == 1).all())


def _segments(q_lens: np.ndarray, kv_lens: np.ndarray, budget: int) -> list:
    """Every row of the requests with new tokens, request after request, cut into chunks of at
    most ``budget`` rows: per chunk, its (request, first row, end row) segments."""
    chunks, current, room = [], [], budget
    for r in np.flatnonzero(q_lens).tolist():
        start, length = 0, int(kv_lens[r])
        while start < length:
            end = start + min(room, length - start)
            current.append((r, start, end))
            room -= end - start
            start = end
            if room == 0:
                chunks.append(current)
                current, room = [], budget
    if current:
        chunks.append(current)
    return chunks


def _plan(q_lens: np.ndarray, kv_lens: np.ndarray, budget: int, top_left: bool) -> list:
    """The chunks of a step: rows to decompress and attention calls, for a backend whose causal
    mask is aligned top-left (``top_left``) or bottom-right.

    Only a chunk's last segment can end before its request's last row (the others end there, or
    the chunk would have taken more rows), so only it needs the extra calls below, and every
    call's sequences have queries and keys.

    Top-left (cuDNN: only square blocks are masked): sections [prefix parts][new-row parts, the
    last segment's first]; an unmasked call of each prefix part with all of its request's
    queries, a causal call of each new-row part ``a..b`` (own indices) with queries ``a..b``
    (square), and an unmasked call of the last segment's new-row part with queries ``b..q``.

    Bottom-right: one section, the segments in order; a causal call of each segment ``s..e``
    that reaches new rows with the queries whose positions lie in it (the mask's last query
    sits at ``e - 1``, as theirs does), and an unmasked call of the last segment with the queries
    past it.

    Returns:
        list: of :class:`_Chunk`.
    """
    prefix = kv_lens - q_lens
    first_token = np.cumsum(q_lens) - q_lens
    plan = []
    for segments in _segments(q_lens, kv_lens, budget):
        last_r, _, last_end = segments[-1]
        cut = last_end < kv_lens[last_r]  # the last segment stops short of its request's end
        calls = []
        if top_left:
            cached = [(r, s, min(e, prefix[r])) for r, s, e in segments if s < prefix[r]]
            new = [(r, max(s, prefix[r]), e) for r, s, e in segments if e > prefix[r]]
            if cut and new and new[-1][0] == last_r:
                new = new[-1:] + new[:-1]  # first: the below-diagonal call's keys start at 0
            sequences = tuple((first_token[r], q_lens[r], e - s) for r, s, e in cached)
            calls.append(_Call(None, 0, 0, sequences))
            diagonal = tuple((first_token[r] + s - prefix[r], e - s, e - s) for r, s, e in new)
            calls.append(_Call("top_left", 1, 0, diagonal))
            if cut and new and new[0][0] == last_r:
                r, s, e = new[0]
                below = e - prefix[r]
                calls.append(
                    _Call(None, 1, 0, ((first_token[r] + below, q_lens[r] - below, e - s),))
                )
            sections = (_rows(cached), _rows(new))
        else:
            reaching = [(r, s, e) for r, s, e in segments if e > prefix[r]]
            sequences = tuple(
                (first_token[r] + max(s, prefix[r]) - prefix[r], e - max(s, prefix[r]), e - s)
                for r, s, e in reaching
            )
            calls.append(_Call("bottom_right", 0, 0, sequences))
            if cut:
                r, s, e = segments[-1]
                past = max(e - prefix[r], 0)
                offset = sum(end - start for _, start, end in segments[:-1])
                sequences = ((first_token[r] + past, q_lens[r] - past, e - s),)
                calls.append(_Call(None, 0, offset, sequences))
            sections = (_rows(segments),)
        calls = tuple(
            _Call(c.causal, c.section, c.offset, tuple(tuple(map(int, q)) for q in c.sequences))
            for c in calls
            if c.sequences
        )
        plan.append(_Chunk(sections, calls))
    return plan


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

    The attended rows (request after request) are decompressed ``row_budget`` at a time, a
    request's rows split across chunks where they do not fit; each chunk's partial attentions
    are merged by their log-sum-exps into an fp32 (fp64 for fp64 inputs) accumulator. The
    ``te`` backend returns no log-sum-exp to merge: it runs one chunk whatever the budget.

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
    budget = ROW_BUDGET if row_budget is None else row_budget
    check_int("row_budget", budget, 1)
    tokens, heads, width = query.shape
    qk_dim = width - rope_dim
    used = int(q_lens.sum())
    if used == 0:
        return query.new_zeros(tokens, heads, v_dim)
    if backend == "te":
        budget = max(int(kv_lens.sum()), 1)
    # Fused backends plan per shape: each packed section and query set is padded to a bucket
    # (rows no query attends).
    size = bucket if backend in ("cudnn", "te") else int
    plan = _plan(q_lens, kv_lens, budget, backend in SPLIT_BACKENDS)
    call_tokens = [[_tokens(call) for call in chunk.calls] for chunk in plan]
    # Where every token is in one call (the whole step in one chunk, as a bottom-right backend
    # runs it), each call's output is the tokens' answer: written straight into the result, with
    # no accumulator and no merge (the merge with nothing gives the same bits).
    direct = _each_token_once(call_tokens, used)
    if backend == "te" and not direct:
        raise RuntimeError(
            "the te backend's plan put a token in two calls; it has nothing to merge"
        )
    out = query.new_empty(tokens, heads, v_dim) if direct else query.new_zeros(tokens, heads, v_dim)
    if used < tokens:
        out[used:] = 0
    if not direct:
        accumulate = torch.float64 if query.dtype == torch.float64 else torch.float32
        acc_out = torch.zeros(used, heads, v_dim, dtype=accumulate, device=query.device)
        acc_lse = torch.full((used, heads), -math.inf, dtype=torch.float32, device=query.device)
    if backend == "flash":
        key_width = value_width = flash_head_dim(width, v_dim)
    else:
        key_width, value_width = width, v_dim
    up_weights = up_projections(kv_up_weight, heads, qk_dim, rope_dim, key_width, value_width)
    scale = float(softmax_scale)
    block_size = kv_cache.shape[1]
    for chunk, tokens_of_calls in zip(plan, call_tokens):
        starts, index_parts = [], []
        for section_requests, section_positions in chunk.sections:
            rows = len(section_requests)
            padded = np.zeros((3, size(rows) if rows else 0), dtype=np.int64)
            padded[0, :rows] = section_requests
            padded[1, :rows] = section_positions // block_size
            padded[2, :rows] = section_positions % block_size
            starts.append(sum(part.shape[1] for part in index_parts))
            index_parts.append(padded)
        index = np.concatenate(index_parts, axis=1)
        # The rows' index and every call's cumulative lengths in one host-to-device copy.
        lengths = [
            tuple(np.array(c, dtype=np.int64) for c in list(zip(*call.sequences))[1:])
            for call in chunk.calls
        ]
        host = [index.reshape(-1), np.zeros(-index.size % 4, dtype=np.int64)]
        places = []
        for call, (q_counts, k_counts) in zip(chunk.calls, lengths):
            places.append(sum(len(part) for part in host))
            if _needs_offsets(backend, call.causal):
                host.append(_ragged_offsets(backend, q_counts, k_counts))
        device_copy = _to_device(np.concatenate(host), query.device)
        keys, values = decompressed_keys_values(
            kv_cache,
            block_table,
            device_copy[: index.size].view(3, -1),
            up_weights,
            heads,
            qk_dim,
            rope_dim,
        )
        for call, token_ids, (q_counts, k_counts), place in zip(
            chunk.calls, tokens_of_calls, lengths, places
        ):
            n = len(token_ids)
            lo = int(token_ids[0])
            # A run of consecutive tokens (the usual case) is read and written through views:
            # no gathered copies of the queries or of the accumulator.
            if np.array_equal(token_ids, np.arange(lo, lo + n)):
                ids = slice(lo, lo + n)
            else:
                ids = _to_device(token_ids, query.device).long()
            q = query[ids]
            if size(n) != n or not q.is_contiguous():
                q = torch.cat([q, q.new_zeros(size(n) - n, heads, width)])
            begin = starts[call.section] + call.offset
            rows = slice(begin, begin + size(int(k_counts.sum())))
            part, part_lse = varlen_attention(
                backend,
                q,
                keys[rows],
                values[rows],
                (q_counts, k_counts),
                call.causal,
                scale,
                not direct,
                device_copy[place:] if _needs_offsets(backend, call.causal) else None,
            )
            # The flash backend's values carry zero columns past v_dim.
            part = part[:n, :, :v_dim]
            if direct:
                out[ids] = part
                continue
            acc_out[ids], acc_lse[ids] = _merge(acc_out[ids], acc_lse[ids], part, part_lse[:n])
    if not direct:
        out[:used] = acc_out.to(query.dtype)
    return out
