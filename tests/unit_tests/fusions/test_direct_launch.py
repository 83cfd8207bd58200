# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The direct C launch: when it is bound, and its probe."""

import types
import warnings

import pytest
import torch
import triton
import triton.language as tl

from megatron_ext import internals
from megatron_ext.fusions import direct_launch
from megatron_ext.fusions.tensor_checks import INTERPRETED

HAVE_CUDA = torch.cuda.is_available()
# The Triton releases whose launchers the direct launch knows (the probe still checks each one).
KNOWN_TRITON = triton.__version__.split(".")[:2] in (["3", "6"], ["3", "7"], ["3", "8"], ["3", "9"])


def test_bind_refuses_when_disabled_or_given_nothing(monkeypatch):
    """The calling conventions themselves are tested with megatron_ext.internals."""
    bound = object()
    monkeypatch.setattr(internals, "bind_triton_launcher", lambda compiled: bound)
    monkeypatch.setattr(direct_launch, "ENABLED", True)
    assert direct_launch.bind(types.SimpleNamespace()) is bound
    assert direct_launch.bind(None) is None
    monkeypatch.setattr(direct_launch, "ENABLED", False)
    assert direct_launch.bind(types.SimpleNamespace()) is None


def test_verified_is_false_when_disabled(monkeypatch):
    monkeypatch.setattr(direct_launch, "ENABLED", False)
    monkeypatch.setattr(direct_launch, "_VERIFIED", {})
    assert direct_launch.verified(torch.device("cuda", 0)) is False


def test_a_failing_probe_switches_the_direct_launch_off_with_a_warning(monkeypatch):
    monkeypatch.setattr(direct_launch, "ENABLED", True)
    monkeypatch.setattr(direct_launch, "_VERIFIED", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda index: _NullContext())
    probes = []

    def broken(device):
        probes.append(device)
        raise RuntimeError("launcher changed")

    monkeypatch.setattr(direct_launch, "_probe", broken)
    with pytest.warns(RuntimeWarning, match="direct kernel launch disabled.*launcher changed"):
        assert direct_launch.verified(torch.device("cuda", 3)) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert direct_launch.verified(torch.device("cuda", 3)) is False  # remembered, no re-probe
    assert probes == [torch.device("cuda", 3)]
    monkeypatch.setattr(direct_launch, "_probe", lambda device: "wrote other values")
    with pytest.warns(RuntimeWarning, match="wrote other values"):
        assert direct_launch.verified(torch.device("cuda", 4)) is False


def test_no_probe_during_graph_capture(monkeypatch):
    monkeypatch.setattr(direct_launch, "ENABLED", True)
    monkeypatch.setattr(direct_launch, "_VERIFIED", {})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(direct_launch, "_probe", lambda device: pytest.fail("probed in capture"))
    assert direct_launch.verified(torch.device("cuda", 0)) is None
    assert direct_launch._VERIFIED == {}


class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.gpu
def test_gpu_probe_passes_on_the_known_tritons():
    """On Triton 3.6-3.9 the probe must pass: a failure here is a changed calling convention."""
    direct_launch._VERIFIED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = direct_launch.verified(torch.device("cuda", torch.cuda.current_device()))
    if KNOWN_TRITON:
        assert ok is True, [str(w.message) for w in caught]
    else:
        assert ok is False and caught, "an unknown Triton must fall back with a warning"


@pytest.mark.gpu
def test_gpu_probe_catches_a_wrong_calling_convention(monkeypatch):
    """Arguments handed in the wrong order make the probe fail, and the launch fall back."""
    real_bind = direct_launch.bind

    def swapped(compiled):
        launch = real_bind(compiled)
        if launch is None:
            return None
        return lambda gx, gy, gz, stream, args: launch(
            gx, gy, gz, stream, (args[0], args[1], args[3], args[2]) + tuple(args[4:])
        )

    monkeypatch.setattr(direct_launch, "bind", swapped)
    monkeypatch.setattr(direct_launch, "_VERIFIED", {})
    with pytest.warns(RuntimeWarning, match="wrote other values|unknown launcher"):
        assert direct_launch.verified(torch.device("cuda", torch.cuda.current_device())) is False


# --------------------------------------------------------------------------------------------------
# KernelLaunches and PreparedLaunch: one direct launch per specialisation Triton compiles
# --------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n"])
def _scale_kernel(out_ptr, x_ptr, factor, n, stride, BLOCK: tl.constexpr):
    idx = tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(x_ptr + idx * stride, mask=mask, other=0.0)
    tl.store(out_ptr + idx, x * factor, mask=mask)


def _scale_args(out, x, n, stride=1, block=64, factor=2.0):
    return dict(out_ptr=out, x_ptr=x, factor=factor, n=n, stride=stride, BLOCK=block)


