# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The MLA serving benchmark's command line, its no-GPU check, and its GPU path run on the CPU
(fp32, Triton interpreter) with fake timings: rows, JSON, plot and tables come out whole."""

import importlib.util
import json

import pytest
import torch

from megatron_ext.bench import __main__ as bench_main
from megatron_ext.bench import mla_serving
from megatron_ext.bench import mla_serving_cases as cases
from megatron_ext.transformer import mla_prefill


def test_help_through_the_main_job(capsys):
    with pytest.raises(SystemExit) as info:
        bench_main.main(["mla-serving", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--rows" in text and "--quick" in text and "copy ceiling" in text


def test_the_main_job_lists_it(capsys):
    assert bench_main.main(["--help"]) == 0
    assert "\n  mla-serving " in capsys.readouterr().out


def test_arguments_default_to_every_section():
    args = mla_serving.parse_args([])
    assert args.rows == ["decode", "prefill", "rope_append"] and not args.quick
    args = mla_serving.parse_args(["--quick", "--rows", "decode", "--out", "d"])
    assert args.rows == ["decode"] and args.quick and args.out == "d"


def test_cases_select_prefill_rows_by_name():
    args = mla_serving.parse_args(["--rows", "prefill", "--cases", "mixed", "chunk 1k"])
    labels = [label for label, _ in mla_serving.row_jobs(args, {}, {}, False)]
    names = {label.split(": ", 1)[1].rsplit(",", 1)[0] for label in labels}
    assert names == {
        case
        for case in cases.PREFILL_CASES
        if case.startswith("mixed") or case.startswith("chunk 1k")
    }
    assert len(labels) == 2 * len(names)  # 16 and 128 heads


@pytest.mark.parametrize(
    "argv",
    [
        ["--rows", "attention"],
        ["--batch", "0"],
        ["--context", "-1"],
        ["--heads", "x"],
        ["--cases", "no such case"],
    ],
)
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as info:
        mla_serving.parse_args(argv)
    assert info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_decode_grid_full_quick_and_overridden():
    full = mla_serving.decode_grid(mla_serving.parse_args([]))
    assert len(full) == 5 * 4 * 4 and (256, 32768, 128) in full and (1, 1024, 16) in full
    assert sorted({h for _, _, h in full}) == [16, 32, 64, 128]
    quick = mla_serving.decode_grid(mla_serving.parse_args(["--quick"]))
    assert sorted({b for b, _, _ in quick}) == [1, 64, 128]
    assert sorted({h for _, _, h in quick}) == [16, 128]
    assert sorted({c for _, c, _ in quick}) == [4096, 32768] and len(quick) == 12
    chosen = mla_serving.decode_grid(
        mla_serving.parse_args(["--batch", "16", "--context", "4096", "--heads", "128"])
    )
    assert chosen == [(16, 4096, 128)]


def test_served_shapes_and_single_shapes_replace_the_grid():
    served = mla_serving.decode_grid(mla_serving.parse_args(["--served-shapes"]))
    assert served == list(cases.SERVED_DECODE_SHAPES)
    assert sorted({h for _, _, h in served}) == [16, 32, 64, 128]
    args = ["--served-shapes", "--heads", "32", "64", "--shape", "3", "100", "40"]
    assert mla_serving.decode_grid(mla_serving.parse_args(args)) == [
        (3, 100, 40),
        (128, 1024, 32),
        (64, 4096, 64),
    ]


@pytest.mark.parametrize(
    "argv",
    [["--shape", "0", "1024", "16"], ["--shape", "1", "2"], ["--batch", "4", "--served-shapes"]],
)
def test_bad_shapes_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        mla_serving.parse_args(argv)
    assert exit_info.value.code == 2
    assert "--" in capsys.readouterr().err


def test_copies_exceed_the_l2_for_small_calls_only():
    assert mla_serving.copies_for(1 << 40) == 1
    assert mla_serving.copies_for(mla_serving.ROTATE_BYTES // 4) == 4
    assert mla_serving.copies_for(1) == mla_serving.MAX_COPIES


def test_no_gpu_check_passes(capsys):
    assert mla_serving.check_interpreted() == 0
    text = capsys.readouterr().out
    assert text.count("within 1e-5") == 2 and "bitwise equal" in text
    assert "FlashInfer:" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path; a GPU runs the benchmark")
def test_main_without_a_gpu_says_so_and_checks(capsys):
    assert mla_serving.main(["--quick"]) == 0
    assert "No CUDA GPU" in capsys.readouterr().out


def test_the_megatron_core_path_writes_the_rows_it_is_compared_on():
    # The append comparison would be vacuous if megatron-core's path wrote nothing.
    step = cases.build_append(
        5, latent=32, rope=16, positions=64, block_size=16, dtype=torch.float32, device="cpu"
    )
    before = step.memory_buffer.clone()
    cases.megatron_core_append(step, step.kv_latent, step.k_pos_emb.clone())
    rows = step.memory_buffer[0, step.block_idx, step.block_offset]
    assert not torch.equal(rows, before[0, step.block_idx, step.block_offset])
    assert torch.equal(rows[:, :32], step.kv_latent[:, 0])


class _FakeFlashInfer:
    """Stands in for FlashInfer's wrapper: the float64 reference, from the inputs it is given in
    the packed layout (FlashInfer 0.7.4+) or as split copies (older releases)."""

    packed = True

    def __init__(self, step, heads, softmax_scale, causal):
        self.step, self.scale, self.causal = step, softmax_scale, causal
        self.latent = step.latent

    inputs = cases.FlashInferMLA.inputs

    def run(self, *inputs):
        if self.packed:
            query, kv_cache, out = inputs
        else:
            q_nope, q_pe, ckv, kpe, out = inputs
            assert all(x.is_contiguous() for x in (q_nope, q_pe, ckv, kpe))
            query, kv_cache = torch.cat([q_nope, q_pe], -1), torch.cat([ckv, kpe], -1)
        step = cases.PagedStep(**{**vars(self.step), "query": query, "kv_cache": kv_cache})
        return out.copy_(cases.attention_reference(step, self.scale))


@pytest.fixture
def fake_gpu(monkeypatch):
    """The GPU path on the CPU in fp32 (kernels in the Triton interpreter), with fake timings:
    each GPU time the next integer, host 2 us, eager 3 us + the contender's index."""
    monkeypatch.setattr(mla_serving, "DEVICE", "cpu")
    monkeypatch.setattr(mla_serving, "DTYPE", torch.float32)
    times = iter(range(1, 10000))

    def fake_graph_us(call, sets, quick, graph=True):
        method = "graph" if graph else mla_serving.QUEUED_METHOD
        return {"gpu_us": float(next(times)), "gpu_method": method}

    def fake_host_us(fns, rounds, sync):
        return {name: {"host_us": 2.0, "eager_us": 3.0 + i} for i, name in enumerate(fns)}

    def fake_interleaved_graph_us(contenders, quick, eager_only=()):
        return {
            name: fake_graph_us(call, sets, quick, graph=name not in eager_only)
            for name, (call, sets) in contenders.items()
        }

    monkeypatch.setattr(mla_serving, "graph_us", fake_graph_us)
    monkeypatch.setattr(mla_serving, "interleaved_graph_us", fake_interleaved_graph_us)
    monkeypatch.setattr(mla_serving, "interleaved_host_us", fake_host_us)
    monkeypatch.setattr(mla_serving, "_copy_ceiling", lambda quick: {"tb_per_s": 4.0})
    monkeypatch.setattr(mla_serving, "matmul_peak", lambda quick: {"tflops": 800.0})
    versions = dict(device="cpu", torch="t", triton="tr", megatron_core="m", python="p")
    monkeypatch.setattr(mla_serving, "_versions", lambda: versions)
    # The plain-torch MHA form: the dynamic path picks none on the CPU.
    monkeypatch.setattr(mla_serving, "MHA_BACKEND", "torch")


