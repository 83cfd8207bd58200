# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Launching a compiled Triton kernel through its C launcher, without Triton's Python dispatch.

``kernel[grid](...)`` costs ~17 us of host time per call (argument binding, specialisation key,
cache lookup); calling the C launcher of the ``CompiledKernel`` it returned costs ~8 us. That
launcher's calling convention is internal to Triton: :mod:`megatron_ext.internals` reads it from
the launcher's structure and binds it (:func:`megatron_ext.internals.bind_triton_launcher`).

Before the first direct launch of a process on a device, :func:`verified` checks the current
device and stream internals against torch's public calls and launches a probe kernel both ways,
comparing what they wrote (pointers, 32- and 64-bit integers, a None pointer and constexprs among
the arguments); any difference or error switches the direct launch off for the process, with a
warning, and every launch takes Triton's JIT path. It is also skipped under the interpreter,
while Triton launch hooks are set (profilers see every launch), for kernels whose convention is
unknown or that need scratch memory, and with ``MEGATRON_EXT_DIRECT_LAUNCH=0``.

Every Triton kernel of the package launches through a :class:`PreparedLaunch`: one launch whose
arguments other than its leading tensors are fixed, kept in a checked call layout's plan
(:mod:`megatron_ext.fusions.launch_plans`). Its first call launches through Triton's JIT and
binds the compiled kernel's C launcher (shared by the kernel's :class:`KernelLaunches`, one
binding per specialisation); later calls launch directly with the call's pointers, or through
the JIT wherever the direct launch is off.
"""

import os
import warnings
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from megatron_ext import internals
from megatron_ext.fusions.launch_plans import MAX_PLANS, LaunchPlan
from megatron_ext.fusions.tensor_checks import INTERPRETED
from megatron_ext.internals import DirectLaunch

ENABLED = not INTERPRETED and os.environ.get("MEGATRON_EXT_DIRECT_LAUNCH", "1") != "0"

# Device index -> whether the probe launched directly wrote what the JIT launch wrote.
_VERIFIED: Dict[int, bool] = {}

# Whether a profiler or tool registered Triton launch hooks (the direct launch then skips itself).
hooks_set = internals.triton_launch_hooks_set


def bind(compiled) -> Optional[DirectLaunch]:
    """The direct launch of ``compiled`` (what ``kernel[grid](...)`` returned), or None.

    Args:
        compiled: Triton's compiled kernel, or None.

    Returns:
        Optional[DirectLaunch]: None when disabled or when the launcher's convention is unknown.
    """
    if not ENABLED or compiled is None:
        return None
    return internals.bind_triton_launcher(compiled)


@triton.jit
def _probe_kernel(out_ptr, add_ptr, scale, offset, n, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    mask = idx < n
    value = idx.to(tl.int64) * scale + offset + SHIFT
    if add_ptr is not None:
        value += tl.load(add_ptr + idx, mask=mask, other=0)
    tl.store(out_ptr + idx, value, mask=mask)


# Odd and above 2**32, so that both launches share one specialisation (no ==1, no %16, int64).
_PROBE_JIT = (2**33 + 3, 2**34 + 5)
_PROBE_DIRECT = (2**35 + 7, 2**36 + 9)


def _probe(device: torch.device) -> Optional[str]:
    """Check the stream internals, then launch the probe through the JIT and directly; what went
    wrong, or None."""
    stream_mismatch = internals.check_cuda_current(device.index)
    if stream_mismatch is not None:
        return stream_mismatch
    block, n, shift, guard = 64, 50, 3, -12345
    out = torch.full((2, block + 8), guard, dtype=torch.int64, device=device)
    compiled = _probe_kernel[(1,)](out[0], None, *_PROBE_JIT, n, BLOCK=block, SHIFT=shift)
    launch = bind(compiled)
    if launch is None:
        return f"unknown launcher {type(getattr(compiled, 'run', None)).__name__}"
    stream = internals.cuda_current_raw_stream(device.index)
    launch(1, 1, 1, stream, (out[1].data_ptr(), None, *_PROBE_DIRECT, n, block, shift))
    idx = torch.arange(block + 8, dtype=torch.int64, device=device)
    expected = torch.full_like(out, guard)
    for row, (scale, offset) in enumerate((_PROBE_JIT, _PROBE_DIRECT)):
        expected[row, :n] = idx[:n] * scale + offset + shift
    if not torch.equal(out, expected):
        return "the probe kernel's direct launch wrote other values than its JIT launch"
    return None


def verified(device: torch.device) -> Optional[bool]:
    """Whether direct launches work on ``device``: probed once per process and device.

    Returns None while a CUDA graph is being captured and the probe has not run yet (it has to
    synchronise); the caller launches through the JIT and asks again later.
    """
    if not ENABLED:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    known = _VERIFIED.get(index)
    if known is not None:
        return known
    if torch.cuda.is_current_stream_capturing():
        return None
    try:
        with torch.cuda.device(index):
            reason = _probe(torch.device("cuda", index))
    except Exception as error:  # noqa: BLE001 (any failure means: do not use it)
        reason = f"{type(error).__name__}: {error}"
    ok = reason is None
    if not ok:
        warnings.warn(
            f"megatron_ext: direct kernel launch disabled on Triton {triton.__version__} "
            f"({reason}); launching through Triton's JIT (about 10 us more host time per call)",
            RuntimeWarning,
            stacklevel=3,
        )
    _VERIFIED[index] = ok
    return ok


# Bounds of Triton's 32-bit and unsigned 64-bit integer arguments (it types an int by its value).
_INT32 = range(-(2**31), 2**31)
_INT64_MAX = 2**63


class KernelLaunches:
    """One Triton kernel's JIT launch and the direct launches bound for it, one per specialisation.

    A specialisation is keyed by what Triton compiles a kernel for: each tensor argument's dtype
    and 16-byte alignment, each specialised integer's value (Triton specialises on 1 and on
    multiples of 16), for the ``unspecialized`` integers only their width, every other argument's
    value (constexprs, strings, None), floats by type, the launch options and the device. A key
    that is not the compiled kernel's own is never made: a key only ever splits one of Triton's.
    The :class:`PreparedLaunch` objects of a kernel share its bindings: a new call layout of a
    specialisation seen before (another token count) launches directly from its first call.

    Args:
        kernel: the ``triton.jit`` function.
        unspecialized: its ``do_not_specialize`` parameter names.
        max_entries: bound on the bindings kept (cleared when reached).
    """

    def __init__(self, kernel, unspecialized: Sequence[str] = (), max_entries: int = MAX_PLANS):
        self.kernel = kernel
        self.unspecialized = frozenset(unspecialized)
        self.max_entries = max_entries
        # key -> DirectLaunch, or False where the direct launch cannot take the kernel.
        self.launches: Dict[tuple, Any] = {}

    def key(self, args: Mapping[str, Any], device_index: int, options: Mapping[str, Any]) -> tuple:
        """The specialisation key of a launch (see the class docstring).

        Args:
            args: every kernel parameter by name, in the kernel's order.
            device_index: the CUDA device.
            options: Triton's launch options.

        Returns:
            tuple: the key.
        """
        parts = [device_index, *options.items()]
        unspecialized = self.unspecialized
        for name, value in args.items():
            kind = type(value)  # exact types first
            if kind is int:
                if name in unspecialized:
                    parts.append((value in _INT32, value < _INT64_MAX))
                else:
                    parts.append(value)
            elif kind is float:
                parts.append(float)
            elif isinstance(value, torch.Tensor):
                parts.append((value.dtype, value.data_ptr() % 16 == 0))
            else:  # bool, str, None, constexpr values; other int types by value
                parts.append(value)
        return tuple(parts)

    def __call__(self, grid, args: Mapping[str, Any], **options: Any):
        """Launch through Triton's JIT, on the tensors' device (``kernel[grid](...)``).

        Args:
            grid: the launch grid (up to three dimensions).
            args: every kernel parameter by name.
            options: Triton's launch options (``num_warps``, ``num_stages``, ...).

        Returns:
            The compiled kernel Triton returned.
        """
        first = next((v for v in args.values() if isinstance(v, torch.Tensor)), None)
        if first is None or first.device.type != "cuda":
            return self.kernel[grid](**args, **options)
        with torch.cuda.device(first.device.index):
            return self.kernel[grid](**args, **options)

    def bound(self, key: tuple, compiled) -> Any:
        """The direct launch of the specialisation ``key``, bound to ``compiled`` on its first
        request (False where the direct launch cannot take it: never rebound)."""
        direct = self.launches.get(key)
        if direct is None:
            direct = bind(compiled) or False
            if len(self.launches) >= self.max_entries:
                self.launches.clear()
            self.launches[key] = direct
        return direct


def _kernel_name(launches: Any) -> str:
    """The kernel's name for a message (a stand-in's type name)."""
    kernel = getattr(launches, "kernel", launches)
    return getattr(kernel, "__name__", type(kernel).__name__)


class PreparedLaunch(LaunchPlan):
    """One launch of a kernel whose arguments other than its leading tensors are fixed: the one
    "direct launch, else Triton's JIT" path of the package.

    A call passes the tensors (or None for an absent pointer) in the prepared order. Its plan's
    key guarantees that they have the layout and 16-byte alignment of the ones it was prepared
    with (tensors the plan allocates come from torch's allocator, aligned as well), so one bound
    C launcher serves every call: a call that finds it bound, on the current device, with no
    Triton launch hook set, launches directly (~8 us of host time); any other call takes
    Triton's JIT (~17 us), and the first one on a CUDA device binds the launcher once
    :func:`verified`. It keeps no tensor (a cached launch must not hold device memory alive).

    Args:
        launches: the kernel's launches (shared with its other prepared launches), or a stand-in
            called as ``launches(grid, args, **options)`` (tests record launches that way; it is
            never launched directly).
        grid: the launch grid (up to three dimensions).
        args: every kernel parameter by name (any order; the kernel's signature orders them),
            the tensors of this call among them.
        options: Triton's launch options.
        tensors: how many leading kernel parameters each call passes (tensors or None); by
            default the leading run of tensors in ``args``.
    """

    __slots__ = (
        "launches", "grid", "options", "args", "names", "device_index", "key", "after", "direct"
    )  # fmt: skip

    def __init__(
        self,
        launches: KernelLaunches,
        grid: Tuple[int, ...],
        args: Mapping[str, Any],
        options: Mapping[str, Any],
        tensors: Optional[int] = None,
    ):
        items = list(args.items())
        if tensors is None:
            tensors = next(
                (i for i, (_, v) in enumerate(items) if not isinstance(v, torch.Tensor)), len(items)
            )
        self.launches = launches
        self.grid = (*grid, 1, 1)[:3]
        self.options = dict(options)
        self.names = tuple(name for name, _ in items[:tensors])
        # What the JIT path takes: every argument by name, the tensors' slots filled per call.
        self.args = {n: (None if i < tensors else v) for i, (n, v) in enumerate(items)}
        first = next((v for _, v in items[:tensors] if isinstance(v, torch.Tensor)), None)
        cuda = first is not None and first.device.type == "cuda"
        self.device_index = first.device.index if cuda else None
        # The specialisation (None: never direct) and the arguments after the pointers in the
        # kernel's order (constexprs included: the C launcher takes them all).
        self.key: Optional[tuple] = None
        self.after: tuple = ()
        # None: not bound yet (the interpreter: never); False: never direct; else the launcher.
        self.direct: Any = None
        if not cuda:
            return
        kernel_launches = isinstance(launches, KernelLaunches)
        names = internals.triton_kernel_arg_names(launches.kernel) if kernel_launches else None
        if (
            names is None
            or tuple(names[:tensors]) != self.names
            or set(names) != set(args)
            or any(isinstance(args[name], torch.Tensor) for name in names[tensors:])
        ):
            self.direct = False
            return
        ordered = {name: args[name] for name in names}
        self.key = launches.key(ordered, self.device_index, self.options)
        self.after = tuple(ordered[name] for name in names[tensors:])
        # Bound by an earlier plan of the same specialisation: direct from the first call.
        self.direct = launches.launches.get(self.key)

    def __call__(self, *tensors: Optional[torch.Tensor]) -> None:
        """Launch with ``tensors`` for the leading arguments (in the prepared order).

        Raises:
            TypeError: for another number of tensors than prepared (the C launcher would read
                past the arguments, the JIT path leave one unset), before any launch.
        """
        if len(tensors) != len(self.names):
            raise TypeError(
                f"{_kernel_name(self.launches)}: {len(tensors)} tensors given, "
                f"{len(self.names)} prepared ({', '.join(self.names)})"
            )
        direct = self.direct
        if direct and internals.cuda_current_device() == self.device_index and not hooks_set():
            gx, gy, gz = self.grid
            direct(
                gx,
                gy,
                gz,
                internals.cuda_current_raw_stream(self.device_index),
                (*[None if t is None else t.data_ptr() for t in tensors], *self.after),
            )
            return
        self.launch_jit(*tensors)

    def launch_jit(self, *tensors: Optional[torch.Tensor]) -> None:
        """Launch through Triton's JIT; bind the direct launch on the first success."""
        args = dict(self.args)
        args.update(zip(self.names, tensors))
        compiled = self.launches(self.grid, args, **self.options)
        if (
            self.direct is None
            and self.key is not None
            and verified(torch.device("cuda", self.device_index))
        ):
            self.direct = self.launches.bound(self.key, compiled)
