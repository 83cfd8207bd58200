# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What the MLA engine benchmark (:mod:`megatron_ext.bench.mla_engine`) prints: the paired-round
comparisons, the host share of a step, the verdict against the engine target (the graphed dynamic
engine at twice the static engine's decode tokens/s) and the table.

Pure functions of the report's rows, so that the tests check them on made-up figures.
"""

from typing import Any, Dict, List, Optional, Sequence, Tuple

from megatron_ext.bench.stats import rounds_speedup, step_paired_ratio

__all__ = [
    "ENGINES",
    "TARGET_REQUESTS",
    "TARGET_SPEEDUP",
    "comparison",
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
    """The candidate's decode tokens/s over the baseline's in one configuration: the geometric
    mean of the rounds' paired ratios with its 95% bootstrap interval
    (:func:`megatron_ext.bench.stats.rounds_speedup`).

    Args:
        report: the benchmark's report (``comparisons`` holds the per-round ratios).
        model: model name.
        requests: concurrent requests.
        candidate: engine name.
        baseline: engine name.

    Returns:
        Optional[Dict[str, float]]: ``speedup``, ``round_min``/``round_max`` and, from two rounds
        on, ``low``, ``high`` and ``half_width``; None if the pair was not measured.
    """
    for entry in report.get("comparisons", []):
        key = (entry["model"], entry["requests"], entry["candidate"], entry["baseline"])
        if key == (model, requests, candidate, baseline) and entry["rounds"]:
            return rounds_speedup(entry["rounds"])
    return None


def _ratio_text(result: Optional[Dict[str, float]]) -> str:
    if result is None:
        return "-"
    if "low" not in result:
        return f"{result['speedup']:.2f}x (1 round)"
    return f"{result['speedup']:.2f}x [{result['low']:.2f}-{result['high']:.2f}]"


def verdicts(report: Dict[str, Any]) -> List[str]:
    """The engine target per model (the graphed dynamic engine at >= 2x the static engine's decode
    tokens/s at 256 requests) and each graphed row's distance from the sum of its kernels.

    Args:
        report: the benchmark's report.

    Returns:
        List[str]: one line per model, then one per graphed row with a host share.
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
        line = f"{head}{state} by {margin:.2f}x ({_ratio_text(result)}, 95% interval)"
        if "low" in result and result["low"] < TARGET_SPEEDUP <= result["high"]:
            line += f"; not settled: the interval spans {TARGET_SPEEDUP:g}x"
        lines.append(line)
    for row in rows:
        if row["engine"] != "dynamic-graphed" or row.get("kernel_ms_per_step") is None:
            continue
        step, kernels = row["median_decode_step_ms"], row["kernel_ms_per_step"]
        lines.append(
            f"host share ({row['model']}, {row['requests']} requests, dynamic-graphed): step "
            f"{step:.2f} ms vs its kernels' sum {kernels:.2f} ms: {step - kernels:.2f} ms "
            f"({row['host_share']:.0%}) of the step is not GPU work"
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
        "| model | requests | engine | batch | decode tok/s (min-max) | step ms | kernels ms | "
        "host share | prefill ms | vs static [95%] | vs eager [95%] |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report.get("rows", []):
        model, requests, engine = row["model"], row["requests"], row["engine"]
        spread = row["decode_tokens_per_s_spread"]
        share = row.get("host_share")
        vs_static = vs_eager = None
        if engine != "static":
            vs_static = comparison(report, model, requests, engine, "static")
        if engine == "dynamic-graphed":
            vs_eager = comparison(report, model, requests, engine, "dynamic-eager")
        lines.append(
            f"| {model} | {requests} | {engine} | {row['batch']} | "
            f"{row['decode_tokens_per_s']:.0f} ({spread['min']:.0f}-{spread['max']:.0f}) | "
            f"{_ms(row['median_decode_step_ms'])} | {_ms(row.get('kernel_ms_per_step'))} | "
            f"{'-' if share is None else f'{share:.0%}'} | {_ms(row['prefill_ms'], 1)} | "
            f"{_ratio_text(vs_static)} | {_ratio_text(vs_eager)} |"
        )
    return "\n".join(lines)