@pytest.mark.parametrize("packed", [True, False], ids=["flashinfer_0.7.4", "older_flashinfer"])
def test_the_gpu_path_on_the_cpu_with_fake_timings(fake_gpu, monkeypatch, tmp_path, capsys, packed):
    monkeypatch.setattr(cases, "PREFILL_CASES", {"tiny chunk": [(20, 8)]})
    monkeypatch.setattr(cases, "APPEND_TOKENS", (1, 8, 1024))
    monkeypatch.setattr(cases, "flashinfer_available", lambda: (True, "fake"))
    monkeypatch.setattr(_FakeFlashInfer, "packed", packed)
    monkeypatch.setattr(cases, "FlashInferMLA", _FakeFlashInfer)
    args = ["--batch", "2", "--context", "40", "--heads", "16", "--out", str(tmp_path)]
    assert mla_serving.bench_gpu(mla_serving.parse_args(args)) == 0

    result = json.loads((tmp_path / "mla_serving.json").read_text())
    sections = [r["section"] for r in result["rows"]]
    assert sections == ["decode", "prefill", "rope_append", "rope_append", "rope_append"]
    decode, prefill = result["rows"][0], result["rows"][1]
    # FlashInfer's (here: the float64 reference's) output is compared with ours.
    assert decode["flashinfer"]["max_abs_diff"] < 1e-5
    assert prefill["flashinfer"]["max_abs_diff"] < 1e-5
    assert decode["bytes"]["minimum"] == cases.step_bytes([(39, 1)] * 2, 16)["minimum"]
    assert all(r["bits_equal"] for r in result["rows"] if r["section"] == "rope_append")
    assert all(r["copy"]["gpu_us"] > 0 for r in result["rows"] if r["section"] == "rope_append")
    assert result["rows"][2]["decode_only"] and not result["rows"][4]["decode_only"]
    printed = capsys.readouterr().out
    # Each row's progress line carries its comparison (a run cut short keeps it).
    for row in (decode, prefill):
        ratio = row["ours"]["gpu_us"] / row["flashinfer"]["gpu_us"]
        assert (
            f"FlashInfer {row['flashinfer']['gpu_us']:.1f} us (ours / FlashInfer {ratio:.2f}x)"
            in printed
        )
    assert f"mha form {prefill['forms']['mha']['gpu_us']:.1f} us" in printed
    if importlib.util.find_spec("matplotlib") is not None:  # the bench extra; not the test one
        assert (tmp_path / "mla_serving.png").stat().st_size > 0
    else:
        assert not (tmp_path / "mla_serving.png").exists()
        assert "matplotlib" in printed
    for title in ("decode attention", "chunked prefill", "key RoPE + paged cache append"):
        assert f"=== table: {title}" in printed
    assert "=== verdicts" in printed and printed.count("\n- ") == len(result["verdicts"]) == 10
    # The Gluon decode kernel is not taken on the CPU: its table and verdicts say why.
    assert decode["gluon"]["refused"] and f"not run: {decode['gluon']['refused']}" in printed
    gluon = [v for v in result["verdicts"] if v["target"].startswith("Gluon")]
    assert len(gluon) == 2 and all(v["status"].startswith("not measured") for v in gluon)
    # The MHA form (plain torch here) computes the same attention as ours, through W_UV.
    forms = prefill["forms"]
    assert forms["backend"] == "torch" and forms["mha"]["max_rel_diff"] < 1e-5, forms
    assert forms["mha"]["gpu_method"] == mla_serving.QUEUED_METHOD, forms
    assert forms["chosen"] in ("ours", "mha") and "=== table: prefill forms" in printed
    # The decode row is outside the targets' region (batch 2, context 40).
    assert "not measured: no decode row in the region" in printed


