# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The direct C launch: which launchers it recognises, what it passes them, and its probe."""

import types
import warnings

import pytest
import torch
import triton

from megatron_ext.fusions import direct_launch

HAVE_CUDA = torch.cuda.is_available()
# The Triton releases whose launchers the direct launch knows (the probe still checks each one).
KNOWN_TRITON = triton.__version__.split(".")[:2] in (["3", "6"], ["3", "7"], ["3", "8"], ["3", "9"])


class _Launcher:
    """A stand-in with the attributes of Triton's ``CudaLauncher`` that the direct launch reads."""

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
        monkeypatch.setattr(direct_launch, "_generic_launch", lambda: launcher.launch)

    return install


def test_convention_is_read_from_the_launcher(generic_utils):
    generated = _Launcher(generic=False)
    assert direct_launch.convention(generated) == "generated"
    generic = _Launcher(generic=True)
    generic_utils(generic)
    assert direct_launch.convention(generic) == "generic"
    # A launcher wrapped for tensor descriptors, scratch memory, GSan, anything else: the JIT path.
    assert direct_launch.convention(_Launcher(generic=True)) is None
    assert direct_launch.convention(_Launcher(generic=False, scratch=64)) is None
    assert direct_launch.convention(_Launcher(generic=False, gsan=True)) is None
    assert direct_launch.convention(object()) is None


def test_generated_convention_arguments(monkeypatch):
    monkeypatch.setattr(direct_launch, "ENABLED", True)
    launcher = _Launcher(generic=False)
    launch = direct_launch.bind(_compiled(launcher))
    launch(6, 3, 1, 777, (11, None, 5, 7))
    assert launcher.calls == [
        (6, 3, 1, 777, 1234, 0, 1, None, None, (4, 1, 0), None, None, None, 11, None, 5, 7)
    ]


def test_generic_convention_arguments(monkeypatch, generic_utils):
    monkeypatch.setattr(direct_launch, "ENABLED", True)
    launcher = _Launcher(generic=True)
    generic_utils(launcher)
    launch = direct_launch.bind(_compiled(launcher))
    launch(6, 3, 1, 777, (11, None, 5, 7))
    head = (6, 3, 1, 777, 1234, 0, 1, (4, 1, 0), None, None, None, None, None)
    assert launcher.calls == [head + (["annotations"], b"sig", (11, None, 5, 7))]


def test_bind_refuses_when_disabled_or_unknown(monkeypatch):
    monkeypatch.setattr(direct_launch, "ENABLED", True)
    assert direct_launch.bind(None) is None
    assert direct_launch.bind(types.SimpleNamespace(run=object())) is None
    assert direct_launch.bind(types.SimpleNamespace()) is None
    monkeypatch.setattr(direct_launch, "ENABLED", False)
    assert direct_launch.bind(_compiled(_Launcher(generic=False))) is None


def test_launch_hooks_are_detected(monkeypatch):
    runtime = triton.knobs.runtime
    monkeypatch.setattr(runtime, "launch_enter_hook", types.SimpleNamespace(calls=[]))
    monkeypatch.setattr(runtime, "launch_exit_hook", None)
    assert not direct_launch.hooks_set()  # an empty hook chain, as Triton keeps by default
    monkeypatch.setattr(runtime, "launch_exit_hook", types.SimpleNamespace(calls=[print]))
    assert direct_launch.hooks_set()
    monkeypatch.setattr(runtime, "launch_enter_hook", lambda *a: None)
    assert direct_launch.hooks_set()


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
