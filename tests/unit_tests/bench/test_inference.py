# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's engine verdicts: paired rounds, an interval, and what it decides."""

from megatron_ext.bench import inference


def _rows(off, on, requests=256):
    return [
        {"mode": "off", "requests": requests, "decode_tokens_per_s_rounds": off},
        {"mode": "on", "requests": requests, "decode_tokens_per_s_rounds": on},
    ]


def test_engine_ratio_is_decided_by_its_interval():
    faster = inference._engine_ratio(_rows([100, 80, 120, 90], [110, 88, 132, 99]), 256)
    assert abs(faster["speedup"] - 1.1) < 1e-9 and faster["low"] > 1.0
    assert inference._verdict(faster) == "faster: the interval is above 1.00"
    assert "+-0.0%" in inference._ratio_text(faster)
    mixed = inference._engine_ratio(_rows([100, 100, 100, 100], [90, 110, 95, 108]), 256)
    assert inference._verdict(mixed) == "the interval contains 1.00"
    assert mixed["half_width"] > 0.03
    assert inference._engine_ratio(_rows([100, 100], [90, 110]), 1024) is None


def test_a_single_round_has_no_interval():
    one = inference._engine_ratio(_rows([100.0], [120.0]), 256)
    assert one == {"speedup": 1.2, "round_min": 1.2, "round_max": 1.2}
    assert inference._ratio_text(one) == "1.20x [one round]"
    assert inference._verdict(one) == "faster in every round"