@pytest.mark.parametrize("model_split, chosen, at", [(2, "split", " 2/3  "), (3, "ours", " 2/3 *")])
def test_prefill_rows_time_the_split_at_the_decodes(
    fake_gpu, monkeypatch, tmp_path, capsys, model_split, chosen, at
):
    """Two decodes and a chunk, the model's split forced (at these tiny sizes it would absorb
    all): at the decodes, the split is the pick; all absorbed, the split at the decodes is still
    timed and marked as not the pick. Its output is compared over the chunk's tokens."""
    monkeypatch.setattr(cases, "PREFILL_CASES", {"mixed": [(30, 1), (12, 1), (9, 6)]})
    monkeypatch.setattr(mla_prefill, "absorbed_request_count", lambda *args: model_split)
    args = ["--rows", "prefill", "--heads", "4", "--out", str(tmp_path)]
    assert mla_serving.bench_gpu(mla_serving.parse_args(args)) == 0
    (row,) = json.loads((tmp_path / "mla_serving.json").read_text())["rows"]
    forms = row["forms"]
    assert (forms["model_split"], forms["requests"], forms["chosen"]) == (model_split, 3, chosen)
    assert forms["split"]["split"] == 2 and forms["split"]["max_rel_diff"] < 1e-5, forms
    assert forms["mha"]["max_rel_diff"] < 1e-5, forms
    printed = capsys.readouterr().out
    assert "mixed steps, the cost model's form" in printed and at in printed


