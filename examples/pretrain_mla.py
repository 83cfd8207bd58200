#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Train a small DeepSeek-V3-shaped MLA GPT on synthetic data, with or without
``--mla-rope-contiguous-load``, and report loss, grad norm and time per step.

The model has DeepSeek-V3's attention geometry (qk_head_dim 128, qk_pos_emb_head_dim 64,
v_head_dim 128, low-rank q/kv projections, q/kv RMSNorm, yarn RoPE with RoPE fusion) at a small
width, and trains with megatron-core's own machinery (GPTModel, DistributedDataParallel, the
megatron optimizer, the forward-backward schedule). Core attention is Transformer Engine's where
it is installed, megatron_ext's ``SDPADotProductAttention`` otherwise.

One GPU, flag on::

    python examples/pretrain_mla.py --mla-rope-contiguous-load

Both modes in one process, the same seed and data, compared bit for bit (exit status 1 when any
step's loss or grad norm differs), with step times and the RoPE share of GPU time::

    python examples/pretrain_mla.py --modes off on --deterministic --profile-steps 3

Realistic per-layer sizes for timing (one full-width DeepSeek-V3 layer, 4096 tokens)::

    python examples/pretrain_mla.py --preset dsv3-layer --modes off on off on --profile-steps 3

Several GPUs (tensor or context parallel; ``NCCL_NVLS_ENABLE=0`` as NVLink multicast is not
available everywhere)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 examples/pretrain_mla.py \\
        --tensor-model-parallel-size 2 --modes off on --deterministic
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Sequence

# cuBLAS reads this when it initialises: it must be set before the first CUDA call, so parse the
# one flag that needs it before torch is imported. megatron-core refuses deterministic_mode with
# Transformer Engine's attention unless TE's non-deterministic algorithms are off too.
if "--deterministic" in sys.argv:
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
if __name__ == "__main__":
    # megatron-core's imports below warn that Transformer Engine / Apex are absent; not needed here.
    from megatron_ext.utils import ignore_optional_dependency_warnings

    ignore_optional_dependency_warnings()

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import package_info as mcore_package_info
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import gpt_layer_specs as mcore_specs
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_config import MLATransformerConfig

from megatron_ext.arguments import (
    add_megatron_ext_args,
    apply_megatron_ext,
    check_model_uses_megatron_ext,
    undo_megatron_ext,
)
from megatron_ext.models.gpt.gpt_layer_specs import to_megatron_ext_spec
from megatron_ext.testing.local_block_spec import local_block_spec
from megatron_ext.testing.network import free_port

PRESETS: Dict[str, Dict[str, Any]] = {
    # Small enough that 50 steps take well under a second on an H200; every MLA code path the
    # extension touches is exercised. 8 heads: a power of two, see --num-attention-heads.
    "small": dict(
        num_layers=2,
        hidden_size=512,
        num_attention_heads=8,
        ffn_hidden_size=1024,
        q_lora_rank=384,
        kv_lora_rank=256,
        vocab_size=1024,
        seq_length=512,
        micro_batch_size=2,
    ),
    # One DeepSeek-V3 layer at full width (attention and a dense MLP), for step-time and RoPE-share
    # measurements at the sizes the kernels are meant for.
    "dsv3-layer": dict(
        num_layers=1,
        hidden_size=7168,
        num_attention_heads=128,
        ffn_hidden_size=18432,
        q_lora_rank=1536,
        kv_lora_rank=512,
        vocab_size=4096,
        seq_length=4096,
        micro_batch_size=1,
    ),
}


# ----------------------------------------------------------------------------------------------
# Arguments


def build_parser() -> argparse.ArgumentParser:
    """The example's argument parser, with megatron_ext's flags added.

    Returns:
        argparse.ArgumentParser: the parser.
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    g = p.add_argument_group("model (defaults from --preset)")
    g.add_argument("--preset", choices=sorted(PRESETS), default="small")
    for name in PRESETS["small"]:
        g.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    g.add_argument("--qk-head-dim", type=int, default=128)
    g.add_argument("--qk-pos-emb-head-dim", type=int, default=64)
    g.add_argument("--v-head-dim", type=int, default=128)
    g.add_argument("--num-microbatches", type=int, default=1)
    g.add_argument(
        "--recompute-mla-up-proj",
        action="store_true",
        help="recompute MLA's up projections and RoPE in backward",
    )

    g = p.add_argument_group("yarn RoPE (DeepSeek-V3 values)")
    g.add_argument("--rotary-base", type=float, default=10000.0)
    g.add_argument("--rotary-scaling-factor", type=float, default=40.0)
    g.add_argument("--original-max-position-embeddings", type=int, default=4096)
    g.add_argument("--beta-fast", type=float, default=32.0)
    g.add_argument("--beta-slow", type=float, default=1.0)
    g.add_argument("--mscale", type=float, default=1.0)
    g.add_argument("--mscale-all-dim", type=float, default=1.0)
    g.add_argument("--rope-type", choices=["yarn", "rope"], default="yarn")
    g.add_argument("--no-rope-fusion", action="store_false", dest="apply_rope_fusion")

    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=50)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    g.add_argument("--hidden-dropout", type=float, default=0.0)
    g.add_argument("--attention-dropout", type=float, default=0.0)

    g = p.add_argument_group("data")
    g.add_argument(
        "--qkv-format",
        choices=["sbhd", "thd"],
        default="sbhd",
        help="thd: each micro-batch is one pack of variable-length sequences",
    )
    g.add_argument(
        "--thd-pad-multiple",
        type=int,
        default=16,
        help="thd: pad each sequence to a multiple of this (cu_seqlens_*_padded)",
    )
    g.add_argument("--thd-min-seqlen", type=int, default=32)

    g = p.add_argument_group("parallelism (launch with torchrun for more than one GPU)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")

    g = p.add_argument_group("attention")
    g.add_argument(
        "--transformer-impl",
        choices=["auto", "transformer_engine", "local"],
        default="auto",
        help="auto: Transformer Engine if installed, else local+SDPA",
    )
    g.add_argument(
        "--sdpa-backend",
        choices=["auto", "math", "efficient", "flash", "cudnn"],
        default="auto",
        help="SDPA backend of the TE-free attention; with "
        "--deterministic, auto means math (deterministic backward)",
    )

    g = p.add_argument_group("run and report")
    g.add_argument(
        "--modes",
        nargs="+",
        choices=["off", "on"],
        default=None,
        help="train once per entry, from the same seed and data; default: on if "
        "--mla-rope-contiguous-load else off",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic algorithms, CUBLAS_WORKSPACE_CONFIG, a deterministic SDPA "
        "backend and megatron's deterministic_mode",
    )
    g.add_argument(
        "--mcore-rope-block-h",
        type=int,
        default=None,
        help="pin megatron-core's MLA RoPE kernels to this BLOCK_H instead of autotuning "
        "(0: autotune). Default: 1 with --deterministic, else autotune. Its key/value backward "
        "sums the heads in an order that depends on BLOCK_H, so only a pinned config gives "
        "reproducible (golden) values; BLOCK_H=1 is the order megatron_ext's kernels use",
    )
    g.add_argument(
        "--ext-rope-block-h",
        type=int,
        default=0,
        help="pin megatron_ext's kernels to this BLOCK_H (0: autotune; their output does not "
        "depend on it)",
    )
    g.add_argument(
        "--timing-warmup", type=int, default=5, help="steps left out of the step-time statistics"
    )
    g.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after training, profile this many extra steps and report the share "
        "of GPU time spent in RoPE kernels",
    )
    g.add_argument(
        "--rope-kernel-regex",
        default=r"rope|rotary",
        help="kernel names counted as RoPE in the profile",
    )
    g.add_argument("--output-json", default=None, help="write per-step results here (rank 0)")
    g.add_argument("--log-interval", type=int, default=1)
    add_megatron_ext_args(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse and check the command line.

    Args:
        argv: arguments; ``sys.argv[1:]`` when None.

    Returns:
        argparse.Namespace: the arguments, preset values filled in.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    for name, value in PRESETS[args.preset].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.modes is None:
        args.modes = ["on" if args.mla_rope_contiguous_load else "off"]
    if args.inference_static_active_slices:
        parser.error("--inference-static-active-slices is an inference flag; this is training")
    if args.train_iters < 1:
        parser.error("--train-iters must be at least 1")
    if args.qkv_format == "thd" and args.thd_pad_multiple < 1:
        parser.error("--thd-pad-multiple must be at least 1")
    cp = args.context_parallel_size
    if args.qkv_format == "thd" and cp > 1 and args.thd_pad_multiple % (2 * cp):
        # The fused RoPE kernels split each padded sequence into 2 * cp chunks; they cannot see
        # a length that does not split (that check would cost a device sync per call).
        parser.error(
            f"--thd-pad-multiple {args.thd_pad_multiple} must be a multiple of 2 * "
            f"--context-parallel-size = {2 * cp}"
        )
    if args.mcore_rope_block_h is None:
        args.mcore_rope_block_h = 1 if args.deterministic else 0
    for name in ("mcore_rope_block_h", "ext_rope_block_h"):
        value = getattr(args, name)
        if value < 0 or value > 128 or value & (value - 1):
            parser.error(f"--{name.replace('_', '-')} must be 0 or a power of two up to 128")
    return args


# ----------------------------------------------------------------------------------------------
# Distributed set-up


@dataclass
class Dist:
    """This process's place in the run."""

    rank: int
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int


def init_distributed(args: argparse.Namespace) -> Dist:
    """Start torch.distributed (world size 1 without torchrun) and megatron's parallel state.

    Args:
        args: parsed arguments (parallel sizes).

    Returns:
        Dist: ranks and sizes.
    """
    if not torch.cuda.is_available():
        raise SystemExit("this example needs a CUDA GPU (yarn RoPE and the Triton kernels do)")
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=os.environ.get("MASTER_PORT", str(free_port())),
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", device_id=torch.device("cuda", local_rank))
    world = dist.get_world_size()
    tp, cp = args.tensor_model_parallel_size, args.context_parallel_size
    if world % (tp * cp) != 0:
        raise SystemExit(f"world size {world} is not a multiple of TP*CP = {tp * cp}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        context_parallel_size=cp,
        create_gloo_process_groups=False,
    )
    return Dist(
        rank=dist.get_rank(),
        world_size=world,
        local_rank=local_rank,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        cp_size=cp,
    )


def set_determinism(args: argparse.Namespace) -> None:
    """Make every kernel choice reproducible, so on/off runs can differ only by the RoPE kernels.

    Args:
        args: parsed arguments.
    """
    if not args.deterministic:
        return
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # TF32 is deterministic, but fixing it keeps fp32 runs comparable across torch defaults.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA) and megatron's model-parallel RNG tracker."""
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)
    model_parallel_cuda_manual_seed(seed)


