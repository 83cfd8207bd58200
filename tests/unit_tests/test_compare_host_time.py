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


def test_a_renamed_copy_imports_beside_the_original(tmp_path):
    """--in-process loads the old tree as another package: every import of it renamed, names
    that merely contain it left alone."""
    tree = tmp_path / "old"
    (tree / "megatron_ext" / "sub").mkdir(parents=True)
    (tree / "megatron_ext" / "__init__.py").write_text("")
    (tree / "megatron_ext" / "sub" / "__init__.py").write_text("")
    (tree / "megatron_ext" / "sub" / "a.py").write_text(
        "import megatron_ext.sub.b\nfrom megatron_ext.sub import b as c\n"
        "ENV = 'MEGATRON_EXT_X megatron_extra'\n"
    )
    (tree / "megatron_ext" / "sub" / "b.py").write_text("VALUE = 3\n")
    copy = load_script("compare_host_time").renamed_copy(tree, "copied_pkg", tmp_path / "into")
    text = (copy / "sub" / "a.py").read_text()
    assert "import copied_pkg.sub.b" in text and "from copied_pkg.sub import b" in text
    assert "MEGATRON_EXT_X megatron_extra" in text


def test_paired_rounds_are_judged_by_their_ratios():
    """In-process rounds slowed alike (a burst on the machine) agree on new / old: not noisy;
    unpaired, the same values are."""
    script = load_script("compare_host_time")
    runs = {"old": [{"a": 10.0}, {"a": 20.0}], "new": [{"a": 9.0}, {"a": 18.2}]}
    (paired,) = script.summarise(runs, paired=True)
    assert paired["ratio"] == pytest.approx(0.9)
    assert paired["spread"] == pytest.approx((0.91 - 0.9) / 0.905)
    (unpaired,) = script.summarise(runs)
    assert unpaired["spread"] > script.NOISY_SPREAD
