# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Fixtures of the benchmark tests."""

from typing import Callable, Dict, List

import pytest


@pytest.fixture
def engine_rows_of() -> Callable[..., List[Dict]]:
    """Engine rows of one configuration, off and on, with the given per-round tokens/s."""

    def rows(off, on, requests=256, model="small", sampling="greedy", schedule="legacy"):
        common = {"requests": requests, "model": model, "sampling": sampling, "schedule": schedule}
        return [
            {"mode": "off", **common, "decode_tokens_per_s_rounds": off},
            {"mode": "on", **common, "decode_tokens_per_s_rounds": on},
        ]

    return rows
