# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``scripts/profile_latent_cache_host.py``: it refuses to run without a GPU and, on one, reports
each call's host time, its launch keys and its profile."""

import pytest
import torch

from tests.unit_tests.fusions.mla_latent_cache_testlib import (
    assert_refuses_without_a_gpu,
    load_script,
)


def _load():
    return load_script("profile_latent_cache_host")


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the no-GPU refusal, on a machine without one"
)
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert_refuses_without_a_gpu(_load(), capsys)


@pytest.mark.gpu
def test_gpu_reports_host_time_launch_keys_and_a_profile(capsys):
    argv = ["--batch", "2", "--context", "512", "--heads", "16", "--append-tokens", "4"]
    assert _load().main([*argv, "--calls", "20", "--top", "5"]) == 0
    printed = capsys.readouterr().out
    assert "== attention, batch 2, context 512, 16 heads:" in printed
    assert "== RoPE + append, 4 tokens:" in printed
    assert "us host per call" in printed and "keys" in printed
    assert "Ordered by: internal time" in printed  # the cProfile tables
