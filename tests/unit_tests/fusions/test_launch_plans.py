# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The latent-cache kernels' checked plans, cached by call layout: what a cache hit may skip and
what it must still check."""

import gc
import weakref

import pytest
import torch

from megatron_ext.fusions.launch_plans import PlanCache, layout_key
from megatron_ext.fusions.mla_latent import attention, mla_paged_latent_attention
from tests.unit_tests.fusions.mla_latent_cache_testlib import build_step

SCALE = 0.125


def test_layout_key_tells_apart_what_the_checks_tell_apart():
    x = torch.zeros(4, 3)
    base = layout_key((x, None), (1.0, 2))
    assert layout_key((torch.ones(4, 3), None), (1.0, 2)) == base  # other values, same layout
    assert layout_key((x.t().contiguous().t(), None), (1.0, 2)) != base  # strides
    assert layout_key((x.double(), None), (1.0, 2)) != base
    assert layout_key((x[:3], None), (1.0, 2)) != base
    assert layout_key((x, x), (1.0, 2)) != base
    assert layout_key((x, None), (1, 2)) != base  # an int where a float was
    assert layout_key((x, None), (1.0, True)) != layout_key((x, None), (1.0, 1))
    assert layout_key((x, None), (1.0, 3)) != base
    assert layout_key(([1, 2], None), (1.0, 2)) is None  # not a tensor: the slow path
    unhashable = layout_key((x, None), ([1.0], 2))
    cache = PlanCache()
    assert cache.put(unhashable, "plan") == "plan" and len(cache) == 0
    assert cache.get(unhashable) is None  # never found: the slow path checks (and refuses) it


def test_plan_cache_is_bounded_and_ignores_none_keys():
    cache = PlanCache(max_entries=2)
    assert cache.put(None, "plan") == "plan" and len(cache) == 0 and cache.get(None) is None
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1 and len(cache) == 2
    cache.put("c", 3)  # full: cleared first
    assert len(cache) == 1 and cache.get("a") is None and cache.get("c") == 3


@pytest.fixture
def plans(monkeypatch):
    fresh = PlanCache()
    monkeypatch.setattr(attention, "ATTENTION_PLANS", fresh)
    return fresh


def _step(seed=0):
    return build_step([(5, 3), (0, 4)], heads=2, seed=seed)


def _call(step, scale=SCALE, **kwargs):
    return mla_paged_latent_attention(
        step.query,
        step.kv_cache,
        step.block_table,
        step.cu_query_lengths,
        step.kv_lengths,
        scale,
        rope_dim=step.rope_dim,
        **kwargs,
    )


def test_a_cached_layout_gives_what_a_fresh_check_gives(plans):
    """Two steps of one layout (other values): the second call is a cache hit and equals the
    call of a fresh cache, bit for bit; another scale is another plan."""
    first, second = _step(0), _step(1)
    _call(first)
    assert len(plans) == 1
    hit = _call(second)
    assert len(plans) == 1
    plans.clear()
    assert torch.equal(hit, _call(second))
    other_scale = _call(second, scale=0.5)
    assert len(plans) == 2 and not torch.equal(other_scale, hit)


def test_a_cache_hit_still_refuses_an_output_overlapping_an_input(plans):
    """The layout of ``out`` matches the cached call's; its memory is the query's: refused."""
    step = _step()
    buffer = torch.empty_like(step.query)
    _call(step, out=buffer[..., : step.latent_dim])
    assert len(plans) == 1
    with pytest.raises(ValueError, match="out overlaps query"):
        _call(step, out=step.query[..., : step.latent_dim])
    before = step.query.clone()
    assert torch.equal(step.query, before)


def test_a_failed_check_caches_nothing(plans):
    step = _step()
    with pytest.raises(ValueError, match="softmax_scale"):
        _call(step, scale=-1.0)
    assert len(plans) == 0
    with pytest.raises(ValueError, match="softmax_scale"):
        _call(step, scale=-1.0)  # refused again, not served from a cache


def test_a_cached_plan_holds_no_tensor(plans):
    step = _step()
    query = step.query.clone()
    held = weakref.ref(query)
    mla_paged_latent_attention(
        query,
        step.kv_cache,
        step.block_table,
        step.cu_query_lengths,
        step.kv_lengths,
        SCALE,
        rope_dim=step.rope_dim,
        num_kv_splits=2,
    )
    assert len(plans) == 1
    del query
    gc.collect()
    assert held() is None, "the plan cache keeps the call's query alive"
