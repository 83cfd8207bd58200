# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Every private Python, torch and Triton internal that megatron_ext uses, each with a fallback.

Any of these can change in a Python, torch or Triton release. Each is looked up once, at import,
and bound to a module-level name (no Python frame is added on a per-call path); where one is
missing, a safe fallback is bound instead, and where one answers unexpectedly at run time, the
caller takes the safe path:

- ``sys.getrefcount``, ``torch.Tensor._use_count``, ``torch._C._storage_Use_Count``: whether a
  backward may rotate its incoming gradient in place (:func:`owns_gradient`). Fallback: the
  gradient is copied, never written in place.
- ``torch._C._autograd._get_creation_meta`` / ``CreationMeta``: whether autograd refuses to
  rebase a view (:data:`autograd_refuses_in_place`). Fallback: every view is treated as refused.
- ``torch._C._functorch.is_functorch_wrapped_tensor``: refusing torch.func transforms
  (:data:`is_functorch_wrapped_tensor`). Fallback: a tensor without storage counts as wrapped.
- ``torch.Tensor._is_view`` and ``torch.Tensor._base``: whether a tensor is a view, and of what
  (:data:`tensor_is_view`, :data:`tensor_base`). Fallback: every tensor counts as a view (of a
  leaf that requires grad), so the in-place RoPE rotates a copy or goes behind autograd's back.
- ``torch._foreach_copy_``: one launch for many copies (:data:`foreach_copy_`). Fallback: one
  ``copy_`` per pair.
- ``torch._C._cuda_getDevice``, ``torch._C._cuda_getCurrentRawStream``: the device and stream of
  a direct kernel launch. Fallback: the public ``torch.cuda`` calls (:func:`check_cuda_current`
  compares them before the first direct launch).
- Triton's ``CudaLauncher``, ``driver.active.utils.launch`` and ``knobs.runtime`` hook chains:
  the direct kernel launch (:func:`bind_triton_launcher`), and ``JITFunction.arg_names``, the
  parameter order it passes arguments in (:func:`triton_kernel_arg_names`). Fallback: Triton's
  JIT launch.
- ``torch.ops.aten._cudnn_attention_forward``: cuDNN's ragged (cumulative sequence lengths)
  attention with separate query/key and value head sizes, for the MHA form of MLA's prefill
  (:data:`cudnn_attention_forward`). Fallback: None (that backend is unavailable and the step
  takes another, ultimately the absorbed Triton kernel).
- ``torch.ops.aten._scaled_dot_product_cudnn_attention``: cuDNN's dense attention (top-left
  causal, separate query/key and value head sizes, plans kept by shape), for the MHA form's
  ``cudnn-dense`` backend (:data:`cudnn_dense_attention_forward`). Fallback: None (as for the
  cuDNN entry).
- ``torch.ops.aten._flash_attention_forward``: FlashAttention-2's ragged attention (cumulative
  sequence lengths, one head size for query, key and value, causal mask aligned bottom-right
  where a sequence has more keys than queries), for the MHA form's ``flash`` backend
  (:data:`flash_attention_forward`). Fallback: None (as for the cuDNN entry). torch can swap the
  kernel behind it (``torch.nn.attention.activate_flash_attention_impl``); the MHA form checks
  the one active at its first prefill step on each device.
- ``torch._ops.OpOverloadPacket`` and ``OpOverload``: whether an entry above is torch's own
  operator, which runs on CUDA tensors only (:func:`is_torch_operator`). Fallback: no entry counts
  as torch's, and a backend named on CPU tensors fails inside torch, as before the check.
- ``torch.Tensor._version``: a tensor's in-place write counter, which tells whether host copies
  of a step's lengths are still current (:data:`tensor_version`). Fallback: a value equal to no
  other, so nothing is reused.
- ``JITFunction.fn`` (the Python function under a ``triton.jit`` kernel): its constexpr
  parameters (:func:`triton_kernel_constexpr_names`; fallback: unknown, every argument keys the
  autotuning), and ``Autotuner``/``Heuristics`` ``.fn``, the kernel under megatron-core's
  autotuned kernels (:func:`triton_jit_function`; fallback: unwrapped by attribute).

