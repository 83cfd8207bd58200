# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``python -m megatron_ext.serve``: its options, the refusal before megatron-core 0.19, and each
bad input it reports before a model is built. None needs a GPU; what needs megatron.training or
megatron-core 0.19 is skipped without them, with the reason."""

import argparse
import asyncio
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from multiprocessing import resource_tracker
from pathlib import Path

import pytest
import torch

from megatron_ext import serve
from megatron_ext.inference.serve_checks import (
    GIB,
    ServeConfigError,
    check_port_free,
    check_vocab,
    checkpoint_args,
    checkpoint_args_mismatches,
    find_checkpoint,
    latent_cache_bytes_per_token,
    plan_buffer_size_gb,
)
from megatron_ext.testing.network import free_port
from megatron_ext.utils import get_megatron_core_version

REPO = Path(__file__).resolve().parents[2]
HAS_SERVER_CORE = get_megatron_core_version().release[:2] >= (0, 19)
HAS_TRAINING = importlib.util.find_spec("megatron.training") is not None


def model_namespace(**overrides) -> argparse.Namespace:
    """The model arguments a parsed serve command line carries (a small MLA GPT)."""
    values = dict(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=None,
        multi_latent_attention=True,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_head_dim=16,
        qk_pos_emb_head_dim=16,
        v_head_dim=16,
        qk_layernorm=True,
        normalization="RMSNorm",
        swiglu=True,
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        position_embedding_type="rope",
        num_experts=None,
        moe_router_topk=2,
        moe_ffn_hidden_size=None,
        moe_shared_expert_intermediate_size=None,
        moe_layer_freq=1,
        padded_vocab_size=256,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        tensor_model_parallel_size=1,
        world_size=1,
        rank=0,
        transformer_impl="local",
        block_size_tokens=64,
        max_requests=None,
        max_sequence_length=None,
        max_tokens=None,
        frontend_replicas=2,
        gpu_memory_fraction=0.9,
        host="127.0.0.1",
        port=free_port(),
        random_weights=False,
        load=None,
        ckpt_step=None,
    )
    values.update(overrides)
    return argparse.Namespace(**values)


def write_checkpoint(root: Path, saved: argparse.Namespace, iteration: int = 4) -> Path:
    """A torch_dist checkpoint's directory layout with its common state (the saved arguments);
    no tensors, which the checks before serving do not read."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "latest_checkpointed_iteration.txt").write_text(f"{iteration}\n")
    ckpt = root / f"iter_{iteration:07d}"
    ckpt.mkdir()
    metadata = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
    metadata.update(common_backend="torch", common_backend_version=1)
    (ckpt / "metadata.json").write_text(json.dumps(metadata))
    torch.save({"args": saved, "checkpoint_version": 3.0}, ckpt / "common.pt")
    return ckpt


# ----------------------------------------------------------------------------------------------
# Options


