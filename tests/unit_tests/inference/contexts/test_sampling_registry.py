# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_ext.inference.contexts.sampling_registry import (
    RequestSamplingRegistry,
    SamplingLimits,
    SamplingRequirements,
    min_sampling_temperature,
    top_k_cap_for,
)


def params(top_k=1, top_p=0.0, return_log_probs=False, top_n_logprobs=0, temperature=1.0):
    return SimpleNamespace(
        top_k=top_k,
        top_p=top_p,
        return_log_probs=return_log_probs,
        top_n_logprobs=top_n_logprobs,
        temperature=temperature,
    )


@pytest.mark.parametrize("max_top_k,cap", [(0, 0), (1, 0), (2, 2), (3, 4), (50, 64), (64, 64)])
def test_top_k_cap_is_the_next_power_of_two(max_top_k, cap):
    assert top_k_cap_for(max_top_k) == cap


def test_requirements_follow_megatron_core_rules_and_counts():
    registry = RequestSamplingRegistry()
    assert registry.requirements() == SamplingRequirements()
    registry.add(0, params(top_k=1))
    registry.add(1, params(top_k=50))
    registry.add(2, params(top_k=0, top_p=0.9))  # nucleus
    registry.add(3, params(top_k=0, top_p=0.0, top_n_logprobs=2))  # whole vocabulary
    registry.add(4, params(top_k=5))
    everything = dict(sample=True, top_p=True, log_probs=True, greedy=True, full_vocab=True)
    assert registry.requirements() == SamplingRequirements(top_k_cap=64, max_top_k=50, **everything)
    registry.discard([2, 3, 99])  # unknown ids are ignored
    assert registry.requirements() == SamplingRequirements(
        sample=True, top_k_cap=64, greedy=True, max_top_k=50
    )
    registry.add(1, params(top_k=1))  # replacing a request's features
    assert registry.requirements() == SamplingRequirements(
        sample=True, top_k_cap=8, greedy=True, max_top_k=5
    )
    assert 4 in registry and 2 not in registry and len(registry) == 3
    registry.clear()
    assert len(registry) == 0 and registry.requirements() == SamplingRequirements()


@pytest.mark.parametrize(
    "bad,match",
    [
        (dict(top_k=5, top_p=0.9), "cannot both be greater than zero"),
        (dict(top_k=1, top_p=0.5), "cannot both be greater than zero"),
        (dict(top_k=0, top_p=1.5), r"top_p must be in \[0.0, 1.0\].*got 1.5"),
        # megatron-core asserts `top_p <= 1.0`, which a NaN fails, whatever top_k is.
        (dict(top_k=0, top_p=float("nan")), r"top_p must be in \[0.0, 1.0\].*got nan"),
        (dict(top_k=5, top_p=float("nan")), r"top_p must be in \[0.0, 1.0\].*got nan"),
        (dict(top_k=5, temperature=0.0), "temperature must be > 0 when sampling"),
        # Out of range whatever the mode: megatron-core samples with them without a word.
        (dict(top_k=-1), r"top_k must be >= 0 .*got -1"),
        (dict(top_k=0, top_p=-0.1), r"top_p must be in \[0.0, 1.0\].*got -0.1"),
        (dict(top_k=0, temperature=-1.0), "temperature must be finite and >= 0, got -1.0"),
        (dict(top_k=1, temperature=-1.0), "temperature must be finite and >= 0, got -1.0"),
        (dict(top_k=1, temperature=float("inf")), "temperature must be finite and >= 0, got inf"),
        (dict(top_k=0, temperature=float("nan")), "temperature must be finite and >= 0, got nan"),
        (dict(top_n_logprobs=-1, return_log_probs=True), "top_n_logprobs must be >= 0, got -1"),
    ],
)
def test_parameters_megatron_cores_sampler_refuses_are_refused_unrecorded(bad, match):
    registry = RequestSamplingRegistry()
    with pytest.raises(ValueError, match=match):
        registry.add(0, params(**bad))
    assert len(registry) == 0 and registry.requirements() == SamplingRequirements()
    registry.add(0, params(top_k=1, temperature=0.0))  # greedy ignores the temperature


