# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Confidence intervals for the benchmarks' off/on ratios.

The benchmarks measure the two variants in interleaved rounds (off, on, on, off, ...), so round
``i`` of each variant ran back to back on the same machine state: the rounds are paired, and the
drift of the machine between rounds cancels in the per-round ratio. :func:`paired_ratio_interval`
summarises those ratios by their geometric mean and a bootstrap percentile interval of it
(resampling whole rounds), and says how wide the interval is, so a report can state whether a
measured ratio is settled or needs more rounds.
"""

import math
import random
import statistics
from typing import Dict, Sequence

__all__ = ["paired_ratio_interval"]


def paired_ratio_interval(
    baseline: Sequence[float],
    candidate: Sequence[float],
    confidence: float = 0.95,
    resamples: int = 4000,
    seed: int = 0,
) -> Dict[str, float]:
    """The ratio ``candidate / baseline`` over paired rounds, with a confidence interval.

    Args:
        baseline: one figure per round (e.g. tokens/s with the extension off).
        candidate: the same rounds' figures for the other variant, in the same order.
        confidence: coverage of the interval, in (0, 1).
        resamples: bootstrap resamples of the rounds.
        seed: seed of the resampling (the interval is reproducible).

    Returns:
        Dict[str, float]: ``ratio`` (geometric mean of the per-round ratios), ``low`` and
        ``high`` (the interval), ``half_width`` (half the interval's width over ``ratio``),
        ``round_min``/``round_max`` (the extreme per-round ratios) and ``rounds``.

    Raises:
        ValueError: for rounds of different counts, fewer than two rounds, a figure that is not
            positive, or a confidence outside (0, 1).
    """
    if len(baseline) != len(candidate):
        raise ValueError(
            f"paired rounds needed: {len(baseline)} baseline, {len(candidate)} candidate"
        )
    if len(baseline) < 2:
        raise ValueError(f"an interval needs at least 2 rounds, got {len(baseline)}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if min(baseline) <= 0 or min(candidate) <= 0:
        raise ValueError("round figures must be positive (a rate or a time)")
    logs = [math.log(c / b) for b, c in zip(baseline, candidate)]
    rng = random.Random(seed)
    means = sorted(
        statistics.fmean(rng.choices(logs, k=len(logs))) for _ in range(max(1, resamples))
    )
    tail = (1.0 - confidence) / 2.0
    low = means[int(tail * (len(means) - 1))]
    high = means[int(math.ceil((1.0 - tail) * (len(means) - 1)))]
    ratio = math.exp(statistics.fmean(logs))
    return {
        "ratio": ratio,
        "low": math.exp(low),
        "high": math.exp(high),
        "half_width": (math.exp(high) - math.exp(low)) / 2.0 / ratio,
        "round_min": math.exp(min(logs)),
        "round_max": math.exp(max(logs)),
        "rounds": float(len(logs)),
    }