def pin_megatron_core_rope(block_h: int) -> None:
    """Give megatron-core's MLA RoPE autotuners a single config (0 leaves them autotuning).

    Args:
        block_h: heads per program, a power of two; 0 to keep megatron-core's autotuning.
    """
    if not block_h:
        return
    import triton
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mcore_rope

    for name in (
        "rotary_fwd_q_kernel",
        "rotary_bwd_q_kernel",
        "rotary_fwd_kv_kernel",
        "rotary_bwd_kv_kernel",
    ):
        tuner = getattr(mcore_rope, name)
        tuner.configs = [triton.Config({"BLOCK_H": block_h})]
        tuner.cache = {}


def ext_rope_context(block_h: int):
    """A context that pins megatron_ext's kernels to ``block_h`` (a no-op for 0)."""
    if not block_h:
        return contextlib.nullcontext()
    from megatron_ext.fusions.fused_mla_yarn_rope_apply import pinned_kernel_config

    return pinned_kernel_config(block_h)


# ----------------------------------------------------------------------------------------------
# Model


def have_transformer_engine() -> bool:
    """Whether Transformer Engine can be imported."""
    try:
        import transformer_engine  # noqa: F401  pylint: disable=unused-import
    except ImportError:
        return False
    return True


def transformer_engine_version() -> Optional[str]:
    """The installed Transformer Engine release, or None without one."""
    if not have_transformer_engine():
        return None
    from importlib.metadata import PackageNotFoundError, version

    for package in ("transformer_engine", "transformer_engine_torch"):
        try:
            return version(package)
        except PackageNotFoundError:
            continue
    return "unknown"


