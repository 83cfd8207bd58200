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
from megatron_ext.bench import mla_roofline
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
        "decode_step_ms": step_ms,
        "tokens_per_step": rate * step_ms / 1e3,
        "median_decode_step_ms": step_ms,
        "kernel_ms_per_step": kernel_ms,
        "host_share": report_lib.host_share(step_ms, None if kernel_ms is None else kernel_ms),
        "prefill_ms": 50.0,
    }


def _comparison(model, requests, candidate, baseline, rounds):
    # Per-round totals whose ratios are ``rounds``: the baseline 1000 tokens in 1 s per round.
    totals = {baseline: [[1000, 1.0]] * len(rounds), candidate: [[1000, 1.0 / r] for r in rounds]}
    return dict(
        model=model,
        requests=requests,
        candidate=candidate,
        baseline=baseline,
        rounds=rounds,
        totals=totals,
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


def test_comparison_is_the_ratio_of_the_pooled_rates_with_an_interval():
    result = report_lib.comparison(_report(), "dsv3_shard", 256, "dynamic-graphed", "static")
    # 4000 tokens over 4 s against 4000 tokens over the sum of 1 / ratio.
    assert result["speedup"] == pytest.approx(4 / sum(1 / r for r in (5.0, 5.1, 4.9, 5.0)))
    assert result["low"] <= result["speedup"] <= result["high"]
    assert 4.9 <= result["low"] and result["high"] <= 5.1
    assert (result["round_min"], result["round_max"]) == (pytest.approx(4.9), pytest.approx(5.1))
    assert report_lib.comparison(_report(), "small", 1024, "dynamic-graphed", "static") is None
    # A report from before the totals: the geometric mean of its per-round ratios.
    old = _report()
    del old["comparisons"][0]["totals"]
    result = report_lib.comparison(old, "dsv3_shard", 256, "dynamic-graphed", "static")
    assert result["speedup"] == pytest.approx((5.0 * 5.1 * 4.9 * 5.0) ** 0.25)


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
    # step ms, tok/step, kernels ms, host share, bound ms, of bound, prefill ms.
    assert graphed[5:12] == ["4.00", "240", "3.00", "25%", "-", "-", "50.0"]
    assert graphed[12].startswith("5.00x [") and graphed[13].startswith("2.00x [")
    static = lines[4].split(" | ")
    assert static[7:9] == ["-", "-"] and static[12:] == ["-", "- |"]


# ------------------------------------------------------------------------- command line


def test_quick_defaults_and_refusals():
    args = mla_engine.parse_args(["--quick"])
    assert (args.rounds, args.generate, args.prompt) == (3, 32, 128)
    assert args.models == ["dsv3_shard", "small"] and args.requests == [256, 1024]
    assert args.engines == ["dynamic-graphed", "dynamic-eager", "static"]
    assert mla_engine.parse_args(["--no-eager"]).engines == ["dynamic-graphed", "static"]
    assert mla_engine.parse_args(["--no-static"]).engines == ["dynamic-graphed", "dynamic-eager"]
    assert mla_engine.parse_args([]).rounds == 8
    for bad in (["--rounds", "1"], ["--generate", "1"], ["--requests", "0"]):
        with pytest.raises(SystemExit):
            mla_engine.parse_args(bad)


def test_graph_scope_option_and_its_config(monkeypatch, tmp_path):
    assert mla_engine.parse_args([]).graph_scope == "layer"
    assert mla_engine.graph_config("layer") == dict(cuda_graph_impl="local")
    with pytest.raises(ValueError, match="graph_scope='all'"):
        mla_engine.graph_config("all")
    for newer, accepted in ((False, False), (True, True)):
        monkeypatch.setattr(mla_engine, "is_megatron_core_min_version", lambda v, n=newer: n)
        if accepted:
            assert mla_engine.parse_args(["--graph-scope", "block"]).graph_scope == "block"
            assert mla_engine.graph_config("block") == dict(
                cuda_graph_impl="local", inference_cuda_graph_scope="block"
            )
        else:
            with pytest.raises(SystemExit):
                mla_engine.parse_args(["--graph-scope", "block"])
            with pytest.raises(ValueError, match="needs megatron-core 0.19"):
                mla_engine.graph_config("block")
    # One report per scope in the same directory: a block run keeps the layer run's.
    paths = {
        scope: mla_engine.report_path(
            argparse.Namespace(out=str(tmp_path / "r"), graph_scope=scope)
        )
        for scope in mla_engine.GRAPH_SCOPES
    }
    assert paths == {
        "layer": str(tmp_path / "r" / "mla_engine.json"),
        "block": str(tmp_path / "r" / "mla_engine_block.json"),
    }
    assert (tmp_path / "r").is_dir()


@pytest.mark.skipif(
    not mla_engine.is_megatron_core_min_version("0.19.0"),
    reason="inference_cuda_graph_scope is megatron-core 0.19's (0.16 graphs per layer)",
)
def test_block_scope_fields_are_megatron_cores():
    """megatron-core 0.19's config takes the block scope's fields as spelled here (a string it
    turns into its enum; capture and replay are the GPU tests')."""
    from megatron.core.transformer.enums import InferenceCudaGraphScope
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        kv_lora_rank=32,
        use_cpu_initialization=True,
        **mla_engine.graph_config("block"),
    )
    assert config.cuda_graph_impl == "local"
    assert config.inference_cuda_graph_scope == InferenceCudaGraphScope.block


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
    engines = ["dynamic-eager", "static"]
    args = argparse.Namespace(
        prompt=5,
        generate=3,
        rounds=2,
        engines=engines,
        server_loop=True,
        prefill_forms=["off", "force"],
        host_profile_steps=2,
    )
    from megatron_ext.transformer import mla_prefill

    mha_modes = []
    mha_attention = mla_prefill.mla_paged_mha_attention

    def recording_mha_attention(*a, **k):
        mha_modes.append(mla_prefill.MODE)
        return mha_attention(*a, **k)

    monkeypatch.setattr(mla_prefill, "mla_paged_mha_attention", recording_mha_attention)
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
    # The prefill timed per MHA-form mode (force: the plain-torch MHA form on the CPU).
    assert set(rows["dynamic-eager"]["prefill_ms_by_form"]) == {"off", "force"}
    assert min(rows["dynamic-eager"]["prefill_ms_by_form"].values()) > 0
    assert "prefill_ms_by_form" not in rows["static"]
    assert mha_modes and set(mha_modes) == {"force"}  # the MHA form ran in force mode only
    assert mla_prefill.MODE == "off"  # put back
    assert rows["static"]["static_cache_gib"] > 0
    # The host profile: the eager engine's (no graphed engine without a GPU), both decode steps.
    profile = rows["dynamic-eager"]["host_profile"]
    assert profile["steps"] == 2 and "host_profile" not in rows["static"]
    assert sum(profile["owners"].values()) == pytest.approx(profile["profiled_ms_per_step"])
    assert profile["owners"]["megatron.core"] > 0 and profile["owners"]["torch"] > 0
    assert profile["owners"]["triton"] > 0  # Triton's interpreter runs the kernels here
    assert profile["owners"]["megatron_ext"] > profile["bench_ms_per_step"] > 0
    assert profile["top_cumulative"] and all(
        r["owner"] == "megatron_ext" and not r["function"].startswith("megatron_ext/bench/")
        for r in profile["top_cumulative"]
    )
    [comparison] = result["comparisons"]
    assert (comparison["candidate"], comparison["baseline"]) == ("dynamic-eager", "static")
    assert len(comparison["rounds"]) == 2 and min(comparison["rounds"]) > 0
    # The server loop: megatron-core's own run_engine served every request of each loop.
    [loop] = result["server_loop"]
    assert (loop["engine"], loop["entry"], loop["requests"]) == ("dynamic-eager", "run_engine", 3)
    assert len(loop["loops_tokens_per_s"]) == 2 and loop["tokens_per_s"] > 0
    assert loop["stepped_tokens_per_s"] > 0 and loop["host_share"] is None
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
@pytest.mark.parametrize("scope", mla_engine.GRAPH_SCOPES)
def test_gpu_smoke_run_of_the_tiny_model(tmp_path, capsys, scope):
    """A --quick-like run of the tiny model: three engines, megatron-core's graphs captured (per
    layer, or per block on 0.19), the profiler's kernel times, the table and the JSON."""
    if scope == "block" and not mla_engine.is_megatron_core_min_version("0.19.0"):
        pytest.skip("inference_cuda_graph_scope='block' is megatron-core 0.19's")
    argv = ["--models", "tiny", "--requests", "8", "--rounds", "2", "--prompt", "16"]
    argv += ["--generate", "6", "--graph-scope", scope, "--out", str(tmp_path)]
    # The benchmark installs megatron-core's inference RNG tracker for its process; put back.
    with inference_rng_tracker():
        assert mla_engine.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| model | requests | engine |" in printed
    assert f"megatron-core's CUDA graphs, one per {scope}" in printed
    name = "mla_engine.json" if scope == "layer" else "mla_engine_block.json"
    saved = json.loads((tmp_path / name).read_text())
    assert not saved["failed"] and not saved["dropped"] and saved["graph_scope"] == scope
    rows = {row["engine"]: row for row in saved["rows"]}
    assert set(rows) == set(report_lib.ENGINES)
    graphed = rows["dynamic-graphed"]
    assert graphed["graph_scope"] == scope
    assert graphed["graph_capture_s"] is not None and graphed["cuda_graph_shapes"] >= 1
    assert graphed["controller_class"].startswith("StaticSlices")
    assert graphed["kernel_ms_per_step"] > 0 and 0 <= graphed["host_share"] <= 1
    # Decode-only steps after the prefill: at most generate - 1. On megatron-core 0.19.2 a round
    # sometimes counted 4 of 5 (one step was not decode-only; seen on the GPU, either dynamic
    # engine), so the count is bounded, not fixed.
    assert 1 <= graphed["decode_steps_per_round"] <= 5
    assert len(saved["comparisons"]) == 3


