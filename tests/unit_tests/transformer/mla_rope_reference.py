# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Plain-torch model of megatron-core's fused MLA RoPE functions, for CPU tests.

Same signatures and output as ``fused_apply_mla_rope_for_q``/``_for_kv`` (YaRN RoPE on the last
``emb_dim`` channels, read interleaved and written as two halves; positions per sequence for thd,
with megatron-core's context-parallel layout), but out of place and differentiable by autograd.
"""

from typing import List, Optional

import torch

__all__ = ["rope_q", "rope_kv", "token_positions"]


def token_positions(
    num_tokens: int, cu_seqlens: Optional[torch.Tensor], cp_rank: int, cp_size: int
) -> torch.Tensor:
    """Position of each token within its sequence (thd) or the sequence index (sbhd, per row)."""
    if cu_seqlens is None:
        return torch.arange(num_tokens)
    bounds: List[int] = [int(x) // cp_size for x in cu_seqlens.tolist()]
    positions = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        idx = torch.arange(end - start)
        if cp_size > 1:
            # The local half-chunks of a sequence are chunks cp_rank and 2*cp_size-1-cp_rank.
            half = (end - start) // 2
            idx = torch.where(
                idx < half,
                idx + cp_rank * half,
                idx - half + (2 * cp_size - cp_rank - 1) * half,
            )
        positions.append(idx)
    return torch.cat(positions)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., 0::2], x[..., 1::2]
    left = x1 * cos[..., :half] - x2 * sin[..., :half]
    right = x2 * cos[..., half:] + x1 * sin[..., half:]
    return torch.cat([left, right], dim=-1)


def _cos_sin(t: torch.Tensor, cos, sin, emb_dim, cu_seqlens, cp_rank, cp_size):
    pos = token_positions(t.shape[0], cu_seqlens, cp_rank, cp_size).to(t.device)
    c = cos.reshape(-1, emb_dim)[pos]
    s = sin.reshape(-1, emb_dim)[pos]
    # sbhd: [s, 1, 1, emb]; thd: [t, 1, emb]
    shape = (-1, 1, 1, emb_dim) if cu_seqlens is None else (-1, 1, emb_dim)
    return c.reshape(shape), s.reshape(shape)


def rope_q(
    t,
    cos,
    sin,
    qk_head_dim,
    emb_dim,
    cu_seqlens_q=None,
    cp_rank=0,
    cp_size=1,
    rotary_interleaved=False,
):
    """Reference of ``fused_apply_mla_rope_for_q`` (returns a new tensor)."""
    assert not rotary_interleaved
    c, s = _cos_sin(t, cos, sin, emb_dim, cu_seqlens_q, cp_rank, cp_size)
    return torch.cat([t[..., :qk_head_dim], _rotate(t[..., qk_head_dim:], c, s)], dim=-1)


def rope_kv(
    kv,
    k_pos_emb,
    cos,
    sin,
    emb_dim,
    k_dim,
    v_dim,
    cu_seqlens_kv=None,
    cp_rank=0,
    cp_size=1,
    rotary_interleaved=False,
):
    """Reference of ``fused_apply_mla_rope_for_kv``: (key, value)."""
    assert not rotary_interleaved
    c, s = _cos_sin(kv, cos, sin, emb_dim, cu_seqlens_kv, cp_rank, cp_size)
    pe = _rotate(k_pos_emb, c, s).expand(*kv.shape[:-1], emb_dim)
    return torch.cat([kv[..., :k_dim], pe], dim=-1), kv[..., k_dim : k_dim + v_dim]