def use_te(args: argparse.Namespace) -> bool:
    """Whether this run uses Transformer Engine's layer spec."""
    if args.transformer_impl == "auto":
        return have_transformer_engine()
    if args.transformer_impl == "transformer_engine" and not have_transformer_engine():
        raise SystemExit("--transformer-impl transformer_engine: Transformer Engine not installed")
    return args.transformer_impl == "transformer_engine"


def sdpa_backends(args: argparse.Namespace) -> Optional[List[str]]:
    """SDPA backends for the TE-free attention; None lets PyTorch choose."""
    if args.sdpa_backend == "auto":
        return ["math"] if args.deterministic else None
    return [args.sdpa_backend]


def build_config(args: argparse.Namespace) -> MLATransformerConfig:
    """The transformer config of the example model.

    Args:
        args: parsed arguments.

    Returns:
        MLATransformerConfig: the config.
    """
    bf16 = args.precision == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    recompute = {}
    if args.recompute_mla_up_proj:
        recompute = dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"])
    return MLATransformerConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_head_dim=args.qk_head_dim,
        qk_pos_emb_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        qk_layernorm=True,
        rope_type=args.rope_type,
        rotary_base=args.rotary_base,
        rotary_scaling_factor=args.rotary_scaling_factor,
        original_max_position_embeddings=args.original_max_position_embeddings,
        beta_fast=args.beta_fast,
        beta_slow=args.beta_slow,
        mscale=args.mscale,
        mscale_all_dim=args.mscale_all_dim,
        apply_rope_fusion=args.apply_rope_fusion,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=0.02,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        sequence_parallel=args.sequence_parallel,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        cross_entropy_loss_fusion=False,
        deterministic_mode=args.deterministic,
        **recompute,
    )


