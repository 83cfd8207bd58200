# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The direct C launch: when it is bound, and its probe."""

import types
import warnings

import pytest
import torch
import triton

from megatron_ext import internals
from megatron_ext.fusions import direct_launch

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
