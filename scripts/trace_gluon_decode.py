# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Where a key tile's time goes in the warp-specialized decode kernel, partition by partition: the
kernel's own timeline (SM clock reads at the points of each tile's work), on one decode step of
the serving benchmark.

    python scripts/trace_gluon_decode.py [--shapes B,CTX,HEADS ...]
        [--variant KEY_TILE,BUFFERS,ORDER[,P_BUFFERS[,HEADS_FIRST]]] [--out FILE.json]

Each shape's step is built as ``bench mla-serving`` builds it (bf16, page 64, shuffled pages) and
launched through the launcher's plan (its ring for the head count, its splits), once with the
timeline compiled in (``trace_ptr``; every launch the plan makes compiles it out). Per partition
and phase of a key tile it prints the median and 90th percentile over the programs' steady tiles
(the first two of each program left out), in SM cycles, beside the tile's MMA work at the dense
bf16 rate of an H100 or H200 SM (2,048 multiply-adds a cycle) and the handoffs between
partitions; then what a program costs besides its steady tiles (its fill and drain, and the gaps
between programs on an SM). Consumer 0's phases are stamped in the 64-key ring's orders
(values first, release first, scores as they land); in the others only its start and end are.
The traced launch's GPU time beside the untraced one's says what the clock reads cost. Prints one
table per shape, last.
"""

import argparse
import json
import os
import sys
from typing import Dict, Sequence

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.bench import mla_serving_cases as cases  # noqa: E402
from megatron_ext.bench.mla_serving import graph_us  # noqa: E402
from megatron_ext.fusions.mla_latent import decode_gluon  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sweep_gluon_decode import VARIANT_FIELDS, variant_arg, variant_call  # noqa: E402

DEFAULT_SHAPES = ["32,8192,128", "128,2048,128", "64,4096,64"]
PARTITIONS = ("consumer 0", "consumer 1", "producer")
# Each partition's phases: (label, from event, to event); event 8 is the next tile's event 0.
# Consumer 0's stamps are in the 64-key ring's orders (decode_gluon's values first
# and release first); in the others only its own row is.
_CONSUMER0_AFTER_SCORES = (
    ("scores done", 2, 3),
    ("softmax", 3, 4),
    ("P handed over", 4, 5),
    ("rescale, values issued, next", 5, 8),
    ("tile period", 0, 8),
)
CONSUMER0_PHASES = {
    decode_gluon.ORDER_VALUES_FIRST: (
        ("key tile ready, scores issued", 0, 1),
        ("key mask's block ids, previous values done", 1, 2),
        *_CONSUMER0_AFTER_SCORES,
    ),
    decode_gluon.ORDER_RELEASE_FIRST: (
        ("previous values done, key tile ready, scores", 0, 1),
        ("key mask's block ids", 1, 2),
        *_CONSUMER0_AFTER_SCORES,
    ),
}
CONSUMER0_PHASES[decode_gluon.ORDER_SCORES_AS_THEY_LAND] = CONSUMER0_PHASES[
    decode_gluon.ORDER_RELEASE_FIRST
]
PHASES = {
    "consumer 1": (
        ("key tile ready", 0, 1),
        ("P ready", 1, 2),
        ("rescale, values issued", 2, 3),
        ("value product", 3, 4),
        ("release, next", 4, 8),
        ("tile period", 0, 8),
    ),
    "producer": (
        ("buffer free", 0, 1),
        ("copies issued (values lag: after the block ids)", 1, 2),
        ("next (release first: the next tile's block ids)", 2, 8),
        ("tile period", 0, 8),
    ),
}
# Handoffs: (label, (partition, event) at tile j, (partition, event) at tile j + offset), the
# offset in tiles or "ring" (the ring's depth: the tile that takes the buffer back).
HANDOFFS = (
    ("P handed over -> consumer 1 has it", ("consumer 0", 5), ("consumer 1", 2), 0),
    ("copies issued -> consumer 0 has the tile", ("producer", 2), ("consumer 0", 1), 0),
    ("copies issued -> consumer 1 has the tile", ("producer", 2), ("consumer 1", 1), 0),
    ("consumer 1 done -> producer has the buffer", ("consumer 1", 4), ("producer", 1), "ring"),
)
# 989 dense bf16 TFLOP/s over 132 SMs at 1,830 MHz (the rate's clock), per SM and cycle.
DENSE_FMA_PER_CYCLE = 2048


def traced_launch(step: cases.PagedStep, out: torch.Tensor, variant: str = None):
    """``(traced, plain, trace, ring)``: the Gluon launch of the launcher's plan for ``step`` (or
    ``variant``'s) with the timeline on (``traced(kv_cache, query, out)`` fills ``trace``, int64
    ``[programs, 3, TRACE_TILES + 1, TRACE_EVENTS]``), the same launch without it, the timeline,
    and the ring's constexprs."""
    grid = cases.step_plan(step, out, "gluon").stage1.grid
    programs = grid[0] * grid[1] * grid[2]  # the same whichever axis holds the head groups
    shape = (programs, 3, decode_gluon.TRACE_TILES + 1, decode_gluon.TRACE_EVENTS)
    trace = torch.full(shape, -1, dtype=torch.int64, device=out.device)
    traced, _, args = variant_call(step, out, variant, trace_ptr=trace)
    plain, _, _ = variant_call(step, out, variant)
    ring = {k: args[k] for k in VARIANT_FIELDS}
    return traced, plain, trace, ring