def test_add_serve_args_defaults_and_megatron_ext_flags():
    parser = serve.add_serve_args(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert (args.host, args.port, args.block_size_tokens) == ("127.0.0.1", 5000, 64)
    assert args.buffer_size_gb is None and args.max_requests is None  # derived later
    assert not args.random_weights
    # megatron_ext's own flags come with the serve options.
    assert args.mla_rope_contiguous_load is False and args.inference_static_active_slices is False
    args = parser.parse_args(["--port", "6001", "--buffer-size-gb", "1.5", "--random-weights"])
    assert (args.port, args.buffer_size_gb, args.random_weights) == (6001, 1.5, True)


def test_force_serving_args_turns_on_what_mla_serving_needs():
    args = argparse.Namespace(cache_mla_latents=False, apply_rope_fusion=True)
    serve.force_serving_args(args)
    assert args.cache_mla_latents and not args.apply_rope_fusion
    assert args.mla_rope_contiguous_load and args.inference_static_active_slices
    assert args.no_load_optim and args.exit_on_missing_checkpoint


def test_main_defaults_cuda_device_max_connections_for_tensor_parallel(monkeypatch):
    # megatron.training's validate_args refuses tensor parallel > 1 without it on most GPUs.
    def refuse() -> None:
        raise ServeConfigError("stop here")

    monkeypatch.setattr(serve, "require_server_release", refuse)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    assert serve.main([]) == serve.EXIT_BAD_INPUT
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # the user's value is kept
    assert serve.main([]) == serve.EXIT_BAD_INPUT
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"


# ----------------------------------------------------------------------------------------------
# Stopping under torchrun


MASK_OF_A_CHILD = (
    "import signal; print(sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))"
)


def test_stop_signals_blocked_reach_a_process_spawned_from_a_thread_started_inside():
    # megatron-core spawns its coordinator from its loop thread, after multiprocessing's resource
    # tracker (which unblocks SIGINT and SIGTERM in the thread that starts it) may have started.
    received = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    masks = []

    def spawn() -> None:
        resource_tracker.ensure_running()
        child = subprocess.run(
            [sys.executable, "-c", MASK_OF_A_CHILD], capture_output=True, text=True, check=True
        )
        masks.append(json.loads(child.stdout))

    try:
        with serve.stop_signals_blocked():
            thread = threading.Thread(target=spawn)
            thread.start()
            thread.join()
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
            assert received == []  # held back inside the block
        assert received == [signal.SIGTERM]  # and delivered after it
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert masks == [sorted([int(signal.SIGINT), int(signal.SIGTERM)])]
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()


# ----------------------------------------------------------------------------------------------
# megatron-core 0.16: refused at once


def test_require_server_release_refuses_0_16():
    with pytest.raises(ServeConfigError, match=r"megatron-core 0\.16\.1 has no OpenAI-compatible"):
        serve.require_server_release("0.16.1")


@pytest.mark.skipif(HAS_SERVER_CORE, reason="megatron-core >= 0.19 is installed: it can serve")
def test_module_refuses_on_0_16_before_parsing(capsys):
    # The model flags are not even parsed: the release is checked first.
    assert serve.main(["--num-layers", "2", "--load", "/nonexistent"]) == serve.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "has no OpenAI-compatible server" in err and "0.19" in err


@pytest.mark.skipif(HAS_SERVER_CORE, reason="megatron-core >= 0.19 is installed: it can serve")
def test_python_m_megatron_ext_serve_refuses_on_0_16():
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.serve", "--load", "/nonexistent"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == serve.EXIT_BAD_INPUT, proc.stderr[-2000:]
    assert "megatron_ext.serve: error: megatron-core" in proc.stderr


# ----------------------------------------------------------------------------------------------
# Port


def test_port_in_use_is_reported():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(
            ServeConfigError, match=rf"--port {port}: 127\.0\.0\.1:{port} is already"
        ):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # released: free again


@pytest.mark.parametrize("port", [0, 70000])
def test_port_out_of_range(port):
    with pytest.raises(ServeConfigError, match="1-65535"):
        check_port_free("127.0.0.1", port)


# ----------------------------------------------------------------------------------------------
# --load


def test_load_missing(tmp_path):
    with pytest.raises(ServeConfigError, match="--load DIR is required"):
        find_checkpoint(None)
    with pytest.raises(ServeConfigError, match="no such directory"):
        find_checkpoint(str(tmp_path / "nope"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ServeConfigError, match="not a directory"):
        find_checkpoint(str(tmp_path / "file"))


def test_load_dir_without_checkpoint(tmp_path):
    with pytest.raises(ServeConfigError, match="no checkpoint there"):
        find_checkpoint(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("banana")
    with pytest.raises(ServeConfigError, match="neither an iteration number"):
        find_checkpoint(str(tmp_path))
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("12")
    with pytest.raises(ServeConfigError, match="names iter_0000012, which is not in"):
        find_checkpoint(str(tmp_path))


def test_load_legacy_checkpoint_is_named(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    (tmp_path / "release" / "mp_rank_00").mkdir(parents=True)
    with pytest.raises(ServeConfigError, match="a legacy torch checkpoint, not a torch_dist"):
        find_checkpoint(str(tmp_path))


def test_load_finds_latest_or_ckpt_step(tmp_path):
    ckpt = write_checkpoint(tmp_path, model_namespace())
    assert find_checkpoint(str(tmp_path)) == ckpt
    with pytest.raises(ServeConfigError, match="iter_0000002"):
        find_checkpoint(str(tmp_path), ckpt_step=2)


# ----------------------------------------------------------------------------------------------
# The checkpoint's model arguments


def test_checkpoint_args_read_from_common_state(tmp_path):
    ckpt = write_checkpoint(tmp_path, model_namespace(kv_lora_rank=64))
    saved, version = checkpoint_args(ckpt)
    assert saved.kv_lora_rank == 64 and version == 3.0


def test_checkpoint_args_mismatch_names_each_flag():
    saved = model_namespace(kv_lora_rank=64, num_layers=3)
    problems = checkpoint_args_mismatches(saved, model_namespace())
    assert problems == [
        "--num-layers: checkpoint 3, command line 2",
        "--kv-lora-rank: checkpoint 64, command line 32",
    ]
    # Arguments the checkpoint did not record are not compared.
    older = argparse.Namespace(num_layers=2)
    assert checkpoint_args_mismatches(older, model_namespace()) == []


def test_checkpoint_query_groups_compared_only_with_grouped_query_attention():
    """megatron.training's pretrain saves num_query_groups = the head count (its throughput
    logging sets it) although MLA has no query groups: that is no mismatch; with grouped-query
    attention on either side it is."""
    trained = model_namespace(num_query_groups=4, group_query_attention=False)
    assert checkpoint_args_mismatches(trained, model_namespace(group_query_attention=False)) == []
    grouped = model_namespace(num_query_groups=4, group_query_attention=True)
    command_line = model_namespace(num_query_groups=2, group_query_attention=True)
    assert checkpoint_args_mismatches(grouped, command_line) == [
        "--num-query-groups: checkpoint 4, command line 2"
    ]


def test_preflight_reports_checkpoint_mismatch(tmp_path):
    write_checkpoint(tmp_path, model_namespace(qk_pos_emb_head_dim=32))
    args = model_namespace(load=str(tmp_path))
    with pytest.raises(ServeConfigError, match="--qk-pos-emb-head-dim: checkpoint 32, command"):
        serve.preflight(args, tokenizer_vocab=256)


def test_preflight_reports_port_before_checkpoint(tmp_path):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        args = model_namespace(load=str(tmp_path / "none"), port=listener.getsockname()[1])
        with pytest.raises(ServeConfigError, match="already in use"):
            serve.preflight(args, tokenizer_vocab=256)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(multi_latent_attention=False), "not multi-latent attention"),
        (dict(pipeline_model_parallel_size=2), "--pipeline-model-parallel-size 2"),
        (dict(world_size=2), "data-parallel serving is not supported"),
        (dict(block_size_tokens=0), "--block-size-tokens 0: must be >= 1"),
        (dict(gpu_memory_fraction=1.5), "--gpu-memory-fraction 1.5"),
        (
            dict(cuda_graph_impl="local", num_experts=4, moe_token_dispatcher_type="alltoall"),
            "needs --moe-pad-experts-for-cuda-graph-inference",
        ),
        (
            dict(
                cuda_graph_impl="local",
                num_experts=4,
                moe_token_dispatcher_type="allgather",
                moe_pad_experts_for_cuda_graph_inference=True,
            ),
            "dispatcher reads its tokens per expert back to the host",
        ),
    ],
)
def test_preflight_layout(overrides, message):
    with pytest.raises(ServeConfigError, match=message):
        serve.preflight(model_namespace(random_weights=True, **overrides), tokenizer_vocab=256)


@pytest.mark.parametrize(
    "overrides",
    [
        dict(
            cuda_graph_impl="local",
            num_experts=4,
            moe_token_dispatcher_type="alltoall",
            moe_pad_experts_for_cuda_graph_inference=True,
        ),
        dict(cuda_graph_impl="local", num_experts=None),
        dict(cuda_graph_impl="none", num_experts=4, moe_token_dispatcher_type="allgather"),
    ],
)
def test_preflight_takes_moe_graphs_with_padding_and_either_alone(overrides):
    serve.preflight(model_namespace(random_weights=True, **overrides), tokenizer_vocab=256)


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine present"
)
def test_preflight_transformer_engine_missing():
    args = model_namespace(random_weights=True, transformer_impl="transformer_engine")
    with pytest.raises(ServeConfigError, match="--transformer-impl local"):
        serve.preflight(args, tokenizer_vocab=256)


