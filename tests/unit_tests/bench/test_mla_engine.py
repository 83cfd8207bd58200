# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MLA engine benchmark (python -m megatron_ext.bench mla-engine): its memory arithmetic, the
paired-round statistics and verdicts on made-up figures, the measurement end to end on the tiny
model (CPU: fp32, Triton interpreter), the no-GPU check, and a GPU smoke run."""

import argparse
import json

import pytest
import torch

from megatron_ext.bench import mla_engine
from megatron_ext.bench import mla_engine_report as report_lib
from tests.unit_tests.mcore_rng import inference_rng_tracker

CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU smoke test runs instead")


# ----------------------------------------------------------------------------- arithmetic


def test_static_cache_of_the_dsv3_shard_fits_256_requests_and_caps_1024_at_256():
    sizes = mla_engine.ENGINE_MODELS["dsv3_shard"]
    tokens = mla_engine.PROMPT + mla_engine.GENERATE
    # 8 layers x 128 heads x (128 + 64 + 128) x 2 bytes per token, 256 rows of 192 tokens.
    assert mla_engine.static_cache_bytes(sizes, 256, tokens) == 30 << 30
    assert mla_engine.static_batch(sizes, 256, tokens) == 256
    assert mla_engine.static_batch(sizes, 1024, tokens) == 256
    small = mla_engine.ENGINE_MODELS["small"]
    assert mla_engine.static_batch(small, 1024, tokens) == 1024
    assert mla_engine.static_batch(sizes, 1024, tokens, budget=1) == 1


def test_paired_round_ratio_compares_time_per_token():
    # Static: 256 tokens in 20 ms; dynamic: 1024 tokens in 10 ms -> 8x the tokens/s.
    static = [(0.020, 256), (0.021, 256), (0.019, 256)]
    dynamic = [(0.010, 1024), (0.0105, 1024), (0.0095, 1024)]
    assert report_lib.paired_round_ratio(static, dynamic) == pytest.approx(8.0)
    # The median pair: one slow step of the candidate does not move it.
    dynamic[1] = (0.1, 1024)
    assert report_lib.paired_round_ratio(static, dynamic) == pytest.approx(8.0)
    with pytest.raises(ValueError):
        report_lib.paired_round_ratio([(0.01, 0)], [(0.01, 4)])


def test_host_share_is_the_step_not_covered_by_its_kernels():
    assert report_lib.host_share(0.010, 0.006) == pytest.approx(0.4)
    assert report_lib.host_share(0.010, 0.012) == 0.0  # overlapping streams
    assert report_lib.host_share(0.010, None) is None


# ------------------------------------------------------------------------ report and verdicts


def _row(model, requests, engine, rate, step_ms, kernel_ms=None):
    return {
        "model": model,
        "requests": requests,
        "engine": engine,
        "batch": min(requests, 256),
        "decode_tokens_per_s": rate,
        "decode_tokens_per_s_spread": {"min": rate * 0.9, "max": rate * 1.1},
        "median_decode_step_ms": step_ms,
        "kernel_ms_per_step": kernel_ms,
        "host_share": report_lib.host_share(step_ms, None if kernel_ms is None else kernel_ms),
        "prefill_ms": 50.0,
    }


def _comparison(model, requests, candidate, baseline, rounds):
    return dict(
        model=model, requests=requests, candidate=candidate, baseline=baseline, rounds=rounds
    )


def _report():
    return {
        "rows": [
            _row("dsv3_shard", 256, "dynamic-graphed", 60000.0, 4.0, 3.0),
            _row("dsv3_shard", 256, "dynamic-eager", 30000.0, 8.0),
            _row("dsv3_shard", 256, "static", 12000.0, 20.0),
            _row("small", 256, "dynamic-graphed", 50000.0, 5.0, 1.0),
            _row("small", 256, "static", 40000.0, 6.0),
            _row("spanning", 256, "dynamic-graphed", 1.0, 1.0),
            _row("eager_only", 1024, "dynamic-eager", 1.0, 1.0),
        ],
        "comparisons": [
            _comparison("dsv3_shard", 256, "dynamic-graphed", "static", [5.0, 5.1, 4.9, 5.0]),
            _comparison("dsv3_shard", 256, "dynamic-graphed", "dynamic-eager", [2.0, 2.0]),
            _comparison("small", 256, "dynamic-graphed", "static", [1.25, 1.3, 1.2]),
            _comparison("spanning", 256, "dynamic-graphed", "static", [1.5, 2.6, 1.6, 2.5]),
        ],
    }


def test_comparison_is_the_geometric_mean_of_the_rounds_with_an_interval():
    result = report_lib.comparison(_report(), "dsv3_shard", 256, "dynamic-graphed", "static")
    assert result["speedup"] == pytest.approx((5.0 * 5.1 * 4.9 * 5.0) ** 0.25)
    assert result["low"] <= result["speedup"] <= result["high"]
    assert 4.9 <= result["low"] and result["high"] <= 5.1
    assert report_lib.comparison(_report(), "small", 1024, "dynamic-graphed", "static") is None


def test_verdicts_say_met_or_missed_by_how_much_and_the_host_share():
    lines = report_lib.verdicts(_report())
    by_model = {line.split("(")[1].split(")")[0]: line for line in lines if line.startswith(">=")}
    assert by_model["dsv3_shard"].startswith(
        ">= 2x static at 256 requests (dsv3_shard): met by 3.00x"
    )
    assert "95% interval" in by_model["dsv3_shard"]
    assert "not settled" not in by_model["dsv3_shard"]
    assert ": missed by 0.75x (1.25x [" in by_model["small"]
    assert "not settled: the interval spans 2x" in by_model["spanning"]
    assert by_model["eager_only"].endswith("not measured (no 256-request graphed row)")
    host = [line for line in lines if line.startswith("host share")]
    assert host == [
        "host share (dsv3_shard, 256 requests, dynamic-graphed): step 4.00 ms vs its kernels' "
        "sum 3.00 ms: 1.00 ms (25%) of the step is not GPU work",
        "host share (small, 256 requests, dynamic-graphed): step 5.00 ms vs its kernels' sum "
        "1.00 ms: 4.00 ms (80%) of the step is not GPU work",
    ]


def test_table_has_a_row_per_engine_with_its_ratios():
    lines = report_lib.table(_report()).splitlines()
    assert lines[0].startswith("| model | requests | engine | batch | decode tok/s")
    assert len(lines) == 2 + len(_report()["rows"])
    graphed = lines[2].split(" | ")
    assert graphed[:5] == ["| dsv3_shard", "256", "dynamic-graphed", "256", "60000 (54000-66000)"]
    assert graphed[6:8] == ["3.00", "25%"]
    assert graphed[9].startswith("5.00x [") and graphed[10].startswith("2.00x [")
    static = lines[4].split(" | ")
    assert static[6:8] == ["-", "-"] and static[9:] == ["-", "- |"]


# ------------------------------------------------------------------------- command line


def test_quick_defaults_and_refusals():
    args = mla_engine.parse_args(["--quick"])
    assert (args.rounds, args.generate, args.prompt) == (3, 32, 128)
    assert args.models == ["dsv3_shard", "small"] and args.requests == [256, 1024]
    assert args.engines == ["dynamic-graphed", "dynamic-eager", "static"]
    assert mla_engine.parse_args(["--no-eager"]).engines == ["dynamic-graphed", "static"]
    assert mla_engine.parse_args([]).rounds == 8
    for bad in (["--rounds", "1"], ["--generate", "1"], ["--requests", "0"]):
        with pytest.raises(SystemExit):
            mla_engine.parse_args(bad)


# --------------------------------------------------------------------------- end to end (CPU)


@CPU_ONLY
def test_tiny_configuration_runs_end_to_end_on_the_cpu(monkeypatch):
    """Every step of the measurement (the engines stepped in turns, the rows, the per-round
    ratios) on the tiny model, with a q_lora_rank of its own as the DeepSeek-V3 shard has; the
    two engines' greedy tokens agree."""
    from megatron_ext import undo_megatron_ext
    from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel

    monkeypatch.setitem(
        mla_engine.ENGINE_MODELS, "tiny", dict(mla_engine.ENGINE_MODELS["tiny"], q_lora_rank=48)
    )
    args = argparse.Namespace(prompt=5, generate=3, rounds=2, engines=["dynamic-eager", "static"])
    with cpu_torch_compat():
        ensure_model_parallel()
        try:
            models = mla_engine.build_models("tiny", torch.float32, "cpu")
            assert [m.config.q_lora_rank for m in models] == [48, 48]
            for a, b in zip(models[0].parameters(), models[1].parameters()):
                assert torch.equal(a, b)
            result = mla_engine.measure_config("tiny", 3, args, models)
        finally:
            undo_megatron_ext()
    rows = {row["engine"]: row for row in result["rows"]}
    assert set(rows) == {"dynamic-eager", "static"} and not result["dropped"]
    for row in rows.values():
        # generate - 1 decode steps of 3 tokens each per round.
        assert row["decode_steps_per_round"] == 2 and row["batch"] == 3
        assert len(row["decode_tokens_per_s_rounds"]) == 2
        assert row["decode_tokens_per_s"] > 0 and row["prefill_ms"] > 0
        assert row["kernel_ms_per_step"] is None and row["host_share"] is None
    assert rows["dynamic-eager"]["context_class"] == "StaticSlicesInferenceContext"
    assert rows["static"]["static_cache_gib"] > 0
    [comparison] = result["comparisons"]
    assert (comparison["candidate"], comparison["baseline"]) == ("dynamic-eager", "static")
    assert len(comparison["rounds"]) == 2 and min(comparison["rounds"]) > 0
    report = {"rows": result["rows"], "comparisons": result["comparisons"]}
    assert report_lib.verdicts(report) == [
        ">= 2x static at 256 requests (tiny): not measured (no 256-request graphed row)"
    ]
    assert "| tiny | 3 | dynamic-eager | 3 |" in report_lib.table(report)


