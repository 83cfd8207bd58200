# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``python -m megatron_ext.serve``: serve a Megatron checkpoint of a DeepSeek-style MLA GPT.

One command builds the model from a training command line's model flags (megatron.training's own
parser, extended with megatron_ext's flags and the options below), loads ``--load DIR`` with
megatron.training's ``load_checkpoint``, builds megatron-core's ``DynamicInferenceEngine`` with
megatron_ext's MLA step (``--mla-rope-contiguous-load``, ``--inference-static-active-slices`` and
``cache_mla_latents`` are turned on here) and serves it with megatron-core 0.19's
OpenAI-compatible server (``MegatronAsyncLLM.serve``): ``POST /v1/completions``,
``POST /v1/chat/completions`` and ``GET /health``. SIGINT or SIGTERM stops it cleanly::

    python -m megatron_ext.serve --load CKPT <the training run's model and tokenizer flags>
    torchrun --nproc-per-node 2 -m megatron_ext.serve --tensor-model-parallel-size 2 ...

What is wrong with the command line, the checkpoint or the machine (no checkpoint, model
arguments that differ from the checkpoint's, a tokenizer of another vocabulary, a port in use, a
cache that does not fit) is reported before the server starts, with exit status 2. Should
megatron-core's engine loop end while serving (its frontends would keep taking requests that
nothing answers), the server shuts down and exits with status 1.
megatron-core 0.16 has no server: the command refuses at once there.
"""

import argparse
import asyncio
import contextlib
import importlib.util
import multiprocessing
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Iterator, List, Optional, Sequence

from megatron_ext.flags import add_megatron_ext_args
from megatron_ext.inference.serve_checks import (
    GIB,
    ServeConfigError,
    check_port_free,
    check_vocab,
    checkpoint_args,
    checkpoint_args_mismatches,
    find_checkpoint,
    free_gpu_bytes,
    latent_cache_bytes_per_token,
    plan_buffer_size_gb,
)

__all__ = [
    "SERVER_MIN_CORE",
    "add_serve_args",
    "main",
    "parse_serve_args",
    "preflight",
    "stop_signals_blocked",
]

PROG = "python -m megatron_ext.serve"
# The first megatron-core release with MegatronAsyncLLM and its OpenAI-compatible server.
SERVER_MIN_CORE = "0.19"
EXIT_ENGINE_ENDED = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
# How often the server looks whether megatron-core's engine loop still runs, and how long a
# shutdown may take before what it started is ended.
ENGINE_POLL_SECONDS = 0.5
SHUTDOWN_TIMEOUT_SECONDS = 120.0
# What serving MLA through megatron_ext's dynamic step needs, whatever the command line says
# (Megatron-LM: --cache-mla-latents --no-rope-fusion and both megatron_ext flags); the optimizer
# and RNG states of a training checkpoint are not needed to serve.
FORCED_ARGS = {
    "cache_mla_latents": True,
    "apply_rope_fusion": False,
    "mla_rope_contiguous_load": True,
    "inference_static_active_slices": True,
    "no_load_optim": True,
    "no_load_rng": True,
    "exit_on_missing_checkpoint": True,
}
# megatron.training's validate_args asserts a micro-batch size; serving does not use one.
ARG_DEFAULTS = {"micro_batch_size": 1}
# megatron-core 0.19's context takes this many tokens per step when max_tokens is not given.
DEFAULT_STEP_TOKENS = 16384
# The signals that stop the server.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server's options and megatron_ext's flags to ``parser`` (megatron.training's
    ``extra_args_provider``).

    Args:
        parser: megatron.training's parser (or any ``argparse.ArgumentParser``).

    Returns:
        argparse.ArgumentParser: the same parser.
    """
    group = parser.add_argument_group(title="megatron_ext.serve")
    group.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    group.add_argument("--port", type=int, default=5000, help="HTTP port")
    group.add_argument(
        "--random-weights",
        action="store_true",
        help="serve the model with its initial (random) weights; no --load",
    )
    group.add_argument(
        "--max-requests",
        type=int,
        default=None,
        help="requests in the engine at once (default: as many as the cache holds)",
    )
    group.add_argument(
        "--max-sequence-length",
        type=int,
        default=None,
        help="prompt + generated tokens of one request (default: --max-position-embeddings)",
    )
    group.add_argument(
        "--max-tokens", type=int, default=None, help="tokens per engine step (chunked prefill)"
    )
    group.add_argument(
        "--block-size-tokens", type=int, default=64, help="tokens per latent-cache block"
    )
    group.add_argument(
        "--buffer-size-gb",
        type=float,
        default=None,
        help="latent-cache size in GiB (default: --gpu-memory-fraction of the GPU memory free "
        "after loading the model, less an estimate of a step's activations)",
    )
    group.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=0.9,
        help="share of the free GPU memory the cache and a step may use",
    )
    group.add_argument("--frontend-replicas", type=int, default=2, help="HTTP frontend processes")
    group.add_argument(
        "--startup-timeout", type=float, default=300.0, help="seconds to wait for /health"
    )
    return add_megatron_ext_args(parser)


