# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Host-side tensor checks shared by every Triton kernel of :mod:`megatron_ext.fusions`.

Each kernel module checks its call with these before any launch (on a layout's first call: the
launch plans of :mod:`megatron_ext.fusions.launch_plans` keep what passed). They raise TypeError
or ValueError with the argument's name, and never read a device tensor's values (no host
synchronisation). Kernel-specific checks stay with their kernels.
"""

import os
from typing import Optional, Sequence, Tuple

import torch

__all__ = [
    "FLOAT_DTYPES",
    "INDEX_DTYPES",
    "INTERPRETED",
    "check_device",
    "check_disjoint",
    "check_index_vector",
    "check_int",
    "check_no_self_overlap",
    "check_runnable",
    "check_tensor",
    "check_unit_last_stride",
    "memory_range",
    "overlaps",
    "span_bytes",
    "spans_meet",
]

# Triton decides at decoration time whether kernels run in its CPU interpreter.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

# The floating-point dtypes the kernels read and write.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The integer dtypes of index tensors (lengths, positions, block ids).
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, x, dtypes: Sequence[torch.dtype]) -> None:
    """Raise TypeError unless ``x`` is a tensor of one of ``dtypes``.

    Args:
        name: what the message calls ``x``.
        x: the argument.
        dtypes: the dtypes accepted.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype {names}; got {x.dtype}")