# ----------------------------------------------------------------------------------------------
# Tokenizer vocabulary


def test_vocab_larger_than_model():
    with pytest.raises(ServeConfigError, match="tokenizer has 300 tokens but the model's padded"):
        check_vocab(300, 256, None)


def test_vocab_not_the_checkpoints():
    with pytest.raises(ServeConfigError, match=r"checkpoint's padded vocabulary \(512\)"):
        check_vocab(256, 256, 512)
    check_vocab(250, 256, 256)


def test_preflight_reports_vocab_of_checkpoint(tmp_path):
    write_checkpoint(tmp_path, model_namespace(padded_vocab_size=512))
    args = model_namespace(load=str(tmp_path))
    with pytest.raises(ServeConfigError, match="does not match the checkpoint's padded vocabulary"):
        serve.preflight(args, tokenizer_vocab=256)


# ----------------------------------------------------------------------------------------------
# Latent-cache size


PER_TOKEN = latent_cache_bytes_per_token(2, 512, 64, 2)


def plan(**overrides):
    values = dict(
        bytes_per_token=PER_TOKEN,
        max_sequence_length=4096,
        block_size_tokens=64,
        requested_gb=None,
        free_bytes=80 * GIB,
        reserve_bytes=2 * GIB,
        memory_fraction=0.9,
    )
    values.update(overrides)
    return plan_buffer_size_gb(**values)


