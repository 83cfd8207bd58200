# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Checks ``python -m megatron_ext.serve`` makes before it builds a model or starts a server.

Each check raises :class:`ServeConfigError` with a message naming the option or file that is
wrong; none needs a GPU, megatron.training or megatron-core's server, so they also run where
serving itself cannot (megatron-core 0.16, a machine without a GPU).
"""

import argparse
import errno
import math
import socket
from pathlib import Path
from typing import Any, Iterable, List, Optional, Tuple

__all__ = [
    "MODEL_SHAPE_ARGS",
    "ServeConfigError",
    "check_port_free",
    "check_vocab",
    "checkpoint_args",
    "checkpoint_args_mismatches",
    "find_checkpoint",
    "free_gpu_bytes",
    "latent_cache_bytes_per_token",
    "plan_buffer_size_gb",
]

GIB = 1024**3
TRACKER_FILE = "latest_checkpointed_iteration.txt"

# Arguments that fix the shape or the computation of an MLA GPT's weights: a checkpoint saved with
# other values cannot be loaded into the model the command line builds (megatron-core would fail
# deep inside the sharded load, or load weights that mean something else).
MODEL_SHAPE_ARGS: Tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "qk_layernorm",
    "normalization",
    "swiglu",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "position_embedding_type",
    "num_experts",
    "moe_router_topk",
    "moe_ffn_hidden_size",
    "moe_shared_expert_intermediate_size",
    "moe_layer_freq",
)


class ServeConfigError(ValueError):
    """A serve command line, checkpoint or machine that cannot serve; the message says why."""


def check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once and release it, so a port in use is reported before a model is
    built (the HTTP frontends bind only after the engine is up).

    ``SO_REUSEADDR`` is set, as the frontends' server sets it: a port held only by connections in
    ``TIME_WAIT`` is free for it, one that something listens on is not.

    Args:
        host: the address the server will bind.
        port: the port it will bind (1-65535).

    Raises:
        ServeConfigError: if the port is out of range, in use, or cannot be bound on ``host``.
    """
    if not 0 < port < 65536:
        raise ServeConfigError(f"--port {port}: a TCP port is 1-65535")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                raise ServeConfigError(
                    f"--port {port}: {host}:{port} is already in use; stop what listens there or "
                    "give another --port"
                ) from None
            raise ServeConfigError(
                f"--host {host} --port {port}: cannot bind it: {error.strerror or error}"
            ) from None


def _read_tracker(tracker: Path) -> Tuple[Optional[int], bool]:
    """(iteration, release) from megatron.training's tracker file."""
    text = tracker.read_text().strip()
    if text == "release":
        return None, True
    try:
        iteration = int(text)
    except ValueError:
        iteration = -1
    if iteration < 0:
        raise ServeConfigError(
            f"--load {tracker.parent}: {TRACKER_FILE} holds {text[:40]!r}, neither an iteration "
            "number nor 'release'"
        )
    return iteration, False


