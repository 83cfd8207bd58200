# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""``--repeat-test NAME:N`` (tests/conftest.py): the named test is collected N times, the
others once."""

from types import SimpleNamespace

import pytest

from tests import conftest


class _Metafunc:
    def __init__(self, option, name):
        self.config = SimpleNamespace(getoption=lambda key: option)
        self.function = SimpleNamespace(__name__=name)
        self.fixturenames = []
        self.parametrized = []

    def parametrize(self, argname, values, ids=None):
        self.parametrized.append((argname, list(values), [ids(v) for v in values]))


def test_the_named_test_is_parametrized_over_its_repetitions():
    metafunc = _Metafunc("test_flaky:3", "test_flaky")
    conftest.pytest_generate_tests(metafunc)
    assert metafunc.fixturenames == ["repetition"]
    assert metafunc.parametrized == [("repetition", [0, 1, 2], ["rep0", "rep1", "rep2"])]


def test_other_tests_and_no_option_are_left_alone():
    for option, name in (("test_flaky:3", "test_other"), (None, "test_flaky")):
        metafunc = _Metafunc(option, name)
        conftest.pytest_generate_tests(metafunc)
        assert metafunc.fixturenames == [] and metafunc.parametrized == []


@pytest.mark.parametrize("option", ["test_flaky", "test_flaky:0", "test_flaky:x", ":3"])
def test_a_malformed_option_is_a_usage_error(option):
    with pytest.raises(pytest.UsageError, match="NAME:N"):
        conftest.pytest_generate_tests(_Metafunc(option, "test_flaky"))
