# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's static-batching MLA section."""

import pytest
import torch

from megatron_ext.bench import inference, static_inference


def _row(batch, mode, prefill, decode):
    return {
        "batch": batch,
        "prompt": 256,
        "new_tokens": 32,
        "mode": mode,
        "prefill_ms": prefill,
        "decode_ms_per_token": decode,
        "decode_ms_rounds": [decode],
        "tokens_equal_off_on": False,
    }


def test_table_puts_off_and_on_side_by_side_with_their_ratios():
    rows = [_row(1, "off", 10.0, 8.0), _row(1, "on", 8.0, 6.4), _row(16, "off", 12.0, 9.0)]
    rows.append(_row(16, "on", 12.0, 10.0))
    lines = static_inference.static_mla_table(rows).splitlines()
    assert lines[0].startswith("| batch | prompt + new | prefill ms off / on")
    assert lines[2] == "| 1 | 256 + 32 | 10.00 / 8.00 | 1.25x | 8.000 / 6.400 | 1.25x |"
    assert lines[3] == "| 16 | 256 + 32 | 12.00 / 12.00 | 1.00x | 9.000 / 10.000 | 0.90x |"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the section runs (GPU test below)")
def test_cpu_refuses_the_section_instead_of_timing_it(capsys):
    assert inference.main(["--static-mla-batches", "1", "--engine-requests"]) == 2
    assert "--static-mla-batches need a CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_section_times_both_modes_per_batch():
    rows = static_inference.run_static_mla([1, 2], prompt=8, new_tokens=3, rounds=1)
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "off"), (1, "on"), (2, "off"), (2, "on")]
    for row in rows:
        assert row["prefill_ms"] > 0 and row["decode_ms_per_token"] > 0
        assert len(row["decode_ms_rounds"]) == 1
