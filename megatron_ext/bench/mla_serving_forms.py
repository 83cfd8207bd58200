# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A prefill or mixed step of the MLA serving benchmark in the MHA form, beside the absorbed
form it is timed against: operands that make both forms compute the same attention, the split
the dynamic path's cost model picks, the call the engine makes for it, and the FLOPs each form
does.

Both forms start from the same query: per head ``[q_nope | rope(q_pe)]`` (``qk + rope`` wide) for
the MHA form, and ``[q_nope @ W_UK | rope(q_pe)]`` (``latent + rope``) for the absorbed one. The
absorbed rows the benchmark times are the attention kernel alone (W_UK into the query and W_UV
after are left out, for ours and FlashInfer's alike); the MHA form's time includes its
decompression GEMM. That accounting favours the absorbed form, so an MHA-form row that wins here
wins in the engine too.
"""

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from megatron_ext.bench import mla_serving_cases as cases
from megatron_ext.fusions.mla_latent import mla_paged_latent_attention
from megatron_ext.fusions.mla_latent.mha_form import mla_paged_mha_attention
from megatron_ext.fusions.side_stream import side_by_side
from megatron_ext.transformer import mla_prefill
from megatron_ext.transformer.mla_prefill import absorbed_request_count, step_split

# DeepSeek-V3's per-head query/key (without RoPE) and value widths.
QK_HEAD = 128
V_HEAD = 128

__all__ = [
    "QK_HEAD",
    "V_HEAD",
    "MhaStep",
    "absorbed_flops",
    "mha_flops",
    "mha_step",
    "run_split",
]


@dataclass
class MhaStep:
    """A :class:`~megatron_ext.bench.mla_serving_cases.PagedStep` in the MHA form."""

    query: torch.Tensor  # [tokens, heads, qk + rope]: [q_nope | rope(q_pe)]
    weight: torch.Tensor  # [heads * (qk + v), latent]: linear_kv_up_proj's weight
    query_lengths: np.ndarray  # new tokens per request (host)
    kv_lengths: np.ndarray  # rows per request, the new ones included (host)
    split: int  # the cost model's leading absorbed requests (all of them: absorbed form)
    split_tokens: int  # the tokens of those requests

    @property
    def requests(self) -> int:
        return len(self.query_lengths)

    def value_projection(self, latent_out: torch.Tensor) -> torch.Tensor:
        """The absorbed form's output ``[tokens, heads, latent]`` through W_UV, in float32:
        what the MHA form returns for the same tokens."""
        heads = latent_out.shape[1]
        w_uv = self.weight.view(heads, -1, latent_out.shape[-1])[:, QK_HEAD:]
        return torch.einsum("thc,hvc->thv", latent_out.float(), w_uv.float())


def mha_step(
    step: cases.PagedStep, heads: int, seed: int = 0, backend: Optional[str] = None
) -> MhaStep:
    """MHA-form operands for ``step``; rewrites ``step.query``'s latent part as ``q_nope``
    absorbed through W_UK (in float32, then rounded), so that both forms attend the same way.

    Args:
        step: the step (its query's RoPE part is kept).
        heads: query heads.
        seed: the random operands' seed.
        backend: the rule's backend for the device (the split follows the dynamic path's
            per-step rule); None: FlashAttention's rates.

    Returns:
        MhaStep: the operands, with the cost model's split.
    """
    device, dtype = step.query.device, step.query.dtype
    gen = torch.Generator(device=device).manual_seed(seed + 2)
    tokens, latent = step.query.shape[0], step.latent
    q_nope = torch.randn(tokens, heads, QK_HEAD, generator=gen, device=device, dtype=dtype)
    weight = torch.randn(
        heads * (QK_HEAD + V_HEAD), latent, generator=gen, device=device, dtype=torch.float32
    )
    weight = (weight / math.sqrt(latent)).to(dtype)
    w_uk = weight.view(heads, QK_HEAD + V_HEAD, latent)[:, :QK_HEAD]
    absorbed = torch.einsum("thd,hdc->thc", q_nope.float(), w_uk.float())
    step.query[..., :latent] = absorbed.to(dtype)
    query = torch.cat([q_nope, step.query[..., latent:]], -1)
    q_lens = np.array([new for _, new in step.requests], dtype=np.int64)
    kv_lens = np.array([cached + new for cached, new in step.requests], dtype=np.int64)
    widths = (latent, step.rope, QK_HEAD, V_HEAD)
    if backend is None:
        split = absorbed_request_count(q_lens, kv_lens, heads, widths)
    else:
        split = step_split(q_lens, kv_lens, heads, widths, backend)
    return MhaStep(query, weight, q_lens, kv_lens, split, int(q_lens[:split].sum()))


def run_split(
    step: cases.PagedStep,
    mha: MhaStep,
    backend: str,
    split: int,
    kv_cache: torch.Tensor,
    query_absorbed: torch.Tensor,
    query_mha: torch.Tensor,
    out_absorbed: torch.Tensor,
    overlap: bool = True,
) -> Optional[torch.Tensor]:
    """The step as the dynamic path runs it with ``split`` leading requests absorbed: those
    through megatron_ext's latent attention into ``out_absorbed``'s first rows (on a side
    stream, as the dynamic path runs them, unless ``overlap`` is False), the rest in the MHA
    form (decompression included) with ``backend``.

    Args:
        step: the step (block table, device lengths).
        mha: its MHA-form operands.
        backend: the MHA form's backend.
        split: leading requests in the absorbed form (``0..requests``).
        kv_cache, query_absorbed, query_mha, out_absorbed: one input set (the step's or copies).
        overlap: the absorbed part on a side stream beside the MHA part, and the MHA part's
            calls side by side where the dynamic path runs them so
            (:data:`~megatron_ext.transformer.mla_prefill.OVERLAP_CALLS`); False: everything in
            order.

    Returns:
        Optional[torch.Tensor]: the MHA part's output ``[tokens after split, heads, v]``, or
        None when every request is absorbed.
    """
    head_tokens = int(mha.query_lengths[:split].sum())

    def leading() -> None:
        mla_paged_latent_attention(
            query_absorbed[:head_tokens],
            kv_cache,
            step.block_table[:split],
            step.cu_query_lengths[: split + 1],
            step.kv_lengths[:split],
            cases.SOFTMAX_SCALE,
            rope_dim=step.rope,
            max_query_len=int(mha.query_lengths[:split].max()),
            out=out_absorbed[:head_tokens],
        )

    if split == mha.requests:
        leading()
        return None

    def rest() -> torch.Tensor:
        return mla_paged_mha_attention(
            query_mha[head_tokens:],
            kv_cache,
            step.block_table[split:],
            mha.weight,
            cases.SOFTMAX_SCALE,
            query_lengths=mha.query_lengths[split:],
            kv_lengths=mha.kv_lengths[split:],
            rope_dim=step.rope,
            backend=backend,
            overlap=overlap and mla_prefill.OVERLAP_CALLS,
        )

    if not split:
        return rest()
    return side_by_side(leading, rest, kv_cache.device, overlap)[1]


def _pairs(mha: MhaStep) -> np.ndarray:
    q = mha.query_lengths.astype(np.float64)
    rows = mha.kv_lengths.astype(np.float64)
    return q * (rows - q) + q * (q + 1) / 2


def absorbed_flops(mha: MhaStep, heads: int, latent: int, rope: int, upto: int) -> float:
    """The absorbed attention's FLOPs over requests ``[0, upto)`` (attended pairs only)."""
    return heads * float(_pairs(mha)[:upto].sum()) * (2 * (latent + rope) + 2 * latent)


def mha_flops(mha: MhaStep, heads: int, latent: int, rope: int, split: int) -> float:
    """FLOPs of the split run: the absorbed requests' attention, then per MHA-form request its
    attended pairs (``2 (qk + rope) + 2 v`` each) and the decompression GEMM
    (``2 latent (qk + v)`` per attended row), per head."""
    pairs = float(_pairs(mha)[split:].sum())
    rows = float(mha.kv_lengths[split:].sum())
    attention = pairs * (2 * (QK_HEAD + rope) + 2 * V_HEAD)
    gemm = rows * 2 * latent * (QK_HEAD + V_HEAD)
    return absorbed_flops(mha, heads, latent, rope, split) + heads * (attention + gemm)
