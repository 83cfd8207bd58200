# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The tests' CPU launcher of ``megatron_ext.serve``: its stand-ins for CUDA-only calls change
nothing with CUDA, and it refuses a CPU run its kernels could not make."""

import contextlib
import importlib.util

import pytest
import torch

from megatron_ext import serve
from megatron_ext.fusions import tensor_checks
from megatron_ext.testing import cpu_serve
from megatron_ext.testing.network import free_port

HAS_TRAINING = importlib.util.find_spec("megatron.training") is not None


def test_cpu_read_metadata_reads_as_undistributed_and_reduces_on_the_cpu():
    seen = []

    def read_metadata(tracker_filename):
        # megatron.training's own takes its cross-rank maximum on a CUDA tensor when it sees a
        # process group: the CPU version must hide it.
        seen.append((tracker_filename, torch.distributed.is_initialized()))
        return 7, False

    created = not torch.distributed.is_initialized()
    if created:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    try:
        assert cpu_serve.cpu_read_metadata(read_metadata)("tracker.txt") == (7, False)
        assert torch.distributed.is_initialized()  # put back after the call
    finally:
        if created:
            torch.distributed.destroy_process_group()
    assert cpu_serve.cpu_read_metadata(read_metadata)("other.txt") == (7, False)
    assert seen == [("tracker.txt", False), ("other.txt", False)]


def test_cpu_only_torch_changes_nothing_with_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    with cpu_serve.cpu_only_torch():
        assert torch.cuda.current_device is current_device


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only path")
@pytest.mark.skipif(not HAS_TRAINING, reason="needs megatron.training (megatron-core 0.19)")
def test_cpu_only_torch_on_the_cpu():
    from megatron.training import arguments, checkpointing

    original = checkpointing.read_metadata
    arch_version = arguments.get_device_arch_version
    with cpu_serve.cpu_only_torch():
        assert torch.cuda.current_device() == "cpu"  # where megatron-core allocates
        assert checkpointing.read_metadata is not original
        # What validate_args asks for tensor parallel > 1.
        assert arguments.get_device_arch_version() == cpu_serve.CPU_DEVICE_ARCH
    assert checkpointing.read_metadata is original
    assert arguments.get_device_arch_version is arch_version


def test_with_cuda_it_is_the_command_itself(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(serve, "main", lambda argv: calls.append(argv) or 0)
    assert cpu_serve.main(["--port", "1"]) == 0
    assert calls == [["--port", "1"]]


def test_on_the_cpu_it_needs_the_triton_interpreter(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(tensor_checks, "INTERPRETED", False)
    monkeypatch.setattr(serve, "main", lambda argv: pytest.fail("served without the interpreter"))
    assert cpu_serve.main(["--port", "1"]) == serve.EXIT_BAD_INPUT
    assert "TRITON_INTERPRET=1" in capsys.readouterr().err


def test_on_the_cpu_it_serves_with_weights_on_the_cpu_and_no_refusal(monkeypatch):
    seen = []

    def main(argv):
        seen.append((argv, serve.cpu_refusal()))
        return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(tensor_checks, "INTERPRETED", True)
    monkeypatch.setattr(serve, "main", main)
    monkeypatch.setattr(cpu_serve, "cpu_only_torch", contextlib.nullcontext)
    assert cpu_serve.main(["--port", "1"]) == 0
    assert seen == [(["--port", "1", "--use-cpu-initialization"], None)]
    assert serve.cpu_refusal() is not None  # only inside the launcher