def test_rows_pick_the_sections(fake_gpu, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cases, "APPEND_TOKENS", (4,))
    args = mla_serving.parse_args(["--rows", "rope_append", "--out", str(tmp_path)])
    assert mla_serving.bench_gpu(args) == 0
    result = json.loads((tmp_path / "mla_serving.json").read_text())
    assert [r["section"] for r in result["rows"]] == ["rope_append"]
    assert not (tmp_path / "mla_serving.png").exists()  # no decode rows, no plot
    assert "FlashInfer: not installed" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_every_section_runs_and_agrees(monkeypatch, tmp_path, capsys):
    # One small row per section, timed for real: graph capture, eager and host timing, FlashInfer
    # where installed; the append rows bitwise equal to megatron-core's, FlashInfer close to ours.
    monkeypatch.setattr(cases, "PREFILL_CASES", {"chunk": [(64, 64)], "mixed": [(90, 1), (32, 16)]})
    monkeypatch.setattr(cases, "QUICK_PREFILL_CASES", ("chunk", "mixed"))  # --quick keeps these
    monkeypatch.setattr(cases, "APPEND_TOKENS", (16, 1024))
    argv = [
        "--quick",
        "--batch",
        "16",
        "--context",
        "4096",
        "--heads",
        "16",
        "--out",
        str(tmp_path),
    ]
    assert mla_serving.main(argv) == 0
    result = json.loads((tmp_path / "mla_serving.json").read_text())
    assert [r["section"] for r in result["rows"]] == ["decode"] + ["prefill"] * 2 + [
        "rope_append"
    ] * 2
    for row in result["rows"]:
        for who in ("ours", "mcore"):
            if who in row:
                assert row[who]["gpu_method"] == "graph", row[who]["gpu_method"]
                # Positive and finite, not compared with each other: under other GPU work (the
                # suite's parallel workers) a graph replay can time slower than an eager call.
                assert 0 < row[who]["gpu_us"] < float("inf"), row[who]
                assert 0 < row[who]["eager_us"] < float("inf"), row[who]
        fi = row.get("flashinfer")
        if isinstance(fi, dict) and "max_abs_diff" in fi:
            assert fi["max_abs_diff"] < 0.05, f"FlashInfer differs from ours: {fi}"
        if row["section"] == "prefill":
            # The MHA form runs where the dynamic path would take it, and agrees with ours.
            forms = row["forms"]
            assert forms["backend"] is not None, forms
            for name in ("mha", "split"):
                if name in forms:
                    assert forms[name]["max_rel_diff"] < 0.02, f"MHA form ({name}): {forms}"
    assert all(r["bits_equal"] for r in result["rows"] if r["section"] == "rope_append")
    assert 1.0 < result["copy_ceiling"]["tb_per_s"] < 20.0
    assert "=== verdicts" in capsys.readouterr().out