def test_buffer_default_from_free_memory():
    assert PER_TOKEN == 2 * 576 * 2
    assert plan() == pytest.approx(0.9 * 80 - 2)


def test_buffer_requested_fits():
    assert plan(requested_gb=10) == 10


def test_buffer_requested_too_large():
    with pytest.raises(ServeConfigError, match="--buffer-size-gb 71 does not fit: 80.00 GiB"):
        plan(requested_gb=71)


def test_buffer_too_small_for_one_request():
    with pytest.raises(ServeConfigError, match="fewer than one request of --max-sequence-length"):
        plan(requested_gb=0.001)
    with pytest.raises(ServeConfigError, match="free memory holds"):
        plan(free_bytes=2 * GIB)


def test_buffer_required_without_gpu():
    with pytest.raises(ServeConfigError, match="--buffer-size-gb is required without a GPU"):
        plan(free_bytes=None)
    assert plan(free_bytes=None, requested_gb=1) == 1


# ----------------------------------------------------------------------------------------------
# megatron.training's parser (megatron-core 0.19 ships it; CI's 0.16.1 does not)


TINY = (
    "--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
    "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 32 --qk-head-dim 16 "
    "--qk-pos-emb-head-dim 16 --v-head-dim 16 --rope-type yarn --seq-length 128 "
    "--max-position-embeddings 128 --tokenizer-type NullTokenizer --vocab-size 256 "
    "--transformer-impl local"
).split()


@pytest.mark.skipif(
    not (HAS_SERVER_CORE and HAS_TRAINING),
    reason="needs megatron-core >= 0.19 and megatron.training",
)
def test_parse_serve_args_and_preflight_with_megatron_training(tmp_path):
    # One parse per process: it sets megatron.training's globals.
    write_checkpoint(tmp_path, argparse.Namespace())
    args = serve.parse_serve_args(TINY + ["--load", str(tmp_path), "--port", str(free_port())])
    assert args.cache_mla_latents and not args.apply_rope_fusion
    assert args.mla_rope_contiguous_load and args.inference_static_active_slices
    assert args.padded_vocab_size == 256
    # A checkpoint saved by this command line passes both checks (megatron_ext's and
    # megatron.training's check_checkpoint_args).
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    shutil.rmtree(tmp_path / "iter_0000004")
    write_checkpoint(tmp_path, argparse.Namespace(**vars(args)))
    serve.preflight(args, tokenizer_vocab=256)
    with pytest.raises(ServeConfigError, match="--random-weights and --load"):
        serve.parse_serve_args(TINY + ["--random-weights", "--load", str(tmp_path)])


