# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's command line."""

import pytest

from megatron_ext.bench import inference


def test_a_second_schedule_is_refused_on_megatron_core_0_16(capsys):
    from megatron_ext.inference.contexts.static_slices_context_base import (
        UPSTREAM_HAS_ACTIVE_SLICES,
    )

    if UPSTREAM_HAS_ACTIVE_SLICES:
        pytest.skip("megatron-core 0.19 has both schedules")
    argv = ["--engine-schedules", "legacy", "async", "--max-requests", "4", "--engine-requests"]
    assert inference.main(argv) == 2
    assert "0.16 has one schedule" in capsys.readouterr().err
