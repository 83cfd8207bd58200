# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The inference benchmark's verdicts: whether a measured speedup differs from parity, and the
summary lines (and the failed checks) of a run."""

from typing import Any, Dict, List, Tuple

from megatron_ext.bench.inference_bookkeeping import bookkeeping_speedups
from megatron_ext.bench.inference_engine import engine_key, engine_ratio
from megatron_ext.bench.inference_tables import bookkeeping_ratio_text, ratio_text

__all__ = ["engine_summary", "summarize", "verdict"]


def verdict(value: Dict[str, float]) -> str:
    """Whether a speedup differs from parity: by its confidence interval where it has one, else
    by its per-round spread."""
    if "low" in value:
        if value["low"] > 1.0:
            return "faster: the interval is above 1.00"
        if value["high"] < 1.0:
            return "slower: the interval is below 1.00"
        return "the interval contains 1.00"
    if value["round_min"] > 1.0:
        return "faster in every round"
    if value["round_max"] < 1.0:
        return "slower in every round"
    return "within the measured spread of parity"


def engine_summary(report: Dict[str, Any]) -> List[str]:
    """Summary lines of the engine rows and their A/A control; sets ``report["worst_engine_row"]``
    (the row whose interval's lower end is lowest).

    Args:
        report (Dict[str, Any]): the benchmark report, with ``engine_rows`` and
            ``engine_control_rows``.

    Returns:
        List[str]: one line per configuration, the control's after the extension's.
    """
    summary: List[str] = []
    worst_engine = None
    engine = report["engine_rows"]
    ratios = {key: engine_ratio(engine, key) for key in sorted({engine_key(r) for r in engine})}
    ratios = {k: v for k, v in ratios.items() if v is not None}
    if ratios:
        # The worst row by the interval's lower end: what the data cannot rule out.
        worst_engine = min(ratios, key=lambda k: ratios[k].get("low", ratios[k]["speedup"]))
        model, sampling, requests, schedule = worst_engine
        report["worst_engine_row"] = {
            "model": model,
            "sampling": sampling,
            "requests": requests,
            "schedule": schedule,
            **ratios[worst_engine],
        }
    for key, value in ratios.items():
        model, sampling, requests, schedule = key
        settled = (
            "one round: no interval"
            if "half_width" not in value
            else f"interval half-width {100 * value['half_width']:.1f}% "
            + ("(settled: <= 3%)" if value["half_width"] <= 0.03 else "(> 3%: more rounds)")
        )
        summary.append(
            f"engine, {model} model, {sampling}, {requests} concurrent requests, {schedule} "
            "schedule: decode "
            f"{ratio_text(value)} tokens/s with the extension ({verdict(value)}; {settled})"
            + (" <- worst engine row" if key == worst_engine else "")
        )
    control = report["engine_control_rows"]
    for key in sorted({engine_key(r) for r in control}):
        value = engine_ratio(control, key)
        if value is None:
            continue
        model, sampling, requests, schedule = key
        summary.append(
            f"A/A control, {model} model, {sampling}, {requests} concurrent requests, "
            f"{schedule} schedule: megatron-core against itself {ratio_text(value)} (what "
            "the method reads between identical engines here)"
        )
    return summary


def summarize(report: Dict[str, Any]) -> Tuple[List[str], bool]:
    """The summary lines of a run, and whether a check failed.

    Also sets ``report["speedups"]``, ``report["worst_row"]`` and ``report["worst_engine_row"]``
    where the rows give them.

    Args:
        report (Dict[str, Any]): the benchmark report (``cuda``, ``rows``, ``engine_rows``,
            ``engine_control_rows``, and ``cpu_sanity`` or ``static_mla_rows`` where run).

    Returns:
        Tuple[List[str], bool]: the lines, and True if the CPU check's outputs differ or an
        extension row synchronised inside the graph-safe region.
    """
    failed = False
    summary: List[str] = []
    if not report["cuda"]:
        sanity = report["cpu_sanity"]
        failed = not sanity["identical_outputs"]
        summary.append(
            f"CPU correctness check: {sanity['requests']} requests through megatron-core's "
            f"engine, extension and megatron-core outputs "
            f"{'identical' if sanity['identical_outputs'] else 'DIFFER'} "
            f"({sanity['engine_steps']} steps, up to {sanity['max_paused']} paused); "
            f"{len(report['rows'])} bookkeeping configurations ran"
        )
    else:
        for row in report["rows"]:
            if row["variant"] != "stock" and row.get("syncs_region", 0) != 0:
                summary.append(f"FAIL: {row['variant']} synchronised inside the graph-safe region")
                failed = True
        speedups = bookkeeping_speedups(report["rows"])
        report["speedups"] = [
            {"max_requests": k[0], "sampling": k[1], "variant": k[2], **v}
            for k, v in speedups.items()
        ]
        if speedups:
            worst = min(speedups, key=lambda k: speedups[k]["speedup"])
            value = speedups[worst]
            report["worst_row"] = {"row": list(worst), **value}
            summary.append(
                f"worst bookkeeping row: {worst[0]} requests {worst[1]} {worst[2]}: "
                f"{bookkeeping_ratio_text(value)} stock ({verdict(value)}; floor 1.00x)"
            )
            for (requests, sampling, variant), value in sorted(speedups.items()):
                if variant == "ext-graphed":
                    target = " (goal 2x)" if requests >= 1024 else ""
                    summary.append(
                        f"ext-graphed at {requests} {sampling}: {bookkeeping_ratio_text(value)} "
                        f"({verdict(value)}){target}"
                    )
        summary += engine_summary(report)
    static_rows = report.get("static_mla_rows") or []
    if static_rows:
        by_key = {(r["batch"], r["mode"]): r for r in static_rows}
        ratios = {
            batch: by_key[(batch, "off")]["decode_ms_per_token"]
            / by_key[(batch, "on")]["decode_ms_per_token"]
            for batch in sorted({r["batch"] for r in static_rows})
        }
        worst_batch = min(ratios, key=ratios.get)
        summary.append(
            f"static MLA generation: decode per token {ratios[worst_batch]:.2f}x with the flag at "
            f"batch {worst_batch} (worst of batches {sorted(ratios)})"
        )
    return summary, failed
