# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``python -m megatron_ext.testing.cpu_serve ARGS``: ``python -m megatron_ext.serve ARGS`` on a
CPU-only torch build, for tests (tiny models; megatron_ext's Triton kernels in Triton's
interpreter, ``TRITON_INTERPRET=1``).

megatron-core's model and engine and megatron.training's loader call CUDA where they have no CPU
path (``torch.cuda.current_device()``, pinned memory, events, streams, a CUDA tensor in
``read_metadata``, the GPU's architecture in ``validate_args`` for tensor parallel > 1);
:func:`cpu_only_torch` stands in for them around the whole command, and the weights are allocated
on the CPU (``--use-cpu-initialization``). Serving itself needs a GPU: ``megatron_ext.serve``
refuses a machine without one, this launcher aside.
"""

import contextlib
import sys
from typing import Callable, Iterator, List, Optional, Tuple
from unittest import mock

import torch

__all__ = ["CPU_DEVICE_ARCH", "cpu_only_torch", "cpu_read_metadata", "main"]

# The GPU architecture megatron.training's validate_args is told on the CPU (9: Hopper).
CPU_DEVICE_ARCH = 9


def cpu_read_metadata(
    read_metadata: Callable[[str], Tuple[int, bool]],
) -> Callable[[str], Tuple[int, bool]]:
    """megatron.training's ``read_metadata`` for a CPU-only torch build.

    megatron.training takes the ranks' largest iteration on a CUDA tensor whenever
    torch.distributed is initialised; this runs ``read_metadata`` as if it were not and takes the
    maximum over the ranks on a CPU tensor instead (gloo).

    Args:
        read_metadata: megatron.training's ``checkpointing.read_metadata``.

    Returns:
        Callable[[str], Tuple[int, bool]]: the same function, reducing on the CPU.
    """

    def cpu_version(tracker_filename: str) -> Tuple[int, bool]:
        with mock.patch.object(torch.distributed, "is_initialized", return_value=False):
            iteration, release = read_metadata(tracker_filename)
        if torch.distributed.is_initialized():
            largest = torch.tensor([iteration], dtype=torch.long)
            torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
            iteration = int(largest[0])
        return iteration, release

    return cpu_version


@contextlib.contextmanager
def cpu_only_torch() -> Iterator[None]:
    """Let the model, its loading and the engine run on a CPU-only torch build (megatron_ext's
    ``cpu_torch_compat`` and :func:`cpu_read_metadata`); nothing changes with CUDA."""
    if torch.cuda.is_available():
        yield
        return
    from megatron.training import arguments, checkpointing

    from megatron_ext.testing.synthetic import cpu_torch_compat

    cpu_version = cpu_read_metadata(checkpointing.read_metadata)
    with contextlib.ExitStack() as stack:
        stack.enter_context(cpu_torch_compat())
        stack.enter_context(mock.patch.object(checkpointing, "read_metadata", cpu_version))
        # validate_args asks CUDA for the GPU's architecture when tensor parallel > 1; a
        # pre-Blackwell answer keeps its CUDA_DEVICE_MAX_CONNECTIONS check, as on most GPUs.
        stack.enter_context(
            mock.patch.object(arguments, "get_device_arch_version", lambda: CPU_DEVICE_ARCH)
        )
        yield


def main(argv: Optional[List[str]] = None) -> int:
    """``megatron_ext.serve``'s command on the CPU.

    Args:
        argv: its arguments (default: ``sys.argv[1:]``).

    Returns:
        int: its exit status.
    """
    from megatron_ext import serve
    from megatron_ext.fusions import tensor_checks

    argv = sys.argv[1:] if argv is None else list(argv)
    if torch.cuda.is_available():
        return serve.main(argv)
    if not tensor_checks.INTERPRETED:
        # Checked first: otherwise the engine fails at the first request, behind a running server.
        print(
            f"{serve.PROG}: error: no CUDA device: megatron_ext's Triton kernels run on the CPU "
            "only in Triton's interpreter; set TRITON_INTERPRET=1 in the environment before "
            "starting (slow: tiny models)",
            file=sys.stderr,
        )
        return serve.EXIT_BAD_INPUT
    with cpu_only_torch(), mock.patch.object(serve, "cpu_refusal", lambda: None):
        return serve.main(argv + ["--use-cpu-initialization"])


if __name__ == "__main__":
    raise SystemExit(main())