@CPU_ONLY
def test_cpu_run_says_so_and_checks_the_engines_agree(tmp_path, capsys):
    assert mla_engine.main(["--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "no CUDA GPU. This is a correctness check, not a benchmark" in printed
    assert "4 requests x 5 greedy tokens: the same tokens" in printed
    saved = json.loads((tmp_path / "mla_engine.json").read_text())
    assert saved["cuda"] is False and saved["cpu_check"]["identical_tokens"]
    tokens = saved["cpu_check"]["tokens"]
    assert tokens["dynamic-eager"] == tokens["static"]
    assert all(len(t) == 5 for t in tokens["static"])


# ---------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_smoke_run_of_the_tiny_model(tmp_path, capsys):
    """A --quick-like run of the tiny model: three engines, megatron-core's graphs captured, the
    profiler's kernel times, the table and the JSON."""
    argv = ["--models", "tiny", "--requests", "8", "--rounds", "2", "--prompt", "16"]
    # The benchmark installs megatron-core's inference RNG tracker for its process; put back.
    with inference_rng_tracker():
        assert mla_engine.main([*argv, "--generate", "6", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| model | requests | engine |" in printed
    saved = json.loads((tmp_path / "mla_engine.json").read_text())
    assert not saved["failed"] and not saved["dropped"]
    rows = {row["engine"]: row for row in saved["rows"]}
    assert set(rows) == set(report_lib.ENGINES)
    graphed = rows["dynamic-graphed"]
    assert graphed["graph_capture_s"] is not None and graphed["cuda_graph_shapes"] >= 1
    assert graphed["controller_class"].startswith("StaticSlices")
    assert graphed["kernel_ms_per_step"] > 0 and 0 <= graphed["host_share"] <= 1
    # Decode-only steps after the prefill: at most generate - 1. On megatron-core 0.19.2 a round
    # sometimes counted 4 of 5 (one step was not decode-only; seen on the GPU, either dynamic
    # engine), so the count is bounded, not fixed.
    assert 1 <= graphed["decode_steps_per_round"] <= 5
    assert len(saved["comparisons"]) == 3
