# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The kernel breakdown of the MLA engine benchmark's decode step (``--profile-steps N``): N
decode steps of an engine under ``torch.profiler`` (CUDA activity only), each synchronised before
and after as the timed rounds' steps are; per kernel (by name) its time per step, calls per step
and share of the GPU time, the step's GPU time against its wall time (the host share,
``1 - GPU / wall``), and the copies apart: every kernel whose full name says it copies (torch's
``direct_copy_kernel`` inside a generic ``elementwise_kernel``, ``CatArrayBatchedCopy``, memcpy),
their share of the GPU time and the largest of them, which a step should keep small. Every
kernel is also put in one of :data:`KERNEL_KINDS` by its name (:func:`kernel_kind`), so that a
prefill's time reads as its linear layers' GEMMs against its attention.

:func:`kernel_breakdown` and :func:`breakdown_lines` are pure functions of the profiler's events
(anything with ``name`` and ``time_range.elapsed_us()``), so the tests check them on made-up
events; :func:`profile_decode_steps` runs the profiler and needs a GPU.
"""

import time
from typing import Any, Dict, Iterable, List, Sequence

__all__ = [
    "KERNEL_KINDS",
    "TOP_KERNELS",
    "breakdown_lines",
    "is_copy_kernel",
    "kernel_breakdown",
    "kernel_kind",
    "profile_decode_steps",
    "profile_prefill",
]

TOP_KERNELS = 12
KERNEL_KINDS = ("matmul", "attention", "copy", "other")
# Lowercase parts of kernel names. Attention is looked for before matmul: FlashAttention's names
# carry cutlass's namespace and cuDNN's attention names say wgmma.
_ATTENTION_MARKS = (
    "attention",
    "attn",
    "sdpa",
    "fmha",
    "flash",
    "batchmla",
    "gluon_decode",
    "combine_splits",
    "merge_partials",
)
_MATMUL_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "matmul")


def is_copy_kernel(name: str) -> bool:
    """Whether a GPU event's full name is a copy: its template arguments or name say ``copy``
    (torch's copies run as ``elementwise_kernel<..., direct_copy_kernel_cuda ...>`` among other
    elementwise work, so only the full name tells them apart) or ``memcpy``.

    Args:
        name: the profiler's kernel name, untruncated.

    Returns:
        bool: True for a copy.
    """
    lowered = name.lower()
    return "copy" in lowered or "memcpy" in lowered


def kernel_kind(name: str) -> str:
    """Which of :data:`KERNEL_KINDS` a GPU event is, by its full name: a copy
    (:func:`is_copy_kernel`), attention (torch's cuDNN and flash entries, FlashInfer's MLA,
    megatron_ext's latent attention and its split combine and merges), a matmul (cuBLAS, cuBLASLt
    and CUTLASS GEMMs), else other.

    Args:
        name: the profiler's kernel name, untruncated.

    Returns:
        str: the kind.
    """
    if is_copy_kernel(name):
        return "copy"
    lowered = name.lower()
    if any(mark in lowered for mark in _ATTENTION_MARKS):
        return "attention"
    if any(mark in lowered for mark in _MATMUL_MARKS):
        return "matmul"
    return "other"


def kernel_breakdown(
    events: Iterable[Any], steps: int, wall_seconds: float, top: int = TOP_KERNELS
) -> Dict[str, Any]:
    """Aggregate GPU events over ``steps`` decode steps.

    Args:
        events: the profiler's device events (kernels, copies, memsets) of the steps.
        steps: decode steps profiled.
        wall_seconds: the steps' wall time, summed.
        top: kernels listed by name; the rest are summed into ``other_ms_per_step``.

    Returns:
        Dict[str, Any]: ``steps``, ``gpu_ms_per_step`` (every event's duration summed, per
        step), ``wall_ms_per_step``, ``host_share`` (``1 - gpu / wall``, floored at 0: streams
        may overlap), ``events_per_step``, ``kernels`` (the ``top`` names by time: ``name``,
        ``ms_per_step``, ``calls_per_step``, ``share`` of the GPU time) and
        ``other_ms_per_step``; ``copy_share`` (the copies' share of the GPU time, by
        :func:`is_copy_kernel`) and ``largest_copy`` (the copy kernel with the largest share, as
        a ``kernels`` entry, or None); ``kinds``: per :data:`KERNEL_KINDS` entry
        (:func:`kernel_kind`) its ``ms_per_step`` and ``share``.

    Raises:
        ValueError: if ``steps`` or ``wall_seconds`` is not positive.
    """
    if steps <= 0 or wall_seconds <= 0:
        raise ValueError(f"steps and wall time must be positive, got {steps}, {wall_seconds}")
    by_name: Dict[str, List[float]] = {}
    for event in events:
        entry = by_name.setdefault(event.name, [0.0, 0])
        entry[0] += event.time_range.elapsed_us()
        entry[1] += 1
    busy_us = sum(us for us, _ in by_name.values())
    ranked = sorted(by_name.items(), key=lambda item: (-item[1][0], item[0]))
    kernels = [
        {
            "name": name,
            "ms_per_step": us / steps / 1e3,
            "calls_per_step": calls / steps,
            "share": us / busy_us if busy_us else 0.0,
        }
        for name, (us, calls) in ranked[:top]
    ]
    gpu_ms, wall_ms = busy_us / steps / 1e3, wall_seconds / steps * 1e3
    copies = [(name, entry) for name, entry in ranked if is_copy_kernel(name)]
    largest_copy = None
    if copies:
        name, (us, calls) = copies[0]
        largest_copy = {
            "name": name,
            "ms_per_step": us / steps / 1e3,
            "calls_per_step": calls / steps,
            "share": us / busy_us if busy_us else 0.0,
        }
    return {
        "steps": steps,
        "gpu_ms_per_step": gpu_ms,
        "wall_ms_per_step": wall_ms,
        "host_share": max(0.0, 1.0 - gpu_ms / wall_ms),
        "events_per_step": sum(calls for _, calls in by_name.values()) / steps,
        "kernels": kernels,
        "other_ms_per_step": sum(us for _, (us, _) in ranked[top:]) / steps / 1e3,
        "copy_share": sum(us for _, (us, _) in copies) / busy_us if busy_us else 0.0,
        "largest_copy": largest_copy,
        "kinds": _by_kind(by_name, steps, busy_us),
    }


def _by_kind(by_name: Dict[str, List[float]], steps: int, busy_us: float) -> Dict[str, Any]:
    """Time per step and share of the GPU time per kernel kind."""
    kinds = {kind: 0.0 for kind in KERNEL_KINDS}
    for name, (us, _) in by_name.items():
        kinds[kernel_kind(name)] += us
    return {
        kind: {"ms_per_step": us / steps / 1e3, "share": us / busy_us if busy_us else 0.0}
        for kind, us in kinds.items()
    }


def breakdown_lines(
    title: str, breakdown: Dict[str, Any], width: int = 72, step: str = "decode step"
) -> List[str]:
    """The printed breakdown: a head line, one line per kernel, the copies, the kinds.

    Args:
        title: what was profiled (model, requests, engine).
        breakdown: :func:`kernel_breakdown`'s result.
        width: kernel names longer than this are cut.
        step: what one profiled step is (``decode step``, ``prefill``).

    Returns:
        List[str]: the lines.
    """
    lines = [
        f"kernels per {step} ({title}, {breakdown['steps']} profiled): GPU "
        f"{breakdown['gpu_ms_per_step']:.3f} ms of a {breakdown['wall_ms_per_step']:.3f} ms "
        f"step, host share {breakdown['host_share']:.0%}, "
        f"{breakdown['events_per_step']:.0f} GPU events per step"
    ]
    for kernel in breakdown["kernels"]:
        name = kernel["name"]
        name = name if len(name) <= width else name[: width - 3] + "..."
        lines.append(
            f"  {kernel['share']:6.1%} {kernel['ms_per_step']:8.3f} ms "
            f"x{kernel['calls_per_step']:<5.0f} {name}"
        )
    if breakdown["other_ms_per_step"]:
        lines.append(f"  {'':6} {breakdown['other_ms_per_step']:8.3f} ms        (the others)")
    largest = breakdown.get("largest_copy")
    if largest is None:
        lines.append("  copies: none")
    else:
        name = largest["name"]
        name = name if len(name) <= width else name[: width - 3] + "..."
        lines.append(
            f"  copies: {breakdown['copy_share']:.1%} of the GPU time; the largest "
            f"{largest['share']:.1%} x{largest['calls_per_step']:.0f}: {name}"
        )
    kinds = breakdown.get("kinds")
    if kinds:
        parts = [
            f"{kind} {kinds[kind]['ms_per_step']:.3f} ms ({kinds[kind]['share']:.1%})"
            for kind in KERNEL_KINDS
        ]
        lines.append("  by kind: " + ", ".join(parts))
    return lines


def profile_decode_steps(
    unit: Any, prompts: Sequence[Sequence[int]], steps: int, top: int = TOP_KERNELS
) -> Dict[str, Any]:
    """Up to ``steps`` decode steps of one engine's batch under ``torch.profiler``; the rest of
    the batch decoded outside it. GPU only.

    Args:
        unit: a :class:`~megatron_ext.bench.mla_engine.DynamicUnit` or ``StaticUnit``.
        prompts: the batch's prompts.
        steps: decode steps to profile (at most the batch's decode steps).
        top: kernels listed by name.

    Returns:
        Dict[str, Any]: :func:`kernel_breakdown`'s result, or ``{"steps": 0}`` when no decode
        step or no GPU event was seen (e.g. without CUPTI).
    """
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    unit.start(prompts)
    unit.prefill()
    torch.cuda.synchronize()
    done, wall = 0, 0.0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while done < steps and not unit.done:
            torch.cuda.synchronize()
            began = time.perf_counter()
            unit.decode_step()
            torch.cuda.synchronize()
            # Every step is counted, a rare one that was not decode-only too: its kernels are in
            # the profile and cannot be told apart afterwards.
            wall += time.perf_counter() - began
            done += 1
    unit.drain()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not events or not done:
        return {"steps": 0}
    return kernel_breakdown(events, done, wall, top)


def profile_prefill(
    unit: Any, prompts: Sequence[Sequence[int]], top: int = TOP_KERNELS
) -> Dict[str, Any]:
    """One prefill of the batch (its time to first token, as ``--prefill-forms`` times it)
    under ``torch.profiler``, synchronised before and after. GPU only.

    Args:
        unit: a :class:`~megatron_ext.bench.mla_engine.DynamicUnit`.
        prompts: the batch's prompts.
        top: kernels listed by name.

    Returns:
        Dict[str, Any]: :func:`kernel_breakdown`'s result over one step (the prefill), or
        ``{"steps": 0}`` when no GPU event was seen.
    """
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    unit.start(prompts)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        unit.prefill()
        torch.cuda.synchronize()
        wall = time.perf_counter() - began
    unit.drain()
    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not events:
        return {"steps": 0}
    return kernel_breakdown(events, 1, wall, top)
