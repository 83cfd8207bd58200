# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``scripts/compare_host_time.py``: its summary of alternated runs, and its refusal without a
GPU (the measurements themselves need one)."""

import pytest
import torch

from tests.unit_tests.fusions.mla_latent_cache_testlib import load_script


def test_the_fastest_per_call_and_the_worst_row(capsys):
    script = load_script("compare_host_time")
    runs = {
        "old": [{"a": 10.0, "b": 20.0}, {"a": 12.0, "b": 18.0}, {"a": 11.0, "b": 30.0}],
        "new": [{"a": 9.0, "b": 25.0}, {"a": 9.5, "b": 21.0}, {"a": 30.0, "b": 22.0}],
    }
    rows = script.summarise(runs)
    assert [row["call"] for row in rows] == ["a", "b"]
    assert (rows[0]["old"], rows[0]["new"]) == (10.0, 9.0)
    assert rows[1]["ratio"] == pytest.approx(21.0 / 18.0)
    # a's new rounds (9, 9.5, 30) differ by 221% of their median; b's old ones (18-30) by 60%.
    assert rows[0]["spread"] == pytest.approx(21.0 / 9.5)
    assert rows[1]["spread"] == pytest.approx(12.0 / 20.0)
    script.print_table(rows)
    printed = capsys.readouterr().out
    assert "worst row: b: new / old = 1.17" in printed
    assert printed.count("(noisy: rerun on a quiet machine)") == 2
    assert "2 of 2 rows noisy" in printed


def test_rounds_that_agree_are_not_marked_noisy(capsys):
    script = load_script("compare_host_time")
    runs = {"old": [{"a": 10.0}, {"a": 10.5}], "new": [{"a": 11.0}, {"a": 11.5}]}
    (row,) = script.summarise(runs)
    assert row["spread"] == pytest.approx(0.5 / 10.25)  # the old rounds, the wider
    script.print_table([row])
    printed = capsys.readouterr().out
    assert "noisy" not in printed and "| 5%" in printed


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the no-GPU refusal, on a machine without one"
)
def test_without_a_gpu_it_says_so_and_exits_2(capsys):
    assert load_script("compare_host_time").main(["--old", "."]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err
