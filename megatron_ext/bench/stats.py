# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Confidence intervals for the benchmarks' off/on ratios.

The benchmarks measure the two variants in interleaved rounds, so each round yields one off/on
ratio from figures taken on the same machine state, and the drift of the machine between rounds
cancels in it. :func:`step_paired_ratio` forms a round's ratio from two variants stepped in
alternating turns (engines, or the bookkeeping rows' stacks); :func:`ratio_interval` summarises
the rounds' ratios by their geometric mean and a bootstrap percentile interval of it (resampling
whole rounds), and says how wide the interval is, so a report can state whether a measured ratio
is settled or needs more rounds. :func:`totals_ratio` is the ratio of two variants' pooled
throughputs (work over time summed over the rounds), the figure a throughput table shows, with a
bootstrap interval over the same rounds of both.
"""

import math
import random
import statistics
from typing import Dict, List, Sequence, Tuple

__all__ = ["ratio_interval", "rounds_speedup", "spread", "step_paired_ratio", "totals_ratio"]


def ratio_interval(
    ratios: Sequence[float], confidence: float = 0.95, resamples: int = 4000, seed: int = 0
) -> Dict[str, float]:
    """The geometric mean of per-round ratios with a bootstrap percentile interval.

    Args:
        ratios: one positive ratio per round.
        confidence: coverage of the interval, in (0, 1).
        resamples: bootstrap resamples of the rounds.
        seed: seed of the resampling.

    Returns:
        Dict[str, float]: ``ratio`` (geometric mean of the ratios), ``low`` and ``high`` (the
        interval), ``half_width`` (half the interval's width over ``ratio``),
        ``round_min``/``round_max`` (the extreme ratios) and ``rounds``.

    Raises:
        ValueError: for fewer than two rounds, a ratio that is not positive, or a confidence
            outside (0, 1).
    """
    if len(ratios) < 2:
        raise ValueError(f"an interval needs at least 2 rounds, got {len(ratios)}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if min(ratios) <= 0:
        raise ValueError("ratios must be positive")
    logs = [math.log(r) for r in ratios]
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


def step_paired_ratio(
    baseline: Sequence[Tuple[float, int]], candidate: Sequence[Tuple[float, int]]
) -> Dict[str, float]:
    """One round's ratio of two engines stepped in alternating turns: turn ``i`` of each ran back
    to back on the same machine state over the same work, so each pair's time ratio is free of
    the drift that separates batches run one after the other.

    Args:
        baseline: ``(seconds, work)`` per turn (extension off); work is what the turn did (the
            tokens it decoded), which pairs the turns.
        candidate: the same for the other engine, in turn order.

    Returns:
        Dict[str, float]: ``ratio`` (median over the pairs of baseline time / candidate time:
        the candidate's throughput relative to the baseline's), ``pairs`` (turns paired) and
        ``unpaired`` (turns without a partner of the same work).

    Raises:
        ValueError: if no turn pairs, or a time is not positive.
    """
    ratios = []
    for (base_time, base_work), (cand_time, cand_work) in zip(baseline, candidate):
        if base_work != cand_work:
            continue
        if base_time <= 0 or cand_time <= 0:
            raise ValueError("step times must be positive")
        ratios.append(base_time / cand_time)
    if not ratios:
        raise ValueError("no turn of the two engines did the same work")
    return {
        "ratio": statistics.median(ratios),
        "pairs": float(len(ratios)),
        "unpaired": float(max(len(baseline), len(candidate)) - len(ratios)),
    }


def spread(values: List[float]) -> Dict[str, float]:
    """Median, min, max and interquartile range of per-round values.

    Args:
        values: one or more values.

    Returns:
        Dict[str, float]: ``median``, ``min``, ``max``, ``q1`` and ``q3``.
    """
    ordered = sorted(values)
    if len(ordered) >= 4:
        q1, _, q3 = statistics.quantiles(ordered, n=4)
    else:
        q1, q3 = ordered[0], ordered[-1]
    return {
        "median": statistics.median(ordered),
        "min": ordered[0],
        "max": ordered[-1],
        "q1": q1,
        "q3": q3,
    }


def rounds_speedup(per_round: List[float]) -> Dict[str, float]:
    """``speedup``: the rounds' geometric mean, with its 95% bootstrap interval
    (:func:`ratio_interval`) from two rounds on; the extreme rounds.

    Args:
        per_round: one positive ratio per round.

    Returns:
        Dict[str, float]: ``speedup``, ``round_min``, ``round_max``, and from two rounds on
        ``low``, ``high`` and ``half_width``.
    """
    if len(per_round) < 2:
        return {"speedup": per_round[0], "round_min": per_round[0], "round_max": per_round[0]}
    interval = ratio_interval(per_round)
    return {"speedup": interval.pop("ratio"), **interval}


def totals_ratio(
    baseline: Sequence[Tuple[float, float]],
    candidate: Sequence[Tuple[float, float]],
    confidence: float = 0.95,
    resamples: int = 4000,
    seed: int = 0,
) -> Dict[str, float]:
    """The candidate's pooled throughput over the baseline's: ``(sum work / sum seconds)`` of
    each over the rounds, so the point estimate is exactly the ratio of the two rows' work/s
    when those are pooled the same way. The interval resamples whole rounds, the same ones for
    both (they ran interleaved on the same machine state).

    Args:
        baseline: ``(work, seconds)`` per round (e.g. decode tokens and decode time).
        candidate: the same for the candidate, in the same round order.
        confidence: coverage of the interval, in (0, 1).
        resamples: bootstrap resamples of the rounds.
        seed: seed of the resampling.

    Returns:
        Dict[str, float]: ``speedup`` (the pooled ratio), ``round_min``/``round_max`` (the
        extreme per-round ratios) and, from two rounds on, ``low``, ``high`` and ``half_width``.

    Raises:
        ValueError: if the rounds differ in number or are empty, or a round's work or time is
            not positive.
    """
    if len(baseline) != len(candidate) or not baseline:
        raise ValueError(f"rounds differ or are empty: {len(baseline)} vs {len(candidate)}")
    if min(v for pair in (*baseline, *candidate) for v in pair) <= 0:
        raise ValueError("work and seconds must be positive")

    def pooled(rounds: Sequence[int]) -> float:
        base = sum(baseline[i][0] for i in rounds) / sum(baseline[i][1] for i in rounds)
        cand = sum(candidate[i][0] for i in rounds) / sum(candidate[i][1] for i in rounds)
        return cand / base

    count = len(baseline)
    per_round = [pooled([i]) for i in range(count)]
    result = {
        "speedup": pooled(range(count)),
        "round_min": min(per_round),
        "round_max": max(per_round),
    }
    if count < 2:
        return result
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = random.Random(seed)
    draws = sorted(pooled(rng.choices(range(count), k=count)) for _ in range(max(1, resamples)))
    tail = (1.0 - confidence) / 2.0
    low = draws[int(tail * (len(draws) - 1))]
    high = draws[int(math.ceil((1.0 - tail) * (len(draws) - 1)))]
    # The pooled ratio of a resample can lie outside the rounds' range only by rounding.
    result.update(
        low=min(low, result["speedup"]),
        high=max(high, result["speedup"]),
        half_width=(high - low) / 2.0 / result["speedup"],
    )
    return result