Tested on CPython 3.11 with torch 2.13 (CPU, Triton 3.9's interpreter) and on CPython 3.12 with
torch 2.11 and Triton 3.6 (CUDA, H200); the launcher conventions are known for Triton 3.6 to 3.9.
Where a check happens at run time (the gradient calibration, the direct launch's probe in
:mod:`megatron_ext.fusions.direct_launch`), any answer other than the expected one selects the
fallback for the rest of the process, with a warning.
"""

import inspect
import operator
import sys
import threading
import warnings
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------------
# Gradient ownership: may a backward overwrite the gradient autograd handed it?
# --------------------------------------------------------------------------------------------------


def _never_exclusive(obj: object) -> int:
    """Fallback without ``sys.getrefcount``: a count no exclusively held gradient has."""
    return sys.maxsize


# Python references to an object (``sys.getrefcount``). A backward calls it first thing, on its
# own ``grad`` argument: the count includes the frames that hold it, so it is comparable only
# with what calibrate_gradient_ownership's probe counted the same way.
python_references: Callable[[object], int] = getattr(sys, "getrefcount", None) or _never_exclusive
_tensor_use_count = getattr(torch.Tensor, "_use_count", None)
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)
# Python, tensor and storage references to a gradient.
GradientReferences = Tuple[int, int, int]
# Device type -> the references of a gradient held exclusively by autograd on that device type,
# or None where calibration failed or the internals are missing (the backward then copies).
EXCLUSIVE_GRADIENT_REFERENCES: Dict[str, Optional[GradientReferences]] = {}
_CALIBRATION_LOCK = threading.Lock()


def owns_gradient(grad: torch.Tensor, python_refs: int) -> bool:
    """Whether a gradient handed to a backward is ours alone to overwrite.

    Only when it has no more Python, tensor and storage references than an exclusively held
    gradient has on its device type (:func:`calibrate_gradient_ownership`): a stashing hook, a
    caller's ``backward(g)``, a second branch or a live view each add one. Also: torch-allocated
    storage (wrapped NumPy/DLPack memory is not resizable), contiguous, not requiring grad, not a
    view. False whenever anything is unknown or fails: a wrong True would be a silently wrong
    gradient.

    Args:
        grad: the gradient handed to a backward.
        python_refs: :data:`python_references` of ``grad``, counted first thing in that backward.

    Returns:
        bool: True if the backward may write ``grad`` in place.
    """
    exclusive = EXCLUSIVE_GRADIENT_REFERENCES.get(grad.device.type)
    if exclusive is None or grad.requires_grad or tensor_base(grad) is not None:
        return False
    try:
        if python_refs > exclusive[0] or _tensor_use_count(grad) > exclusive[1]:
            return False
        if not grad.is_contiguous():
            return False
        storage = grad.untyped_storage()
        return _storage_use_count(storage._cdata) <= exclusive[2] and storage.resizable()
    except Exception:  # noqa: BLE001 (an internal that fails means: not known to be ours)
        return False


def _references(grad: torch.Tensor, python_refs: int) -> GradientReferences:
    return python_refs, _tensor_use_count(grad), _storage_use_count(grad.untyped_storage()._cdata)


class _ReferenceProbe(torch.autograd.Function):
    """Records the references to the gradient its backward is handed (into the ``sink`` list)."""

    @staticmethod
    def forward(ctx, x, sink):
        ctx.sink = sink
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        python_refs = python_references(grad)  # first, as a real backward counts
        ctx.sink.append(_references(grad, python_refs))
        return grad, None


def _probe_references(device: torch.device, hold: Optional[str]) -> Optional[GradientReferences]:
    """The references the probe's backward sees when autograd hands it a fresh gradient
    (``hold=None``) or one also held elsewhere: by the caller (``"caller"``), by a hook
    (``"hook"``) or through a view a hook kept (``"view"``)."""
    sink: List[GradientReferences] = []
    kept = []
    with torch.enable_grad():
        x = torch.zeros(2, device=device, requires_grad=True)
        y = _ReferenceProbe.apply(x, sink)
        if hold == "caller":
            seed = torch.ones(2, device=device)
            y.backward(seed)
        else:
            if hold == "hook":
                y.register_hook(kept.append)
            elif hold == "view":
                y.register_hook(lambda g: kept.append(g[:1]))
            (y * 2).sum().backward()
    return sink[0] if len(sink) == 1 else None


def _calibrated(device: torch.device) -> Tuple[Optional[GradientReferences], Optional[str]]:
    """The exclusive gradient's references on ``device``'s type, or None and why not."""
    if python_references is _never_exclusive or None in (_tensor_use_count, _storage_use_count):
        return None, "sys.getrefcount, Tensor._use_count or torch._C._storage_Use_Count missing"
    exclusive = _probe_references(device, None)
    if exclusive is None or not all(isinstance(c, int) and 1 <= c < sys.maxsize for c in exclusive):
        return None, f"an exclusive gradient was counted as {exclusive}"
    if _probe_references(device, None) != exclusive:
        return None, "an exclusive gradient's counts are not stable"
    for hold in ("caller", "hook", "view"):
        shared = _probe_references(device, hold)
        if shared is None or all(c <= e for c, e in zip(shared, exclusive)):
            return None, f"a gradient held by a {hold} ({shared}) looks exclusive ({exclusive})"
    return exclusive, None


def calibrate_gradient_ownership(device: torch.device) -> None:
    """Measure what an exclusively held gradient looks like on ``device``'s type, once.

    The counts depend on the interpreter, torch and the autograd engine's thread for the device,
    so they are measured, and accepted only if gradients known to be shared (held by the caller,
    a hook, or a view) count more. Otherwise, or if the internals are missing or raise, backwards
    on that device type copy for the rest of the process (with a warning). Not measured during
    CUDA-graph capture (the probe's backward would be captured); until then the backward copies.

    Args:
        device: a device the backward runs on.
    """
    if device.type in EXCLUSIVE_GRADIENT_REFERENCES:
        return
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return
    with _CALIBRATION_LOCK:
        if device.type in EXCLUSIVE_GRADIENT_REFERENCES:
            return
        try:
            exclusive, reason = _calibrated(device)
        except Exception as error:  # noqa: BLE001 (any failure means: always copy)
            exclusive, reason = None, f"{type(error).__name__}: {error}"
        if reason is not None:
            warnings.warn(
                f"megatron_ext: the MLA RoPE backward copies every gradient on {device.type} "
                f"(the in-place path needs an ownership check: {reason})",
                RuntimeWarning,
                stacklevel=3,
            )
        EXCLUSIVE_GRADIENT_REFERENCES[device.type] = exclusive


# --------------------------------------------------------------------------------------------------
# Autograd views and torch.func
# --------------------------------------------------------------------------------------------------

_get_creation_meta = getattr(torch._C._autograd, "_get_creation_meta", None)
_DEFAULT_CREATION = getattr(getattr(torch._C._autograd, "CreationMeta", None), "DEFAULT", None)


def _refuses_by_creation_meta(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view autograd cannot rebase: made inside a custom Function, by a
    multi-output op, or under no-grad or inference mode (an unexpected answer: refused)."""
    if not tensor_is_view(t):
        return False
    try:
        return _get_creation_meta(t) != _DEFAULT_CREATION
    except Exception:  # noqa: BLE001 (unknown: the side that never raises after the write)
        return True


def _refuses_every_view(t: torch.Tensor) -> bool:
    """Fallback without creation metadata: every view is treated as one autograd cannot rebase."""
    return tensor_is_view(t)


# Whether ``ctx.mark_dirty(t)`` would be refused for a tensor ``t`` that requires grad. Where the
# creation metadata is missing or fails, a view counts as refused: the caller then rotates it
# behind autograd's back with a version bump, as megatron-core does for every input, which keeps
# the output and its gradient right and makes a backward that saved the storage fail loudly;
# the other side (``mark_dirty``) would raise only after the kernel wrote the view.
autograd_refuses_in_place: Callable[[torch.Tensor], bool] = (
    _refuses_by_creation_meta
    if callable(_get_creation_meta) and _DEFAULT_CREATION is not None
    else _refuses_every_view
)


def _has_no_storage(x: torch.Tensor) -> bool:
    """Fallback: torch.func's wrappers (BatchedTensorImpl, TensorWrapper) have no storage."""
    try:
        x.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return True
    return False


# Whether a tensor is a torch.func (vmap, grad, jvp) wrapper without storage the kernels could use.
is_functorch_wrapped_tensor: Callable[[torch.Tensor], bool] = (
    getattr(getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", None)
    or _has_no_storage
)


# --------------------------------------------------------------------------------------------------
# Views, and many copies in one launch
# --------------------------------------------------------------------------------------------------


def _every_tensor_a_view(t: torch.Tensor) -> bool:
    """Fallback without ``Tensor._is_view``: every tensor counts as a view (the callers' safe
    side: a view is refused in place, rotated behind autograd's back or copied)."""
    return True


class _UnknownLeaf:
    """Fallback base without ``Tensor._base``: a leaf that requires grad (its callers copy)."""

    is_leaf = True
    requires_grad = True


def _unknown_base(t: torch.Tensor) -> _UnknownLeaf:
    return _UnknownLeaf()


_PROBE_TENSOR = torch.zeros(2)
# Whether ``t`` is a view (a C method, no Python frame).
tensor_is_view: Callable[[torch.Tensor], bool] = (
    getattr(torch.Tensor, "_is_view", None)
    if callable(getattr(torch.Tensor, "_is_view", None))
    else _every_tensor_a_view
)
# The tensor ``t`` views, or None (a C attribute getter, no Python frame).
tensor_base: Callable[[torch.Tensor], Optional[torch.Tensor]] = (
    operator.attrgetter("_base")
    if getattr(_PROBE_TENSOR[:1], "_base", None) is _PROBE_TENSOR
    else _unknown_base
)
del _PROBE_TENSOR


def _copy_each(destinations: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> None:
    """Fallback without ``torch._foreach_copy_``: one ``copy_`` per pair (same values)."""
    for destination, source in zip(destinations, sources):
        destination.copy_(source)


# ``destinations[i].copy_(sources[i])`` for every i, in as few launches as torch can.
foreach_copy_: Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor]], None] = (
    getattr(torch, "_foreach_copy_", None) or _copy_each
)


# --------------------------------------------------------------------------------------------------
# CUDA's current device and stream, for the direct kernel launch
# --------------------------------------------------------------------------------------------------


def _public_current_raw_stream(index: int) -> int:
    """Fallback: the current stream's handle through the public (slower) API."""
    return torch.cuda.current_stream(index).cuda_stream


# The current CUDA device index, and the current stream's handle on a device index.
cuda_current_device: Callable[[], int] = (
    getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
)
cuda_current_raw_stream: Callable[[int], int] = (
    getattr(torch._C, "_cuda_getCurrentRawStream", None) or _public_current_raw_stream
)


def check_cuda_current(index: int) -> Optional[str]:
    """Compare :data:`cuda_current_device` and :data:`cuda_current_raw_stream` with the public
    ``torch.cuda`` answers on device ``index`` (its current stream and a side stream).

    Args:
        index: a CUDA device index.

    Returns:
        Optional[str]: what differed, or None.
    """
    with torch.cuda.device(index):
        if cuda_current_device() != index:
            return f"the current device is {cuda_current_device()}, expected {index}"
        for stream in (torch.cuda.current_stream(index), torch.cuda.Stream(index)):
            with torch.cuda.stream(stream):
                raw = cuda_current_raw_stream(index)
            if raw != stream.cuda_stream:
                return f"the current stream is {raw}, expected {stream.cuda_stream}"
    return None


# --------------------------------------------------------------------------------------------------
# Triton's C launcher
# --------------------------------------------------------------------------------------------------

# (grid x, grid y, grid z, raw stream, kernel arguments in signature order, constexprs included)
DirectLaunch = Callable[[int, int, int, int, tuple], None]


def _hook_active(hook) -> bool:
    # Triton keeps its launch hooks as HookChain objects (a list of calls, often empty).
    return hook is not None and bool(getattr(hook, "calls", True))


def triton_launch_hooks_set() -> bool:
    """Whether a profiler or tool registered Triton launch hooks (the direct launch skips them)."""
    runtime = triton.knobs.runtime
    return _hook_active(runtime.launch_enter_hook) or _hook_active(runtime.launch_exit_hook)


def _generic_launch():
    """The active driver's shared C launch function (Triton 3.7+), or None."""
    try:
        return triton.runtime.driver.active.utils.launch
    except (AttributeError, RuntimeError):
        return None


def triton_launch_convention(launcher) -> Optional[str]:
    """The calling convention of a compiled kernel's C launcher, read from its structure.

    - ``generated`` (Triton 3.6): each compiled kernel has a generated C module; its ``launch``
      takes grid, stream, function, flags, scratch, metadata and hooks, then every argument.
    - ``generic`` (Triton 3.7 to 3.9): one C function, ``driver.utils.launch``, takes the same
      head, the launcher's argument annotations and packed signature, and a tuple of arguments.

    Args:
        launcher: ``compiled.run`` of what ``kernel[grid](...)`` returned.

    Returns:
        Optional[str]: ``"generic"``, ``"generated"`` or None (unknown: launch through the JIT).
    """
    if type(launcher).__name__ != "CudaLauncher" or not callable(getattr(launcher, "launch", None)):
        return None
    if getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1):
        return None
    if getattr(launcher, "gsan_enabled", False):
        return None
    generic = (hasattr(launcher, "arg_annotations"), hasattr(launcher, "kernel_signature"))
    if not any(generic):
        return "generated"
    # A launcher wrapped for tensor descriptors rewrites its arguments: not ours to skip.
    return "generic" if all(generic) and launcher.launch is _generic_launch() else None


