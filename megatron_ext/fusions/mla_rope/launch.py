# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""How a call of an MLA RoPE kernel is launched: its cached plan, and its configs.

:func:`run` is the one path of every kernel, query and key/value, forward and backward. It looks
the call's plan up in :data:`PLANS` (a :class:`megatron_ext.fusions.launch_plans.PlanCache`) by
everything that decides it except the data pointers (shapes, strides, dtypes, devices, the
argument record's values and types, pointer alignment, the pinned config and a forced FMA
pairing), built inline from the call's argument record. A hit allocates the outputs and launches;
a miss checks the call into a :class:`megatron_ext.fusions.mla_rope.checks.RopePlan`, pairs its
FMAs as chosen for the installed Triton, picks the config and prepares its launch
(:func:`configure`): a :class:`megatron_ext.fusions.direct_launch.PreparedLaunch`, which launches
through Triton's JIT first and through the compiled kernel's C launcher afterwards (that module
says when it stays with the JIT).

Launch configs (``BLOCK_H`` heads per program, ``num_warps``) are autotuned on first use for each
compiled variant, head count and power-of-two bucket of the token count: every config in
:data:`AUTOTUNE_CONFIGS` is timed once (the in-place kernels on a scratch copy) and the fastest
kept. The output is the same for all of them. :func:`pinned_kernel_config` pins one config instead
(tests, benchmarks, and the Triton interpreter, which cannot time anything). Tune before capturing
a CUDA graph: a variant first seen during capture runs with ``KernelConfig(16, 4)``.

Graph safety: :func:`run` can be captured once the call shape was seen outside capture.
"""

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import triton

from megatron_ext import internals
from megatron_ext.fusions.direct_launch import KernelLaunches, PreparedLaunch
from megatron_ext.fusions.launch_plans import NO_LAUNCH, PlanCache
from megatron_ext.fusions.mla_rope import checks, probe
from megatron_ext.fusions.mla_rope.checks import RopePlan
from megatron_ext.fusions.mla_rope.kernels import RUNTIME_INTS
from megatron_ext.fusions.mla_rope.pairing import CHOSEN, FORCED, Pairing
from megatron_ext.fusions.tensor_checks import INTERPRETED

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
    """Forget every autotuned config and cached plan (benchmarks re-tune per shape with this)."""
    TUNED.clear()
    PLANS.clear()


def autotuned_configs() -> Dict[tuple, KernelConfig]:
    """The configs chosen so far: {(kernel name, ..., head_num, token bucket): config}."""
    return dict(TUNED)


def benchmark_us(launch: Callable[[], None]) -> float:
    """Median time of one call of ``launch`` in microseconds."""
    return triton.testing.do_bench(launch, warmup=5, rep=20, return_mode="median") * 1e3


def tuned_config(plan: RopePlan, tensors: Sequence[Optional[torch.Tensor]]) -> KernelConfig:
    """Time each config once per (variant, size) and keep the fastest.

    Unlike ``triton.autotune`` with ``restore_value``, which clones and restores the in-place
    tensor inside every timed call (for a one-token launch that copy costs as much as the kernel
    and made its choice noise), in-place kernels are timed on a scratch tensor with the same
    strides, and nothing but the kernel is timed.

    Args:
        plan: the launch plan.
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
# The cached plans
# --------------------------------------------------------------------------------------------------

# Checked, configured plans of the drop-ins' calls (key built inline by run).
PLANS: PlanCache[RopePlan] = PlanCache()
# Each kernel's launches (its JIT launch and direct-launch bindings, shared by its plans).
KERNEL_LAUNCHES: Dict[object, KernelLaunches] = {
    kernel: KernelLaunches(kernel, RUNTIME_INTS) for kernel in checks.PAIRING_KIND
}


def configure(
    key: Optional[tuple],
    plan: RopePlan,
    tensors: Sequence[Optional[torch.Tensor]],
    device: torch.device,
) -> RopePlan:
    """Configure the launch of ``plan`` (a cache miss) and cache it under ``key``.

    Args:
        key: the cache key (everything that decides the launch except the data pointers), or
            None to not cache it.
        plan: the checked plan, its pairing applied.
        tensors: the pointer arguments of this call (tuning runs on them, or on a scratch copy of
            the first for an in-place kernel).
        device: the tensors' device.

    Returns:
        RopePlan: ``plan`` with its launch; call that with the pointer arguments.
    """
    config = current_config()
    cacheable = True
    if config is None and plan.grid(1) is not None:
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            config = tuned_config(plan, tensors)
        # A config chosen during CUDA-graph capture is a stand-in: tune again after capture.
        cacheable = not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    config = config or CAPTURE_DEFAULT
    grid = plan.grid(config.block_h)
    launch = NO_LAUNCH
    if grid is not None:
        names = internals.triton_kernel_arg_names(plan.kernel)
        if names is None:
            raise RuntimeError(f"cannot read the parameter names of {plan.kernel.__name__}")
        args = dict(zip(names[: plan.pointers], tensors), **plan.args, BLOCK_H=config.block_h)
        options = dict(plan.options, num_warps=config.num_warps)
        launch = PreparedLaunch(KERNEL_LAUNCHES[plan.kernel], grid, args, options, plan.pointers)
    plan = dataclasses.replace(plan, launch=launch)
    if cacheable:
        PLANS.put(key, plan)
    return plan


