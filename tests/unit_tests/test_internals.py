# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The private internals megatron_ext binds, their answers on this torch, and each fallback."""

import types
import warnings

import pytest
import torch
import triton

from megatron_ext import internals
from megatron_ext.fusions import direct_launch
from megatron_ext.fusions import fused_mla_yarn_rope_apply as rope
from megatron_ext.fusions.mla_rope.kernels import mla_rope_q_bwd_kernel
from megatron_ext.fusions.mla_rope.launch import pinned_kernel_config

HAVE_CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param(torch.device("cpu"), id="cpu"),
    pytest.param(torch.device("cuda"), id="cuda", marks=pytest.mark.gpu),
]
# qk_head_dim, emb_dim of the small query below.
QK, EMB = 8, 16


def _query(device, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(4, 2, 3, QK + EMB, generator=g).to(device)
    cos, sin = torch.rand(8, EMB, generator=g).to(device), torch.rand(8, EMB, generator=g).to(
        device
    )
    weight = torch.randn(t.shape, generator=g).to(device)
    return t, cos, sin, weight


def _rope_step(t, cos, sin, weight):
    """A training step's use of the query RoPE: the gradient comes fresh from the next op."""
    x = t.clone().requires_grad_(True)
    with pinned_kernel_config(2, 1):
        out = rope.fused_apply_mla_rope_for_q(x * 1, cos, sin, QK, EMB)
        (out * weight).sum().backward()
        expected = rope.mla_rope_q_bwd(weight, cos, sin, QK, EMB)
    return x.grad, expected


@pytest.fixture
def uncalibrated(monkeypatch):
    """Forget this process's calibration (restored afterwards)."""
    for device_type in ("cpu", "cuda"):
        monkeypatch.delitem(internals.EXCLUSIVE_GRADIENT_REFERENCES, device_type, raising=False)


@pytest.fixture
def never_in_place(monkeypatch):
    """Fail the test if the backward writes its incoming gradient in place."""

    run = rope.run

    def refuse_in_place(kernel, *args, **kwargs):
        if kernel is mla_rope_q_bwd_kernel:
            pytest.fail("the backward rotated a gradient in place")
        return run(kernel, *args, **kwargs)

    monkeypatch.setattr(rope, "run", refuse_in_place)


# --------------------------------------------------------------------------------------------------
# Gradient ownership
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_the_ownership_probe_on_this_torch(device, uncalibrated):
    """The real probe calibrates here (no warning), and judges fresh and shared gradients."""
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        internals.calibrate_gradient_ownership(device)
    exclusive = internals.EXCLUSIVE_GRADIENT_REFERENCES[device.type]
    assert exclusive is not None and all(isinstance(c, int) and c >= 1 for c in exclusive)

    def fresh(*shape):
        return torch.randn(*shape).to(device)

    refs = exclusive[0]  # the Python count a backward's frame sees for an exclusive gradient

    def owns(grad, python_refs=refs):
        return internals.owns_gradient(grad, python_refs)

    assert owns(fresh(4, 6))
    assert not owns(fresh(4, 6), refs + 1)  # another Python reference
    assert not owns(fresh(4, 6), internals._never_exclusive(None))  # getrefcount's fallback
    held = fresh(4, 6)
    other = held.view(4, 6)  # another tensor on the same storage
    assert not owns(held) and not owns(other)
    del other
    assert owns(held)
    assert not owns(fresh(4, 6).t())  # not contiguous
    assert not owns(fresh(4, 6).requires_grad_(True))
    assert not owns(fresh(6).expand(4, 6))
    if device.type == "cpu":
        import numpy as np

        assert not owns(torch.from_numpy(np.zeros((4, 6), dtype=np.float32)))  # not resizable


def test_a_fresh_gradient_is_rotated_in_place(monkeypatch):
    """The path the fallbacks below switch off: without them, no copy is made."""
    in_place = []
    run = rope.run

    def record(kernel, *args, **kwargs):
        in_place.append(kernel is mla_rope_q_bwd_kernel)
        return run(kernel, *args, **kwargs)

    monkeypatch.setattr(rope, "run", record)
    grad, expected = _rope_step(*_query("cpu", seed=1))
    assert in_place[:2] == [False, True]  # the forward, then the backward in place
    assert torch.equal(grad, expected)


@pytest.mark.parametrize(
    "missing, fallback",
    [
        ("python_references", internals._never_exclusive),
        ("_tensor_use_count", None),
        ("_storage_use_count", None),
    ],
    ids=["getrefcount", "tensor-use-count", "storage-use-count"],
)
def test_a_missing_reference_count_makes_the_backward_copy(
    missing, fallback, monkeypatch, uncalibrated, never_in_place
):
    """What binding at import leaves when the internal is missing: the backward then copies."""
    monkeypatch.setattr(internals, missing, fallback)
    with pytest.warns(RuntimeWarning, match="copies every gradient on cpu.*missing"):
        grad, expected = _rope_step(*_query("cpu", seed=2))
    assert torch.equal(grad, expected)
    assert internals.EXCLUSIVE_GRADIENT_REFERENCES["cpu"] is None  # settled: no re-calibration


def _constant(value):
    return lambda *args: value


def _raising(*args):
    raise RuntimeError("internal changed")


@pytest.mark.parametrize(
    "name, replacement, reason",
    [
        # Every gradient counted alike: a shared one would look exclusive.
        ("python_references", _constant(3), "looks exclusive"),
        ("_tensor_use_count", _constant(0), "counted as"),
        ("_storage_use_count", _raising, "RuntimeError: internal changed"),
    ],
    ids=["refcount-constant", "use-count-zero", "storage-count-raises"],
)
def test_a_calibration_that_answers_unexpectedly_makes_the_backward_copy(
    name, replacement, reason, monkeypatch, uncalibrated, never_in_place
):
    monkeypatch.setattr(internals, name, replacement)
    with pytest.warns(RuntimeWarning, match=f"copies every gradient on cpu.*{reason}"):
        grad, expected = _rope_step(*_query("cpu", seed=3))
    assert torch.equal(grad, expected)


def test_a_failing_calibration_makes_the_backward_copy(monkeypatch, uncalibrated, never_in_place):
    monkeypatch.setattr(internals, "_probe_references", _raising)
    with pytest.warns(RuntimeWarning, match="RuntimeError: internal changed"):
        grad, expected = _rope_step(*_query("cpu", seed=4))
    assert torch.equal(grad, expected)


def test_a_count_failing_in_the_backward_makes_it_copy(monkeypatch, never_in_place):
    """Calibrated, then the internal fails on the real gradient: that gradient is copied."""
    internals.calibrate_gradient_ownership(torch.device("cpu"))
    t, cos, sin, weight = _query("cpu", seed=5)
    monkeypatch.setattr(internals, "_tensor_use_count", _raising)
    grad, expected = _rope_step(t, cos, sin, weight)
    assert torch.equal(grad, expected)


# --------------------------------------------------------------------------------------------------
# Autograd views and torch.func
# --------------------------------------------------------------------------------------------------


def test_creation_meta_on_this_torch():
    """(A view made inside a custom Function: test_fused_mla_yarn_rope_apply.py.)"""
    assert internals.autograd_refuses_in_place is internals._refuses_by_creation_meta
    activation = torch.ones(2, 3, requires_grad=True) * 1
    first_row, _ = activation.unbind(0)  # a view made by a multi-output op
    assert internals.autograd_refuses_in_place(first_row)
    assert not internals.autograd_refuses_in_place(activation.view(3, 2))
    assert not internals.autograd_refuses_in_place(activation)  # not a view


def test_unknown_creation_meta_counts_as_refused(monkeypatch):
    view = (torch.ones(2, 3, requires_grad=True) * 1).view(3, 2)
    monkeypatch.setattr(internals, "_get_creation_meta", _raising)
    assert internals._refuses_by_creation_meta(view)
    monkeypatch.setattr(internals, "_get_creation_meta", _constant("not a CreationMeta"))
    assert internals._refuses_by_creation_meta(view)
    assert internals._refuses_every_view(view)
    assert not internals._refuses_every_view(torch.ones(2))


def test_without_creation_meta_a_view_is_rotated_behind_autograd(monkeypatch):
    """The fallback's side: the same output and gradient as with mark_dirty, no error, and a
    backward that saved the storage still fails loudly."""
    t, cos, sin, weight = _query("cpu", seed=6)

    def run():
        leaf = t.clone().requires_grad_(True)
        with pinned_kernel_config(2, 1):
            out = rope.fused_apply_mla_rope_for_q((leaf * 1).view(t.shape), cos, sin, QK, EMB)
            (out * weight).sum().backward()
        return out.detach(), leaf.grad

    with_meta = run()
    monkeypatch.setattr(internals, "autograd_refuses_in_place", internals._refuses_every_view)
    without = run()
    assert torch.equal(with_meta[0], without[0]) and torch.equal(with_meta[1], without[1])
    q = (t.clone().requires_grad_(True) * 1).view(t.shape)
    saved_user = q * torch.ones(t.shape[-1], requires_grad=True)  # saves q
    out = rope.fused_apply_mla_rope_for_q(q, cos, sin, QK, EMB)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (saved_user.sum() + out.sum()).backward()


def test_functorch_check_on_this_torch_and_its_fallback(monkeypatch):
    assert internals.is_functorch_wrapped_tensor is torch._C._functorch.is_functorch_wrapped_tensor
    seen = []
    torch.func.vmap(lambda x: seen.append(internals._has_no_storage(x)) or x)(torch.ones(2, 3))
    torch.func.grad(lambda x: seen.append(internals._has_no_storage(x)) or x.sum())(torch.ones(3))
    assert seen == [True, True]
    assert not internals._has_no_storage(torch.ones(2))
    # The drop-in with the fallback bound still refuses a transform, before any launch.
    monkeypatch.setattr(rope, "_is_functorch_wrapped", internals._has_no_storage)
    t, cos, sin, _ = _query("cpu", seed=7)
    with pytest.raises(TypeError, match="torch.func transforms"):
        torch.func.vmap(lambda x: rope.fused_apply_mla_rope_for_q(x * 1.0, cos, sin, QK, EMB))(
            torch.stack([t, t])
        )


# --------------------------------------------------------------------------------------------------
# Views, and many copies in one launch
# --------------------------------------------------------------------------------------------------


def test_view_bindings_on_this_torch():
    """Bound to torch's own C callables: no Python frame on the drop-ins' per-call path."""
    assert internals.tensor_is_view is torch.Tensor._is_view
    base = torch.ones(2, 3)
    assert internals.tensor_is_view(base[0]) and not internals.tensor_is_view(base)
    assert internals.tensor_base(base[0]) is base and internals.tensor_base(base) is None


def test_without_view_internals_the_drop_in_copies_and_gives_the_same_bits(monkeypatch):
    """The fallbacks' side: every tensor counts as a view of a leaf that requires grad, so the
    in-place forward rotates a copy (or goes behind autograd's back) and the backward copies the
    gradient; output and gradient are the same, and the caller's leaf is left as it was."""
    assert internals._every_tensor_a_view(torch.ones(2))
    fallback_base = internals._unknown_base(torch.ones(2))
    assert fallback_base.is_leaf and fallback_base.requires_grad
    t, cos, sin, weight = _query("cpu", seed=8)

    def run():
        leaf = t.clone().requires_grad_(True)
        with pinned_kernel_config(2, 1):
            out = rope.fused_apply_mla_rope_for_q(leaf * 1, cos, sin, QK, EMB)
            (out * weight).sum().backward()
            kept = t.clone().requires_grad_(True)
            rope.fused_apply_mla_rope_for_q(kept, cos, sin, QK, EMB)
        return out.detach(), leaf.grad, kept.detach()

    with_internals = run()
    for module in (internals, rope):
        monkeypatch.setattr(module, "tensor_is_view", internals._every_tensor_a_view)
        monkeypatch.setattr(module, "tensor_base", internals._unknown_base)
    without = run()
    assert all(torch.equal(a, b) for a, b in zip(with_internals, without))
    assert torch.equal(without[2], t), "a leaf was rotated in place"
    grad = torch.ones(3)
    assert not internals.owns_gradient(grad, 0)


def test_foreach_copy_on_this_torch_and_its_fallback():
    assert internals.foreach_copy_ is torch._foreach_copy_
    for copy in (internals.foreach_copy_, internals._copy_each):
        destinations = [torch.zeros(3), torch.zeros(2, dtype=torch.int32)]
        sources = [torch.arange(3.0), torch.tensor([7, 8], dtype=torch.int32)]
        copy(destinations, sources)
        assert all(torch.equal(d, s) for d, s in zip(destinations, sources))


# --------------------------------------------------------------------------------------------------
# Triton kernels' Python side
# --------------------------------------------------------------------------------------------------


def test_torch_operators_on_this_torch_and_their_fallback(monkeypatch):
    """torch's operators (a packet and an overload) are told from a Python function; where the
    operator types are unknown, nothing counts as torch's."""
    assert internals._OPERATOR_TYPES, "this torch's operator types are expected to be found"
    assert internals.is_torch_operator(torch.ops.aten.add)
    assert internals.is_torch_operator(torch.ops.aten.add.Tensor)
    assert not internals.is_torch_operator(torch.add) and not internals.is_torch_operator(None)
    monkeypatch.setattr(internals, "_OPERATOR_TYPES", ())
    assert not internals.is_torch_operator(torch.ops.aten.add)


def test_constexpr_names_on_this_triton_and_their_fallback(monkeypatch):
    from megatron_ext.fusions.mla_rope import checks

    names = internals.triton_kernel_constexpr_names(mla_rope_q_bwd_kernel)
    assert "EMB_DIM" in names and "BLOCK_H" in names and "head_num" not in names
    assert internals.triton_kernel_constexpr_names(types.SimpleNamespace()) is None
    # Unknown constexprs: every argument keys the tuned config (finer, never wrong).
    cos, sin = torch.rand(8, EMB), torch.rand(8, EMB)
    record = checks.QueryRope(cos, sin, None, None, QK, EMB, 0, 1, False, False)
    plan = checks.plan_query(mla_rope_q_bwd_kernel, torch.zeros(4, 2, 3, QK + EMB), record)
    monkeypatch.setattr(internals, "triton_kernel_constexpr_names", lambda kernel: None)
    checks._constexpr_names.cache_clear()
    try:
        assert plan.constexprs() == dict(plan.args)
    finally:
        checks._constexpr_names.cache_clear()


def test_jit_function_under_autotuners_and_its_fallback(monkeypatch):
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mcore

    kernel = internals.triton_jit_function(mcore.rotary_fwd_q_kernel)
    assert type(kernel).__name__ in ("JITFunction", "InterpretedFunction")
    assert internals.triton_jit_function(kernel) is kernel
    # Without the wrapper classes (moved in a release): unwrapped by their names.
    monkeypatch.setattr(internals, "_KERNEL_WRAPPERS", ())
    assert internals.triton_jit_function(mcore.rotary_fwd_q_kernel) is kernel
    Autotuner = type("Autotuner", (), {})
    wrapped = Autotuner()
    wrapped.fn = kernel
    assert internals.triton_jit_function(wrapped) is kernel


# --------------------------------------------------------------------------------------------------
# CUDA's current device and stream
# --------------------------------------------------------------------------------------------------


def test_cuda_current_bindings_on_this_torch():
    """The raw internals where this torch has them, else the public calls."""
    if hasattr(torch._C, "_cuda_getDevice"):
        assert internals.cuda_current_device is torch._C._cuda_getDevice
    else:
        assert internals.cuda_current_device is torch.cuda.current_device
    if hasattr(torch._C, "_cuda_getCurrentRawStream"):
        assert internals.cuda_current_raw_stream is torch._C._cuda_getCurrentRawStream
    else:
        assert internals.cuda_current_raw_stream is internals._public_current_raw_stream


@pytest.mark.gpu
def test_gpu_cuda_current_bindings_agree_with_torch_cuda():
    index = torch.cuda.current_device()
    assert internals.check_cuda_current(index) is None
    assert internals._public_current_raw_stream(index) == internals.cuda_current_raw_stream(index)


@pytest.mark.gpu
def test_gpu_a_wrong_stream_answer_switches_the_direct_launch_off(monkeypatch):
    """A raw-stream internal that answers the default stream everywhere: the probe notices on its
    side stream, and launches take Triton's JIT path."""
    monkeypatch.setattr(internals, "cuda_current_raw_stream", _constant(0))
    monkeypatch.setattr(direct_launch, "_VERIFIED", {})
    with pytest.warns(RuntimeWarning, match="direct kernel launch disabled.*current stream is 0"):
        assert direct_launch.verified(torch.device("cuda", torch.cuda.current_device())) is False


# --------------------------------------------------------------------------------------------------
# Triton's C launcher
# --------------------------------------------------------------------------------------------------


class _Launcher:
    """A stand-in with the attributes of Triton's ``CudaLauncher`` that the binding reads."""

    def __init__(self, generic, scratch=0, gsan=False):
        self.calls = _Calls()
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = 0
        self.launch_pdl = 1
        if gsan:
            self.gsan_enabled = True
        if generic:
            self.arg_annotations = ["annotations"]
            self.kernel_signature = b"sig"

        # An attribute, as Triton's is: the driver's shared function is compared by identity.
        self.launch = self.calls.append_args


_Launcher.__name__ = "CudaLauncher"


class _Calls(list):
    def append_args(self, *args):
        self.append(args)


def _compiled(launcher):
    return types.SimpleNamespace(run=launcher, function=1234, packed_metadata=(4, 1, 0))


@pytest.fixture
def generic_utils(monkeypatch):
    """Make a generic launcher's ``launch`` the active driver's shared launch function."""

    def install(launcher):
        monkeypatch.setattr(internals, "_generic_launch", lambda: launcher.launch)

    return install


def test_convention_is_read_from_the_launcher(generic_utils):
    generated = _Launcher(generic=False)
    assert internals.triton_launch_convention(generated) == "generated"
    generic = _Launcher(generic=True)
    generic_utils(generic)
    assert internals.triton_launch_convention(generic) == "generic"
    # A launcher wrapped for tensor descriptors, scratch memory, GSan, anything else: the JIT path.
    assert internals.triton_launch_convention(_Launcher(generic=True)) is None
    assert internals.triton_launch_convention(_Launcher(generic=False, scratch=64)) is None
    assert internals.triton_launch_convention(_Launcher(generic=False, gsan=True)) is None
    assert internals.triton_launch_convention(object()) is None


def test_generated_convention_arguments():
    launcher = _Launcher(generic=False)
    launch = internals.bind_triton_launcher(_compiled(launcher))
    launch(6, 3, 1, 777, (11, None, 5, 7))
    assert launcher.calls == [
        (6, 3, 1, 777, 1234, 0, 1, None, None, (4, 1, 0), None, None, None, 11, None, 5, 7)
    ]


def test_generic_convention_arguments(generic_utils):
    launcher = _Launcher(generic=True)
    generic_utils(launcher)
    launch = internals.bind_triton_launcher(_compiled(launcher))
    launch(6, 3, 1, 777, (11, None, 5, 7))
    head = (6, 3, 1, 777, 1234, 0, 1, (4, 1, 0), None, None, None, None, None)
    assert launcher.calls == [head + (["annotations"], b"sig", (11, None, 5, 7))]


def test_an_unknown_launcher_binds_nothing():
    """None means: launch through Triton's JIT."""
    assert internals.bind_triton_launcher(types.SimpleNamespace(run=object())) is None
    assert internals.bind_triton_launcher(types.SimpleNamespace()) is None
    assert internals.bind_triton_launcher(_compiled(_Launcher(generic=True))) is None


def test_launch_hooks_are_detected(monkeypatch):
    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "launch_enter_hook", types.SimpleNamespace(calls=[]))
    monkeypatch.setattr(runtime, "launch_exit_hook", None)
    assert not internals.triton_launch_hooks_set()  # an empty hook chain, as Triton keeps
    monkeypatch.setattr(runtime, "launch_exit_hook", types.SimpleNamespace(calls=[print]))
    assert internals.triton_launch_hooks_set()
    monkeypatch.setattr(runtime, "launch_enter_hook", lambda *a: None)
    assert internals.triton_launch_hooks_set()
    assert direct_launch.hooks_set is internals.triton_launch_hooks_set
