# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""local_block_spec: the test models' final norm is torch's, whatever is installed."""

from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import transformer_block
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_ext.testing.local_block_spec import local_block_spec
from megatron_ext.testing.small_gpt import build_small_gpt
from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel


def test_block_spec_names_torch_norm_and_repeats_the_layer():
    layer = get_gpt_layer_local_spec()
    block = local_block_spec(layer, 3)
    assert isinstance(block, TransformerBlockSubmodules)
    assert block.layer_norm is WrappedTorchNorm
    assert block.layer_specs == [layer] * 3


def test_small_gpt_final_norm_does_not_follow_megatron_cores_choice(monkeypatch):
    """megatron-core's block picks its module-level LayerNormImpl (Transformer Engine's norm where
    TE imports) for a layer spec; the test model keeps torch's even when that choice differs."""
    if torch.cuda.is_available():
        pytest.skip("builds the model on CPU")

    class NotTorchNorm(torch.nn.Module):
        def __init__(self, *args, **kwargs):
            raise AssertionError("the model used megatron-core's choice of final norm")

    monkeypatch.setattr(transformer_block, "LayerNormImpl", NotTorchNorm)
    args = SimpleNamespace(
        **dict(num_layers=2, hidden_size=32, num_attention_heads=2, num_query_groups=2),
        **dict(ffn_hidden_size=64, vocab_size=64, max_sequence_length=32, seed=1, device="cpu"),
    )
    with cpu_torch_compat():
        ensure_model_parallel()
        model, _ = build_small_gpt(args, torch.float32)
    norm = model.decoder.final_layernorm
    assert isinstance(norm, (torch.nn.LayerNorm, torch.nn.RMSNorm)), type(norm)