def _steady(trace: torch.Tensor, partition: int) -> torch.Tensor:
    """``[programs, tiles, 9]`` of one partition's stamps (event 8: the next tile's event 0, -1
    for a program's last tile), the first two tiles left out (as -1)."""
    rows = trace[:, partition, : decode_gluon.TRACE_TILES].clone()
    nxt = torch.full_like(rows[..., :1], -1)
    nxt[:, :-1, 0] = rows[:, 1:, 0]
    rows = torch.cat([rows, nxt], dim=-1)
    rows[:, :2] = -1
    return rows


def _stats(values: torch.Tensor) -> Dict[str, float]:
    values = values.double()
    if values.numel() == 0:
        return {"median": float("nan"), "p90": float("nan"), "n": 0}
    return {
        "median": values.median().item(),
        "p90": values.quantile(0.9).item(),
        "n": values.numel(),
    }


def analyse(
    trace: torch.Tensor, buffers: int, order: int = decode_gluon.ORDER_VALUES_FIRST
) -> Dict:
    """Phase and handoff statistics (SM cycles) of one launch's timeline with a ring of
    ``buffers`` key tiles in consumer 0's ``order``."""
    steady = {name: _steady(trace, i) for i, name in enumerate(PARTITIONS)}
    phases = {}
    for name, rows in steady.items():
        named = PHASES.get(name) or CONSUMER0_PHASES.get(order, (("tile period", 0, 8),))
        for label, a, b in named:
            ok = (rows[..., a] >= 0) & (rows[..., b] >= 0)
            phases[(name, label)] = _stats((rows[..., b] - rows[..., a])[ok])
    handoffs = {}
    tiles = decode_gluon.TRACE_TILES
    for label, (pa, ea), (pb, eb), offset in HANDOFFS:
        shift = buffers if offset == "ring" else offset
        first, second = steady[pa][:, : tiles - shift, ea], steady[pb][:, shift:, eb]
        ok = (first >= 0) & (second >= 0)
        handoffs[label] = _stats((second - first)[ok])
    total = trace[:, :, tiles]
    spans = (total[..., 1] - total[..., 0]).double()
    return {"phases": phases, "handoffs": handoffs, "partition_cycles": spans}


def program_ends(trace: torch.Tensor) -> Dict[str, Dict[str, float]]:
    """What a program costs besides its steady tiles, from a launch's timeline: per partition, its
    span beyond whole steady periods (its tiles times its median steady period: the fill before
    the steady tiles and the drain after them), and per SM the gaps between one program's last
    partition ending and the next program's first starting (a program's launch and exit, and
    its code before and after the partitions). Only programs whose tiles all fit the timeline
    are counted.

    Args:
        trace: a launch's timeline (``traced_launch``'s).

    Returns:
        Dict[str, Dict[str, float]]: statistics (median, p90, n) of "<partition>: beyond its
        tiles (cycles)", "gap between programs on an SM (ns)", "clock (GHz)", the launch's
        first start to last end in "launch span (us)" (median: the span), and where the
        timeline has a program's entry and fork, the gap's parts: "previous program's end to
        entry (ns)", "entry to fork (ns)" (the metadata before the partitions) and "fork to the
        partitions' start (ns)".
    """
    tiles = decode_gluon.TRACE_TILES
    own = trace[:, :, tiles]
    counts = (trace[:, :, :tiles, 0] >= 0).sum(-1)  # [programs, partitions]
    stamped = (own[..., :5] >= 0).flatten(1).all(-1)
    whole = (counts < tiles).all(-1) & (counts > 2).all(-1) & stamped
    if not whole.any():
        return {}
    result = {}
    for i, name in enumerate(PARTITIONS):
        rows = _steady(trace, i)
        period = (rows[..., 8] - rows[..., 0])[(rows[..., 0] >= 0) & (rows[..., 8] >= 0)]
        if period.numel():
            span = (own[whole, i, 1] - own[whole, i, 0]).double()
            excess = span - counts[whole, i] * period.double().median()
            result[f"{name}: beyond its tiles (cycles)"] = _stats(excess)
    clock, ns = own[whole][..., :2], own[whole][..., 3:5]  # [programs, partitions, start / end]
    result["clock (GHz)"] = _stats(
        (clock[..., 1] - clock[..., 0]).double() / (ns[..., 1] - ns[..., 0]).double()
    )
    first, last = ns[..., 0].min(-1).values, ns[..., 1].max(-1).values
    # Consumer 0's own row also holds the program's entry and fork (global timer, slots 5, 6).
    entry, fork = own[whole][:, 0, 5], own[whole][:, 0, 6]
    sm = own[whole][:, 0, 2]
    gaps, launch = [], []
    for s in sm.unique():
        order = first[sm == s].argsort()
        before = last[sm == s][order][:-1]  # the previous program's end on the SM
        gaps.append(first[sm == s][order][1:] - before)
        launch.append(entry[sm == s][order][1:] - before)
    result["gap between programs on an SM (ns)"] = _stats(torch.cat(gaps))
    if (entry >= 0).all() and (fork >= 0).all():
        result["previous program's end to entry (ns)"] = _stats(torch.cat(launch))
        result["entry to fork (ns)"] = _stats(fork - entry)
        result["fork to the partitions' start (ns)"] = _stats(first - fork)
    span_us = (last.max() - first.min()).double().item() / 1000
    result["launch span (us)"] = {"median": span_us, "p90": span_us, "n": 1}
    return result


