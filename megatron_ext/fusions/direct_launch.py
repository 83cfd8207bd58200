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

Users: the MLA RoPE launches (:mod:`megatron_ext.fusions.mla_rope.launch`, keyed by the call's
shapes, which also skips their checks), and, through :class:`KernelLaunches` (keyed by what Triton
specialises on), the top-k draw and the paged latent-cache kernels (attention and its split
combine, the RoPE + append). The latent-cache kernels keep a :class:`PreparedLaunch` per checked
call layout (:mod:`megatron_ext.fusions.launch_plans`): only the tensors change between its calls,
so a call swaps their pointers into the stored arguments instead of rebuilding them.
"""

import os
import warnings
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

from megatron_ext import internals
from megatron_ext.fusions.mla_rope.checks import INTERPRETED
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
    """Launches of one Triton kernel: through Triton's JIT on a specialisation's first call, then
    directly through the compiled kernel's C launcher (:func:`bind`), once :func:`verified`.

    A specialisation is keyed by what Triton compiles a kernel for: each tensor argument's dtype
    and 16-byte alignment, each specialised integer's value (Triton specialises on 1 and on
    multiples of 16), for the ``unspecialized`` integers only their width, every other argument's
    value (constexprs, strings, None), floats by type, the launch options and the device. A key
    that is not the compiled kernel's own is never made: a key only ever splits one of Triton's.

    Args:
        kernel: the ``triton.jit`` function.
        unspecialized: its ``do_not_specialize`` parameter names.
        max_entries: bound on the cached launches (cleared when reached).
    """

    def __init__(self, kernel, unspecialized: Sequence[str] = (), max_entries: int = 1024):
        self.kernel = kernel
        self.unspecialized = frozenset(unspecialized)
        self.max_entries = max_entries
        # key -> DirectLaunch, or False where the direct launch cannot take the kernel.
        self.launches: Dict[tuple, Any] = {}

    def key(self, args: Mapping[str, Any], device_index: int, options: Mapping[str, Any]) -> tuple:
        """The specialisation key of a launch (see the class docstring)."""
        return self._key_and_values(args, device_index, options)[0]

    def _key_and_values(
        self, args: Mapping[str, Any], device_index: int, options: Mapping[str, Any]
    ) -> Tuple[tuple, tuple]:
        """The launch's key and the C launcher's argument values (tensors as pointers), in one
        pass over the arguments: this runs on every launch."""
        parts = [device_index, *options.items()]
        values = []
        unspecialized = self.unspecialized
        for name, value in args.items():
            kind = type(value)  # exact types first
            if kind is int:
                if name in unspecialized:
                    parts.append((value in _INT32, value < _INT64_MAX))
                else:
                    parts.append(value)
                values.append(value)
            elif kind is float:
                parts.append(float)
                values.append(value)
            elif isinstance(value, torch.Tensor):
                pointer = value.data_ptr()
                parts.append((value.dtype, pointer % 16 == 0))
                values.append(pointer)
            else:  # bool, str, None, constexpr values; other int types by value
                parts.append(value)
                values.append(value)
        return tuple(parts), tuple(values)

    def __call__(self, grid, args: Mapping[str, Any], **options: Any) -> None:
        """Launch on ``grid`` (up to three dimensions) with ``args``: every kernel parameter by
        name, in the kernel's order (constexprs included), and Triton's launch ``options``
        (``num_warps``, ``num_stages``). CUDA tensors launch on their device's current stream;
        CPU tensors (the interpreter) through the JIT."""
        first = next((v for v in args.values() if isinstance(v, torch.Tensor)), None)
        if first is None or first.device.type != "cuda":
            self.kernel[grid](**args, **options)
            return
        index = first.device.index
        key, values = self._key_and_values(args, index, options)
        direct = self.launches.get(key)
        if direct and not hooks_set() and internals.cuda_current_device() == index:
            gx, gy, gz = (*grid, 1, 1)[:3]
            direct(gx, gy, gz, internals.cuda_current_raw_stream(index), values)
            return
        with torch.cuda.device(index):
            compiled = self.kernel[grid](**args, **options)
        if direct is None and verified(first.device):
            if len(self.launches) >= self.max_entries:
                self.launches.clear()
            # The C launcher takes the arguments in the kernel's order: bind only when the given
            # names are the kernel's. False, not None: no rebinding per call.
            names = internals.triton_kernel_arg_names(self.kernel)
            ok = names is not None and list(args) == names
            self.launches[key] = (ok and bind(compiled)) or False


class PreparedLaunch:
    """One launch of a :class:`KernelLaunches` kernel whose arguments other than its tensors are
    fixed: a call passes only the tensors (same names, dtypes and order as the ones it was
    prepared with; the caller's plan key guarantees that) and goes direct once bound.

    It keeps no tensor (a cached launch must not hold device memory alive): the launch key and the
    C launcher's values are stored with the tensors' slots empty, and each call fills them with
    the pointers and their 16-byte alignment (which Triton specialises on, so it stays in the key).

    Args:
        launches: the kernel's launches (shared with its other callers: one JIT compile and one
            binding per specialisation).
        grid: the launch grid (up to three dimensions).
        args: every kernel parameter by name, in the kernel's order, as for
            :meth:`KernelLaunches.__call__`.
        options: Triton's launch options.
    """

    __slots__ = ("launches", "grid", "args", "options", "names", "slots", "parts", "values")

    def __init__(
        self,
        launches: KernelLaunches,
        grid: Tuple[int, ...],
        args: Mapping[str, Any],
        options: Mapping[str, Any],
    ):
        self.launches = launches
        self.grid = tuple(grid)
        self.options = dict(options)
        self.names = [name for name, v in args.items() if isinstance(v, torch.Tensor)]
        self.args = {n: (None if isinstance(v, torch.Tensor) else v) for n, v in args.items()}
        first = args[self.names[0]] if self.names else None
        # No stored key (every call through ``launches(grid, args)``) for CPU tensors (the
        # interpreter) and for a stand-in launcher (tests record launches that way).
        self.parts: Optional[List[Any]] = None
        self.slots: List[Tuple[int, int, torch.dtype]] = []
        self.values: List[Any] = []
        if first is None or first.device.type != "cuda" or not isinstance(launches, KernelLaunches):
            return
        key, values = launches._key_and_values(args, first.device.index, options)
        # (position in the key, position in the values, dtype) of each tensor argument.
        offset = len(key) - len(values)
        positions = [i for i, v in enumerate(args.values()) if isinstance(v, torch.Tensor)]
        self.slots = [(offset + i, i, args[n].dtype) for i, n in zip(positions, self.names)]
        self.parts = list(key)
        self.values = list(values)

    def __call__(self, *tensors: torch.Tensor) -> None:
        """Launch with ``tensors`` for the tensor arguments (in the prepared order)."""
        parts = self.parts
        if parts is not None:
            parts = parts.copy()
            values = self.values.copy()
            for (key_at, value_at, dtype), tensor in zip(self.slots, tensors):
                pointer = tensor.data_ptr()
                parts[key_at] = (dtype, pointer % 16 == 0)
                values[value_at] = pointer
            index = parts[0]
            direct = self.launches.launches.get(tuple(parts))
            if direct and not hooks_set() and internals.cuda_current_device() == index:
                gx, gy, gz = (*self.grid, 1, 1)[:3]
                direct(gx, gy, gz, internals.cuda_current_raw_stream(index), tuple(values))
                return
        # The first call of a specialisation (or no direct launch): the full path binds it.
        args = dict(self.args)
        args.update(zip(self.names, tensors))
        self.launches(self.grid, args, **self.options)