def triton_kernel_arg_names(kernel) -> Optional[List[str]]:
    """A ``triton.jit`` function's parameter names in signature order (constexprs included), or
    None where the attribute is missing or not a list of strings (no direct launch then).

    Args:
        kernel: the ``triton.jit`` function.

    Returns:
        Optional[List[str]]: the names.
    """
    names = getattr(kernel, "arg_names", None)
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        return None
    return list(names)


def triton_kernel_constexpr_names(kernel) -> Optional[Tuple[str, ...]]:
    """A ``triton.jit`` function's constexpr parameter names, read from the annotations of the
    Python function it wraps (``fn``; the compiled and the interpreted kernel both keep it), or
    None where that is missing.

    Args:
        kernel: the ``triton.jit`` function.

    Returns:
        Optional[Tuple[str, ...]]: the names, in signature order.
    """
    try:
        params = inspect.signature(kernel.fn).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return None
    return tuple(p.name for p in params if p.annotation is tl.constexpr)


try:
    from triton.runtime.autotuner import Autotuner as _Autotuner
    from triton.runtime.autotuner import Heuristics as _Heuristics

    _KERNEL_WRAPPERS: Tuple[type, ...] = (_Autotuner, _Heuristics)
except ImportError:  # moved: unwrap by name
    _KERNEL_WRAPPERS = ()