def test_serving_needs_a_gpu_and_names_the_tests_cpu_launcher(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert serve.cpu_refusal() is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refusal = serve.cpu_refusal()
    assert "no CUDA device" in refusal and "megatron_ext.testing.cpu_serve" in refusal


class _LoopTask:
    """A stand-in for the engine loop's task on megatron-core's loop thread."""

    def __init__(self, error=None, cancelled=False, ends_after=0.0):
        self.error, self._cancelled = error, cancelled
        self.end = None if ends_after is None else time.monotonic() + ends_after

    def done(self):
        return self.end is not None and time.monotonic() >= self.end

    def cancelled(self):
        return self._cancelled

    def exception(self):
        return self.error


@pytest.mark.parametrize(
    "task, stop_after, expected",
    [
        (_LoopTask(ends_after=None), 0.2, None),
        (_LoopTask(RuntimeError("boom"), ends_after=0.2), None, "RuntimeError: boom"),
        (_LoopTask(cancelled=True), None, "its task was cancelled"),
        (_LoopTask(), None, "it returned"),
        (None, 0.1, None),
    ],
    ids=["stopped", "step_raised", "cancelled", "returned", "no_task_yet"],
)
def test_wait_for_stop_or_engine_end(task, stop_after, expected):
    async def wait():
        stop = asyncio.Event()
        if stop_after is not None:
            asyncio.get_running_loop().call_later(stop_after, stop.set)
        engine = types.SimpleNamespace(engine_loop_task=task)
        return await serve.wait_for_stop_or_engine_end(stop, engine, poll=0.02)

    assert asyncio.run(asyncio.wait_for(wait(), 10)) == expected


def test_an_engine_loop_that_ends_while_serving_stops_the_server(monkeypatch, capsys):
    """megatron-core's frontends would keep taking requests that nothing answers: the server
    shuts down what it started and the command exits with status 1, saying why."""
    shut_down = []

    class LLM:
        is_primary_rank = True

        def __init__(self, **kwargs):
            self.engine = types.SimpleNamespace(
                engine_loop_task=_LoopTask(ValueError("a step raised"), ends_after=0.2)
            )
            self.context = None

        async def serve(self, config, blocking):
            assert blocking is False

        async def shutdown(self):
            shut_down.append(True)

    apis = types.ModuleType("megatron.core.inference.apis")
    apis.MegatronAsyncLLM, apis.ServeConfig = LLM, lambda **kwargs: kwargs
    monkeypatch.setitem(sys.modules, "megatron.core.inference.apis", apis)
    config = types.SimpleNamespace(buffer_size_gb=1.0, block_size_tokens=64)
    monkeypatch.setattr(serve, "inference_config", lambda args, model: config)
    monkeypatch.setattr(serve, "wait_until_healthy", lambda host, port, timeout: None)
    monkeypatch.setattr(serve, "init_distributed", lambda args: None)
    # run() ends the process group it set up; here the test session's own is left alone.
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: None)
    monkeypatch.setattr(serve, "build_model", lambda args: object())
    # run() takes the tokenizer from megatron.training, which need not be installed here.
    training = types.ModuleType("megatron.training")
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_tokenizer = lambda: object()
    training.global_vars = global_vars
    monkeypatch.setitem(sys.modules, "megatron.training", training)
    monkeypatch.setitem(sys.modules, "megatron.training.global_vars", global_vars)
    args = argparse.Namespace(host="127.0.0.1", port=1, frontend_replicas=1, startup_timeout=1.0)

    def too_long(signum, frame):
        raise TimeoutError("the server kept waiting for a stop signal after its engine ended")

    # A server that misses the end would wait for a signal forever: fail the test instead.
    previous = signal.signal(signal.SIGALRM, too_long)
    signal.alarm(30)
    try:
        assert serve.run(args) == serve.EXIT_ENGINE_ENDED
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert shut_down == [True]
    err = capsys.readouterr().err
    assert "the engine stopped serving: ValueError: a step raised" in err