def require_server_release(version: Optional[Any] = None) -> None:
    """Refuse megatron-core releases without the OpenAI-compatible server.

    Args:
        version: the megatron-core version (default: the installed one).

    Raises:
        ServeConfigError: on megatron-core before 0.19, or where megatron.training is missing.
    """
    from packaging.version import Version

    from megatron_ext.utils import get_megatron_core_version

    version = Version(str(version)) if version is not None else get_megatron_core_version()
    if version < Version(SERVER_MIN_CORE):
        raise ServeConfigError(
            f"megatron-core {version} has no OpenAI-compatible server (MegatronAsyncLLM): serving "
            f"needs megatron-core {SERVER_MIN_CORE} or later (pip install "
            "'megatron-core>=0.19,<0.20' and the server extra, pip install 'megatron-ext[server]')"
        )
    if importlib.util.find_spec("megatron.training") is None:
        raise ServeConfigError(
            "megatron.training is not importable: serving parses the command line, builds the "
            "model and loads the checkpoint with it (Megatron-LM's megatron/training at the tag "
            "of the installed megatron-core, on PYTHONPATH after megatron-core)"
        )


def force_serving_args(args: argparse.Namespace) -> None:
    """Set what serving MLA through megatron_ext needs (:data:`FORCED_ARGS`)."""
    for name, value in FORCED_ARGS.items():
        setattr(args, name, value)  # not megatron-core state: this command's parsed arguments


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv`` with megatron.training's parser and :func:`add_serve_args`, validate it as
    megatron.training does and set megatron.training's globals (the tokenizer among them).

    Args:
        argv: the command line, without the program name.

    Returns:
        argparse.Namespace: the arguments, with :data:`FORCED_ARGS` set.

    Raises:
        ServeConfigError: if ``--load`` names no checkpoint (checked first, where
            ``--use-checkpoint-args`` reads the model's arguments from it), or megatron.training
            rejects the arguments.
    """
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    saved_argv = sys.argv
    sys.argv = [PROG, *argv]
    try:
        args = parse_args(extra_args_provider=add_serve_args)
    finally:
        sys.argv = saved_argv
    if args.random_weights and args.load:
        raise ServeConfigError("--random-weights and --load: give one of them")
    if args.use_checkpoint_args and not args.random_weights:
        from megatron.training.checkpointing import load_args_from_checkpoint

        find_checkpoint(args.load, getattr(args, "ckpt_step", None))
        load_args_from_checkpoint(args)
    force_serving_args(args)
    try:
        validate_args(args, ARG_DEFAULTS)
    except AssertionError as error:
        raise ServeConfigError(f"megatron.training rejects the arguments: {error}") from error
    set_global_variables(args, build_tokenizer=True)
    return args


def _check_layout(args: argparse.Namespace) -> None:
    """The model and parallel layouts this command serves."""
    if not args.multi_latent_attention:
        raise ServeConfigError(
            "the model is not multi-latent attention: pass the training run's "
            "--multi-latent-attention and its MLA sizes (megatron_ext.serve serves DeepSeek-style "
            "MLA GPTs)"
        )
    unsupported = {
        "--pipeline-model-parallel-size": args.pipeline_model_parallel_size,
        "--context-parallel-size": args.context_parallel_size,
        "--expert-model-parallel-size": args.expert_model_parallel_size,
    }
    for flag, size in unsupported.items():
        if size != 1:
            raise ServeConfigError(f"{flag} {size}: served with 1 only (tensor parallel only)")
    if getattr(args, "cuda_graph_impl", "none") == "local" and getattr(args, "num_experts", None):
        # megatron-core's MoE layers read their tokens per expert back to the host (which a
        # capture cannot do) with the allgather dispatcher always, and with alltoall unless its
        # inference padding gives them fixed shapes.
        if getattr(args, "moe_token_dispatcher_type", None) == "allgather":
            raise ServeConfigError(
                "--cuda-graph-impl local with MoE layers and --moe-token-dispatcher-type "
                "allgather: that dispatcher reads its tokens per expert back to the host in every "
                "step, which a CUDA graph capture cannot do; use alltoall with "
                "--moe-pad-experts-for-cuda-graph-inference, or no CUDA graphs"
            )
        if not getattr(args, "moe_pad_experts_for_cuda_graph_inference", False):
            raise ServeConfigError(
                "--cuda-graph-impl local with MoE layers needs --moe-pad-experts-for-cuda-graph-"
                "inference: without it megatron-core's MoE layers read their tokens per expert "
                "back to the host, which a CUDA graph capture cannot do"
            )
    if args.world_size != args.tensor_model_parallel_size:
        raise ServeConfigError(
            f"{args.world_size} processes for --tensor-model-parallel-size "
            f"{args.tensor_model_parallel_size}: data-parallel serving is not supported, start "
            "as many processes as the tensor-parallel size"
        )
    if args.transformer_impl == "transformer_engine" and (
        importlib.util.find_spec("transformer_engine") is None
    ):
        raise ServeConfigError(
            "--transformer-impl transformer_engine (megatron.training's default) but Transformer "
            "Engine is not installed: pass --transformer-impl local --spec "
            "megatron_ext.models.gpt.gpt_layer_specs get_gpt_layer_local_mla_spec"
        )
    for flag, value in (
        ("--block-size-tokens", args.block_size_tokens),
        ("--max-requests", args.max_requests),
        ("--max-sequence-length", args.max_sequence_length),
        ("--max-tokens", args.max_tokens),
        ("--frontend-replicas", args.frontend_replicas),
    ):
        if value is not None and value < 1:
            raise ServeConfigError(f"{flag} {value}: must be >= 1")
    if not 0 < args.gpu_memory_fraction <= 1:
        raise ServeConfigError(
            f"--gpu-memory-fraction {args.gpu_memory_fraction}: must be in (0, 1]"
        )


def cpu_refusal() -> Optional[str]:
    """Why this machine cannot serve, or None: megatron-core's inference engine needs a CUDA
    device (the tests serve tiny models on the CPU through ``megatron_ext.testing.cpu_serve``)."""
    import torch

    if torch.cuda.is_available():
        return None
    return (
        "no CUDA device: serving needs a GPU (megatron-core's inference engine runs on CUDA); "
        "tests serve tiny models on the CPU with python -m megatron_ext.testing.cpu_serve under "
        "TRITON_INTERPRET=1"
    )


def preflight(args: argparse.Namespace, tokenizer_vocab: int) -> None:
    """Everything checked before torch.distributed, the model or the server start: the layout,
    the port (on the rank that serves HTTP), the checkpoint, its model arguments (megatron_ext's
    list and megatron.training's ``check_checkpoint_args``) and the tokenizer's vocabulary.

    Args:
        args: :func:`parse_serve_args`'s arguments.
        tokenizer_vocab: the tokenizer's vocabulary size.

    Raises:
        ServeConfigError: naming the first problem found.
    """
    _check_layout(args)
    if args.rank == 0:
        check_port_free(args.host, args.port)
    saved = None
    if not args.random_weights:
        saved, version = checkpoint_args(
            find_checkpoint(args.load, getattr(args, "ckpt_step", None))
        )
        problems = checkpoint_args_mismatches(saved, args) if saved is not None else []
        if problems:
            raise ServeConfigError(
                f"the checkpoint in {args.load} was saved with other model arguments than the "
                f"command line gives: {'; '.join(problems)} (pass the training run's model flags, "
                "or --use-checkpoint-args)"
            )
    check_vocab(tokenizer_vocab, args.padded_vocab_size, getattr(saved, "padded_vocab_size", None))
    if saved is not None:
        # megatron.training's own check too (it reads the run's arguments from its globals).
        from megatron.training.checkpointing import check_checkpoint_args, set_checkpoint_version

        # Its checks depend on the checkpoint's version, which load_checkpoint sets (the same).
        set_checkpoint_version(version)
        try:
            check_checkpoint_args(saved)
        except AssertionError as error:
            raise ServeConfigError(f"checkpoint {args.load}: {error}") from error


def _free_local_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (a one-process group's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(args: argparse.Namespace) -> None:
    """torch.distributed and megatron-core's model-parallel state: under torchrun from its
    environment, otherwise one process on a free local port. NCCL with a GPU, gloo without."""
    import torch
    from megatron.core import parallel_state, tensor_parallel

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        if "MASTER_ADDR" in os.environ:
            init = "env://"
        else:
            init = f"tcp://127.0.0.1:{_free_local_port()}"
        torch.distributed.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=init,
            rank=args.rank,
            world_size=args.world_size,
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(args.tensor_model_parallel_size)
    torch.manual_seed(args.seed)
    if cuda:
        tensor_parallel.model_parallel_cuda_manual_seed(args.seed)


def build_model(args: argparse.Namespace) -> Any:
    """The GPT as megatron.training builds it for inference (its ``GPTModelBuilder`` from the
    parsed arguments, the layer spec of ``--spec`` or megatron.training's default, no DDP), with
    ``--load`` loaded by megatron.training's ``load_checkpoint``.

    Returns:
        torch.nn.Module: the model, in eval mode.
    """
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.models import GPTModelBuilder

    from megatron_ext import apply_megatron_ext
    from megatron_ext.model_check import check_model_uses_megatron_ext

    apply_megatron_ext(args)  # before the layer spec is built
    builder = GPTModelBuilder(gpt_config_from_args(args))
    chunks = builder.build_distributed_models(
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(), wrap_with_ddp=False
    )
    check_model_uses_megatron_ext(chunks)
    if not args.random_weights:
        load_checkpoint(chunks, None, None, strict=True)
    (model,) = chunks
    return model.eval()


def activation_reserve_bytes(args: argparse.Namespace, dtype_bytes: int) -> int:
    """An estimate of what one engine step needs besides the cache: a few hidden- and FFN-wide
    tensors per token of the step (layers run one at a time), the last-token logits in float32,
    and 1 GiB for the CUDA context's workspaces and the allocator's fragmentation."""
    tokens = args.max_tokens or DEFAULT_STEP_TOKENS
    ffn = max(args.ffn_hidden_size or 0, (args.moe_ffn_hidden_size or 0) * args.moe_router_topk)
    rows = args.max_requests or tokens
    per_token = (16 * args.hidden_size + 4 * ffn) * dtype_bytes
    return GIB + tokens * per_token + rows * args.padded_vocab_size * 4 * 2


def inference_config(args: argparse.Namespace, model: Any) -> Any:
    """megatron-core's ``InferenceConfig`` from the serve options, the latent cache sized to the
    free GPU memory (:func:`plan_buffer_size_gb`)."""
    from megatron.core.inference.config import InferenceConfig

    dtype_bytes = next(model.parameters()).element_size()
    max_sequence_length = args.max_sequence_length or args.max_position_embeddings
    buffer_gb = plan_buffer_size_gb(
        bytes_per_token=latent_cache_bytes_per_token(
            args.num_layers, args.kv_lora_rank, args.qk_pos_emb_head_dim, dtype_bytes
        ),
        max_sequence_length=max_sequence_length,
        block_size_tokens=args.block_size_tokens,
        requested_gb=args.buffer_size_gb,
        free_bytes=free_gpu_bytes(),
        reserve_bytes=activation_reserve_bytes(args, dtype_bytes),
        memory_fraction=args.gpu_memory_fraction,
    )
    return InferenceConfig(
        max_sequence_length=max_sequence_length,
        buffer_size_gb=buffer_gb,
        block_size_tokens=args.block_size_tokens,
        max_requests=args.max_requests,
        max_tokens=args.max_tokens,
        enable_chunked_prefill=True,
        materialize_only_last_token_logits=True,
    )


def wait_until_healthy(host: str, port: int, timeout: float) -> None:
    """Poll ``/health`` until it answers 200 (the frontends bind after they start).

    Raises:
        TimeoutError: if it has not answered within ``timeout`` seconds.
    """
    address = "127.0.0.1" if host in ("0.0.0.0", "") else host
    address = f"[{address}]" if ":" in address else address
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{address}:{port}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server on port {port} did not answer /health in {timeout} s")
        time.sleep(0.25)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread inside the block; one sent to this thread alone
    is delivered when the block ends (Python still handles one sent to the process: another
    thread takes it). Threads started inside inherit the mask and keep it, and so do processes
    they spawn: a blocked signal stays blocked across fork and exec."""
    from multiprocessing import resource_tracker

    # Started first: multiprocessing starts it with exactly these signals blocked and then
    # unblocks them in the calling thread, which would undo the block for what comes after.
    resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class EngineEnded(RuntimeError):
    """megatron-core's engine loop ended while the server was serving."""


async def wait_for_stop_or_engine_end(
    stop: asyncio.Event, engine: Any, poll: float = ENGINE_POLL_SECONDS
) -> Optional[str]:
    """Wait until ``stop`` is set or ``engine``'s loop task ends, whichever comes first.

    megatron-core runs the engine loop on its own thread's event loop; when that task ends (an
    exception in a step) its frontends keep accepting requests that nothing will answer, and
    ``/health`` still answers 200. The server stops instead, so that a supervisor sees it.

    Args:
        stop: set by the stop signals.
        engine: megatron-core's ``DynamicInferenceEngine`` (its ``engine_loop_task``).
        poll: seconds between looks at the task.

    Returns:
        Optional[str]: None when ``stop`` was set; otherwise how the engine loop ended.
    """
    while not stop.is_set():
        task = getattr(engine, "engine_loop_task", None)
        if task is not None and task.done():
            if task.cancelled():
                return "its task was cancelled"
            error = task.exception()
            return "it returned" if error is None else f"{type(error).__name__}: {error}"
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), poll)
    return None


async def serve_until_signal(args: argparse.Namespace, model: Any, tokenizer: Any) -> None:
    """Serve ``model`` until SIGINT or SIGTERM, then stop the frontends, the engine and the
    coordinator. Tensor-parallel ranks other than 0 run the engine and stop with rank 0.

    Raises:
        EngineEnded: when megatron-core's engine loop ended while serving (after the shutdown).
    """
    from megatron.core.inference.apis import MegatronAsyncLLM, ServeConfig

    config = inference_config(args, model)
    stop = asyncio.Event()

    def on_signal() -> None:
        # The first signal stops the server in order; a second one (a stuck shutdown) at once.
        if stop.is_set():
            print(f"{PROG}: second signal, exiting without a clean shutdown", flush=True)
            os._exit(EXIT_INTERRUPTED)
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, on_signal)
    # torchrun (and a terminal) signals each rank's whole process group, megatron-core's
    # coordinator process among it; a coordinator that died with the signal would leave
    # shutdown() waiting for it forever. It is spawned here (from the LLM's loop thread), so it
    # starts with the stop signals blocked and is stopped by shutdown() in order instead.
    with stop_signals_blocked():
        llm = MegatronAsyncLLM(
            model=model,
            tokenizer=tokenizer,
            inference_config=config,
            # One host: the coordinator's ZMQ sockets stay on the loopback interface.
            coordinator_host="127.0.0.1",
            coordinator_port=getattr(args, "inference_coordinator_port", None),
        )
    try:
        await llm.serve(
            ServeConfig(host=args.host, port=args.port, frontend_replicas=args.frontend_replicas),
            blocking=False,
        )
        if not llm.is_primary_rank:
            await llm.wait_for_shutdown()
            return
        await asyncio.to_thread(wait_until_healthy, args.host, args.port, args.startup_timeout)
        print(
            f"{PROG}: serving on http://{args.host}:{args.port}/v1 (POST /v1/completions, "
            f"/v1/chat/completions; GET /health); latent cache {config.buffer_size_gb:.2f} GiB, "
            f"block {config.block_size_tokens} tokens, context {type(llm.context).__name__}. "
            "SIGINT or SIGTERM stops it.",
            flush=True,
        )
        ended = await wait_for_stop_or_engine_end(stop, llm.engine)
        reason = "" if ended is None else f": the engine loop ended ({ended})"
        print(f"{PROG}: stopping{reason}", flush=True)
        if ended is not None:
            raise EngineEnded(f"the engine stopped serving: {ended}")
    finally:
        if llm.is_primary_rank:
            coordinator = getattr(llm.engine, "inference_coordinator_process", None)
            try:
                await asyncio.wait_for(llm.shutdown(), SHUTDOWN_TIMEOUT_SECONDS)
            except asyncio.TimeoutError:
                print(
                    f"{PROG}: the shutdown did not finish in {SHUTDOWN_TIMEOUT_SECONDS:.0f} s",
                    flush=True,
                )
            if coordinator is not None:
                coordinator.join(timeout=30)
            # What megatron-core started and did not stop in time (a frontend a terminal's
            # SIGINT interrupted mid-shutdown): ended here so nothing outlives the command.
            for child in multiprocessing.active_children():
                child.terminate()
                child.join(timeout=5)
                if child.is_alive():  # the coordinator blocks SIGTERM (above)
                    child.kill()
                    child.join(timeout=5)