def test_launch_key_splits_only_what_triton_specialises():
    launches = direct_launch.KernelLaunches(_scale_kernel, ["n"])
    x, out = torch.zeros(256), torch.zeros(256)
    options = dict(num_warps=4)

    def key(**changes):
        return launches.key(dict(_scale_args(out, x, 50), **changes), 0, options)

    base = key()
    # Not specialised: the unspecialised size within 32 bits, the float's value.
    assert key(n=1) == key(n=16) == key(n=2**31 - 1) == base
    assert key(factor=0.5) == base
    # Specialised: a 64-bit unspecialised size, another dtype, another 16-byte alignment, a
    # specialised int's value (Triton specialises on 1 and multiples of 16), a constexpr, the
    # options, the device.
    assert key(n=2**31) != base
    assert key(x_ptr=torch.zeros(256, dtype=torch.float64)) != base
    assert key(x_ptr=x[1:]) != base and key(x_ptr=x[4:]) == base
    assert key(stride=16) != base and key(stride=2) != key(stride=3)
    assert key(BLOCK=128) != base
    assert launches.key(_scale_args(out, x, 50), 0, dict(num_warps=8)) != base
    assert launches.key(_scale_args(out, x, 50), 1, options) != base
    assert launches.key(dict(_scale_args(out, x, 50), x_ptr=None), 0, options) != base


def test_cpu_tensors_launch_through_the_interpreter_and_bind_nothing():
    if not INTERPRETED:
        pytest.skip("CPU tensors run only in Triton's interpreter (TRITON_INTERPRET=1)")
    launches = direct_launch.KernelLaunches(_scale_kernel, ["n"])
    x = torch.arange(64, dtype=torch.float32)
    out = torch.full((64,), -1.0)
    launches((1,), _scale_args(out, x, 50))
    assert torch.equal(out[:50], 2 * x[:50]) and (out[50:] == -1).all()
    assert launches.launches == {}


def test_arg_names_internal_falls_back_to_none():
    assert internals.triton_kernel_arg_names(_scale_kernel) == [
        "out_ptr", "x_ptr", "factor", "n", "stride", "BLOCK"
    ]  # fmt: skip
    assert internals.triton_kernel_arg_names(types.SimpleNamespace()) is None
    assert internals.triton_kernel_arg_names(types.SimpleNamespace(arg_names=[1, 2])) is None


@pytest.mark.gpu
def test_gpu_prepared_launches_go_direct_after_the_first_call_with_the_jit_bits(monkeypatch):
    """The first launch of a specialisation binds its direct launch; later prepared launches of
    it (for any unspecialised size) take it and write what Triton's JIT writes; names out of the
    kernel's order bind nothing."""
    device = torch.device("cuda", torch.cuda.current_device())
    if not direct_launch.verified(device):
        pytest.skip("the direct launch is off on this Triton (its probe warned why)")
    launches = direct_launch.KernelLaunches(_scale_kernel, ["n"])
    x = torch.randn(256, device=device)
    jit_calls = []
    real_getitem = type(_scale_kernel).__getitem__

    def counting(kernel, grid):
        jit_calls.append(grid)
        return real_getitem(kernel, grid)

    monkeypatch.setattr(type(_scale_kernel), "__getitem__", counting)
    outs = []
    for n in (50, 7, 64):
        out = torch.full((256,), -1.0, device=device)
        args = _scale_args(out, x, n, factor=3.0)
        direct_launch.PreparedLaunch(launches, (1,), args, {})(out, x)
        outs.append((n, out))
    assert len(jit_calls) == 1 and len(launches.launches) == 1
    assert callable(next(iter(launches.launches.values())))
    for n, out in outs:
        assert torch.equal(out[:n], x[:n] * 3.0) and (out[n:] == -1).all(), n
    args = _scale_args(torch.zeros(256, device=device), x, 50)
    shuffled = direct_launch.PreparedLaunch(launches, (1,), dict(reversed(args.items())), {})
    # No launch key: it can never bind a direct launch (every call takes the JIT).
    assert not shuffled.direct and shuffled.key is None


class _OnCuda(torch.Tensor):
    """A CPU tensor that says it is on cuda:0: drives PreparedLaunch's CUDA branch on the CPU."""

    @property
    def device(self):
        return torch.device("cuda", 0)


def _stubbed_cuda_branch(monkeypatch, jit: list, direct: list) -> direct_launch.KernelLaunches:
    """KernelLaunches of a stand-in kernel with the device, Triton and the C launcher stubbed:
    JIT launches are recorded in ``jit`` as (grid, kwargs), direct ones in ``direct`` as the C
    launcher's arguments; the current device is 0 and its stream 1234."""

    class FakeKernel:
        arg_names = ["out_ptr", "x_ptr", "factor", "n", "stride", "BLOCK"]

        def __getitem__(self, grid):
            def launch(**kwargs):
                jit.append((grid, kwargs))
                return "compiled"

            return launch

    monkeypatch.setattr(direct_launch, "verified", lambda device: True)
    monkeypatch.setattr(
        direct_launch, "bind", lambda compiled: lambda *call: direct.append(call) or None
    )
    monkeypatch.setattr(direct_launch, "hooks_set", lambda: False)
    monkeypatch.setattr(internals, "cuda_current_device", lambda: 0)
    monkeypatch.setattr(internals, "cuda_current_raw_stream", lambda index: 1234)
    monkeypatch.setattr(torch.cuda, "device", lambda index: _NullContext())
    return direct_launch.KernelLaunches(FakeKernel(), ["n"])