def triton_jit_function(kernel):
    """The ``triton.jit`` function under Triton's ``autotune``/``heuristics`` wrappers (each
    keeps the function it wraps as ``fn``), so that it launches at one given config.

    Args:
        kernel: a kernel, wrapped or not.

    Returns:
        The innermost kernel.
    """
    while (
        isinstance(kernel, _KERNEL_WRAPPERS) or type(kernel).__name__ in ("Autotuner", "Heuristics")
    ) and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return kernel


def bind_triton_launcher(compiled) -> Optional[DirectLaunch]:
    """The direct launch of ``compiled`` through its C launcher, or None if its convention is
    unknown (:func:`triton_launch_convention`).

    Args:
        compiled: what ``kernel[grid](...)`` returned.

    Returns:
        Optional[DirectLaunch]: ``launch(gx, gy, gz, stream, args)``, or None.
    """
    try:
        launcher = compiled.run  # loads the module on first use
        kind = triton_launch_convention(launcher)
        if kind is None:
            return None
        c_launch, function, packed = launcher.launch, compiled.function, compiled.packed_metadata
        cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        if kind == "generic":
            annotations, signature = launcher.arg_annotations, launcher.kernel_signature
    except AttributeError:
        return None

    if kind == "generated":

        def launch(gx, gy, gz, stream, args, _keep=compiled):
            c_launch(
                gx, gy, gz, stream, function, cooperative, pdl, None, None, packed, None, None,
                None, *args,
            )  # fmt: skip

    else:

        def launch(gx, gy, gz, stream, args, _keep=compiled):
            c_launch(
                gx, gy, gz, stream, function, cooperative, pdl, packed, None, None, None, None,
                None, annotations, signature, args,
            )  # fmt: skip

    return launch


