# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Tests of what the serving benchmark prints and decides about the warp-specialized decode kernel
(megatron_ext.bench.mla_serving_gluon_report), on fake timings."""

from megatron_ext.bench import mla_serving_gluon_report as report


def _row(batch, context, heads, stage1, gluon, fi, splits=1):
    entry = (
        {
            "gpu_us": gluon,
            "host_us": 9.0,
            "eager_us": gluon + 1,
            "splits": splits,
            "max_abs_diff_vs_stage1": 1e-3,
        }
        if gluon is not None
        else {"refused": "compute capability (8, 0) (wgmma is sm_90a's)"}
    )
    return {
        "section": "decode",
        "batch": batch,
        "context": context,
        "heads": heads,
        # The public entry takes the Gluon kernel where it runs; stage 1 through its own plan.
        "ours": {"gpu_us": gluon if gluon is not None else stage1},
        "stage1": {"gpu_us": stage1},
        "gluon": entry,
        "flashinfer": {"gpu_us": fi} if fi is not None else "not installed",
    }


def test_flops_count_score_and_value_products():
    row = _row(32, 8192, 128, 400.0, 150.0, 149.0)
    assert report.decode_flops(row) == 2 * 32 * 128 * 8192 * (512 + 512 + 64)


def test_verdicts_name_the_worst_row_of_the_region():
    rows = [
        _row(32, 8192, 128, 400.0, 150.0, 149.0),  # 1.007x, 481 TFLOP/s
        _row(96, 3072, 128, 600.0, 240.0, 200.0),  # 1.2x: the worst
        _row(128, 1024, 32, 70.0, 80.0, 60.0),  # outside the region (context < 2048)
        _row(4, 8192, 64, 70.0, 80.0, 40.0),  # outside the region (batch < 16)
    ]
    peer, rate = report.gluon_verdicts(rows)
    assert peer["status"].startswith("missed by 20.0%")
    assert "batch 96, context 3072" in peer["worst"]
    assert rate["status"].startswith("missed")
    worst_tflops = report.decode_flops(rows[1]) / 240.0 / 1e6
    assert f"{worst_tflops:.0f}" in rate["worst"]


def test_verdicts_met_when_every_region_row_is_at_flashinfer_and_fast():
    rows = [_row(32, 8192, 128, 400.0, 100.0, 149.0)]  # 722 TFLOP/s
    peer, rate = report.gluon_verdicts(rows)
    assert peer["status"] == "met" and rate["status"] == "met"


def test_a_refused_kernel_is_not_measured_with_the_reason():
    rows = [_row(32, 8192, 128, 400.0, None, 149.0)]
    for verdict in report.gluon_verdicts(rows):
        assert verdict["status"].startswith("not measured: compute capability")
    table = "\n".join(report.gluon_table(rows))
    assert "not run: compute capability (8, 0)" in table


def test_no_gluon_entry_no_table_and_no_verdict():
    row = _row(32, 8192, 128, 400.0, 100.0, 149.0)
    del row["gluon"]
    assert report.gluon_table([row]) == [] and report.gluon_verdicts([row]) == []


def test_table_rows_show_gluon_beside_stage_1_and_flashinfer():
    lines = report.gluon_table([_row(64, 4096, 64, 213.3, 124.1, 122.2, splits=2)])
    assert len(lines) == 3
    cells = lines[-1].split()
    assert "213.3" in cells and "124.1" in cells and "122.2" in cells and "1.02x" in cells
    # Its host time and eager time per call beside the GPU time.
    assert cells[cells.index("124.1") + 3 : cells.index("124.1") + 5] == ["9.0", "125.1"]


def test_the_stage_1_column_is_stage_1s_own_timing_not_the_public_entrys():
    """Where the public entry ("ours") takes the Gluon kernel, the table's stage 1 column is the
    stage-1 contender's time; a row without one (an older report) falls back to "ours"."""
    row = _row(64, 4096, 64, 213.3, 124.1, 122.2, splits=2)
    assert row["ours"]["gpu_us"] == 124.1
    assert report.gluon_table([row])[-1].split()[4] == "213.3"
    del row["stage1"]
    assert report.gluon_table([row])[-1].split()[4] == "124.1"
