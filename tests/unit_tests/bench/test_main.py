# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The main job's command line (python -m megatron_ext.bench): listing, dispatch, report."""

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.bench import __main__ as bench_main
from megatron_ext.bench import inference, mla_serving, rope


def fake_benchmark(name, seen, status=0):
    """A stand-in benchmark main: records its arguments, prints a table, returns ``status``."""

    def main(argv):
        seen.append((name, list(argv)))
        print(f"=== table: {name}\n| a | b |\n| 1 | 2 |")
        return status

    return main


@pytest.fixture
def calls(monkeypatch):
    """The benchmarks replaced by stand-ins; the list of their calls."""
    seen = []
    monkeypatch.setattr(rope, "main", fake_benchmark("rope", seen))
    monkeypatch.setattr(inference, "main", fake_benchmark("inference", seen))
    monkeypatch.setattr(mla_serving, "main", fake_benchmark("mla-serving", seen))
    return seen


def test_help_lists_the_benchmarks_and_how_to_get_their_options(capsys, calls):
    assert bench_main.main(["--help"]) == 0
    text = capsys.readouterr().out
    for name in ("rope", "inference", "mla-serving", "all"):
        assert f"\n  {name} " in text, text
    assert "python -m megatron_ext.bench BENCHMARK --help" in text
    assert calls == []  # nothing ran


def test_help_after_a_benchmark_is_that_benchmarks_help(calls):
    bench_main.main(["inference", "--help"])
    assert calls == [("inference", ["--help"])]


def test_real_benchmark_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as info:
        bench_main.main(["inference", "-h"])
    assert info.value.code == 0
    assert "--max-requests" in capsys.readouterr().out


def test_default_run_writes_the_report_to_the_default_directory(
    tmp_path, monkeypatch, capsys, calls
):
    monkeypatch.chdir(tmp_path)
    assert bench_main.main([]) == 0
    out = tmp_path / "results" / "bench"
    assert calls == [(name, ["--out", str(out)]) for name in ("rope", "inference", "mla-serving")]
    report = (out / "report.md").read_text()
    assert "| rope | 0 |" in report and "| inference | 0 |" in report
    assert "=== table: rope" in report and "=== table: inference" in report
    assert "torch" in report and "megatron-core" in report
    printed = capsys.readouterr().out
    assert f"report written to {out}" in printed
    assert "=== table: rope" in printed  # the console still shows every table


def test_options_go_to_the_named_benchmark(tmp_path, calls):
    out = tmp_path / "o"
    assert bench_main.main(["inference", "--max-requests", "8", "--out", str(out)]) == 0
    assert calls == [("inference", ["--max-requests", "8", "--out", str(out)])]
    assert (out / "report.md").is_file()


def test_all_takes_only_the_common_options(tmp_path, calls, capsys):
    assert bench_main.main(["all", "--quick", "--out", str(tmp_path)]) == 0
    assert [argv for _, argv in calls] == [["--quick", "--out", str(tmp_path)]] * 3
    with pytest.raises(SystemExit) as info:
        bench_main.main(["all", "--max-requests", "8"])
    assert info.value.code == 2
    assert "--max-requests" in capsys.readouterr().err


def test_a_failing_benchmark_fails_the_job(tmp_path, monkeypatch, calls):
    monkeypatch.setattr(rope, "main", fake_benchmark("rope", calls, status=1))
    assert bench_main.main(["--out", str(tmp_path)]) == 1
    assert "| rope | 1 |" in (tmp_path / "report.md").read_text()


def test_one_benchmarks_run_keeps_the_others_sections(tmp_path, monkeypatch, calls):
    assert bench_main.main(["all", "--out", str(tmp_path)]) == 0
    monkeypatch.setattr(rope, "main", fake_benchmark("rope", calls, status=1))
    assert bench_main.main(["rope", "--out", str(tmp_path)]) == 1
    report = (tmp_path / "report.md").read_text()
    for name in ("inference", "mla-serving"):
        assert f"| {name} | 0 |" in report
        assert f"=== table: {name}" in report
        assert f"\n## {name}\n" in report
    assert "| rope | 1 |" in report and "| rope | 0 |" not in report
    assert report.count("=== table: rope") == 1  # rope's section replaced, not added
    assert report.index("## rope") < report.index("## inference") < report.index("## mla-serving")
    sections = sorted(p.name for p in (tmp_path / bench_main.SECTIONS_DIR).iterdir())
    assert sections == ["inference.md", "mla-serving.md", "rope.md"]


def test_report_keeps_a_section_of_a_benchmark_it_does_not_list(tmp_path, calls):
    sections = tmp_path / bench_main.SECTIONS_DIR
    sections.mkdir()
    (sections / "old-benchmark.md").write_text("## old-benchmark\n\nkept\n")
    assert bench_main.main(["inference", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "report.md").read_text()
    assert "| inference | 0 |\n| old-benchmark | ? |" in report
    assert report.index("## inference") < report.index("## old-benchmark")
    assert "kept" in report


@pytest.mark.parametrize("benchmark", ["mla-engine", "mla-serving", "inference"])
def test_benchmark_help_prints_no_warnings(benchmark):
    """A benchmark's --help imports megatron-core, whose optional-package warnings stay hidden."""
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.bench", benchmark, "--help"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: python -m megatron_ext.bench {benchmark}")
    assert "Warning" not in done.stderr and "warnings.warn" not in done.stderr, done.stderr