# ------------------------------------------------- one statistic for the table and the verdict


def _turns(rounds=3):
    """Made-up rounds shaped as the small model's at 1024 requests: the static engine steps
    1024 tokens in 5.5 ms; the graphed engine's median step is quicker (5.2 ms) but a few of its
    steps are slow (40 ms) and its last three decode fewer tokens (the requests whose prefill
    chunk came first finish first)."""
    turns = []
    for index in range(rounds):
        jitter = 1.0 + 0.01 * index
        static = [(0.0055 * jitter, 1024)] * 31
        graphed = [(0.0052 * jitter, 1024)] * 24 + [(0.040 * jitter, 1024)] * 4
        graphed += [(0.0052 * jitter, n) for n in (768, 512, 256)]
        turns.append(
            {
                "static": {"prefill_s": 0.02, "steps": static, "other_s": 0.0},
                "dynamic-graphed": {"prefill_s": 0.3, "steps": graphed, "other_s": 0.01},
            }
        )
    return turns


def _summary_report(turns, args):
    rows = [
        mla_engine.engine_row("small", 1024, name, 1024, turns, args, {})
        for name in ("dynamic-graphed", "static")
    ]
    comparison = report_lib.engine_comparison(turns, "dynamic-graphed", "static")
    return {"rows": rows, "comparisons": [dict(model="small", requests=1024, **comparison)]}