def find_checkpoint(load_dir: Optional[str], ckpt_step: Optional[int] = None) -> Path:
    """The directory of the checkpoint ``--load`` names, as megatron.training's loader finds it
    (the iteration in ``latest_checkpointed_iteration.txt``, or ``--ckpt-step``).

    Args:
        load_dir: ``--load``.
        ckpt_step: ``--ckpt-step``, the iteration to load instead of the latest.

    Returns:
        Path: the checkpoint's directory (``iter_NNNNNNN`` or ``release``).

    Raises:
        ServeConfigError: if ``load_dir`` is not given or not a directory, holds no checkpoint,
            or the checkpoint is not in the ``torch_dist`` format.
    """
    if not load_dir:
        raise ServeConfigError(
            "--load DIR is required: the directory megatron.training saved the checkpoint to "
            "(or give --random-weights to serve an untrained model)"
        )
    root = Path(load_dir)
    if not root.exists():
        raise ServeConfigError(f"--load {load_dir}: no such directory")
    if not root.is_dir():
        raise ServeConfigError(f"--load {load_dir}: not a directory")
    tracker = root / TRACKER_FILE
    if not tracker.is_file():
        raise ServeConfigError(
            f"--load {load_dir}: no checkpoint there (no {TRACKER_FILE}, which megatron.training "
            "writes with every checkpoint it saves)"
        )
    iteration, release = _read_tracker(tracker)
    if ckpt_step:
        iteration, release = ckpt_step, False
    name = "release" if release else f"iter_{iteration:07d}"
    checkpoint = root / name
    if not checkpoint.is_dir():
        raise ServeConfigError(
            f"--load {load_dir}: {TRACKER_FILE} names {name}, which is not in the directory"
        )
    if not (checkpoint / "metadata.json").is_file():
        found = (
            "a legacy torch checkpoint" if any(checkpoint.glob("mp_rank_*")) else "no checkpoint"
        )
        raise ServeConfigError(
            f"--load {load_dir}: {name} holds {found}, not a torch_dist checkpoint (metadata.json "
            "missing); save with --ckpt-format torch_dist (megatron.training's default)"
        )
    return checkpoint


def checkpoint_args(checkpoint: Path) -> Tuple[Optional[argparse.Namespace], float]:
    """The Megatron arguments saved with a ``torch_dist`` checkpoint, and its format version.

    Args:
        checkpoint: the checkpoint's directory (:func:`find_checkpoint`).

    Returns:
        Tuple[Optional[argparse.Namespace], float]: the arguments of the run that saved it (None
        where it saved none) and megatron.training's ``checkpoint_version`` (0 where absent).

    Raises:
        ServeConfigError: if its common state cannot be read.
    """
    from megatron.core import dist_checkpointing

    try:
        state = dist_checkpointing.load_common_state_dict(str(checkpoint))
    except Exception as error:  # any reader failure is a bad checkpoint to the user
        raise ServeConfigError(
            f"--load: cannot read {checkpoint}'s common state: {type(error).__name__}: {error}"
        ) from error
    if not isinstance(state, dict):
        return None, 0
    return state.get("args"), state.get("checkpoint_version", 0)


def checkpoint_args_mismatches(
    saved: Any, args: Any, names: Iterable[str] = MODEL_SHAPE_ARGS
) -> List[str]:
    """Model arguments where the checkpoint and the command line disagree.

    Arguments the checkpoint did not record are not compared (older releases saved fewer).

    Args:
        saved: the checkpoint's arguments (:func:`checkpoint_args`).
        args: the command line's.
        names: the arguments to compare.

    Returns:
        List[str]: ``"--flag: checkpoint X, command line Y"`` per mismatch.
    """
    problems = []
    # The query groups count only with grouped-query attention (exclusive with MLA): pretrain's
    # throughput logging sets num_query_groups to the head count on the arguments it saves.
    grouped = getattr(saved, "group_query_attention", False) or getattr(
        args, "group_query_attention", False
    )
    for name in names:
        if not hasattr(saved, name) or (name == "num_query_groups" and not grouped):
            continue
        have, want = getattr(saved, name), getattr(args, name, None)
        if have != want:
            flag = "--" + name.replace("_", "-")
            problems.append(f"{flag}: checkpoint {have!r}, command line {want!r}")
    return problems


def check_vocab(
    tokenizer_vocab: int, padded_vocab: int, checkpoint_padded_vocab: Optional[int]
) -> None:
    """The tokenizer's vocabulary against the model's padded one and the checkpoint's.

    Args:
        tokenizer_vocab: the tokenizer's vocabulary size.
        padded_vocab: the model's (embedding rows, logits width) this command line builds.
        checkpoint_padded_vocab: the checkpoint's ``padded_vocab_size``, or None if unrecorded.

    Raises:
        ServeConfigError: if the tokenizer has ids the model has no row for, or the checkpoint's
            embedding has another number of rows than the model built from this tokenizer.
    """
    if tokenizer_vocab > padded_vocab:
        raise ServeConfigError(
            f"the tokenizer has {tokenizer_vocab} tokens but the model's padded vocabulary is "
            f"{padded_vocab}: ids from {padded_vocab} up have no embedding row"
        )
    if checkpoint_padded_vocab is not None and checkpoint_padded_vocab != padded_vocab:
        raise ServeConfigError(
            f"the tokenizer's vocabulary ({tokenizer_vocab} tokens, padded to {padded_vocab} with "
            f"--make-vocab-size-divisible-by and the tensor-parallel size) does not match the "
            f"checkpoint's padded vocabulary ({checkpoint_padded_vocab}): give the tokenizer the "
            "checkpoint was trained with (--tokenizer-type, --tokenizer-model, --vocab-size)"
        )


