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
  shape, with ``cudnn``'s top-left plan: a chunk's queries over the rows before its own in an
  unmasked call, over its own rows in a square causal one, merged by their log-sum-exps. Square
  causal sequences take the entry's causal flag: batched by length, each padded with zero rows
  to its length's bucket (a query attends only keys at or before its own position, so the
  padding is seen only by padding), the batch to its bucket with empty sequences; sequences of
  one length laid out back to back go in as views. Unmasked ones are batched by bucketed query
  and key lengths, the keys' padding (if any) masked by an additive bias built once per step.
  Query/key and value head sizes stay apart (640 FLOPs per pair). Checked once per device as
  ``cudnn`` is. Its calls live in :mod:`~megatron_ext.fusions.mla_latent.mha_dense`.
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
from megatron_ext.fusions.mla_latent.mha_dense import square_causal_attention, unmasked_attention
from megatron_ext.fusions.mla_latent.mha_rows import bucket, to_device

__all__ = [
    "BACKENDS",
    "CHECKED_BACKENDS",
    "FLASH_MAX_HEAD_DIM",
    "SPLIT_BACKENDS",
    "WHOLE_BACKENDS",
    "Ragged",
    "device_problem",
    "empty_sequences_supported",
    "flash_head_dim",
    "needs_offsets",
    "present_backends",
    "ragged_check",
    "ragged_metadata",
    "ragged_offsets",
    "torch_varlen",
    "varlen_attention",
]

# Backends whose causal mask is top-left (a cached prefix is attended in a second call) and those
# with a bottom-right mask (a request's cached and new rows in one call).
SPLIT_BACKENDS = ("cudnn", "cudnn-dense", "torch")
WHOLE_BACKENDS = ("te", "flash", "torch-bottom-right")
# The largest head size of FlashAttention-2 (and what the dense cuDNN backend is held to).
FLASH_MAX_HEAD_DIM = 256
# The fused backends checked once per device before use (:func:`ragged_check`), by their causal
# alignment.
CHECKED_BACKENDS = {"cudnn": "top_left", "cudnn-dense": "top_left", "flash": "bottom_right"}
BACKENDS = SPLIT_BACKENDS + WHOLE_BACKENDS


def _cumulative(lengths: np.ndarray, entries: int) -> np.ndarray:
    """[0, cumsum(lengths)...] padded to ``entries + 1`` values with zero-length sequences."""
    out = np.zeros(entries + 1, dtype=np.int64)
    out[1 : len(lengths) + 1] = np.cumsum(lengths)
    out[len(lengths) + 1 :] = out[len(lengths)]
    return out


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
    if out.shape[-1] != v_dim:  # v padded here (the MHA form's come padded: no view to take)
        out = out[..., :v_dim]
    if not want_lse:
        return out, None
    # A query with no key gets +inf (and zeros): -inf is what the merge takes for "nothing".
    lse = lse.t().float()
    return out, lse.masked_fill(lse == math.inf, -math.inf)


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


