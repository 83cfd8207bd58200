# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Launch configs, their tuning and pinning, and the cached launch of the MLA RoPE kernels.

Launch configs (``BLOCK_H`` heads per program, ``num_warps``) are autotuned on first use for each
compiled variant, head count and power-of-two bucket of the token count: every config in
:data:`AUTOTUNE_CONFIGS` is timed once (the in-place kernels on a scratch copy) and the fastest
kept. The output is the same for all of them. :func:`pinned_kernel_config` pins one config instead
(tests, benchmarks, and the Triton interpreter, which cannot time anything). Tune before capturing
a CUDA graph: a variant first seen during capture runs with ``KernelConfig(16, 4)``.

The launch itself is cached: the drop-ins look up a :class:`CachedLaunch` by everything that
decides a launch except the data pointers (shapes, strides, dtypes, devices, flags, pointer
alignment, the pinned config). A miss checks the inputs into a launch plan
(:mod:`megatron_ext.fusions.mla_rope.plans`), picks the config, and launches through Triton's JIT,
keeping the compiled kernel it returns; a hit launches that compiled kernel through
its C launcher (:mod:`megatron_ext.fusions.direct_launch`, which says when it falls back
to the JIT path) with the pointers and the stored arguments.
"""

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch
import triton

from megatron_ext import internals
from megatron_ext.fusions import direct_launch
from megatron_ext.fusions.mla_rope.checks import INTERPRETED

BLOCK_H_CHOICES = (1, 2, 4, 8, 16, 32, 64, 128)
# Token counts share an autotuning result within a power-of-two bucket up to this size.
MAX_TUNE_ROWS = 1 << 15


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration of the MLA RoPE kernels.

    Args:
        block_h: heads per program, a power of two from 1 to 128.
        num_warps: warps per program, a power of two from 1 to 32.
    """

    block_h: int
    num_warps: int = 4

    def __post_init__(self):
        if self.block_h not in BLOCK_H_CHOICES:
            raise ValueError(f"block_h must be one of {BLOCK_H_CHOICES}, got {self.block_h}")
        if self.num_warps not in (1, 2, 4, 8, 16, 32):
            raise ValueError(f"num_warps must be a power of two from 1 to 32, got {self.num_warps}")


# The autotuner's search space. The output does not depend on which one it picks.
AUTOTUNE_CONFIGS: Tuple[KernelConfig, ...] = (
    KernelConfig(1, 1),
    KernelConfig(2, 1),
    KernelConfig(4, 1),
    KernelConfig(8, 2),
    KernelConfig(16, 4),
    KernelConfig(32, 4),
    KernelConfig(64, 4),
    KernelConfig(128, 4),
    KernelConfig(128, 8),
)
# What the interpreter runs when nothing is pinned.
INTERPRETER_DEFAULT = KernelConfig(4, 1)

PINNED: contextvars.ContextVar[Optional[KernelConfig]] = contextvars.ContextVar(
    "megatron_ext_mla_rope_pinned_config", default=None
)


@contextlib.contextmanager
def pinned_kernel_config(block_h: int, num_warps: int = 4) -> Iterator[KernelConfig]:
    """Run every MLA RoPE kernel with one fixed config instead of autotuning.

    The autograd functions record the pinned config in their forward pass, so a backward run later,
    outside the ``with`` block, uses the same config. Autotuning is impossible under the Triton
    interpreter (``TRITON_INTERPRET=1``); there, unpinned launches use ``KernelConfig(4, 1)``.

    Args:
        block_h: heads per program, a power of two from 1 to 128.
        num_warps: warps per program.

    Returns:
        A context manager yielding the pinned :class:`KernelConfig`.
    """
    config = KernelConfig(block_h, num_warps)
    token = PINNED.set(config)
    try:
        yield config
    finally:
        PINNED.reset(token)


def current_config() -> Optional[KernelConfig]:
    """The pinned config, the interpreter's default, or None (autotune)."""
    pinned = PINNED.get()
    if pinned is None and INTERPRETED:
        return INTERPRETER_DEFAULT
    return pinned


# Tuned configs, keyed by kernel, compiled variant (dtypes, flags, None-ness) and problem size.
TUNED: Dict[tuple, KernelConfig] = {}
# Used while a CUDA graph is captured and no tuned config exists yet (timing is impossible there).
CAPTURE_DEFAULT = KernelConfig(16, 4)


def clear_autotune_cache() -> None:
    """Forget every autotuned config and cached launch (benchmarks re-tune per shape with this)."""
    TUNED.clear()
    LAUNCHES.clear()


def autotuned_configs() -> Dict[tuple, KernelConfig]:
    """The configs chosen so far: {(kernel name, ..., head_num, token bucket): config}."""
    return dict(TUNED)


def benchmark_us(launch: Callable[[], None]) -> float:
    """Median time of one call of ``launch`` in microseconds."""
    return triton.testing.do_bench(launch, warmup=5, rep=20, return_mode="median") * 1e3


