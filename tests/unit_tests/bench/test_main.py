# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The main job's command line (python -m megatron_ext.bench): listing, dispatch, report."""

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
