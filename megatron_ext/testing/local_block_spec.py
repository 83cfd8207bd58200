# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A decoder block spec whose final norm does not depend on what is installed.

Given a layer spec, megatron-core's ``TransformerBlock`` picks the final norm itself: Transformer
Engine's where TE imports, else Apex's, else torch's. The test models' golden values and float64
references must not change with that (TE's norm has no float64), so they name torch's norm.
"""

from typing import Any

__all__ = ["local_block_spec"]


def local_block_spec(layer_spec: Any, num_layers: int) -> Any:
    """``num_layers`` copies of ``layer_spec`` and megatron-core's torch norm as the final norm.

    Args:
        layer_spec (ModuleSpec): the transformer layer spec.
        num_layers (int): layers in the block.

    Returns:
        TransformerBlockSubmodules: what ``GPTModel(transformer_layer_spec=...)`` accepts.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * num_layers, layer_norm=WrappedTorchNorm
    )
