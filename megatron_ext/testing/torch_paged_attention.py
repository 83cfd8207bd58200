# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Paged-KV attention for dynamic inference in plain torch, for machines without flash-attn.

megatron-core's dynamic-batching attention (``Attention.flash_decode_and_prefill``) calls
flash-attn's ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` on the paged KV cache of the
dynamic inference context. :func:`paged_attention` computes the same causal attention with torch
operations only: every query token gathers its request's KV blocks through the block table and
attends to the positions it may see. Shapes depend only on the tensor shapes passed in (never on
their values), nothing reads back to the host, so the function can run inside a captured CUDA
graph. It is a reference implementation: correct and deterministic, not fast.

:class:`TorchPagedSelfAttention` is megatron-core's ``SelfAttention`` with
``flash_decode_and_prefill`` replaced by :func:`paged_attention`; put it in a layer spec in place
of ``SelfAttention`` and enter :func:`allow_dynamic_inference_without_flash_attn` while the
engine runs (megatron-core asserts that flash-attn is installed whenever it sees a dynamic
inference context).
"""

import contextlib
from typing import Any, Iterator, Optional
from unittest import mock

import torch
from megatron.core.transformer import attention
from megatron.core.transformer.attention import SelfAttention
from torch import Tensor


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cu_seqlens_q: Tensor,
    seqlens_k: Tensor,
    block_table: Tensor,
    softmax_scale: Optional[float] = None,
    token_chunk: int = 256,
) -> Tensor:
    """Causal attention of packed query tokens over a paged KV cache.

    Request ``r`` owns query tokens ``[cu_seqlens_q[r], cu_seqlens_q[r + 1])``, which are the last
    ``query length`` tokens of its ``seqlens_k[r]`` cached positions; its position ``j`` is slot
    ``j % block_size`` of block ``block_table[r, j // block_size]``. Tokens past
    ``cu_seqlens_q[-1]`` (padding) get zeros.

    Args:
        q (Tensor): ``[T, Hq, D]`` queries.
        k_cache (Tensor): ``[num_blocks, block_size, Hkv, D]`` keys; ``Hq`` a multiple of ``Hkv``.
        v_cache (Tensor): values, same shape as ``k_cache``.
        cu_seqlens_q (Tensor): ``[B + 1]`` cumulative query lengths (padding repeats the total).
        seqlens_k (Tensor): ``[B]`` cached lengths including this step's tokens (0 for padding).
        block_table (Tensor): ``[B, max_blocks]`` block ids (-1 where unused).
        softmax_scale (Optional[float]): default ``D ** -0.5``.
        token_chunk (int): query tokens processed at once (bounds the gathered KV memory).

    Returns:
        Tensor: ``[T, Hq, D]`` in the dtype of ``q``.

    Raises:
        ValueError: on inconsistent shapes.
    """
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"expected q [T, H, D] and caches [N, block, Hkv, D], got {tuple(q.shape)}, "
            f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_heads % num_kv_heads or k_cache.shape[-1] != head_dim:
        raise ValueError(f"query heads {num_heads} / kv heads {num_kv_heads} / dims mismatch")
    batch = seqlens_k.shape[0]
    if cu_seqlens_q.shape[0] != batch + 1 or block_table.shape[0] < batch:
        raise ValueError("cu_seqlens_q, seqlens_k and block_table disagree on the batch size")
    if token_chunk < 1:
        raise ValueError("token_chunk must be positive")
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = num_heads // num_kv_heads
    max_positions = block_table.shape[1] * block_size
    device = q.device

    cu_q = cu_seqlens_q.to(torch.int64)
    kv_lengths = seqlens_k.to(torch.int64)
    positions = torch.arange(max_positions, device=device)
    out = torch.empty_like(q)
    for start in range(0, num_tokens, token_chunk):
        stop = min(start + token_chunk, num_tokens)
        tokens = torch.arange(start, stop, device=device)
        # Request of each token: the number of request ends at or before it.
        request = torch.searchsorted(cu_q[1:], tokens, right=True)
        real = request < batch
        request = request.clamp(max=batch - 1)
        query_length = cu_q[request + 1] - cu_q[request]
        kv_length = kv_lengths[request]
        # Sequence position of each query token: its offset among the last query_length slots.
        position = kv_length - query_length + (tokens - cu_q[request])
        cached = positions.unsqueeze(0) < kv_length.unsqueeze(1)
        visible = (positions.unsqueeze(0) <= position.unsqueeze(1)) & cached & real.unsqueeze(1)
        # Padding rows see nothing; let them see slot 0 so the softmax stays finite, then zero.
        visible[:, 0] |= ~visible.any(dim=1)

        blocks = block_table[request].to(torch.int64).clamp(min=0)  # [t, max_blocks]
        keys = k_cache[blocks].flatten(1, 2)  # [t, positions, Hkv, D]
        # Slots past a request's cached length were never written and may hold any bits,
        # NaN and inf included; a zero attention weight would not cancel those (0 * inf = NaN).
        values = v_cache[blocks].flatten(1, 2).masked_fill(~cached[:, :, None, None], 0.0)
        chunk_q = q[start:stop].reshape(-1, num_kv_heads, group, head_dim).float()
        scores = torch.einsum("tkgd,tpkd->tkgp", chunk_q, keys.float()) * scale
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        chunk_out = torch.einsum("tkgp,tpkd->tkgd", probs, values.float())
        chunk_out = chunk_out.reshape(-1, num_heads, head_dim)
        out[start:stop] = torch.where(real[:, None, None], chunk_out, 0.0).to(q.dtype)
    return out


class TorchPagedSelfAttention(SelfAttention):
    """megatron-core's ``SelfAttention`` with dynamic-batching attention in plain torch.

    Only ``flash_decode_and_prefill`` changes: it calls :func:`paged_attention` (decode and
    prefill alike) instead of flash-attn. Multi-latent attention and attention sinks are not
    supported.
    """

    def flash_decode_and_prefill(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        max_seqlen_q: Any,
        max_seqlen_k: Any,
        cu_seqlens_q: Tensor,
        cu_seqlens_k: Tensor,
        seqlens_k: Tensor,
        block_table: Tensor,
        is_decode_only: bool,
        softmax_offset: Optional[Tensor] = None,
    ) -> Tensor:
        """Attention of the step's packed tokens over the paged KV cache.

        Args:
            q (Tensor): ``[T, 1, H, D]`` queries.
            k (Tensor): ``[num_blocks, block_size, Hkv, D]`` key cache of this layer.
            v (Tensor): value cache of this layer.
            max_seqlen_q: unused (shapes come from the tensors).
            max_seqlen_k: unused.
            cu_seqlens_q (Tensor): cumulative query lengths.
            cu_seqlens_k (Tensor): unused (``seqlens_k`` carries the same information).
            seqlens_k (Tensor): cached lengths including this step's tokens.
            block_table (Tensor): KV block ids per request.
            is_decode_only (bool): unused (one code path).
            softmax_offset (Optional[Tensor]): attention sinks; must be None.

        Returns:
            Tensor: ``[T, 1, H, D]``.

        Raises:
            NotImplementedError: for attention sinks.
        """
        del max_seqlen_q, max_seqlen_k, cu_seqlens_k, is_decode_only
        if softmax_offset is not None:
            raise NotImplementedError("TorchPagedSelfAttention does not support attention sinks")
        scale = getattr(self, "softmax_scale", None)
        out = paged_attention(
            q.reshape(q.shape[0], q.shape[-2], q.shape[-1]),
            k,
            v,
            cu_seqlens_q,
            seqlens_k,
            block_table,
            softmax_scale=scale,
        )
        return out.unsqueeze(1)


@contextlib.contextmanager
def allow_dynamic_inference_without_flash_attn() -> Iterator[None]:
    """Let megatron-core's attention accept a dynamic inference context without flash-attn.

    ``Attention.forward`` asserts a flash-attn version whenever the inference context batches
    dynamically, even when ``flash_decode_and_prefill`` is overridden. Inside this block the
    version check reports success; use it only with :class:`TorchPagedSelfAttention`. Where
    einops is not installed (it is an optional dependency of megatron-core), the one
    ``rearrange`` that path calls is given a torch stand-in.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(attention, "is_fa_min_version", lambda *a, **k: True))
        if getattr(attention, "rearrange", None) is None:
            stack.enter_context(mock.patch.object(attention, "rearrange", _merge_heads))
        yield


def _merge_heads(tensor: torch.Tensor, pattern: str) -> torch.Tensor:
    """``einops.rearrange(tensor, 's b h d -> s b (h d)')``, the only pattern supported."""
    if pattern.replace(" ", "") != "sbhd->sb(hd)":
        raise ValueError(
            f"only 's b h d -> s b (h d)' is supported without einops, got {pattern!r}"
        )
    return tensor.flatten(2)


__all__ = [
    "TorchPagedSelfAttention",
    "allow_dynamic_inference_without_flash_attn",
    "paged_attention",
]