def _row(shape: Sequence[int], variant: str) -> Dict:
    batch, context, heads = shape
    step = cases.build_step(cases.decode_requests(batch, context), heads, device="cuda")
    out = torch.empty_like(step.query[..., : step.latent])
    traced, plain, trace, ring = traced_launch(step, out, variant)
    sets = [(step.kv_cache, step.query, out)]
    reference = torch.empty_like(out)
    plain(step.kv_cache, step.query, reference)
    traced(step.kv_cache, step.query, out)
    torch.cuda.synchronize()
    same = torch.equal(out.view(torch.int16), reference.view(torch.int16))  # bitwise
    timing = {
        "untraced_us": graph_us(plain, sets, quick=True)["gpu_us"],
        "traced_us": graph_us(traced, sets, quick=True)["gpu_us"],
    }
    trace.fill_(-1)
    traced(step.kv_cache, step.query, out)
    torch.cuda.synchronize()
    host = trace.cpu()
    result = analyse(host, ring["BUFFERS"], ring["ORDER"])
    result["ends"] = program_ends(host)
    # A tile's FLOPs: scores over latent + rope columns, values over the latent ones.
    ideal = 2 * decode_gluon.HEADS_PER_PROGRAM * ring["KEY_TILE"] * (2 * step.latent + step.rope)
    result.update(
        shape=list(shape),
        ring=ring,
        same_bits_as_untraced=same,
        mma_cycles_per_tile=ideal / 2 / DENSE_FMA_PER_CYCLE,
        **timing,
    )
    return result


def _print(row: Dict) -> None:
    b, c, h = row["shape"]
    ring = row["ring"]
    print(
        f"\n{b} x {c}, {h} heads; ring {ring['KEY_TILE']},{ring['BUFFERS']},{ring['ORDER']}: "
        f"untraced {row['untraced_us']:.1f} us, traced {row['traced_us']:.1f} us; "
        f"outputs {'the same bits' if row['same_bits_as_untraced'] else 'DIFFER'} traced; "
        f"a tile's MMAs {row['mma_cycles_per_tile']:.0f} cycles at the dense rate"
    )
    print(f"  {'partition':<11} {'phase':<46} {'median':>8} {'p90':>8} {'n':>7}")
    rows = [(name, label, s) for (name, label), s in row["phases"].items()]
    rows += [("handoff", label, s) for label, s in row["handoffs"].items()]
    for name, label, s in rows:
        if s["n"]:  # phases a partition does not stamp in this order are left out
            print(f"  {name:<11} {label:<46} {s['median']:>8.0f} {s['p90']:>8.0f} {s['n']:>7}")
    for label, s in row["ends"].items():
        if s["n"]:
            print(f"  {'program':<11} {label:<46} {s['median']:>8.2f} {s['p90']:>8.2f} {s['n']:>7}")


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    parser.add_argument("--variant", type=variant_arg, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or decode_gluon.GLUON_DECODE_LAUNCHES is None:
        print("the trace needs a GPU and a Triton with Gluon")
        return 2
    rows = []
    for text in args.shapes:
        shape = tuple(int(x) for x in text.split(","))
        try:
            rows.append(_row(shape, args.variant))
        except Exception as error:  # the next shape goes on
            print(f"{text}: {type(error).__name__}: {error}"[:400], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                [
                    {
                        **{k: v for k, v in r.items() if k not in ("phases", "partition_cycles")},
                        "phases": {" / ".join(k): v for k, v in r["phases"].items()},
                    }
                    for r in rows
                ],
                f,
                indent=1,
            )
    print(f"\n{torch.cuda.get_device_name()}, SM cycles per key tile (clock64), bf16, page 64")
    for row in rows:
        _print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
