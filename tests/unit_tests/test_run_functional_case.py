# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The functional-test runner (tests/functional_tests/python_test_utils/run_functional_case.py),
exercised on CPU with a stand-in entry point."""

import importlib.util
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
RUNNER = REPO_ROOT / "tests" / "functional_tests" / "python_test_utils" / "run_functional_case.py"
CASES_ROOT = REPO_ROOT / "tests" / "functional_tests" / "test_cases"


def _load_runner():
    spec = importlib.util.spec_from_file_location("run_functional_case", RUNNER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


runner = _load_runner()

FAKE_ENTRY = textwrap.dedent("""
    import argparse, json
    p = argparse.ArgumentParser()
    p.add_argument("--output-json")
    p.add_argument("--modes", nargs="+", default=["off", "on"])
    p.add_argument("--differ-at", type=int, default=0)
    p.add_argument("--exit", type=int, default=0)
    p.add_argument("--no-output", action="store_true")
    p.add_argument(
        "--result-shape", default="ok", choices=["ok", "list", "env-string", "version-0"]
    )
    a = p.parse_args()
    runs = []
    for i, mode in enumerate(a.modes):
        loss = [10.0 / (s + 1) for s in range(5)]
        if a.differ_at and i > 0:
            loss[a.differ_at - 1] = loss[a.differ_at - 1] + 1e-15
        runs.append({"mode": mode, "lm loss": loss, "lm loss hex": [v.hex() for v in loss],
                     "grad norm": [1.5] * 5, "median_step_time_ms": 10.0 + i,
                     "step_time_ms": [10.0] * 5})
    result = {"environment": {"megatron_core": "0.16.1", "device": "NVIDIA H200"}, "runs": runs}
    if a.result_shape == "list":
        result = runs
    elif a.result_shape == "env-string":
        result["environment"] = "megatron-core 0.16.1 on an H200"
    elif a.result_shape == "version-0":
        result["environment"]["megatron_core"] = "0"
    if not a.no_output:
        with open(a.output_json, "w") as f:
            json.dump(result, f)
    raise SystemExit(a.exit)
    """)


def make_case(
    tmp_path: Path, name="case", nproc=1, args=None, extra_yaml="", compare_modes=True
) -> Path:
    entry = tmp_path / "fake_entry.py"
    entry.write_text(FAKE_ENTRY)
    case = tmp_path / "gpt" / name
    case.mkdir(parents=True)
    arg_lines = "".join(f"\n  {k}: {v}" for k, v in (args or {}).items())
    (case / "model_config.yaml").write_text(
        f"ENTRYPOINT: {entry}\nNPROC: {nproc}\nTIMEOUT: 60\n"
        f"ARGS:{arg_lines or ' {}'}\n"
        f'METRICS: ["lm loss", "grad norm"]\nCOMPARE_MODES: {str(compare_modes).lower()}\n'
        + extra_yaml
    )
    return case


def run(case: Path, tmp_path: Path, **kwargs):
    options = dict(
        generate_golden=False,
        env=None,
        platform=None,
        python=sys.executable,
        extra_args=[],
        available_gpus=1,
    )
    options.update(kwargs)
    return runner.run_case(runner.load_case(case), tmp_path / "out", **options)


# ----------------------------------------------------------------------------------------------
# Case files


def committed_cases():
    return sorted(p.parent for p in CASES_ROOT.rglob("model_config.yaml"))


@pytest.mark.parametrize("case", committed_cases(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_cases_load(case):
    config = runner.load_case(case)
    assert config.metrics
    assert config.nproc >= 1


def test_training_cases_cover_the_matrix():
    names = {p.name for p in committed_cases() if p.name.startswith("mla_rope_contiguous_load")}
    for precision in ("bf16", "fp32"):
        for fmt in ("sbhd", "thd"):
            case = CASES_ROOT / "gpt" / f"mla_rope_contiguous_load_{precision}_{fmt}"
            assert case.name in names
            config = runner.load_case(case)
            assert config.compare_modes and config.golden == "bitwise"
            assert config.metrics == ["lm loss", "grad norm"]
            args = config.args
            assert args[args.index("--modes") + 1 : args.index("--modes") + 3] == ["off", "on"]
            assert int(args[args.index("--train-iters") + 1]) >= 50
            assert "--deterministic" in args


@pytest.mark.parametrize(
    "content,message",
    [
        ("NPROC: 1\n", "exactly one of ENTRYPOINT"),
        ("ENTRYPOINT: x.py\nMODULE: y\n", "exactly one of ENTRYPOINT"),
        ("ENTRYPOINT: no/such/file.py\n", "does not exist"),
        ("MODULE: m\nNPROC: 0\n", "NPROC"),
        ("MODULE: m\nARGS: [a]\n", "ARGS must be a mapping"),
        ("MODULE: m\nARGS:\n  plain: 1\n", "must be a flag"),
        ("MODULE: m\nMETRICS: []\n", "METRICS"),
        ("MODULE: m\nGOLDEN: close\n", "GOLDEN"),
        ("MODULE: m\nSTEPS: 3\n", "unknown keys"),
    ],
)
def test_invalid_case_files(tmp_path, content, message):
    (tmp_path / "model_config.yaml").write_text(content)
    with pytest.raises(ValueError, match=message):
        runner.load_case(tmp_path)


def test_args_to_command_line():
    args = runner._args_to_list(
        {"--a": True, "--b": False, "--c": None, "--d": [1, "x"], "--e": 2.5}, "here"
    )
    assert args == ["--a", "--d", "1", "x", "--e", "2.5"]


def test_module_entry_point_and_torchrun(tmp_path):
    (tmp_path / "model_config.yaml").write_text("MODULE: pkg.entry\nNPROC: 2\n")
    case = runner.load_case(tmp_path)
    command = runner.build_command(case, Path("/o.json"), "python", ["--x"])
    assert command == [
        "python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "pkg.entry",
        "--x",
        "--output-json",
        "/o.json",
    ]


# ----------------------------------------------------------------------------------------------
# Comparisons


def test_bits_are_exact():
    assert runner.bits(0.1) == (0.1).hex()
    assert runner.bits(0.1) != runner.bits(0.1 + 2**-56 * 8)
    assert runner.bits(3) == "3"
    with pytest.raises(TypeError):
        runner.bits("0.1")


def test_golden_round_trip_is_bitwise():
    values = [1 / 3, 2.0**-30, 10.123456789012345]
    result = {"runs": [{"mode": "off", "lm loss": values}], "environment": {}}
    golden = json.loads(json.dumps(runner.golden_from_result(result, ["lm loss"])))
    assert runner.compare_golden(result, golden, ["lm loss"]) == []
    nudged = {"runs": [{"mode": "on", "lm loss": [values[0], values[1] * (1 + 2**-52), values[2]]}]}
    problems = runner.compare_golden(nudged, golden, ["lm loss"])
    assert len(problems) == 1 and "first at step 2" in problems[0]


def test_names():
    assert runner.env_name("0.16.1") == "mcore-0.16"
    assert runner.env_name("0.19.2rc1") == "mcore-0.19"
    assert runner.platform_name("NVIDIA H200") == "h200"
    assert runner.platform_name("NVIDIA H100 80GB HBM3") == "h100"


# ----------------------------------------------------------------------------------------------
# Running cases


def test_generate_then_compare(tmp_path):
    case = make_case(tmp_path)
    outcome = run(case, tmp_path, generate_golden=True)
    assert outcome.status == runner.GOLDEN_WRITTEN, outcome.messages
    golden = case / "golden_values_mcore-0.16_h200.json"
    assert golden.is_file()
    assert json.loads(golden.read_text())["lm loss"]["end_step"] == 5
    assert any("on/off" in line for line in outcome.timings)
    assert run(case, tmp_path).status == runner.PASSED


def test_missing_golden_fails_clearly(tmp_path):
    outcome = run(make_case(tmp_path), tmp_path)
    assert outcome.status == runner.FAILED
    assert "no golden values for env 'mcore-0.16' on platform 'h200'" in outcome.messages[0]
    assert "--generate-golden" in outcome.messages[0]


def test_modes_that_differ_fail_and_write_no_golden(tmp_path):
    case = make_case(tmp_path, args={"--differ-at": 3})
    outcome = run(case, tmp_path, generate_golden=True)
    assert outcome.status == runner.FAILED
    assert any("differs at 1 of 5 steps, first at step 3" in m for m in outcome.messages)
    assert any("NOT written" in m for m in outcome.messages)
    assert not list(case.glob("golden_values_*.json"))


def test_runs_that_may_differ_need_a_case_each(tmp_path):
    """Golden values hold one series per metric: two runs allowed to differ (two dtypes, say)
    cannot share them (the second would be compared with the first's values), so writing them is
    refused; one run per case works."""
    case = make_case(tmp_path, args={"--differ-at": 3}, compare_modes=False)
    outcome = run(case, tmp_path, generate_golden=True)
    assert outcome.status == runner.FAILED
    assert any("against one series of golden values" in m for m in outcome.messages)
    assert not list(case.glob("golden_values_*.json"))
    single = make_case(tmp_path, name="single", args={"--modes": "bf16"}, compare_modes=False)
    assert run(single, tmp_path, generate_golden=True).status == runner.GOLDEN_WRITTEN
    assert run(single, tmp_path).status == runner.PASSED


def test_golden_mismatch_fails(tmp_path):
    case = make_case(tmp_path)
    assert run(case, tmp_path, generate_golden=True).status == runner.GOLDEN_WRITTEN
    outcome = run(case, tmp_path, extra_args=["--differ-at", "2"])
    assert outcome.status == runner.FAILED
    assert any("differs from golden" in m and "run 1 (on)" in m for m in outcome.messages)


def test_entry_point_failures(tmp_path):
    outcome = run(make_case(tmp_path, args={"--no-output": "true", "--exit": 3}), tmp_path)
    assert outcome.status == runner.FAILED
    assert "exited with status 3" in outcome.messages[0]


def test_two_gpu_case_is_reported_not_passed(tmp_path):
    outcome = run(make_case(tmp_path, nproc=2), tmp_path, available_gpus=1)
    assert outcome.status == runner.NOT_RUN
    assert "needs a machine with 2 GPUs" in outcome.messages[0]


def test_cpu_case_runs_without_a_gpu(tmp_path):
    gpu_only = make_case(tmp_path, name="gpu_only")
    outcome = run(gpu_only, tmp_path, available_gpus=0)
    assert outcome.status == runner.NOT_RUN
    assert "needs a machine with 1 GPUs" in outcome.messages[0]
    cpu = make_case(tmp_path, name="cpu", extra_yaml="CPU: true\n")
    assert run(cpu, tmp_path, available_gpus=0, generate_golden=True).status == (
        runner.GOLDEN_WRITTEN
    )


def test_gpus_a_one_process_case_needs(tmp_path):
    # One process that starts two ranks itself: two GPUs on a GPU machine, the CPU without one.
    case = make_case(tmp_path, extra_yaml="CPU: true\nGPUS: 2\n")
    assert (runner.load_case(case).nproc, runner.load_case(case).gpus) == (1, 2)
    outcome = run(case, tmp_path, available_gpus=1)
    assert outcome.status == runner.NOT_RUN
    assert "needs a machine with 2 GPUs (this one has 1)" in outcome.messages[0]
    assert run(case, tmp_path, available_gpus=0, generate_golden=True).status == (
        runner.GOLDEN_WRITTEN
    )
    assert runner.load_case(make_case(tmp_path, name="default", nproc=2)).gpus == 2


@pytest.mark.parametrize("value", ["0", "true", '"2"'])
def test_gpus_key_is_checked(tmp_path, value):
    case = make_case(tmp_path, nproc=1, extra_yaml=f"GPUS: {value}\n")
    with pytest.raises(ValueError, match="GPUS must be an integer >= NPROC"):
        runner.load_case(case)


@pytest.mark.parametrize(
    "nproc, value, message",
    [(1, '"yes"', "CPU must be true or false"), (2, "true", "NPROC must be 1")],
)
def test_cpu_key_is_checked(tmp_path, nproc, value, message):
    case = make_case(tmp_path, nproc=nproc, extra_yaml=f"CPU: {value}\n")
    with pytest.raises(ValueError, match=message):
        runner.load_case(case)


def test_main_exit_codes_and_summary(tmp_path):
    one = make_case(tmp_path, name="one")
    make_case(tmp_path, name="two", nproc=2)
    out = tmp_path / "results"
    common = ["--out", str(out), "--gpus", "1"]
    assert runner.main([str(one), *common]) == 1  # no golden values yet
    assert runner.main([str(one), *common, "--generate-golden"]) == 0
    assert runner.main([str(one), *common]) == 0
    assert runner.main([str(tmp_path / "gpt"), *common]) == 2  # 'two' needs 2 GPUs
    assert runner.main([str(tmp_path / "gpt"), *common, "--allow-missing-hardware"]) == 0
    summary = (out / "summary.md").read_text()
    assert "| gpt/one | PASSED |" in summary and "| gpt/two | NOT RUN |" in summary
    assert runner.main([str(tmp_path / "nothing-here")]) == 1


# ----------------------------------------------------------------------------------------------
# Bad files: the case fails with one line naming the file, later cases still run, the summary is
# written.


def _summary_messages(summary: str, name: str) -> list:
    """The case's message lines in the summary (its timing lines left out)."""
    block = summary.split(f"**{name}**", 1)[1].split("```", 2)[1]
    timing = re.compile(r"^run \d+ \[.*\] median step|^step time on/off")
    return [line for line in block.strip("\n").splitlines() if not timing.search(line)]


def _run_bad_and_good(tmp_path, corrupt) -> tuple:
    """Runs 'a_bad' then 'b_good' through main() after corrupt(bad_case_dir); returns the exit
    status, the bad case's message lines and the summary."""
    bad = make_case(tmp_path, name="a_bad")
    make_case(tmp_path, name="b_good")
    out = tmp_path / "results"
    common = ["--out", str(out), "--gpus", "1"]
    assert runner.main([str(tmp_path / "gpt"), *common, "--generate-golden"]) == 0
    corrupt(bad)
    status = runner.main([str(tmp_path / "gpt"), *common])
    summary = (out / "summary.md").read_text()
    assert "| gpt/b_good | PASSED |" in summary, summary  # the later case still ran
    assert "| gpt/a_bad | FAILED |" in summary, summary
    return status, _summary_messages(summary, "gpt/a_bad"), summary


GOLDEN_NAME = "golden_values_mcore-0.16_h200.json"


def _edit_golden(edit):
    def corrupt(case: Path) -> None:
        path = case / GOLDEN_NAME
        golden = json.loads(path.read_text())
        edit(golden["lm loss"])
        path.write_text(json.dumps(golden))

    return corrupt


def _write_golden(text: str):
    def corrupt(case: Path) -> None:
        (case / GOLDEN_NAME).write_text(text)

    return corrupt


def _truncate_golden(case: Path) -> None:
    path = case / GOLDEN_NAME
    path.write_text(path.read_text()[:200])


def _nudge_hex(entry) -> None:
    entry["values"]["2"] = entry["values"]["2"] * (1 + 2**-40)  # hex still the old value


BAD_GOLDEN = [
    ("truncated", _truncate_golden, "not readable JSON"),
    ("empty", _write_golden(""), "not readable JSON"),
    ("not an object", _write_golden("[1, 2]"), "top level must be an object"),
    ("no start_step", _edit_golden(lambda e: e.pop("start_step")), "has no start_step"),
    ("step_interval 0", _edit_golden(lambda e: e.update(step_interval=0)), "step_interval"),
    ("end_step past entries", _edit_golden(lambda e: e.update(end_step=9)), "has no step 6"),
    ("null entry", _edit_golden(lambda e: e["values"].update({"3": None})), "step 3 is null"),
    ("values a list", _edit_golden(lambda e: e.update(values=[1.0] * 5)), "values must be"),
    ("values a string", _edit_golden(lambda e: e.update(values="1.0")), "values must be"),
    ("metric not an object", _edit_golden(lambda e: e.clear() or None), "has no start_step"),
    ("hex disagrees", _edit_golden(_nudge_hex), "step 2: hex"),
]


@pytest.mark.parametrize(
    "corrupt,problem", [c[1:] for c in BAD_GOLDEN], ids=[c[0] for c in BAD_GOLDEN]
)
def test_bad_golden_file_fails_its_case_only(tmp_path, corrupt, problem):
    status, messages, _ = _run_bad_and_good(tmp_path, corrupt)
    assert status == 1
    assert len(messages) == 1, messages
    assert GOLDEN_NAME in messages[0] and "a_bad" in messages[0]
    assert problem in messages[0]


def test_golden_hex_is_checked_against_values_directly():
    golden = runner.golden_from_result(
        {"runs": [{"mode": "off", "lm loss": [1.0, 2.0]}]}, ["lm loss"]
    )
    golden["lm loss"]["values"]["1"] = 1.5
    with pytest.raises(ValueError, match="step 1: hex '0x1.0000000000000p\\+0' disagrees"):
        runner.check_golden(golden, ["lm loss"])


BAD_RESULTS = [
    ("list", "top level must be an object"),
    ("env-string", "'environment' must be an object"),
    # Raised out of run_case and aborted the whole run (no later case, no summary).
    ("version-0", "cannot read a release from megatron-core version '0'; pass --env"),
]


@pytest.mark.parametrize("shape,problem", BAD_RESULTS, ids=[r[0] for r in BAD_RESULTS])
def test_bad_result_file_fails_its_case_only(tmp_path, shape, problem):
    def corrupt(case: Path) -> None:
        path = case / "model_config.yaml"
        path.write_text(path.read_text().replace("ARGS: {}", f"ARGS:\n  --result-shape: {shape}"))

    status, messages, _ = _run_bad_and_good(tmp_path, corrupt)
    assert status == 1
    assert len(messages) == 1, messages
    assert "result.json" in messages[0] and "a_bad" in messages[0]
    assert problem in messages[0]


BAD_YAML = [
    ("malformed", "ENTRYPOINT: [unclosed\n", "not readable YAML"),
    ("a list", "- ENTRYPOINT\n- x.py\n", "top level must be a mapping"),
    ("a scalar", "just a string\n", "top level must be a mapping"),
    ("COMPARE_MODES 'no'", "COMPARE_MODES: 'no'", "COMPARE_MODES must be true or false"),
    ("TIMEOUT true", "TIMEOUT: true", "TIMEOUT must be a positive number"),
    ("NPROC a string", "NPROC: '1'", "NPROC must be a positive integer"),
    ("ENTRYPOINT a number", "ENTRYPOINT: 3", "ENTRYPOINT must be a non-empty string"),
    ("ENV_VARS a list", "ENV_VARS: [A]", "ENV_VARS must be a mapping"),
    ("ENV_VARS value a list", "ENV_VARS:\n  A: [1]", "ENV_VARS 'A'"),
    ("ARGS value a mapping", "ARGS:\n  --x: {a: 1}", "ARGS --x"),
    ("METRICS a string", "METRICS: lm loss", "METRICS must be a non-empty list"),
    ("GOLDEN a list", "GOLDEN: [bitwise]", "GOLDEN must be a non-empty string"),
]


def _replace_yaml_key(text: str, replacement: str) -> str:
    """Replaces the key that ``replacement`` sets (and its block) in a case file, or the whole
    file when ``replacement`` is not a ``KEY: value`` line."""
    key = replacement.split(":", 1)[0]
    if not key.isupper():
        return replacement
    lines, out, skipping = text.splitlines(), [], False
    for line in lines:
        if line.startswith(f"{key}:"):
            skipping = True
            continue
        if skipping and line.startswith(" "):
            continue
        skipping = False
        out.append(line)
    return "\n".join(out) + "\n" + replacement + "\n"


@pytest.mark.parametrize("content,problem", [c[1:] for c in BAD_YAML], ids=[c[0] for c in BAD_YAML])
def test_bad_case_file_fails_its_case_only(tmp_path, content, problem):
    def corrupt(case: Path) -> None:
        path = case / "model_config.yaml"
        path.write_text(_replace_yaml_key(path.read_text(), content))

    status, messages, summary = _run_bad_and_good(tmp_path, corrupt)
    assert status == 1
    assert len(messages) == 1, messages
    assert "a_bad/model_config.yaml" in messages[0]
    assert problem in messages[0]


def test_compare_modes_must_be_a_boolean(tmp_path):
    (tmp_path / "model_config.yaml").write_text("MODULE: m\nCOMPARE_MODES: 'no'\n")
    with pytest.raises(ValueError, match="COMPARE_MODES must be true or false, got a string"):
        runner.load_case(tmp_path)
    (tmp_path / "model_config.yaml").write_text("MODULE: m\nCOMPARE_MODES: no\n")  # YAML false
    assert runner.load_case(tmp_path).compare_modes is False


def test_timeout_true_is_not_one_second(tmp_path):
    (tmp_path / "model_config.yaml").write_text("MODULE: m\nTIMEOUT: true\n")
    with pytest.raises(
        ValueError, match="TIMEOUT must be a positive number of seconds, got a bool"
    ):
        runner.load_case(tmp_path)


def committed_goldens():
    return sorted(CASES_ROOT.rglob("golden_values_*.json"))


@pytest.mark.parametrize("path", committed_goldens(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_golden_values_are_well_formed(path):
    metrics = runner.load_case(path.parent).metrics
    golden = runner.load_golden(path, metrics)
    assert set(metrics) <= set(golden)


def test_a_case_whose_required_module_is_missing_is_not_run_and_says_why(tmp_path):
    case = make_case(tmp_path, extra_yaml='REQUIRES: ["json", "megatron_ext_no_such.module"]\n')
    outcome = run(case, tmp_path)
    assert outcome.status == runner.NOT_RUN
    assert "needs megatron_ext_no_such.module" in outcome.messages[0]
    assert not (tmp_path / "out" / "result.json").exists()
    present = make_case(tmp_path, name="present", extra_yaml='REQUIRES: ["json"]\n')
    assert run(present, tmp_path, generate_golden=True).status == runner.GOLDEN_WRITTEN


@pytest.mark.parametrize("value", ['"json"', "[1]", '[""]'])
def test_requires_must_be_a_list_of_module_names(tmp_path, value):
    case = make_case(tmp_path, extra_yaml=f"REQUIRES: {value}\n")
    with pytest.raises(ValueError, match="REQUIRES must be a list of module names"):
        runner.load_case(case)


def test_inference_case_takes_the_flag_from_megatron_trainings_parser():
    pytest.importorskip(
        "megatron.training.arguments",
        reason="megatron.training is not installed (the megatron-core 0.19 wheel ships it)",
    )
    import importlib.util

    from megatron_ext import applied_megatron_ext, apply_megatron_ext, undo_megatron_ext

    script = CASES_ROOT / "gpt" / "inference_static_active_slices" / "run_case.py"
    spec = importlib.util.spec_from_file_location("inference_case", script)
    case = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(case)
    args = case.parse_args(["--out", "unused", "--megatron-training-parser"])
    for mode, expected in (("off", False), ("on", True)):
        parsed = case.megatron_training_args(args, mode)
        assert parsed.inference_static_active_slices is expected
        assert parsed.mla_rope_contiguous_load is False
        assert (parsed.num_layers, parsed.hidden_size) == (args.num_layers, args.hidden_size)
        try:
            apply_megatron_ext(parsed)
            assert applied_megatron_ext()["inference_static_active_slices"] is expected
        finally:
            undo_megatron_ext()


def test_inference_case_runs_off_and_on_identically_on_cpu(tmp_path, monkeypatch):
    """The inference case end to end on the CPU (a smoke run: few requests): megatron-core's
    engine around the small GPT, extension off and on, the same tokens and log-probs."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU smoke run; on a GPU the full case runs from the GPU suite")
    from megatron.core.inference.contexts import dynamic_context

    # The case turns megatron-core's Triton KV append off on the CPU; restore it afterwards.
    monkeypatch.setattr(
        dynamic_context,
        "triton_append_key_value_cache",
        dynamic_context.triton_append_key_value_cache,
    )
    script = CASES_ROOT / "gpt" / "inference_static_active_slices" / "run_case.py"
    spec = importlib.util.spec_from_file_location("inference_case_cpu", script)
    case = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(case)
    output = tmp_path / "result.json"
    assert case.main(["--device", "cpu", "--quick", "--output-json", str(output)]) == 0
    result = json.loads(output.read_text())
    off, on = result["runs"]
    assert result["identical"] and not result["problems"]
    assert (off["context_class"], on["context_class"]) == (
        "DynamicInferenceContext",
        "StaticSlicesInferenceContext",
    )
    assert off["generated tokens"] == on["generated tokens"] and len(on["generated tokens"]) > 50
    assert off["generated log probs"] == on["generated log probs"]
    assert len(on["generated log probs"]) == len(on["generated tokens"])
    assert on["finished_requests"] == result["requests"]


def _usage_error(capsys, argv) -> str:
    """main(argv) stops with argparse's usage error (status 2, no traceback); its message."""
    with pytest.raises(SystemExit) as stop:
        runner.main(argv)
    assert stop.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "option,value,problem",
    [
        ("--extra-args", "--lr '1e-3", r"--extra-args \"--lr '1e-3\": No closing quotation"),
        ("--gpus", "-1", r"--gpus: must be >= 0, got -1"),
        ("--gpus", "two", r"--gpus: not an integer: 'two'"),
        ("--platform", "x/y", r"--platform 'x/y': a golden file tag is"),
        ("--env", "..", r"--env '..': a golden file tag is"),
        ("--python", "/nonexistent/python3", r"--python '/nonexistent/python3': no such"),
    ],
)
def test_bad_command_line_values_are_usage_errors(tmp_path, capsys, option, value, problem):
    case = make_case(tmp_path)
    message = _usage_error(capsys, [str(case), "--out", str(tmp_path / "out"), option, value])
    assert re.search(problem, message), message
    assert not (tmp_path / "out" / "gpt").exists()  # no case ran


def test_out_naming_a_file_is_a_usage_error(tmp_path, capsys):
    case = make_case(tmp_path)
    (tmp_path / "a_file").write_text("")
    for out in (tmp_path / "a_file", tmp_path / "a_file" / "below"):
        message = _usage_error(capsys, [str(case), "--out", str(out)])
        assert f"--out '{out}'" in message, message
