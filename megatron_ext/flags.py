# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron_ext's command-line flags, added to a Megatron-LM script's parser.

Megatron-LM scripts take extra flags through ``extra_args_provider``:
``pretrain(..., extra_args_provider=add_megatron_ext_args)`` (chain it with a script's own
provider as ``lambda p: add_megatron_ext_args(own(p))``). :mod:`megatron_ext.apply` applies what
they request.
"""

import argparse

from megatron_ext import patches

__all__ = [
    "FLAG_DESTS",
    "INFERENCE_STATIC_ACTIVE_SLICES_FLAG",
    "MLA_ROPE_CONTIGUOUS_LOAD_FLAG",
    "MegatronExtConfigError",
    "add_megatron_ext_args",
]

MLA_ROPE_CONTIGUOUS_LOAD_FLAG = "--mla-rope-contiguous-load"
INFERENCE_STATIC_ACTIVE_SLICES_FLAG = "--inference-static-active-slices"

# flag -> the namespace attribute (argparse ``dest``) it sets, which names its extension.
FLAG_DESTS = {
    MLA_ROPE_CONTIGUOUS_LOAD_FLAG: patches.MLA_ROPE_CONTIGUOUS_LOAD,
    INFERENCE_STATIC_ACTIVE_SLICES_FLAG: patches.INFERENCE_STATIC_ACTIVE_SLICES,
}
# Marks the parser actions add_megatron_ext_args created, to tell them from a script's own.
_ADDED_BY_MEGATRON_EXT = "_megatron_ext_flag"


class MegatronExtConfigError(ValueError):
    """A megatron_ext extension was requested for a configuration it cannot act on."""


def add_megatron_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add megatron_ext's flags to ``parser``; usable as Megatron-LM's ``extra_args_provider``.

    Calling it twice on one parser is harmless (the flags are added once).

    Args:
        parser: the script's argument parser.

    Returns:
        argparse.ArgumentParser: the same parser, with a ``megatron_ext`` argument group.

    Raises:
        TypeError: if ``parser`` is not an ``argparse.ArgumentParser``.
        ValueError: if the parser already defines one of the flags, or an option that stores to
            one of their attribute names, itself (named in the message); nothing is added then.
    """
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"expected an argparse.ArgumentParser, got {type(parser).__name__}")
    if any(getattr(action, _ADDED_BY_MEGATRON_EXT, False) for action in parser._actions):
        return parser
    clashes = []
    for action in parser._actions:
        for flag, dest in FLAG_DESTS.items():
            if flag in action.option_strings:
                clashes.append(flag)
            elif action.dest == dest:
                own = "/".join(action.option_strings) or dest
                clashes.append(f"{own} (it stores to args.{dest}, as {flag} does)")
    if clashes:
        raise ValueError(
            f"add_megatron_ext_args: the parser already defines {', '.join(clashes)}; "
            f"megatron_ext adds {' and '.join(FLAG_DESTS)} itself. Remove the script's own "
            "definition."
        )
    group = parser.add_argument_group(title="megatron_ext")
    mla_action = group.add_argument(
        MLA_ROPE_CONTIGUOUS_LOAD_FLAG,
        action="store_true",
        default=False,
        dest="mla_rope_contiguous_load",
        help="Run multi-latent attention's YaRN RoPE with megatron_ext's contiguous-load Triton "
        "kernels instead of megatron-core's (bit-identical results, fewer memory transactions). "
        "Needs --multi-latent-attention and yarn RoPE (--rope-type yarn or the MLA default). "
        "Training and static-batching inference (StaticInferenceContext): needs RoPE fusion "
        "(--position-embedding-type rope, no --no-rope-fusion). Dynamic batching "
        "(DynamicInferenceEngine): needs --cache-mla-latents --no-rope-fusion; megatron_ext's MLA "
        "step then serves it with its own paged latent-cache kernels (kv_lora_rank and "
        "qk_pos_emb_head_dim powers of two >= 16, context parallel size 1, a tensor parallel "
        "size that divides the attention heads, no sequence parallelism, no FP8 KV cache), at "
        "any KV block size with --inference-static-active-slices (megatron-core's own context "
        "takes 64 only). Dynamic batching with RoPE fusion on is refused.",
    )
    slices_action = group.add_argument(
        INFERENCE_STATIC_ACTIVE_SLICES_FLAG,
        action="store_true",
        default=False,
        dest="inference_static_active_slices",
        help="Dynamic inference: megatron-core's DynamicInferenceContext and "
        "TextGenerationController are built as megatron_ext's subclasses, which keep the "
        "active-request slices in static-address tensors, rebuilt in place each step, and sample "
        "in a region that CUDA graphs capture when the engine uses them. megatron-core's "
        "DynamicInferenceEngine then checks each request where it enters (prompt token ids within "
        "the model's vocabulary, a non-empty prompt, integer token counts, sampling values in "
        "range, the log-prob options it asserts on, an id no request in the engine holds) and "
        "fails a bad request, or one whose logits are not finite, alone, with the reason, while "
        "it serves the others.",
    )
    for action in (mla_action, slices_action):
        setattr(action, _ADDED_BY_MEGATRON_EXT, True)
    return parser
