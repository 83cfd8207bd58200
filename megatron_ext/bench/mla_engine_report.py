# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What the MLA engine benchmark (:mod:`megatron_ext.bench.mla_engine`) prints: each engine's
decode throughput and the comparisons between engines (both from the same per-round totals), the
host share of a step, the verdict against the engine target (the graphed dynamic engine at twice
the static engine's decode tokens/s) and the table.

One statistic throughout: an engine's decode tokens/s is its decode tokens over its decode time,
both summed over the timed rounds (:func:`engine_summary`), and a comparison is the ratio of two
engines' such figures with a bootstrap interval over the rounds
(:func:`megatron_ext.bench.stats.totals_ratio`), so the verdict's ratio is the table's tokens/s
divided. The median over step pairs of their per-token time ratio (:func:`paired_round_ratio`)
ignores the slow steps and the steps with fewer tokens that the totals include; it is kept as a
diagnostic (``step_median_rounds``), never as the comparison.

Pure functions of the measurements and the report's rows, so that the tests check them on
made-up figures.
"""

import statistics
from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_ext.bench.stats import rounds_speedup, spread, step_paired_ratio, totals_ratio

__all__ = [
    "ENGINES",
    "STEP_MEDIAN_NOTE",
    "TARGET_REQUESTS",
    "TARGET_SPEEDUP",
    "comparison",
    "engine_comparison",
    "engine_summary",
    "host_share",
    "paired_round_ratio",
    "table",
    "verdicts",
]

# The engines of a configuration: megatron-core's dynamic engine with its decode CUDA graphs and
# megatron_ext's flags, the same without the graphs, and its static-batching path with the RoPE
# flag (the baseline).
ENGINES = ("dynamic-graphed", "dynamic-eager", "static")
TARGET_SPEEDUP = 2.0
TARGET_REQUESTS = 256
# A verdict notes the median step pair where it differs from the throughput ratio by more than
# this fraction: the steps' times (or tokens) then have a tail the totals include.
STEP_MEDIAN_NOTE = 0.05

Steps = Sequence[Tuple[float, int]]


def _totals(steps: Steps) -> Tuple[int, float]:
    return sum(n for _, n in steps), sum(s for s, _ in steps)


def engine_summary(turns: Sequence[Dict[str, Dict[str, Any]]], name: str) -> Dict[str, Any]:
    """One engine's decode figures over the timed rounds, every one from the same steps.

    Args:
        turns: per round, per engine, ``steps``: ``(seconds, tokens)`` per decode step.
        name: the engine.

    Returns:
        Dict[str, Any]: ``decode_tokens_per_s`` (tokens over seconds, both summed over the
        rounds), ``decode_step_ms`` (seconds over steps, summed likewise),
        ``tokens_per_step`` (tokens over steps: so tokens/s = tokens_per_step / step time),
        ``median_decode_step_ms`` (the median step, a diagnostic), ``decode_steps_per_round``
        (median), ``decode_totals_rounds`` (``[tokens, seconds]`` per round),
        ``decode_tokens_per_s_rounds`` and their ``decode_tokens_per_s_spread``.

    Raises:
        ValueError: if a round has no decode step of the engine.
    """
    totals = [_totals(t[name]["steps"]) for t in turns]
    if not totals or min(s for _, s in totals) <= 0:
        raise ValueError(f"{name}: a round without decode steps")
    counts = [len(t[name]["steps"]) for t in turns]
    tokens, seconds = sum(n for n, _ in totals), sum(s for _, s in totals)
    rates = [n / s for n, s in totals]
    return {
        "decode_tokens_per_s": tokens / seconds,
        "decode_step_ms": seconds / sum(counts) * 1e3,
        "tokens_per_step": tokens / sum(counts),
        "median_decode_step_ms": statistics.median(s for t in turns for s, _ in t[name]["steps"])
        * 1e3,
        "decode_steps_per_round": statistics.median(counts),
        "decode_totals_rounds": [[n, s] for n, s in totals],
        "decode_tokens_per_s_rounds": rates,
        "decode_tokens_per_s_spread": spread(rates),
    }


def engine_comparison(
    turns: Sequence[Dict[str, Dict[str, Any]]], candidate: str, baseline: str
) -> Dict[str, Any]:
    """The measurements a comparison of two engines is computed from.

    Args:
        turns: as :func:`engine_summary`'s.
        candidate: engine name.
        baseline: engine name.

    Returns:
        Dict[str, Any]: ``candidate``, ``baseline``, ``totals`` (per engine, ``[tokens,
        seconds]`` per round, as the rows'), ``rounds`` (each round's candidate tokens/s over
        the baseline's) and ``step_median_rounds`` (each round's :func:`paired_round_ratio`, a
        diagnostic).
    """
    totals = {
        name: [list(_totals(t[name]["steps"])) for t in turns] for name in (baseline, candidate)
    }
    return {
        "candidate": candidate,
        "baseline": baseline,
        "totals": totals,
        "rounds": [
            (c[0] / c[1]) / (b[0] / b[1]) for b, c in zip(totals[baseline], totals[candidate])
        ],
        "step_median_rounds": [
            paired_round_ratio(t[baseline]["steps"], t[candidate]["steps"]) for t in turns
        ],
    }


def paired_round_ratio(
    baseline: Sequence[Tuple[float, int]], candidate: Sequence[Tuple[float, int]]
) -> float:
    """One round's throughput ratio of two engines whose decode steps ran in alternating turns.

    Step ``i`` of each ran back to back on the same machine state, but the engines decode
    different batch sizes per step (the static engine's batch may be capped by its cache), so each
    pair compares time per token rather than time per step.

    Args:
        baseline: ``(seconds, tokens)`` per decode step of the baseline, in step order.
        candidate: the same for the candidate.

    Returns:
        float: the median over the pairs of baseline seconds per token over candidate seconds per
        token: the candidate's tokens/s relative to the baseline's.

    Raises:
        ValueError: if no step pairs, or a step decoded no token.
    """
    if any(tokens <= 0 for _, tokens in (*baseline, *candidate)):
        raise ValueError("a decode step without tokens cannot be paired")
    per_token = [
        [(seconds / tokens, 1) for seconds, tokens in steps] for steps in (baseline, candidate)
    ]
    return step_paired_ratio(*per_token)["ratio"]


def host_share(step_seconds: float, kernel_seconds: Optional[float]) -> Optional[float]:
    """The share of a step's wall time not covered by its GPU work.

    Args:
        step_seconds: wall time per step (synchronised before and after).
        kernel_seconds: the sum of the step's kernel (and copy) durations per step, or None where
            not measured.

    Returns:
        Optional[float]: ``1 - kernels / wall``, floored at 0 (kernels on two streams may
        overlap), or None.
    """
    if kernel_seconds is None or step_seconds <= 0:
        return None
    return max(0.0, 1.0 - kernel_seconds / step_seconds)


def comparison(
    report: Dict[str, Any], model: str, requests: int, candidate: str, baseline: str
) -> Optional[Dict[str, float]]:
    """The candidate's decode tokens/s over the baseline's in one configuration: the ratio of
    their decode tokens over decode time summed over the rounds (the rows' tokens/s), with its
    95% bootstrap interval over the rounds (:func:`megatron_ext.bench.stats.totals_ratio`).

    Args:
        report: the benchmark's report (``comparisons`` holds the per-round totals; a report
            without them, from before, falls back on the geometric mean of its ``rounds``).
        model: model name.
        requests: concurrent requests.
        candidate: engine name.
        baseline: engine name.

    Returns:
        Optional[Dict[str, float]]: ``speedup``, ``round_min``/``round_max``, from two rounds
        on ``low``, ``high`` and ``half_width``, and ``step_median`` (the geometric mean of the
        rounds' median step pairs) where measured; None if the pair was not measured.
    """
    for entry in report.get("comparisons", []):
        key = (entry["model"], entry["requests"], entry["candidate"], entry["baseline"])
        if key != (model, requests, candidate, baseline) or not entry["rounds"]:
            continue
        if "totals" not in entry:
            return rounds_speedup(entry["rounds"])
        result = totals_ratio(entry["totals"][baseline], entry["totals"][candidate])
        if entry.get("step_median_rounds"):
            result["step_median"] = rounds_speedup(entry["step_median_rounds"])["speedup"]
        return result
    return None


def _ratio_text(result: Optional[Dict[str, float]]) -> str:
    if result is None:
        return "-"
    if "low" not in result:
        return f"{result['speedup']:.2f}x (1 round)"
    return f"{result['speedup']:.2f}x [{result['low']:.2f}-{result['high']:.2f}]"


def _step_ms(row: Dict[str, Any]) -> float:
    # Rows from before the totals carried only the median-based step.
    return row.get("decode_step_ms", row["median_decode_step_ms"])


def verdicts(report: Dict[str, Any]) -> List[str]:
    """The engine target per model (the graphed dynamic engine at >= 2x the static engine's decode
    tokens/s at 256 requests), each graphed row's distance from the sum of its kernels and from
    its roofline bound, and the server-loop rows.

    Args:
        report: the benchmark's report.

    Returns:
        List[str]: one line per model, then one per graphed row with a host share, one per row
        with a roofline bound, one per server-loop row.
    """
    lines = []
    rows = report.get("rows", [])
    for model in dict.fromkeys(row["model"] for row in rows):
        result = comparison(report, model, TARGET_REQUESTS, "dynamic-graphed", "static")
        head = f">= {TARGET_SPEEDUP:g}x static at {TARGET_REQUESTS} requests ({model}): "
        if result is None:
            lines.append(head + f"not measured (no {TARGET_REQUESTS}-request graphed row)")
            continue
        ratio = result["speedup"]
        margin = abs(ratio - TARGET_SPEEDUP)
        state = "met" if ratio >= TARGET_SPEEDUP else "missed"
        line = (
            f"{head}{state} by {margin:.2f}x ({_ratio_text(result)}, 95% interval; decode "
            "tokens/s as in the table, tokens over time summed over the rounds)"
        )
        if "low" in result and result["low"] < TARGET_SPEEDUP <= result["high"]:
            line += f"; not settled: the interval spans {TARGET_SPEEDUP:g}x"
        median = result.get("step_median")
        if median is not None and abs(median / ratio - 1.0) > STEP_MEDIAN_NOTE:
            line += (
                f"; the median step pair alone says {median:.2f}x: not a throughput, the totals "
                "include the slower steps and the steps with fewer tokens that it leaves out"
            )
        lines.append(line)
    for row in rows:
        if row["engine"] != "dynamic-graphed" or row.get("kernel_ms_per_step") is None:
            continue
        step, kernels = _step_ms(row), row["kernel_ms_per_step"]
        lines.append(
            f"host share ({row['model']}, {row['requests']} requests, dynamic-graphed): step "
            f"{step:.2f} ms vs its kernels' sum {kernels:.2f} ms: {step - kernels:.2f} ms "
            f"({row['host_share']:.0%}) of the step is not GPU work"
        )
    ceilings = report.get("ceilings")
    if ceilings:
        lines.append(
            f"device rates (this run): copy {ceilings['copy']['tb_per_s']:.2f} TB/s (read + "
            f"write), bf16 matmul {ceilings['matmul']['tflops']:.0f} TFLOP/s"
        )
    for row in rows:
        bound = row.get("roofline")
        if not bound:
            continue
        lines.append(
            f"roofline ({row['model']}, {row['requests']} requests, {row['engine']}): "
            f"{bound['bytes'] / 1e6:.1f} MB and {bound['flops'] / 1e9:.1f} GFLOP per step: "
            f"bound {bound['bound_ms']:.3f} ms ({bound['bound_by']}) vs step "
            f"{_step_ms(row):.2f} ms: achieved {bound['achieved']:.1%} (bound / step)"
        )
    for row in report.get("server_loop", []):
        share = row.get("host_share")
        lines.append(
            f"server loop ({row['model']}, {row['requests']} requests, {row['engine']}, "
            f"{row['entry']}): {row['tokens_per_s']:.0f} generated tokens/s end to end (prefill "
            f"included; stepped: {row['stepped_tokens_per_s']:.0f}), host share "
            f"{'-' if share is None else f'{share:.0%}'}"
        )
    return lines


def _ms(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table(report: Dict[str, Any]) -> str:
    """A markdown table of the rows: per model, request count and engine.

    Args:
        report: the benchmark's report.

    Returns:
        str: the table.
    """
    lines = [
        "| model | requests | engine | batch | decode tok/s (min-max) | step ms | tok/step | "
        "kernels ms | host share | bound ms | of bound | prefill ms | vs static [95%] | "
        "vs eager [95%] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report.get("rows", []):
        model, requests, engine = row["model"], row["requests"], row["engine"]
        spread_ = row["decode_tokens_per_s_spread"]
        share = row.get("host_share")
        bound = row.get("roofline") or {}
        vs_static = vs_eager = None
        if engine != "static":
            vs_static = comparison(report, model, requests, engine, "static")
        if engine == "dynamic-graphed":
            vs_eager = comparison(report, model, requests, engine, "dynamic-eager")
        achieved = bound.get("achieved")
        lines.append(
            f"| {model} | {requests} | {engine} | {row['batch']} | "
            f"{row['decode_tokens_per_s']:.0f} ({spread_['min']:.0f}-{spread_['max']:.0f}) | "
            f"{_ms(_step_ms(row))} | {_ms(row.get('tokens_per_step'), 0)} | "
            f"{_ms(row.get('kernel_ms_per_step'))} | "
            f"{'-' if share is None else f'{share:.0%}'} | {_ms(bound.get('bound_ms'), 3)} | "
            f"{'-' if achieved is None else f'{achieved:.0%}'} | {_ms(row['prefill_ms'], 1)} | "
            f"{_ratio_text(vs_static)} | {_ratio_text(vs_eager)} |"
        )
    return "\n".join(lines)
