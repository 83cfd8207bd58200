# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``scripts/compare_host_time.py``: its summary of alternated runs, and its refusal without a
GPU (the measurements themselves need one)."""

import pytest
import torch

from tests.unit_tests.fusions.mla_latent_cache_testlib import load_script


def test_medians_per_call_and_the_worst_row(capsys):
    script = load_script("compare_host_time")
    runs = {
        "old": [{"a": 10.0, "b": 20.0}, {"a": 12.0, "b": 18.0}, {"a": 11.0, "b": 30.0}],
        "new": [{"a": 9.0, "b": 25.0}, {"a": 9.5, "b": 21.0}, {"a": 30.0, "b": 22.0}],
    }
    rows = script.summarise(runs)
    assert [row["call"] for row in rows] == ["a", "b"]
    assert (rows[0]["old"], rows[0]["new"]) == (11.0, 9.5)
    assert rows[1]["ratio"] == pytest.approx(22.0 / 20.0)
    script.print_table(rows)
    assert "worst row: b: new / old = 1.10" in capsys.readouterr().out


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the no-GPU refusal, on a machine without one"
)
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert load_script("compare_host_time").main(["--old", "."]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
