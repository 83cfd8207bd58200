# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``scripts/profile_mha_overlap_host.py``: its step syntax, the hand-over switch it restores, the
no-GPU refusal and, on a GPU, its table."""

import argparse

import pytest
import torch

from megatron_ext.fusions import side_stream
from tests.unit_tests.fusions.mla_latent_cache_testlib import (
    assert_refuses_without_a_gpu,
    load_script,
)


def _load():
    return load_script("profile_mha_overlap_host")


def test_a_step_is_new_on_cached_and_anything_else_is_refused():
    script = _load()
    assert script.parse_case("512 on 1024") == (1024, 512)
    for bad in ("512", "512 at 1024", "x on 1024", "512 on"):
        with pytest.raises(argparse.ArgumentTypeError, match="NEW on CACHED"):
            script.parse_case(bad)


def test_the_hand_over_is_left_out_only_inside_the_block():
    script = _load()
    kept = side_stream._hand_over
    with pytest.raises(RuntimeError, match="inside"):
        with script.no_hand_over():
            assert side_stream._hand_over is not kept
            raise RuntimeError("inside")
    assert side_stream._hand_over is kept


def test_the_parts_alone_make_the_in_order_calls_result():
    from megatron_ext.bench import mla_serving_cases as cases
    from megatron_ext.bench import mla_serving_forms as forms

    script = _load()
    step = cases.build_step([(128, 64)], 4, device="cpu", dtype=torch.float32)
    mha = forms.mha_step(step, 4, seed=4, backend="torch")
    timed = script.parts(step, mha, "torch")
    assert list(timed) == ["checks+plan", "decompress", "attend", "merge"]
    for name in ("checks+plan", "decompress", "attend"):
        timed[name]()
    merged = timed["merge"]()
    whole = script.mha_attention(step, mha, "torch")
    torch.testing.assert_close(merged, whole, rtol=0, atol=0)
    fresh = cases.build_step([(0, 64)], 4, device="cpu", dtype=torch.float32)
    with pytest.raises(ValueError, match="one chunk whose calls are merged"):
        script.parts(fresh, forms.mha_step(fresh, 4, backend="torch"), "torch")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the no-GPU refusal, on a machine without one"
)
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert_refuses_without_a_gpu(_load(), capsys)


@pytest.mark.gpu
def test_gpu_prints_each_variants_host_time_and_the_profiles(capsys):
    argv = ["--heads", "16", "--cases", "64 on 128", "--calls", "5", "--top", "5"]
    assert _load().main(argv) == 0
    printed = capsys.readouterr().out
    assert "== 64 on 128, 16 heads, side by side" in printed
    assert "Ordered by: internal time" in printed
    table = printed.split("=== host | eager us per call")[1].splitlines()
    assert "no hand-over" in table[1] and "fork/join" in table[1] and "fresh events" in table[1]
    assert table[2].split()[:4] == ["64", "on", "128", "16"]


@pytest.mark.gpu
def test_gpu_prints_the_parts_of_the_in_order_call(capsys):
    argv = ["--heads", "16", "--cases", "64 on 128", "--calls", "2", "--top", "2", "--parts"]
    assert _load().main(argv) == 0
    table = capsys.readouterr().out.split("=== the in-order call's parts alone")[1].splitlines()
    for name in ("in order", "checks+plan", "decompress", "attend", "merge"):
        assert name in table[1]
    assert table[2].split()[:4] == ["64", "on", "128", "16"]
