# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's verdicts: what a measured engine ratio decides, and the summary."""

from megatron_ext.bench.inference_engine import engine_ratio
from megatron_ext.bench.inference_tables import ratio_text
from megatron_ext.bench.inference_verdicts import engine_summary, verdict

SMALL_256 = ("small", "greedy", 256, "legacy")


def test_engine_ratio_is_decided_by_its_interval(engine_rows_of):
    faster = engine_ratio(engine_rows_of([100, 80, 120, 90], [110, 88, 132, 99]), SMALL_256)
    assert abs(faster["speedup"] - 1.1) < 1e-9 and faster["low"] > 1.0
    assert verdict(faster) == "faster: the interval is above 1.00"
    assert "+-0.0%" in ratio_text(faster)
    mixed = engine_ratio(engine_rows_of([100, 100, 100, 100], [90, 110, 95, 108]), SMALL_256)
    assert verdict(mixed) == "the interval contains 1.00"
    assert mixed["half_width"] > 0.03
    assert (
        engine_ratio(engine_rows_of([100, 100], [90, 110]), ("small", "greedy", 1024, "legacy"))
        is None
    )


def test_a_single_round_has_no_interval(engine_rows_of):
    one = engine_ratio(engine_rows_of([100.0], [120.0]), SMALL_256)
    assert one == {"speedup": 1.2, "round_min": 1.2, "round_max": 1.2}
    assert ratio_text(one) == "1.20x [one round]"
    assert verdict(one) == "faster in every round"


def test_the_summary_names_the_worst_row_and_reports_the_control_apart(engine_rows_of):
    """The worst engine row is the one whose interval reaches lowest; the A/A control's rows are
    summarised on their own lines and never compete for worst."""
    engine = engine_rows_of([100, 100, 100, 100], [120, 118, 122, 121])
    engine += engine_rows_of([100, 100, 100, 100], [101, 99, 103, 97], requests=1024)
    control = engine_rows_of([100, 100, 100, 100], [80, 82, 79, 81])
    report = {"engine_rows": engine, "engine_control_rows": control}
    lines = engine_summary(report)
    assert len(lines) == 3
    assert "1024 concurrent requests" in lines[1] and lines[1].endswith("<- worst engine row")
    assert report["worst_engine_row"]["requests"] == 1024
    assert lines[2].startswith("A/A control, small model, greedy, 256 concurrent requests")
    assert "worst" not in lines[2]
    assert engine_summary({"engine_rows": [], "engine_control_rows": []}) == []