# --------------------------------------------------------------------------------------------------
# torch's ragged cuDNN attention, and in-place write counters
# --------------------------------------------------------------------------------------------------


def _aten_op(name: str):
    """``torch.ops.aten.<name>``, or None where this torch has no such operator."""
    try:
        return getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return None


# torch's cuDNN attention over packed (THD) tensors with cumulative sequence lengths:
# ``(query, key, value, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k, compute_log_sumexp,
# dropout_p, is_causal, return_debug_mask, *, scale)`` -> (output, logsumexp, ...). Its causal
# mask is aligned top-left in each sequence (torch aligns it bottom-right only for a per-sequence
# used-KV length, which this operator does not take), so the MHA form attends a cached prefix in
# a separate unmasked call. None where missing.
cudnn_attention_forward = _aten_op("_cudnn_attention_forward")

# torch's FlashAttention-2 over packed (THD) tensors: ``(query, key, value, cum_seq_q, cum_seq_k,
# max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale)`` -> (output, logsumexp, ...).
# Its causal mask is FlashAttention's, aligned bottom-right in each sequence; query, key and value
# share one head size. Unlike the cuDNN entry it builds no execution plan per call.
flash_attention_forward = _aten_op("_flash_attention_forward")

# torch's cuDNN attention over dense ``[batch, heads, length, head size]`` tensors: ``(query, key,
# value, attn_bias, compute_log_sumexp, dropout_p, is_causal, return_debug_mask, *, scale)`` ->
# (output, logsumexp, ...). Its causal mask is aligned top-left; query/key and value head sizes may
# differ. torch keeps its cuDNN execution plans by shape (unlike the ragged entry's), so a shape
# seen before costs no planning.
cudnn_dense_attention_forward = _aten_op("_scaled_dot_product_cudnn_attention")


