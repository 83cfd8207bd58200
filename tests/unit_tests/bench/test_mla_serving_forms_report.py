# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The prefill rows' forms: the cost model's pick, its verdicts against FlashInfer and the
absorbed form (met, missed by a stated amount, not measured), and the table, from fake rows."""

import pytest

from megatron_ext.bench import mla_serving_forms_report as forms_report


def prefill_row(requests, absorbed, mha=None, split=None, fi=None, model_split=None, heads=128):
    """A prefill row with the given GPU times (us), each form's eager time 1.25x its GPU time;
    the pick follows ``model_split``."""
    forms = {"backend": "cudnn", "requests": len(requests)}
    forms["model_split"] = len(requests) if model_split is None else model_split
    for name, us in (("mha", mha), ("split", split)):
        if us is not None:
            forms[name] = {
                "gpu_us": us,
                "eager_us": 1.25 * us,
                "tflops": 100.0,
                "max_rel_diff": 1e-3,
            }
    chosen = "ours"
    if forms["model_split"] < len(requests):
        chosen = "mha" if forms["model_split"] == 0 else "split"
    forms["chosen"] = chosen
    return {
        "section": "prefill",
        "case": f"{len(requests)} requests",
        "requests": requests,
        "tokens": sum(new for _, new in requests),
        "heads": heads,
        "ours": {"gpu_us": absorbed, "eager_us": 1.25 * absorbed},
        "flashinfer": {"gpu_us": fi} if fi is not None else "not installed",
        "forms": forms,
    }


def verdict(rows, words, flashinfer="flashinfer 0.7.4"):
    (found,) = [v for v in forms_report.forms_verdicts(rows, flashinfer) if words in v["target"]]
    return found


def test_a_step_is_mixed_with_decodes_beside_longer_requests():
    assert forms_report.is_mixed(prefill_row([(4095, 1), (1024, 512)], 1.0))
    assert not forms_report.is_mixed(prefill_row([(0, 4096)], 1.0))
    assert not forms_report.is_mixed(prefill_row([(4095, 1)] * 3, 1.0))


def test_the_pick_is_timed_from_its_contender():
    assert forms_report.chosen_us(prefill_row([(0, 4096)], 500.0, mha=200.0, model_split=0)) == 200
    mixed = prefill_row([(9, 1), (0, 600)], 500.0, mha=400.0, split=300.0, model_split=1)
    assert forms_report.chosen_us(mixed) == 300.0
    assert forms_report.chosen_us(prefill_row([(9, 1)] * 2 + [(0, 8)], 50.0, mha=90.0)) == 50.0


@pytest.mark.parametrize("fi, status", [(260.0, "met"), (200.0, "missed by 0.30x")])
def test_prefill_speed_against_flashinfer(fi, status):
    rows = [
        prefill_row([(0, 4096)], 600.0, mha=200.0, fi=fi, model_split=0),
        prefill_row([(0, 8192)], 900.0, mha=400.0, fi=2.0 * fi, model_split=0),
        prefill_row([(0, 1024)], 90.0, mha=100.0, fi=10.0, model_split=0),  # under 2k tokens
    ]
    found = verdict(rows, "prefill/chunked-prefill")
    assert found["status"] == status
    assert found["worst"].startswith("1 requests, 128 heads: ")
    assert found["worst"].endswith(f"{fi / 200.0:.2f}x (mha)")


def test_mixed_speed_against_flashinfer_and_the_absorbed_form():
    rows = [prefill_row([(4095, 1)] * 8 + [(1024, 512)], 400.0, 500.0, 380.0, 342.0, 8)]
    assert verdict(rows, "mixed steps")["status"] == "missed by 0.10x"
    never = verdict(rows, "never slower")
    assert never["status"] == "met" and "split at 0.95x" in never["worst"]
    rows[0]["ours"]["gpu_us"] = 300.0
    assert verdict(rows, "never slower")["status"] == "missed by 26.7%"


def test_without_flashinfer_or_rows_the_targets_are_not_measured():
    rows = [prefill_row([(0, 4096)], 600.0, mha=200.0, model_split=0)]
    found = verdict(rows, "prefill/chunked-prefill", "not installed (ModuleNotFoundError)")
    assert found["status"].startswith("not measured: FlashInfer or the chosen form did not run")
    assert verdict(rows, "mixed steps")["status"] == "not measured: no row"
    assert verdict([], "never slower")["status"] == "not measured: no row"


def test_table_names_the_pick_the_fastest_and_errors():
    rows = [
        prefill_row([(0, 4096)], 600.0, mha=200.0, fi=300.0, model_split=0),
        prefill_row([(9, 1), (0, 600)], 500.0, mha=700.0, split=450.0, fi=400.0, model_split=1),
    ]
    rows[1]["forms"]["mha"] = {"error": "failed: RuntimeError: cuDNN refused"}
    lines = forms_report.forms_table(rows)
    assert lines[0].startswith(
        "=== table: prefill forms (MHA-form backend: cudnn; a chunk's calls in order, "
        "MEGATRON_EXT_MLA_MHA_OVERLAP)"
    )
    rows[0]["forms"]["overlap_calls"] = True
    assert "a chunk's calls side by side" in forms_report.forms_table(rows)[0]
    first, second = lines[2], lines[3]
    assert " 0/1 " in first
    assert first.split()[-6:] == ["mha", "250.0", "300.0", "0.67x", "0.33x", "mha"]
    assert second.rstrip().endswith("split") and " 1/2 " in second and "1.12x" in second
    assert lines[4].strip() == "mha: failed: RuntimeError: cuDNN refused"
    assert forms_report.forms_table([]) == []


def test_table_marks_a_split_timed_beside_an_absorbed_pick():
    """A mixed step the cost model keeps absorbed: its decodes-absorbed split is timed and shown
    (marked as not the model's), the pick stays the absorbed form."""
    row = prefill_row([(9, 1), (0, 600)], 500.0, mha=700.0, split=450.0, fi=400.0)
    row["forms"]["split"]["split"] = 1
    line = forms_report.forms_table([row])[2]
    assert " 1/2 *" in line
    assert line.split()[-6:] == ["ours", "625.0", "400.0", "1.25x", "1.00x", "split"]