def test_prepared_launch_binds_once_then_launches_directly(monkeypatch):
    """The CUDA branch with the device, Triton and the C launcher stubbed: the first call
    launches through the JIT under the tensor's device and binds; later calls call the bound
    launcher with the grid padded to three dimensions, the current stream, and every argument in
    order with tensors as pointers; a set launch hook or another current device take the JIT."""
    jit, direct = [], []
    launches = _stubbed_cuda_branch(monkeypatch, jit, direct)
    x = torch.zeros(64).as_subclass(_OnCuda)
    out = torch.zeros(64).as_subclass(_OnCuda)
    prepared = direct_launch.PreparedLaunch(
        launches, (3,), _scale_args(out, x, 7), dict(num_warps=4)
    )
    prepared(out, x)
    assert len(jit) == 1 and jit[0][0] == (3, 1, 1) and jit[0][1]["num_warps"] == 4
    assert not direct and len(launches.launches) == 1
    prepared(out, x)
    assert len(jit) == 1
    assert direct == [(3, 1, 1, 1234, (out.data_ptr(), x.data_ptr(), 2.0, 7, 1, 64))]
    monkeypatch.setattr(direct_launch, "hooks_set", lambda: True)
    prepared(out, x)
    assert len(jit) == 2 and len(direct) == 1
    monkeypatch.setattr(direct_launch, "hooks_set", lambda: False)
    monkeypatch.setattr(internals, "cuda_current_device", lambda: 1)
    prepared(out, x)
    assert len(jit) == 3 and len(direct) == 1


def test_prepared_launches_share_the_kernels_bindings_and_keep_no_tensor(monkeypatch):
    """A second PreparedLaunch of a bound specialisation (another unspecialised size) launches
    directly from its first call; one of another 16-byte alignment or another specialised value
    is another specialisation (the JIT first); none keeps a tensor alive."""
    import weakref

    jit, direct = [], []
    launches = _stubbed_cuda_branch(monkeypatch, jit, direct)
    x = torch.zeros(64).as_subclass(_OnCuda)
    out = torch.zeros(64).as_subclass(_OnCuda)
    prepared = direct_launch.PreparedLaunch(launches, (3,), _scale_args(out, x, 50), {})
    held = weakref.ref(x)
    del x
    assert held() is None, "the prepared launch keeps a tensor alive"

    x2, out2 = torch.ones(64).as_subclass(_OnCuda), torch.ones(64).as_subclass(_OnCuda)
    prepared(out2, x2)
    assert len(jit) == 1 and jit[0][1]["out_ptr"] is out2 and jit[0][1]["x_ptr"] is x2
    assert jit[0][1]["n"] == 50 and not direct
    other_size = direct_launch.PreparedLaunch(launches, (3,), _scale_args(out, x2, 9), {})
    other_size(out, x2)
    assert len(jit) == 1
    assert direct == [(3, 1, 1, 1234, (out.data_ptr(), x2.data_ptr(), 2.0, 9, 1, 64))]
    shifted = direct_launch.PreparedLaunch(launches, (3,), _scale_args(out, x2[1:], 50), {})
    shifted(out, x2[1:])  # 4 bytes off: not 16-byte aligned
    strided = direct_launch.PreparedLaunch(launches, (3,), _scale_args(out, x2, 50, 16), {})
    strided(out, x2)
    assert len(jit) == 3 and len(direct) == 1 and len(launches.launches) == 3


def test_prepared_launch_of_cpu_tensors_or_a_stand_in_takes_the_full_path():
    calls = []

    class StandIn:
        def __call__(self, grid, args, **options):
            calls.append((grid, dict(args), options))

    x, out = torch.arange(8.0), torch.zeros(8)
    prepared = direct_launch.PreparedLaunch(
        StandIn(), (2,), _scale_args(out, x, 8), {"num_warps": 1}
    )
    x2 = torch.ones(8)
    prepared(out, x2)
    assert prepared.direct is None
    assert calls == [((2, 1, 1), _scale_args(out, x2, 8), {"num_warps": 1})]


@pytest.mark.parametrize("given", [1, 3])
def test_prepared_launch_refuses_another_number_of_tensors_before_launching(given):
    """A caller that passes one tensor too few or too many (a plan's operands changed under it)
    gets a TypeError naming the kernel and the prepared tensors, and nothing is launched."""
    calls = []

    class StandIn:
        kernel = _scale_kernel

        def __call__(self, grid, args, **options):
            calls.append(grid)

    x, out = torch.arange(8.0), torch.zeros(8)
    prepared = direct_launch.PreparedLaunch(StandIn(), (2,), _scale_args(out, x, 8), {})
    with pytest.raises(TypeError, match=rf"_scale_kernel: {given} tensors given, 2 prepared"):
        prepared(*[out, x, x][:given])
    assert calls == []
