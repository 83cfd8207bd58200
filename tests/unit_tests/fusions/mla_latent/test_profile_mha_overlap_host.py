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