def test_the_verdict_quotes_the_ratio_of_the_tables_tokens_per_s(monkeypatch):
    """The old verdict, the median over step pairs, favoured the graphed engine while the table's
    tokens/s favoured static; now the verdict is the table's tokens/s divided."""
    monkeypatch.setattr(report_lib, "TARGET_REQUESTS", 1024)
    turns = _turns()
    old = report_lib.paired_round_ratio
    assert all(old(t["static"]["steps"], t["dynamic-graphed"]["steps"]) > 1.05 for t in turns)
    args = argparse.Namespace(prompt=128, generate=32, rounds=3)
    report = _summary_report(turns, args)
    rows = {row["engine"]: row for row in report["rows"]}
    graphed, static = rows["dynamic-graphed"], rows["static"]
    table_ratio = graphed["decode_tokens_per_s"] / static["decode_tokens_per_s"]
    assert table_ratio < 0.8  # static is faster in the table
    result = report_lib.comparison(report, "small", 1024, "dynamic-graphed", "static")
    assert result["speedup"] == pytest.approx(table_ratio, rel=1e-12)
    assert result["low"] <= result["speedup"] <= result["high"] < 1.0
    # The table's own columns agree: tok/s = tok/step / step.
    for row in rows.values():
        per_step = row["tokens_per_step"] / (row["decode_step_ms"] / 1e3)
        assert per_step == pytest.approx(row["decode_tokens_per_s"])
    assert static["tokens_per_step"] == 1024 and graphed["tokens_per_step"] < 1024
    assert graphed["median_decode_step_ms"] == pytest.approx(5.2, rel=0.02)
    [verdict] = [line for line in report_lib.verdicts(report) if line.startswith(">=")]
    assert f"missed by {2 - table_ratio:.2f}x ({table_ratio:.2f}x [" in verdict
    assert "the median step pair alone says 1.0" in verdict and "not a throughput" in verdict
    line = [x for x in report_lib.table(report).splitlines() if "dynamic-graphed" in x][0]
    assert f" | {table_ratio:.2f}x [" in line
    assert f"| {graphed['decode_tokens_per_s']:.0f} (" in line