# --------------------------------------------------------------------------------------------------
# The run path
# --------------------------------------------------------------------------------------------------


def pairing_for(plan: RopePlan, x, y, rope) -> Pairing:
    """The FMA pairing of a new plan: forced, chosen before (a dict lookup), or asked of
    :func:`megatron_ext.fusions.mla_rope.probe.pairing_for`, which probes on first use.

    Args: as :func:`run`, with the plan of the call.
    """
    forced = FORCED.get()
    if forced is not None:
        return forced
    kind = checks.PAIRING_KIND[plan.kernel]
    # The rotated input: k_pos_emb in the key/value forward, else the first tensor.
    x_dtype = y.dtype if kind == "kv_fwd" else x.dtype
    table_dtype, device = rope.cos.dtype, x.device
    inverse = getattr(rope, "inverse", False)  # the key/value record has no inverse rotation
    if not inverse:
        known = CHOSEN.get((kind, x_dtype, table_dtype, str(device)))
        if known is not None:
            return known[0]
    return probe.pairing_for(kind, x_dtype, table_dtype, device, inverse)


def _meets(start: int, span: int, low: int, high: int) -> bool:
    """Whether ``span`` bytes from ``start`` meet the bytes from ``low`` up to ``high``."""
    return start < high and low < start + span


def run(kernel, x, y, rope, name: str = "t") -> List[torch.Tensor]:
    """Launch ``kernel`` on ``x`` (and ``y``) with the call's argument record ``rope``.

    Args:
        kernel: one of the five kernels of :mod:`megatron_ext.fusions.mla_rope.kernels`.
        x: the tensor a query kernel rotates (or reads, for the copy kernel), kv or dkey.
        y: None for a query kernel, else k_pos_emb or dvalue.
        rope: the call's :class:`megatron_ext.fusions.mla_rope.checks.QueryRope` or
            :class:`megatron_ext.fusions.mla_rope.checks.KeyValueRope`.
        name: what a query kernel's error messages call ``x``.

    Returns:
        List[torch.Tensor]: the new tensors the kernel wrote (none for an in-place kernel).
    """
    # Both records hold the four tensors, then six scalars (a unit test checks it).
    cos, sin, cu, pos, s0, s1, s2, s3, s4, s5 = rope
    try:
        # Inline rather than per-tensor helpers: this is every call's host cost. Pointers'
        # 16-byte alignment is part of it (Triton specialises on it); the scalars' types too
        # (8.0 == 8 and True == 1: the types keep such calls on the checked path). The pointers
        # read here serve the overlap test below as well.
        x_ptr, cos_ptr, sin_ptr = x.data_ptr(), cos.data_ptr(), sin.data_ptr()
        key = (
            kernel,
            x.shape,
            x.stride(),
            x.dtype,
            x.device,
            x_ptr & 15,
            None if y is None else (y.shape, y.stride(), y.dtype, y.device, y.data_ptr() & 15),
            cos.shape,
            cos.stride(),
            cos.dtype,
            cos.device,
            cos_ptr & 15,
            sin.shape,
            sin.stride(),
            sin.dtype,
            sin.device,
            sin_ptr & 15,
            (
                None
                if cu is None
                else (cu.shape, cu.stride(), cu.dtype, cu.device, cu.data_ptr() & 15)
            ),
            (
                None
                if pos is None
                else (pos.shape, pos.stride(), pos.dtype, pos.device, pos.data_ptr() & 15)
            ),
            s0,
            s1,
            s2,
            s3,
            s4,
            s5,
            type(s0),
            type(s1),
            type(s2),
            type(s3),
            type(s4),
            type(s5),
            PINNED.get(),
            FORCED.get(),
        )
        plan = PLANS.lookup(key)
    except (AttributeError, TypeError):  # not tensors, or unhashable: the checks say what
        key, plan = None, None
    hit = plan is not None
    if not hit:
        plan = checks.plan(kernel, x, y, rope, name)
        plan = plan.with_pairing(pairing_for(plan, x, y, rope))
    elif plan.read_spans:
        # An in-place kernel: whether x shares memory with a tensor it reads, which the layout
        # cannot tell, from the data pointers and the layout's spans (the check names it).
        # tensor_checks.spans_meet's test, inline and unrolled: a cached call stays within this
        # file, and a loop over the four costs about a microsecond per call.
        x_span, cos_span, sin_span, cu_span, pos_span = plan.read_spans
        high = x_ptr + x_span
        if (
            (cos_span and cos_ptr < high and x_ptr < cos_ptr + cos_span)
            or (sin_span and sin_ptr < high and x_ptr < sin_ptr + sin_span)
            or (cu_span and _meets(cu.data_ptr(), cu_span, x_ptr, high))
            or (pos_span and _meets(pos.data_ptr(), pos_span, x_ptr, high))
        ):
            checks.check_in_place_disjoint(name, x, rope)
    if plan.contiguous_inputs:
        x, y = x.contiguous(), y.contiguous()
    if pos is not None and not pos.is_contiguous():  # indexed by flat row
        pos = pos.contiguous()
    outputs = [x.new_empty(shape) for shape in plan.outputs] if plan.outputs else []
    if y is None:
        pointers = (x, *outputs, cos, sin, cu, pos)
    else:
        pointers = (x, y, *outputs, cos, sin, cu, pos)
    if not hit:
        plan = configure(key, plan, pointers, x.device)
    plan.launch(*pointers)
    return outputs