# torch's operator objects (``torch.ops.aten.<name>`` and its overloads); empty where this torch
# names them otherwise (then no entry counts as torch's own: see is_torch_operator).
_OPERATOR_TYPES = tuple(
    kind
    for kind in (
        getattr(getattr(torch, "_ops", None), "OpOverloadPacket", None),
        getattr(getattr(torch, "_ops", None), "OpOverload", None),
    )
    if isinstance(kind, type)
)


def is_torch_operator(entry: object) -> bool:
    """Whether ``entry`` is one of torch's own operators (one of the entries above as torch has
    it), not a Python function put in its place. False where this torch's operator types are
    unknown.

    Args:
        entry: an entry such as :data:`cudnn_attention_forward`.

    Returns:
        bool: whether it is torch's operator.
    """
    return bool(_OPERATOR_TYPES) and isinstance(entry, _OPERATOR_TYPES)


class _NeverEqual:
    """Fallback version: equal to nothing, so a cached host copy is never taken as current."""

    def __eq__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


def _unknown_version(t: torch.Tensor) -> object:
    return _NeverEqual()


# A tensor's in-place write counter (shared by its views), a C attribute getter.
tensor_version: Callable[[torch.Tensor], object] = (
    operator.attrgetter("_version")
    if isinstance(getattr(torch.zeros(1), "_version", None), int)
    else _unknown_version
)