def check_int(name: str, value, minimum: int) -> int:
    """Raise unless ``value`` is an int (not a bool) of at least ``minimum``.

    Args:
        name: what the message calls ``value``.
        value: the argument.
        minimum: its smallest accepted value.

    Returns:
        int: ``value``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_device(name: str, x: torch.Tensor, device: torch.device) -> None:
    """Raise ValueError unless ``x`` is on ``device`` (the first input's)."""
    if x.device != device:
        raise ValueError(f"{name} is on {x.device}, but the input is on {device}")


def check_runnable(function: str, name: str, x: torch.Tensor) -> None:
    """Raise ValueError for a device ``function``'s kernels cannot run on, saying how to fix it.

    CUDA tensors run compiled; CPU tensors only in Triton's interpreter, which must be chosen
    before Triton is imported (Triton would otherwise fail with "0 active drivers").

    Args:
        function: what the message calls the caller (a function or a family of kernels).
        name: what it calls ``x``.
        x: the tensor whose device the kernels run on.
    """
    kind = x.device.type
    if kind == "cuda" or (kind == "cpu" and INTERPRETED):
        return
    if kind == "cpu":
        raise ValueError(
            f"{function}: {name} is on the CPU; its Triton kernels run on CUDA devices. Move the "
            "tensors to a GPU (.cuda()), or set TRITON_INTERPRET=1 in the environment before "
            "Python starts to run them in Triton's CPU interpreter (slow; meant for tests)"
        )
    raise ValueError(
        f"{function}: {name} is on {x.device}; its Triton kernels run on CUDA devices (or on the "
        "CPU with TRITON_INTERPRET=1 set before Python starts, for tests)"
    )


def check_unit_last_stride(name: str, x: torch.Tensor) -> None:
    """Raise ValueError unless the last dimension of a non-empty ``x`` has unit stride."""
    if x.numel() > 0 and x.stride(-1) != 1:
        raise ValueError(
            f"{name} must have unit stride in its last dimension; got strides {tuple(x.stride())}"
        )


def check_index_vector(name: str, x, length: int, device: torch.device) -> None:
    """Raise unless ``x`` is a contiguous int32/int64 vector of ``length`` entries on ``device``."""
    check_tensor(name, x, INDEX_DTYPES)
    check_device(name, x, device)
    if tuple(x.shape) != (length,):
        raise ValueError(f"{name} must have shape ({length},); got {tuple(x.shape)}")
    if length > 1 and x.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous; got stride {x.stride(0)}")


def span_bytes(x: Optional[torch.Tensor]) -> int:
    """Bytes from a tensor's data pointer to the end of its last element; 0 for None or an
    empty tensor. Its layout (shape, strides, dtype) alone decides it.

    Args:
        x: a tensor, or None.

    Returns:
        int: the span.
    """
    if x is None or x.numel() == 0:
        return 0
    extent = sum((size - 1) * abs(stride) for size, stride in zip(x.shape, x.stride()))
    return (extent + 1) * x.element_size()


def memory_range(x: torch.Tensor) -> Tuple[int, int]:
    """The byte addresses [start, end) that a non-empty tensor's elements lie in.

    Taken from the data pointer and the strides, not from the storage object: two storages can
    hold the same memory (``torch.frombuffer`` of one buffer twice, ``UntypedStorage`` views,
    DLPack or ``__cuda_array_interface__`` imports), and only the addresses tell.
    """
    start = x.data_ptr()
    return start, start + span_bytes(x)


def spans_meet(tensors: Sequence[Optional[torch.Tensor]], spans: Sequence[int], out: int) -> bool:
    """Whether ``tensors[out]``'s bytes meet another tensor's, given the spans of a checked
    layout (:func:`span_bytes`, measured once per layout): per call only the data pointers are
    read, which keeps the test that runs on every call of a cached launch cheap.

    Args:
        tensors: a call's tensors (None for an absent one).
        spans: their spans, in the same order.
        out: the index of the tensor the kernel writes.

    Returns:
        bool: True if they meet (:func:`check_disjoint` then says which).
    """
    out_span = spans[out]
    if not out_span:
        return False
    low = tensors[out].data_ptr()
    high = low + out_span
    for index, (x, span) in enumerate(zip(tensors, spans)):
        if span and index != out:
            start = x.data_ptr()
            if start < high and low < start + span:
                return True
    return False


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory ranges of two tensors intersect (conservative for interleaved views).

    Args:
        a: a tensor.
        b: another tensor.

    Returns:
        bool: False when either is empty.
    """
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = memory_range(a), memory_range(b)
    return a0 < b1 and b0 < a1


def check_disjoint(
    out_name: str, out: torch.Tensor, inputs: Sequence[Tuple[str, torch.Tensor]]
) -> None:
    """Raise ValueError if ``out``'s memory range meets that of any of ``inputs``.

    Args:
        out_name: what the message calls ``out``.
        out: the tensor a kernel writes.
        inputs: (name, tensor) of each tensor it reads (None for an absent one).
    """
    if out.numel() == 0:
        return
    out_start, out_end = memory_range(out)
    for name, tensor in inputs:
        if tensor is None or tensor.numel() == 0:
            continue
        start, end = memory_range(tensor)
        if start < out_end and out_start < end:
            raise ValueError(
                f"{out_name} overlaps {name}: the kernel would read what it writes. Pass "
                "separate tensors"
            )


def check_no_self_overlap(name: str, x: torch.Tensor) -> None:
    """Raise ValueError if two elements of ``x``, which a kernel writes, share memory.

    Two programs would write one address (or an in-place kernel rotate an element twice), with a
    result that depends on the schedule or the launch config. Sufficient test: with the dims of
    size > 1 sorted by stride, each stride exceeds the span of the dims before it (a few exotic
    non-overlapping layouts, dims whose strides interleave, fail it too and are refused).

    Args:
        name: what the message calls ``x``.
        x: the tensor.
    """
    span = 1
    for stride, size in sorted((st, sz) for sz, st in zip(x.shape, x.stride()) if sz > 1):
        if stride < span:
            raise ValueError(
                f"{name} (shape {tuple(x.shape)}, strides {tuple(x.stride())}) has elements that "
                "share memory (an expanded or overlapping view); a kernel would write them more "
                "than once. Pass a tensor that owns its elements (e.g. .contiguous())"
            )
        span += stride * (size - 1)