def test_a_failing_row_is_reported_and_the_others_still_run(fake_gpu, monkeypatch, tmp_path):
    monkeypatch.setattr(cases, "APPEND_TOKENS", (2, 3))
    real = mla_serving.append_row

    def append_row(tokens, ceiling, quick):
        if tokens == 2:
            raise RuntimeError("CUDA out of memory (a stand-in)")
        return real(tokens, ceiling, quick)

    monkeypatch.setattr(mla_serving, "append_row", append_row)
    args = mla_serving.parse_args(["--rows", "rope_append", "--out", str(tmp_path)])
    assert mla_serving.bench_gpu(args) == 1
    result = json.loads((tmp_path / "mla_serving.json").read_text())
    assert [r["tokens"] for r in result["rows"]] == [3]
    assert result["failed_rows"] == [
        {"row": "rope_append: 2 tokens", "error": "RuntimeError: CUDA out of memory (a stand-in)"}
    ]


@pytest.mark.gpu
def test_gpu_queued_timing_is_the_gpu_time_of_calls_the_host_is_slow_to_issue():
    """Matmuls issued with a host delay per call: eagerly the host's pace, queued behind a GPU
    sleep their GPU time (what a CUDA graph of them replays in)."""
    import time

    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def slow_call():
        time.sleep(2e-3)
        torch.mm(a, a, out=out)

    slow_call()
    torch.cuda.synchronize()
    queued = mla_serving.queued_us(lambda i: slow_call(), 5, quick=True)
    graphed = mla_serving.graph_us(lambda: torch.mm(a, a, out=out), [()], quick=True)["gpu_us"]
    assert queued < 1000, f"queued {queued:.1f} us: the host's 2 ms per call leaked in"
    assert 0.7 * graphed < queued < 1.5 * graphed + 5, (queued, graphed)