def run(args: argparse.Namespace) -> int:
    """Build, load and serve (after :func:`preflight`).

    Returns:
        int: the exit status.
    """
    import torch
    from megatron.training.global_vars import get_tokenizer

    init_distributed(args)
    try:
        model = build_model(args)
        asyncio.run(serve_until_signal(args, model, get_tokenizer()))
    except ServeConfigError as error:  # the cache size, known once the model is loaded
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except EngineEnded as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_ENGINE_ENDED
    except KeyboardInterrupt:  # SIGINT while the model was built or loaded: nothing serves yet
        print(f"{PROG}: interrupted before serving", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    print(f"{PROG}: stopped", flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    """The command.

    Args:
        argv: arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        int: 0 after a clean stop, 1 when megatron-core's engine loop ended while serving, 2 for
        bad input found before serving, 130 when interrupted before serving or by a second
        signal.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    # megatron.training's validate_args refuses tensor parallel > 1 on GPUs before Blackwell
    # without it (it orders the tensor-parallel communication); read when CUDA starts, later.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    try:
        require_server_release()
        args = parse_serve_args(argv)
        from megatron.training.global_vars import get_tokenizer

        preflight(args, get_tokenizer().vocab_size)
        refusal = cpu_refusal()
        if refusal is not None:
            raise ServeConfigError(refusal)
    except ServeConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
