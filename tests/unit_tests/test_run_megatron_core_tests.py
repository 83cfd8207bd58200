# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The megatron-core test runner's reading of its pytest logs."""

from tests.unit_tests.fusions.mla_latent_cache_testlib import load_script


def test_outcomes_read_plain_and_xdist_lines(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(
        "tests/a.py::test_one PASSED [ 50%]\n"
        "[gw1] [ 75%] FAILED tests/a.py::test_two[x]\n"
        "tests/a.py::test_three SKIPPED (needs TE) [100%]\n"
        "E   AssertionError: not an outcome line\n"
    )
    script = load_script("run_megatron_core_tests")
    assert script.outcomes(log) == {
        "tests/a.py::test_one": "passed",
        "tests/a.py::test_two[x]": "failed",
        "tests/a.py::test_three": "skipped",
    }


def test_a_run_with_no_outcome_says_why(tmp_path):
    """A file whose tests never ran (a collection error) is named with its error, not counted as
    0 of 0 and left unexplained."""
    script = load_script("run_megatron_core_tests")
    log = tmp_path / "run.log"
    log.write_text(
        "ERROR collecting tests/unit_tests/inference/engines/test_dynamic_engine.py\n"
        "E   ModuleNotFoundError: No module named 'pydantic'\n"
        "=== 1 error in 2.1s ===\n"
    )
    assert script.nothing_ran_reason(log) == (
        "nothing ran: ModuleNotFoundError: No module named 'pydantic'"
    )
    log.write_text("collected 0 items\n\n=== no tests ran in 0.5s ===\n")
    assert script.nothing_ran_reason(log) == "nothing ran: === no tests ran in 0.5s ==="
    assert script.nothing_ran_reason(tmp_path / "missing.log") == "no log"


def test_a_run_whose_every_test_errored_says_why(tmp_path):
    """Tests that all error in a fixture (megatron-core 0.16.1's conftest asks Transformer
    Engine's version in an autouse fixture) compared nothing: the note says so, with the error;
    one passing test among them leaves no note."""
    script = load_script("run_megatron_core_tests")
    log = tmp_path / "run.log"
    log.write_text(
        "tests/a.py::test_one ERROR\n"
        "tests/a.py::test_two ERROR\n"
        "E           TypeError: '>=' not supported between instances of 'NoneType' and 'Version'\n"
    )
    outcome = script.outcomes(log)
    assert outcome == {"tests/a.py::test_one": "error", "tests/a.py::test_two": "error"}
    assert script.all_errored_reason(log, outcome) == (
        "every test errored: TypeError: '>=' not supported between instances of 'NoneType' and "
        "'Version'"
    )
    assert script.all_errored_reason(log, dict(outcome, **{"tests/a.py::t3": "passed"})) == ""
    assert script.all_errored_reason(log, {}) == ""