def tuned_config(plan, tensors: Sequence[Optional[torch.Tensor]]) -> KernelConfig:
    """Time each config once per (variant, size) and keep the fastest.

    Unlike ``triton.autotune`` with ``restore_value``, which clones and restores the in-place
    tensor inside every timed call (for a one-token launch that copy costs as much as the kernel
    and made its choice noise), in-place kernels are timed on a scratch tensor with the same
    strides, and nothing but the kernel is timed.

    Args:
        plan: the :class:`megatron_ext.fusions.mla_rope.plans.LaunchPlan`.
        tensors: this call's pointer arguments.
    """
    kernel, rows, head_num = plan.kernel, plan.rows, plan.head_num
    variant = tuple(None if t is None else (str(t.dtype), t.stride()) for t in tensors)
    constexprs = tuple(sorted((k, str(v)) for k, v in plan.constexprs().items()))
    key = (kernel.__name__, variant, constexprs, head_num)
    key += (min(triton.next_power_of_2(max(rows, 1)), MAX_TUNE_ROWS),)
    config = TUNED.get(key)
    if config is not None:
        return config
    if tensors[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return CAPTURE_DEFAULT
    if plan.in_place:
        x = tensors[0]
        scratch = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=x.device)
        tensors = (scratch.copy_(x),) + tuple(tensors[1:])
    # Blocks wider than the head count only add masked lanes.
    limit = triton.next_power_of_2(max(1, head_num))
    candidates = [c for c in AUTOTUNE_CONFIGS if c.block_h <= limit] or [AUTOTUNE_CONFIGS[0]]
    timings = {}
    for candidate in candidates:
        grid = plan.grid(candidate.block_h)[:2]

        def launch(c=candidate, grid=grid):
            kernel[grid](
                *tensors, **plan.args, **plan.options, BLOCK_H=c.block_h, num_warps=c.num_warps
            )

        timings[candidate] = benchmark_us(launch)
    config = min(timings, key=timings.get)
    TUNED[key] = config
    return config


# --------------------------------------------------------------------------------------------------
# The cached launch
# --------------------------------------------------------------------------------------------------

# Launches cached by the drop-ins (key -> CachedLaunch); cleared when it grows past MAX_LAUNCHES.
LAUNCHES: Dict[tuple, "CachedLaunch"] = {}
MAX_LAUNCHES = 4096


class CachedLaunch:
    """One checked, configured launch of a kernel, replayed with new data pointers.

    Args:
        plan: the :class:`megatron_ext.fusions.mla_rope.plans.LaunchPlan`.
        config: the launch config.
        device: the tensors' device.
    """

    __slots__ = ("plan", "grid", "config", "device_index", "direct", "tail")

    def __init__(self, plan, config: KernelConfig, device: torch.device):
        self.plan = plan
        self.grid = plan.grid(config.block_h)
        self.config = config
        self.device_index = device.index if device.type == "cuda" else None
        self.direct = None
        # What the C launcher parses after the pointers (it ignores the constexprs' values).
        self.tail = plan.tail(config.block_h)

    def __call__(self, *tensors: Optional[torch.Tensor]) -> None:
        """Launch with these pointer arguments (tensors or None, in the kernel's order)."""
        if self.grid is None:
            return
        direct = self.direct
        if (
            direct
            and internals.cuda_current_device() == self.device_index
            and not direct_launch.hooks_set()
        ):
            gx, gy, gz = self.grid
            stream = internals.cuda_current_raw_stream(self.device_index)
            direct(
                gx,
                gy,
                gz,
                stream,
                (*[None if t is None else t.data_ptr() for t in tensors], *self.tail),
            )
            return
        self.launch_jit(*tensors)

    def launch_jit(self, *tensors: Optional[torch.Tensor]) -> None:
        """Launch through Triton's JIT (``kernel[grid](...)``); bind the direct path on success."""
        if self.grid is None:
            return
        device = self.device_index
        guard = torch.cuda.device(device) if device is not None else contextlib.nullcontext()
        with guard:
            compiled = self.plan.kernel[self.grid[:2]](
                *tensors,
                **self.plan.args,
                **self.plan.options,
                BLOCK_H=self.config.block_h,
                num_warps=self.config.num_warps,
            )
        if (
            self.direct is None
            and device is not None
            and direct_launch.verified(torch.device("cuda", device))
        ):
            # False, not None, for a kernel the direct launch cannot take: no rebinding per call.
            self.direct = direct_launch.bind(compiled) or False


def prepare(
    key: Optional[tuple], plan, tensors: Sequence[Optional[torch.Tensor]], device: torch.device
) -> CachedLaunch:
    """Configure the launch of ``plan`` (a cache miss) and cache it under ``key``.

    Args:
        key: the cache key (everything that decides the launch except the data pointers), or
            None to not cache it.
        plan: the checked :class:`megatron_ext.fusions.mla_rope.plans.LaunchPlan`.
        tensors: the pointer arguments of this call (tuning runs on them, or on a scratch copy of
            the first for an in-place kernel).
        device: the tensors' device.

    Returns:
        CachedLaunch: call it with the pointer arguments to launch.
    """
    config = current_config()
    cacheable = True
    if config is None and plan.grid(1) is not None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            config = tuned_config(plan, tensors)
        # A config chosen during CUDA-graph capture is a stand-in: tune again after capture.
        cacheable = not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    launch = CachedLaunch(plan, config or CAPTURE_DEFAULT, device)
    if cacheable and key is not None:
        if len(LAUNCHES) >= MAX_LAUNCHES:
            LAUNCHES.clear()
        LAUNCHES[key] = launch
    return launch
