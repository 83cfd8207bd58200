# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron-core's unfused latent-cache path without a whole context, the baseline of the
benchmark and the kernel tests: its RoPE module as ``MLASelfAttention`` builds it, and a stand-in
for ``DynamicInferenceContext`` holding only what its latent-cache methods read, so that those
methods run unbound, as megatron-core's MLA calls them."""

import types

import torch

__all__ = ["LatentCacheContextStandIn", "yarn_rotary_embedding"]


def yarn_rotary_embedding(config):
    """megatron-core's ``YarnRotaryEmbedding`` as ``MLASelfAttention`` builds it from ``config``.

    Args:
        config: an ``MLATransformerConfig`` with yarn RoPE.

    Returns:
        YarnRotaryEmbedding: the module (its frequencies on ``torch.cuda.current_device()``).
    """
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    return YarnRotaryEmbedding(
        config.qk_pos_emb_head_dim,
        rotary_base=config.rotary_base,
        scaling_factor=config.rotary_scaling_factor,
        original_max_position_embeddings=config.original_max_position_embeddings,
        beta_fast=config.beta_fast,
        beta_slow=config.beta_slow,
        mscale=config.mscale,
        mscale_all_dim=config.mscale_all_dim,
    )


class LatentCacheContextStandIn:
    """The tensors megatron-core's ``DynamicInferenceContext.apply_rotary_emb_key`` and
    ``append_key_value_cache`` read (0.16 on the context, 0.19 on its ``gpu_view``).

    Args:
        memory_buffer: the latent cache, ``[layers, blocks, block_size, width]`` (layer 0 used).
        positions: each token's position in its request.
        block_idx: each token's cache block.
        block_offset: each token's row in its block.
        decode_only: what ``is_decode_only()`` answers.
    """

    def __init__(
        self,
        memory_buffer: torch.Tensor,
        positions: torch.Tensor,
        block_idx: torch.Tensor,
        block_offset: torch.Tensor,
        decode_only: bool,
    ):
        self.cache_mla_latent = True
        self.layer_map = {0: 0}
        self.memory_buffer = memory_buffer
        self.padded_active_token_count = positions.shape[0]
        self.token_to_position_in_request = positions
        self.token_to_block_idx = block_idx
        self.token_to_local_position_within_kv_block = block_offset
        self.gpu_view = types.SimpleNamespace(
            token_to_position_in_request=positions,
            token_to_block_idx=block_idx,
            token_to_local_position_within_kv_block=block_offset,
        )
        self._decode_only = decode_only

    def is_decode_only(self) -> bool:
        """Whether the step is decode-only (megatron-core's branch of the key RoPE)."""
        return self._decode_only