def test_contenders_in_turns_route_each_to_its_own_timing(monkeypatch):
    """Without a GPU, the timer's routing with its device parts faked: the captured contenders
    are replayed in turns and divided by their calls; an eager-only one goes to graph_us's queued
    path; one whose capture fails is timed eagerly once, not captured again, and says why."""
    captures, eager = [], []

    class FakeGraph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            return self.name

    def fake_capture(run_all):
        run_all()
        name = captures[-1]
        return (None, "RuntimeError: synced") if name == "syncs" else (FakeGraph(name), "")

    def fake_turns(replays, rounds):
        assert rounds == mla_serving.QUICK_TURN_ROUNDS
        return {name: 100.0 * (i + 1) for i, name in enumerate(replays)}

    def fake_do_bench(fn, quick):
        eager.append(fn)
        fn()
        return 50.0

    monkeypatch.setattr(mla_serving.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(mla_serving, "_capture", fake_capture)
    monkeypatch.setattr(mla_serving, "_replays_in_turns", fake_turns)
    monkeypatch.setattr(mla_serving, "_do_bench_us", fake_do_bench)
    monkeypatch.setattr(mla_serving, "queued_us", lambda call, calls, quick: 7.0)
    contenders = {
        name: (lambda *args, name=name: captures.append(name), [()] * n)
        for name, n in (("one", 1), ("many", 20), ("syncs", 1), ("eager", 1))
    }
    times = mla_serving.interleaved_graph_us(contenders, quick=True, eager_only=("eager",))
    assert list(times) == ["one", "many", "syncs", "eager"]
    calls = mla_serving.MIN_GRAPH_CALLS
    assert times["one"] == {"gpu_us": 100.0 / calls, "gpu_method": "graph"}
    assert times["many"] == {"gpu_us": 200.0 / 20, "gpu_method": "graph"}
    assert times["syncs"]["gpu_us"] == 50.0 / calls
    assert "capture failed: RuntimeError: synced" in times["syncs"]["gpu_method"]
    assert times["eager"] == {"gpu_us": 7.0, "gpu_method": mla_serving.QUEUED_METHOD}
    # Captured once each (the eager-only one never), the failed one run eagerly by do_bench.
    assert captures.count("syncs") == 2 * calls and captures.count("eager") == 0
    assert len(eager) == 1


@pytest.mark.gpu
def test_gpu_contenders_in_turns_each_get_their_own_time():
    """Two contenders timed in turns, one twice the other's matmuls on its own tensors, and one
    that cannot be captured: each time is its own (the double about twice the single, the
    capture's failure timed eagerly and said so), in the contenders' order."""
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    b, out_a, out_b = a.clone(), torch.empty_like(a), torch.empty_like(a)

    def single(x, out):
        torch.mm(x, x, out=out)

    def double(x, out):
        torch.mm(x, x, out=out)
        torch.mm(out, x, out=out)

    def syncs(x, out):
        torch.mm(x, x, out=out)
        torch.cuda.synchronize()  # not allowed while capturing

    contenders = {
        "double": (double, [(b, out_b)]),
        "single": (single, [(a, out_a)]),
        "syncs": (syncs, [(a, out_a)]),
    }
    for call, sets in contenders.values():
        call(*sets[0])
    times = mla_serving.interleaved_graph_us(contenders, quick=True)
    alone = mla_serving.graph_us(single, [(a, out_a)], quick=True)["gpu_us"]
    assert list(times) == ["double", "single", "syncs"]
    assert times["single"]["gpu_method"] == times["double"]["gpu_method"] == "graph"
    assert "capture failed" in times["syncs"]["gpu_method"], times["syncs"]
    ratio = times["double"]["gpu_us"] / times["single"]["gpu_us"]
    assert 1.6 < ratio < 2.4, (times, ratio)
    assert 0.7 * alone < times["single"]["gpu_us"] < 1.4 * alone, (times, alone)


@pytest.mark.gpu
def test_gpu_queued_timing_takes_calls_of_more_launches_than_the_queue_holds():
    """Calls of 300 small launches each, 20 to a round: 6000 launches, more than the GPU's launch
    queue holds, where the host blocks behind the sleep. The round is cut until the host gets
    ahead, and the time is the calls' GPU time, below their eager time per call."""
    import time

    x = torch.zeros(1024, device="cuda")

    def many_launches():
        for _ in range(300):
            x.add_(1)

    many_launches()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        many_launches()
    torch.cuda.synchronize()
    eager = (time.perf_counter() - start) / 20 * 1e6
    queued = mla_serving.queued_us(lambda i: many_launches(), 20, quick=True)
    graphed = mla_serving.graph_us(many_launches, [()], quick=True)["gpu_us"]
    assert 0.5 * graphed < queued < eager, (queued, graphed, eager)


def test_a_row_times_stage_1_beside_the_gluon_kernel_through_their_own_plans(fake_gpu, monkeypatch):
    """Where the Gluon kernel takes the step (faked on the CPU), the row times it and stage 1
    each through its own plan, whichever the public entry takes, and compares their outputs."""
    from megatron_ext.fusions import mla_latent

    monkeypatch.setattr(mla_latent, "gluon_decode_refusal", lambda *args, **kwargs: None)
    planned = []

    def fake_planned_attention(step, out, kernel):
        planned.append(kernel)
        shift = 0.5 if kernel == "gluon" else 0.0

        def call(kv_cache, query, out):
            return out.fill_(shift)

        return call, 3 if kernel == "gluon" else 1

    monkeypatch.setattr(cases, "planned_attention", fake_planned_attention)
    row = mla_serving.attention_row(cases.decode_requests(2, 40), 16, True, False, gluon=True)
    assert planned == ["stage1", "gluon"]
    assert row["gluon"]["max_abs_diff_vs_stage1"] == 0.5 and row["gluon"]["splits"] == 3
    assert row["stage1"]["gpu_us"] > 0 and row["gluon"]["gpu_us"] > 0
    assert row["stage1"]["gpu_us"] not in (row["ours"]["gpu_us"], row["gluon"]["gpu_us"])