def build_layer_spec(args: argparse.Namespace, mode: str, config: MLATransformerConfig):
    """The layer spec, built the way a Megatron-LM script builds it, flag on or off.

    With the flag on, ``apply_megatron_ext`` makes megatron-core's own spec function build
    megatron_ext's MLA class (and refuses configurations the flag cannot act on); with it off,
    ``undo_megatron_ext`` restores megatron-core's. Without Transformer Engine the spec's local
    core attention is swapped for the SDPA one, in both modes, and the block gets torch's final
    norm.

    Args:
        args: parsed arguments.
        mode: ``"on"`` or ``"off"``.
        config: the transformer config (checked by ``apply_megatron_ext``).

    Returns:
        ModuleSpec or TransformerBlockSubmodules: the TE layer spec, or the local block spec.
    """
    if mode == "on":
        apply_megatron_ext(args, mla_rope_contiguous_load=True, config=config)
    else:
        undo_megatron_ext()
    if use_te(args):
        return mcore_specs.get_gpt_layer_with_transformer_engine_spec(
            multi_latent_attention=True, qk_layernorm=True
        )
    spec = mcore_specs.get_gpt_layer_local_spec(
        multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
    )
    spec = to_megatron_ext_spec(
        spec,
        mla_rope_contiguous_load=False,  # the flag (above) already decided the MLA class
        sdpa_core_attention=True,
        sdpa_backends=sdpa_backends(args),
    )
    # Given a layer spec, megatron-core picks TE's final norm wherever TE imports; local means
    # torch's, so that a local run is the same model with or without TE installed.
    return local_block_spec(spec, args.num_layers)


def build_model(args: argparse.Namespace, mode: str):
    """GPT model wrapped for mixed precision and DDP, and its optimizer.

    Args:
        args: parsed arguments.
        mode: ``"on"`` or ``"off"``.

    Returns:
        Tuple of (ddp model, optimizer, config, number of megatron_ext MLA modules).
    """
    config = build_config(args)
    spec = build_layer_spec(args, mode, config)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.vocab_size,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",  # MLA applies its own (yarn) RoPE; no learned positions
        share_embeddings_and_output_weights=False,
        parallel_output=True,
    )
    n_ext = check_model_uses_megatron_ext(model)
    expected = args.num_layers if mode == "on" else 0
    if n_ext != expected:
        raise RuntimeError(
            f"mode {mode}: expected {expected} megatron_ext MLA modules, got {n_ext}"
        )
    model.cuda(torch.cuda.current_device())
    if config.bf16:
        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=args.lr,
            min_lr=args.lr,
            weight_decay=args.weight_decay,
            adam_beta1=0.9,
            adam_beta2=0.95,
            adam_eps=1e-8,
            clip_grad=args.clip_grad,
            bf16=config.bf16,
            params_dtype=config.params_dtype,
            use_distributed_optimizer=False,
        ),
        [model],
        use_gloo_process_groups=False,
    )
    return model, optimizer, config, n_ext