def test_the_smallest_sampling_temperature_comes_from_the_dtype():
    """The bound is the smallest value of the dtype whose reciprocal is finite there (float32:
    a subnormal about 2.94e-39), not a constant."""
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        bound = min_sampling_temperature(dtype)
        stored = torch.tensor(bound, dtype=dtype)
        assert float(stored) == bound
        assert torch.isfinite(1 / stored)
        below = torch.nextafter(stored, torch.zeros((), dtype=dtype))
        assert not torch.isfinite(1 / below)
    assert 2.9e-39 < min_sampling_temperature() < torch.finfo(torch.float32).tiny


@pytest.mark.parametrize(
    "sampling",
    [
        dict(top_k=0, temperature=1e-40),
        dict(top_k=0, temperature=1e-50),
        dict(top_k=0, top_p=0.5, temperature=1e-40),
        dict(top_k=5, temperature=2.9e-39),
    ],
    ids=["1e-40", "1e-50", "1e-40_top_p", "just_below_the_bound"],
)
def test_temperatures_whose_reciprocal_overflows_are_refused(sampling):
    """They used to become subnormal or 0 in the float32 metadata: every scaled logit infinite,
    the softmax NaN, and the draw token 0 every time."""
    registry = RequestSamplingRegistry()
    with pytest.raises(ValueError, match=r"temperature \(.*\) is too small to sample with"):
        registry.add(0, params(**sampling))
    assert len(registry) == 0
    registry.add(0, params(**{**sampling, "temperature": min_sampling_temperature()}))
    registry.add(1, params(top_k=1, temperature=1e-50))  # greedy never scales


@pytest.mark.parametrize(
    "field,value,error,match",
    [
        ("temperature", "1.0", TypeError, r"temperature must be a real number, got str \('1.0'\)"),
        ("temperature", None, TypeError, r"temperature must be a real number, got NoneType"),
        ("temperature", True, TypeError, r"temperature must be a real number, got bool"),
        ("top_k", None, TypeError, r"top_k must be an int, got NoneType"),
        ("top_k", 5.0, TypeError, r"top_k must be an int, got float \(5.0\)"),
        ("top_k", "5", TypeError, r"top_k must be an int, got str"),
        ("top_k", True, TypeError, r"top_k must be an int, got bool"),
        ("top_p", "0.5", TypeError, r"top_p must be a real number, got str"),
        ("return_log_probs", "False", TypeError, r"return_log_probs must be a bool, got str"),
        ("top_n_logprobs", 2.5, TypeError, r"top_n_logprobs must be an int, got float"),
    ],
)
def test_fields_of_the_wrong_type_are_refused_by_name(field, value, error, match):
    registry = RequestSamplingRegistry()
    with pytest.raises(error, match=match):
        registry.add(0, params(**{field: value}))
    assert len(registry) == 0


def test_numpy_scalars_are_numbers():
    registry = RequestSamplingRegistry()
    registry.add(0, params(top_k=np.int64(5), temperature=np.float32(0.5), top_p=np.float64(0)))
    registry.add(1, params(top_k=np.int32(0), top_p=np.float32(0.5), return_log_probs=np.True_))
    assert registry.requirements().max_top_k == 5 and registry.requirements().log_probs


def test_limits_refuse_what_the_sampler_cannot_honour():
    limits = SamplingLimits(max_top_k=64, max_top_n_logprobs=64)
    registry = RequestSamplingRegistry()
    with pytest.raises(ValueError, match=r"top_k \(65\) is larger than the sampler allows \(64"):
        registry.add(0, params(top_k=65), limits)
    with pytest.raises(ValueError, match=r"top_n_logprobs \(65\) is larger than the vocabulary"):
        registry.add(0, params(top_n_logprobs=65, return_log_probs=True), limits)
    assert len(registry) == 0
    registry.add(0, params(top_k=64, top_n_logprobs=64, return_log_probs=True), limits)
