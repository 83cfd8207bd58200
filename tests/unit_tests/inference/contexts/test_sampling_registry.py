# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

from types import SimpleNamespace

import pytest

from megatron_ext.inference.contexts.sampling_registry import (
    RequestSamplingRegistry,
    SamplingRequirements,
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
        (dict(top_k=0, top_p=1.5), "top_p must be at most 1.0"),
        # megatron-core asserts `top_p <= 1.0`, which a NaN fails, whatever top_k is.
        (dict(top_k=0, top_p=float("nan")), "top_p must be at most 1.0"),
        (dict(top_k=5, top_p=float("nan")), "top_p must be at most 1.0"),
        (dict(top_k=5, temperature=0.0), "temperature must be > 0"),
        (dict(top_k=0, temperature=-1.0), "temperature must be > 0"),
    ],
)
def test_parameters_megatron_cores_sampler_refuses_are_refused_unrecorded(bad, match):
    registry = RequestSamplingRegistry()
    with pytest.raises(ValueError, match=match):
        registry.add(0, params(**bad))
    assert len(registry) == 0 and registry.requirements() == SamplingRequirements()
    registry.add(0, params(top_k=1, temperature=0.0))  # greedy ignores the temperature