def param_checksum(model: torch.nn.Module) -> str:
    """A digest of all parameters' bit patterns (proves both modes start from the same weights).

    Reduced on the GPU (sum and sum of squares of the raw bits, wrapping in int64) so that it
    stays cheap for the full-width preset.
    """
    int_of_size = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        flat = param.detach().contiguous().view(-1)
        bits = flat.view(int_of_size[flat.element_size()]).long()
        digest.update(f"{name}:{int(bits.sum())}:{int((bits * bits).sum())};".encode())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------------------------
# Synthetic data


def _sequence(gen: torch.Generator, length: int, vocab: int) -> torch.Tensor:
    """A learnable token stream: arithmetic progressions modulo the vocabulary, with noise."""
    start = torch.randint(0, vocab, (1,), generator=gen)
    stride = torch.randint(1, 8, (1,), generator=gen)
    seq = (start + stride * torch.arange(length)) % vocab
    noise = torch.rand(length, generator=gen) < 0.1
    seq[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=gen)
    return seq


def _split_lengths(gen: torch.Generator, total: int, multiple: int, minimum: int) -> List[int]:
    """Random padded sequence lengths, each a multiple of ``multiple``, summing to ``total``."""
    if total % multiple:
        raise SystemExit(
            f"the pack size {total} is not a multiple of --thd-pad-multiple {multiple}"
        )
    units, lo = total // multiple, max(1, math.ceil(minimum / multiple))
    lengths = []
    while units > 0:
        if units < 2 * lo:
            take = units  # what is left could not make two sequences of the minimum length
        else:
            take = int(torch.randint(lo, max(lo, units // 2) + 1, (1,), generator=gen))
        lengths.append(take * multiple)
        units -= take
    return lengths


def cp_slice_index(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Token indices of a (padded) sequence that a context-parallel rank holds.

    The sequence is cut into ``2 * cp_size`` chunks and rank r takes chunks r and
    ``2 * cp_size - 1 - r``: megatron-core's load-balanced causal layout, which the fused RoPE
    kernels assume when given ``cp_rank``/``cp_size``.
    """
    if length % (2 * cp_size):
        raise SystemExit(f"sequence length {length} is not a multiple of 2*CP = {2 * cp_size}")
    chunk = length // (2 * cp_size)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second_rank = 2 * cp_size - 1 - cp_rank
    second = torch.arange(second_rank * chunk, (second_rank + 1) * chunk)
    return torch.cat([first, second])


def data_iterator(args: argparse.Namespace, d: Dist) -> Iterator[Dict[str, Any]]:
    """Endless synthetic micro-batches; identical across modes and across TP/CP ranks.

    Args:
        args: parsed arguments.
        d: ranks and sizes (data differs per data-parallel rank only).

    Yields:
        dict: ``tokens``, ``labels``, ``loss_mask``, ``position_ids`` (on the GPU) and, for thd,
        ``packed_seq_params``; ``num_tokens``, the loss-bearing tokens of the whole micro-batch
        across context-parallel ranks.
    """
    gen = torch.Generator().manual_seed(args.seed * 1000 + d.dp_rank)
    device = torch.cuda.current_device()
    vocab, s, b = args.vocab_size, args.seq_length, args.micro_batch_size
    while True:
        if args.qkv_format == "sbhd":
            seqs = torch.stack([_sequence(gen, s + 1, vocab) for _ in range(b)])
            tokens, labels = seqs[:, :-1], seqs[:, 1:]
            loss_mask = torch.ones(b, s)
            position_ids = torch.arange(s).expand(b, s)
            batch = dict(
                tokens=tokens, labels=labels, loss_mask=loss_mask, position_ids=position_ids
            )
            num_tokens = loss_mask.sum()
            if d.cp_size > 1:
                index = cp_slice_index(s, d.cp_size, d.cp_rank)
                batch = {k: v.index_select(1, index) for k, v in batch.items()}
            out = {k: v.contiguous().to(device) for k, v in batch.items()}
        else:
            total = b * s
            padded = _split_lengths(gen, total, args.thd_pad_multiple, args.thd_min_seqlen)
            tokens, labels, loss_mask, position_ids = [], [], [], []
            actual = []
            for plen in padded:
                pad = int(torch.randint(0, min(args.thd_pad_multiple, plen), (1,), generator=gen))
                alen = plen - pad
                seq = _sequence(gen, alen + 1, vocab)
                mask = torch.ones(alen)
                mask[-1] = 0  # the last token's label belongs to no sequence of the pack
                tokens.append(torch.cat([seq[:-1], torch.zeros(pad, dtype=seq.dtype)]))
                labels.append(torch.cat([seq[1:], torch.zeros(pad, dtype=seq.dtype)]))
                loss_mask.append(torch.cat([mask, torch.zeros(pad)]))
                position_ids.append(torch.arange(plen))
                actual.append(alen)
            if d.cp_size > 1:
                from megatron_ext.fusions.mla_rope.checks import check_cp_sequence_lengths

                check_cp_sequence_lengths(padded, d.cp_size)  # on the host here: no sync
            cu = torch.tensor([0] + actual).cumsum(0).to(torch.int32)
            cu_padded = torch.tensor([0] + padded).cumsum(0).to(torch.int32)
            batch = dict(
                tokens=torch.cat(tokens)[None],
                labels=torch.cat(labels)[None],
                loss_mask=torch.cat(loss_mask)[None],
                position_ids=torch.cat(position_ids)[None],
            )
            num_tokens = batch["loss_mask"].sum()
            if d.cp_size > 1:
                index = torch.cat(
                    [
                        int(start) + cp_slice_index(plen, d.cp_size, d.cp_rank)
                        for start, plen in zip(cu_padded[:-1], padded)
                    ]
                )
                batch = {k: v.index_select(1, index) for k, v in batch.items()}
            out = {k: v.contiguous().to(device) for k, v in batch.items()}
            out["packed_seq_params"] = PackedSeqParams(
                qkv_format="thd",
                cu_seqlens_q=cu.to(device),
                cu_seqlens_kv=cu.to(device),
                cu_seqlens_q_padded=cu_padded.to(device),
                cu_seqlens_kv_padded=cu_padded.to(device),
                max_seqlen_q=max(padded),
                max_seqlen_kv=max(padded),
            )
        out["num_tokens"] = num_tokens.to(device)
        yield out


# ----------------------------------------------------------------------------------------------
# Training


def _loss_func(loss_mask: torch.Tensor, num_tokens: torch.Tensor, output: torch.Tensor):
    """Mean token loss of the micro-batch, summed over context-parallel ranks for reporting.

    The schedule multiplies the returned loss by the CP size and DDP averages gradients over
    data- and context-parallel ranks, so each CP rank returns its share of the global mean.
    """
    local_sum = (output.float() * loss_mask).sum()
    loss = local_sum / num_tokens
    reported = local_sum.detach().clone()
    if parallel_state.get_context_parallel_world_size() > 1:
        dist.all_reduce(reported, group=parallel_state.get_context_parallel_group())
    # A copy: the schedule scales the returned loss in place.
    return loss, {"lm loss": reported / num_tokens}


def _forward_step(data: Iterator, model: torch.nn.Module):
    batch = next(data)
    output = model(
        batch["tokens"],
        batch["position_ids"],
        None,
        labels=batch["labels"],
        packed_seq_params=batch.get("packed_seq_params"),
    )
    return output, partial(_loss_func, batch["loss_mask"], batch["num_tokens"])


def train_step(args, model, optimizer, data) -> Dict[str, float]:
    """One optimizer step over ``args.num_microbatches`` micro-batches.

    Returns:
        dict: ``lm loss`` (mean over micro-batches and data-parallel ranks) and ``grad norm``.
    """
    model.zero_grad_buffer()
    optimizer.zero_grad()
    with ext_rope_context(args.ext_rope_block_h):
        outputs = get_forward_backward_func()(
            forward_step_func=_forward_step,
            data_iterator=data,
            model=[model],
            num_microbatches=args.num_microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
    update_ok, grad_norm, _ = optimizer.step()
    if not update_ok:
        raise RuntimeError("the optimizer skipped a step (non-finite gradients)")
    loss = torch.stack([o["lm loss"] for o in outputs]).mean()
    if parallel_state.get_data_parallel_world_size() > 1:
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        loss /= parallel_state.get_data_parallel_world_size()
    return {"lm loss": float(loss.item()), "grad norm": float(grad_norm)}


def profile_rope(args, model, optimizer, data) -> Dict[str, Any]:
    """Profile ``args.profile_steps`` training steps; GPU time in RoPE kernels vs. all kernels.

    Returns:
        dict: per-step RoPE and total kernel time (us), the RoPE share, the RoPE kernels seen.
    """
    from torch.profiler import ProfilerActivity, profile

    pattern = re.compile(args.rope_kernel_regex)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.profile_steps):
            train_step(args, model, optimizer, data)
        torch.cuda.synchronize()
    steps = args.profile_steps
    kernels: Dict[str, float] = {}
    for evt in prof.key_averages():
        # Kernels are the device-side events; CPU ops would count their kernels a second time.
        if getattr(evt, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(evt, "self_device_time_total", None)
        if us is None:  # older torch
            us = getattr(evt, "self_cuda_time_total", 0.0)
        kernels[evt.key] = kernels.get(evt.key, 0.0) + us / steps
    total = sum(kernels.values())
    rope_kernels = {k: v for k, v in kernels.items() if pattern.search(k)}
    rope = sum(rope_kernels.values())
    if total == 0.0 and dist.get_rank() == 0:
        print("warning: the profiler reported no CUDA kernel time; RoPE share unknown", flush=True)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    return {
        "steps": steps,
        "rope_us_per_step": rope,
        "kernel_us_per_step": total,
        "rope_share_of_kernel_time": rope / total if total else None,
        "rope_kernels_us_per_step": rope_kernels,
        "top_kernels_us_per_step": dict(top),
    }


def run_mode(args: argparse.Namespace, mode: str, d: Dist) -> Dict[str, Any]:
    """Build a fresh model from the seed and train it with the flag ``mode``.

    Returns:
        dict: per-step values (floats and their hex), step times, and diagnostics.
    """
    seed_everything(args.seed)
    model, optimizer, config, n_ext = build_model(args, mode)
    checksum = param_checksum(model)
    data = data_iterator(args, d)
    losses, norms, times = [], [], []
    for step in range(1, args.train_iters + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        values = train_step(args, model, optimizer, data)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000.0)
        losses.append(values["lm loss"])
        norms.append(values["grad norm"])
        if d.rank == 0 and args.log_interval and step % args.log_interval == 0:
            print(
                f"[{mode:>3}] step {step:4d} | lm loss {losses[-1]:.6f} ({losses[-1].hex()}) | "
                f"grad norm {norms[-1]:.6f} ({norms[-1].hex()}) | {times[-1]:7.2f} ms",
                flush=True,
            )
    timed = times[args.timing_warmup :] or times
    result = {
        "mode": mode,
        "lm loss": losses,
        "lm loss hex": [v.hex() for v in losses],
        "grad norm": norms,
        "grad norm hex": [v.hex() for v in norms],
        "step_time_ms": times,
        "median_step_time_ms": statistics.median(timed),
        "mean_step_time_ms": statistics.fmean(timed),
        "init_param_checksum": checksum,
        "megatron_ext_mla_modules": n_ext,
        "core_attention": type(_first_core_attention(model)).__name__,
    }
    if args.profile_steps > 0:
        result["rope_profile"] = profile_rope(args, model, optimizer, data)
        result["rope_profile"]["rope_share_of_step_time"] = (
            result["rope_profile"]["rope_us_per_step"] / 1000.0 / result["median_step_time_ms"]
        )
    del model, optimizer, data
    undo_megatron_ext()
    torch.cuda.empty_cache()
    return result


def _first_core_attention(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    for module in model.modules():
        if hasattr(module, "core_attention"):
            return module.core_attention
    return None


def compare_modes(results: List[Dict[str, Any]]) -> List[str]:
    """Bitwise comparison of every run with the first; returns the mismatches found."""
    problems = []
    ref = results[0]
    for index, other in enumerate(results[1:], start=1):
        tag = f"{other['mode']} (run {index}) vs {ref['mode']} (run 0)"
        if other["init_param_checksum"] != ref["init_param_checksum"]:
            problems.append(f"{tag}: initial parameters differ (seeding, not the kernels)")
        for key in ("lm loss hex", "grad norm hex"):
            for step, (a, b) in enumerate(zip(ref[key], other[key]), start=1):
                if a != b:
                    problems.append(f"{tag}: {key[:-4]} differs first at step {step}: {a} vs {b}")
                    break
    return problems


def environment() -> Dict[str, Any]:
    """Versions and device of this run."""
    import triton

    version = mcore_package_info.__version__
    return {
        "megatron_core": version,
        "env": "mcore-" + ".".join(version.split(".")[:2]),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "device": torch.cuda.get_device_name(),
        "transformer_engine": transformer_engine_version(),
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the example.

    Args:
        argv: command-line arguments; ``sys.argv[1:]`` when None.

    Returns:
        int: 0 on success, 1 if runs with ``--deterministic`` are not bitwise identical.
    """
    args = parse_args(argv)
    d = init_distributed(args)
    set_determinism(args)
    pin_megatron_core_rope(args.mcore_rope_block_h)
    env = environment()
    if d.rank == 0:
        print(f"environment: {json.dumps(env)}", flush=True)
        print(
            f"modes: {args.modes} | preset {args.preset} | {args.precision} | "
            f"{args.qkv_format} | TP {args.tensor_model_parallel_size} "
            f"CP {args.context_parallel_size} | world {d.world_size} | RoPE BLOCK_H "
            f"megatron-core {args.mcore_rope_block_h or 'autotuned'}, "
            f"megatron_ext {args.ext_rope_block_h or 'autotuned'}",
            flush=True,
        )
    if d.rank == 0 and d.cp_size > 1 and args.qkv_format == "sbhd" and args.precision == "fp32":
        # YarnRotaryEmbedding caches a context-parallel slice of its full-length table when it is
        # built and, when the dtype matches, later returns rows of that slice instead of slicing
        # a table of the actual sequence length: wrong positions for every chunk but the first
        # (the same with the flag on or off). bf16 or thd rebuild the table and are unaffected.
        print(
            "warning: megatron-core's yarn cos/sin cache gives wrong positions with context "
            "parallelism, sbhd and fp32 when --seq-length < --original-max-position-embeddings",
            flush=True,
        )
    results = [run_mode(args, mode, d) for mode in args.modes]
    problems = compare_modes(results) if len(results) > 1 else []
    if d.rank == 0:
        print("summary:")
        for i, r in enumerate(results):
            line = (
                f"  run {i} [{r['mode']:>3}] median step {r['median_step_time_ms']:.3f} ms "
                f"(mean {r['mean_step_time_ms']:.3f}) | final lm loss {r['lm loss'][-1]:.6f}"
                f" | core attention {r['core_attention']}"
            )
            if "rope_profile" in r:
                rp = r["rope_profile"]
                share = rp["rope_share_of_kernel_time"]
                line += (
                    f" | RoPE {rp['rope_us_per_step']:.1f} us/step = "
                    f"{100 * (share or 0):.2f}% of kernel time, "
                    f"{100 * rp['rope_share_of_step_time']:.2f}% of step time"
                )
            print(line)
        by_mode = {}
        for r in results:
            by_mode.setdefault(r["mode"], []).append(r["median_step_time_ms"])
        if {"on", "off"} <= set(by_mode):
            on, off = statistics.median(by_mode["on"]), statistics.median(by_mode["off"])
            print(f"  step time on/off: {on:.3f} / {off:.3f} ms ({100 * (on / off - 1):+.2f}%)")
        if len(results) > 1:
            print("  bitwise: " + ("all runs identical" if not problems else "MISMATCH"))
            for p in problems:
                print("    " + p)
            if problems and not args.deterministic:
                print("    (without --deterministic, kernel choices may differ between runs)")
        if args.output_json:
            with open(args.output_json, "w") as f:
                json.dump(
                    {
                        "format_version": 1,
                        "environment": env,
                        "args": vars(args),
                        "runs": results,
                        "mismatches": problems,
                    },
                    f,
                    indent=1,
                )
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return 1 if problems and args.deterministic else 0


if __name__ == "__main__":
    sys.exit(main())
