#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A Megatron-LM GPT pretraining script with megatron_ext's flags, on megatron.training 0.19.

What a user's ``pretrain_gpt.py`` looks like with the plugin: megatron.training parses the
command line with ``extra_args_provider=add_megatron_ext_args``, ``apply_megatron_ext(args)`` runs
before the model config (and so the layer spec) is built, and ``pretrain`` does the rest. The data
is megatron-core's ``MockGPTDataset`` (``--mock-data``). Without Transformer Engine, pass
``--transformer-impl local --spec megatron_ext.models.gpt.gpt_layer_specs
get_gpt_layer_local_mla_spec`` (megatron-core's local attention cannot take MLA's head sizes).

megatron.training's API is the 0.19 one (``parse_and_validate_args``, a config container passed
to ``pretrain``); Megatron-LM at ``core_v0.16.1`` passes ``extra_args_provider`` to ``pretrain``
itself (see the README).
"""

from functools import partial
from typing import Any, Dict, Iterator, Tuple

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args
from megatron.training.arguments import parse_and_validate_args

from megatron_ext.arguments import add_megatron_ext_args, apply_megatron_ext


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """megatron-core's mock GPT datasets (no blend given), sized as megatron.training asks."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        split=args.split,
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    return BlendedMegatronDatasetBuilder(
        MockGPTDataset, train_val_test_num_samples, lambda: True, config
    ).build()


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> Tuple[Any, Any, Dict[str, Any]]:
    """Summed token loss, token count, and the report megatron.training averages over tokens."""
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(output.view(-1).float() * loss_mask)
    num_tokens = loss_mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator: Iterator, model: torch.nn.Module):
    """One micro-batch: the GPT's per-token losses and the loss function over them."""
    batch = {k: v.cuda(non_blocking=True) for k, v in next(data_iterator).items() if v is not None}
    output = model(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"]
    )
    return output, partial(loss_func, batch["loss_mask"])


def main() -> None:
    """Parse the command line with megatron_ext's flags, apply them, and pretrain."""
    args = parse_and_validate_args(
        extra_args_provider=add_megatron_ext_args,
        args_defaults={"tokenizer_type": "NullTokenizer"},
    )
    apply_megatron_ext(args)  # before the model config builds the layer spec
    config = pretrain_cfg_container_from_args(args, gpt_config_from_args(args))
    pretrain(config, datasets_provider, ModelType.encoder_or_decoder, forward_step)


if __name__ == "__main__":
    main()