def test_engine_rows_keep_the_rounds_totals_and_the_end_to_end_figure():
    turns = _turns(2)
    args = argparse.Namespace(prompt=128, generate=32, rounds=2)
    row = mla_engine.engine_row("small", 1024, "dynamic-graphed", 1024, turns, args, {})
    tokens = 24 * 1024 + 4 * 1024 + 768 + 512 + 256
    assert [n for n, _ in row["decode_totals_rounds"]] == [tokens, tokens]
    assert row["decode_steps_per_round"] == 31 and row["roofline"] is None
    seconds = sum(0.3 + 0.01 + sum(s for s, _ in t["dynamic-graphed"]["steps"]) for t in turns)
    assert row["end_to_end_tokens_per_s"] == pytest.approx(2 * 1024 * 32 / seconds)
    with pytest.raises(ValueError):
        report_lib.engine_summary([{"x": {"steps": []}}], "x")


def test_rows_get_a_roofline_from_the_runs_measured_rates():
    turns = _turns(2)
    ceilings = {"copy": {"tb_per_s": 4.0}, "matmul": {"tflops": 800.0}}
    args = argparse.Namespace(prompt=128, generate=32, rounds=2, ceilings=ceilings)
    report = _summary_report(turns, args)
    rows = {row["engine"]: row for row in report["rows"]}
    assert rows["static"]["roofline"] is None  # the model is the latent cache's
    bound = rows["dynamic-graphed"]["roofline"]
    sizes = mla_engine.ENGINE_MODELS["small"]
    tokens = round(rows["dynamic-graphed"]["tokens_per_step"])
    cost = mla_roofline.decode_step_cost(sizes, [128 + 16] * tokens)
    assert bound["bytes"] == cost["bytes"] and bound["flops"] == cost["flops"]
    step_s = rows["dynamic-graphed"]["decode_step_ms"] / 1e3
    assert bound["achieved"] == pytest.approx(bound["bound_ms"] / 1e3 / step_s)
    report["ceilings"] = ceilings
    lines = report_lib.verdicts(report)
    assert "device rates (this run): copy 4.00 TB/s (read + write), bf16 matmul 800 TFLOP/s" in (
        lines
    )
    assert any(x.startswith("roofline (small, 1024 requests, dynamic-graphed): ") for x in lines)
    graphed = report_lib.table(report).splitlines()[2].split(" | ")
    assert graphed[9] == f"{bound['bound_ms']:.3f}" and graphed[10].endswith("%")


def test_new_options_and_the_help_text():
    args = mla_engine.parse_args(["--profile-steps", "5", "--server-loop"])
    assert args.profile_steps == 5 and args.server_loop
    defaults = mla_engine.parse_args([])
    assert defaults.profile_steps == 0 and not defaults.server_loop
    assert defaults.prefill_forms is None
    assert mla_engine.parse_args(["--prefill-forms", "off", "auto"]).prefill_forms == [
        "off",
        "auto",
    ]
    with pytest.raises(SystemExit):
        mla_engine.parse_args(["--prefill-forms", "on"])
    with pytest.raises(SystemExit):
        mla_engine.parse_args(["--profile-steps", "-1"])
    text = " ".join(mla_engine.parse_args.__globals__["_EPILOG"].split())
    assert "summed over the timed rounds" in text and "max(bytes / copy bandwidth" in text
    assert "95% bootstrap" in text


@CPU_ONLY
def test_without_the_static_engine_the_dynamic_one_is_measured_alone():
    """``--no-static``: no static engine is built or stepped, and no comparison against it."""
    from megatron_ext import undo_megatron_ext
    from megatron_ext.testing.synthetic import cpu_torch_compat, ensure_model_parallel

    args = argparse.Namespace(
        prompt=5,
        generate=3,
        rounds=2,
        engines=["dynamic-eager"],
        server_loop=False,
        prefill_forms=["off"],
        host_profile_steps=0,
    )
    with cpu_torch_compat():
        ensure_model_parallel()
        try:
            models = mla_engine.build_models("tiny", torch.float32, "cpu")
            result = mla_engine.measure_config("tiny", 3, args, models)
        finally:
            undo_megatron_ext()
    (row,) = result["rows"]
    assert row["engine"] == "dynamic-eager" and row["decode_tokens_per_s"] > 0
    assert row["prefill_ms_by_form"]["off"] > 0
    assert result["comparisons"] == [] and not result["dropped"]


def test_profile_prefill_option():
    assert not mla_engine.parse_args([]).profile_prefill
    assert mla_engine.parse_args(["--profile-prefill"]).profile_prefill