def latent_cache_bytes_per_token(
    num_layers: int, kv_lora_rank: int, qk_pos_emb_head_dim: int, dtype_bytes: int
) -> int:
    """Bytes of MLA's latent cache per token on one rank: one latent row and one RoPE row per
    layer (the latent is not split over tensor-parallel ranks, each keeps all of it).

    Returns:
        int: bytes.
    """
    return num_layers * (kv_lora_rank + qk_pos_emb_head_dim) * dtype_bytes


def plan_buffer_size_gb(
    *,
    bytes_per_token: int,
    max_sequence_length: int,
    block_size_tokens: int,
    requested_gb: Optional[float],
    free_bytes: Optional[int],
    reserve_bytes: int,
    memory_fraction: float,
) -> float:
    """The latent cache's size (``InferenceConfig.buffer_size_gb``, GiB).

    Given: checked to fit the free GPU memory and hold one request of the longest length.
    Not given: ``memory_fraction`` of the free memory less ``reserve_bytes`` (the step's
    activations and logits).

    Args:
        bytes_per_token: :func:`latent_cache_bytes_per_token`.
        max_sequence_length: ``--max-sequence-length``.
        block_size_tokens: ``--block-size-tokens``.
        requested_gb: ``--buffer-size-gb``, or None.
        free_bytes: free GPU memory after the model is loaded; None without a GPU.
        reserve_bytes: memory kept back for a step's activations.
        memory_fraction: ``--gpu-memory-fraction``.

    Returns:
        float: the buffer size in GiB.

    Raises:
        ServeConfigError: if it does not fit, or cannot hold one request of
            ``max_sequence_length`` tokens.
    """
    blocks = math.ceil(max_sequence_length / block_size_tokens) + 1  # + the context's dummy block
    need = blocks * block_size_tokens * bytes_per_token
    usable = None
    if free_bytes is not None:
        usable = int(free_bytes * memory_fraction) - reserve_bytes
    if requested_gb is None:
        if usable is None:
            raise ServeConfigError(
                "--buffer-size-gb is required without a GPU (its default is derived from free "
                "GPU memory)"
            )
        size = usable
    else:
        size = int(requested_gb * GIB)
        if usable is not None and size > usable:
            raise ServeConfigError(
                f"--buffer-size-gb {requested_gb:g} does not fit: {free_bytes / GIB:.2f} GiB of "
                f"GPU memory are free after loading the model, {memory_fraction:g} of it "
                f"(--gpu-memory-fraction) less {reserve_bytes / GIB:.2f} GiB for a step's "
                f"activations leaves {max(usable, 0) / GIB:.2f} GiB; give a smaller "
                "--buffer-size-gb, --max-requests or --max-tokens"
            )
    if size < need:
        what = f"--buffer-size-gb {requested_gb:g}" if requested_gb is not None else "free memory"
        raise ServeConfigError(
            f"{what} holds {max(size, 0) // bytes_per_token} tokens of latent cache "
            f"({bytes_per_token} bytes each), fewer than one request of --max-sequence-length "
            f"{max_sequence_length} needs ({need / GIB:.3f} GiB); give a larger --buffer-size-gb "
            "or a smaller --max-sequence-length"
        )
    return size / GIB


def free_gpu_bytes() -> Optional[int]:
    """Free memory on the current CUDA device, or None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info()[0])