def ragged_metadata(backend: str, q_lens: np.ndarray, k_lens: np.ndarray, cu: Tensor) -> Ragged:
    """A fused call's :class:`Ragged` from its host lengths and its offsets on the device.

    Args:
        backend: a backend that takes offsets (:func:`needs_offsets`).
        q_lens, k_lens: the call's query and key lengths per sequence (host).
        cu: ``ragged_offsets(backend, q_lens, k_lens)`` on the device (or an array that starts
            with it).

    Returns:
        Ragged: views of ``cu`` and the bucketed maxima.
    """
    requests, k_start = _offsets_layout(backend, q_lens)
    return Ragged(
        cu[: requests + 1],
        cu[k_start : k_start + requests + 1],
        # At least 2: newer cuDNN releases take a single-query ragged call for a decode and
        # refuse it on some GPUs; the maximum only has to bound the lengths.
        bucket(int(q_lens.max(initial=1)), minimum=2),
        bucket(int(k_lens.max(initial=1)), minimum=1),
    )


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
    ragged: Optional[Ragged] = None,
    out: Optional[Tensor] = None,
) -> Tuple[Tensor, Optional[Tensor]]:
    """Ragged attention of packed sequences: request ``r``'s queries and keys follow the earlier
    requests' in ``q`` and in ``k``/``v`` (rows past the lengths are ignored).

    Args:
        backend: one of :data:`BACKENDS`.
        q, k, v: [tokens, heads, qk], [rows, heads, qk], [rows, heads, v].
        lengths: host query and key lengths per request.
        causal: None, ``"top_left"`` (``cudnn``, ``torch``; ``cudnn-dense``: square sequences
            only) or ``"bottom_right"`` (``te``, ``flash``, ``torch-bottom-right``).
        scale: the softmax scale.
        want_lse: also return the natural log-sum-exp of each query's scaled logits (split
            backends only).
        cu: the call's cumulative lengths already on the device (a copy of
            ``ragged_offsets(backend, *lengths)``, made with others in one transfer); None:
            copied here.
        ragged: the call's :func:`ragged_metadata` already built (a step's plan keeps it for
            every layer); None: built here from ``cu``.
        out: [tokens, heads, v] to write the result into, apart from q, k and v: the
            ``cudnn-dense`` backend's square causal calls do (and return it: one copy fewer
            than the caller copying the result); the others leave it and return their own.

    Returns:
        Tuple[Tensor, Optional[Tensor]]: [tokens, heads, v] and [tokens, heads] fp32 (-inf for a
        query that attends to nothing) or None.
    """
    q_lens, k_lens = lengths
    if backend in ("torch", "torch-bottom-right"):
        out, lse = torch_varlen(q, k, v, q_lens, k_lens, causal, scale)
        return out, (lse if want_lse else None)
    if backend == "cudnn-dense":
        if causal is None:
            return unmasked_attention(q, k, v, q_lens, k_lens, scale, want_lse)
        if causal == "top_left" and np.array_equal(q_lens, k_lens):
            # Square: the causal flag (no mask to read; cuDNN skips the masked tiles).
            return square_causal_attention(q, k, v, q_lens, scale, want_lse, out)
        raise ValueError(
            "the cudnn-dense backend masks top-left square sequences only; got a "
            f"{causal} call of query lengths {q_lens.tolist()} and key lengths "
            f"{k_lens.tolist()}"
        )
    if ragged is None:
        if cu is None:
            cu = to_device(ragged_offsets(backend, q_lens, k_lens), q.device)
        ragged = ragged_metadata(backend, q_lens, k_lens, cu)
    if backend == "te":
        return _te_varlen(q, k, v, ragged, scale), None
    if backend == "flash":
        out, lse = _flash_varlen(q, k, v, ragged, causal is not None, scale, want_lse)
    else:
        out, lse = _cudnn_varlen(q, k, v, ragged, causal is not None, scale, want_lse)
    # A request with no keys (a fresh one beside a chunked one) attends to nothing (never one
    # of a step's plan: every planned sequence has keys).
    if want_lse and not k_lens.all():
        empty = np.repeat(k_lens == 0, q_lens)
        if empty.any():
            mask = to_device(np.pad(empty, (0, q.shape[0] - len(empty))), q.device).bool()
            lse = lse.masked_fill(mask[:, None], -math.inf)
            out = out.masked_fill(mask[:, None, None], 0.0)
    return out, lse


# The entries of megatron_ext.internals each of torch's fused backends calls.
_TORCH_ENTRIES = {
    "cudnn": "cudnn_attention_forward",
    "cudnn-dense": "cudnn_dense_attention_forward",
    "flash": "flash_attention_forward",
}


def device_problem(backend: str, device: torch.device) -> Optional[str]:
    """Why ``backend``'s operator cannot take tensors on ``device``, told without running it, or
    None: torch's cuDNN and FlashAttention operators have no kernels but CUDA's, and a torch
    without the operator has none at all. (A function put in an operator's place, as the CPU
    tests do, is taken at its word.)

    Args:
        backend: one of :data:`BACKENDS`.
        device: the query's device.

    Returns:
        Optional[str]: what is wrong, or None.
    """
    name = _TORCH_ENTRIES.get(backend)
    if name is None:
        return None
    entry = getattr(internals, name)
    if entry is None:
        return f"this torch has no operator for the {backend} backend (internals.{name})"
    if device.type != "cuda" and internals.is_torch_operator(entry):
        return (
            f"the {backend} backend runs torch's CUDA-only operator; the query is on {device} "
            "(the torch backend runs anywhere)"
        )
    return None


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

    Small calls in the backend's layout (bf16, query/key head size 192 and value 128 as at
    DeepSeek-V3's widths, nine short sequences: a causal call in the backend's alignment, square
    blocks for ``cudnn`` and ``cudnn-dense``, two cached rows before the new ones for ``flash``, and
    an unmasked one; for ``cudnn-dense`` a second unmasked one whose keys fill their bucket, which
    it runs without a bias), compared with the plain-torch backend. torch releases and GPUs differ
    in what the operators take (some releases refuse ragged queries of 128 rows or fewer on an older
    cuDNN; GPUs before Hopper have no ragged cuDNN attention, before Ampere no FlashAttention), and
    a refusal mid-step, or a result that disagrees (a mask aligned otherwise, another log-sum-exp
    layout), must not reach a user's step. Not graph-safe (it allocates and compares on the host):
    call it outside capture, once per device.

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
    if backend == "cudnn-dense":  # keys that fill their bucket: no padding bias
        calls.append((None, np.full_like(q_lens, 16)))
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
