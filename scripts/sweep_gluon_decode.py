# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Sweep the warp-specialized decode kernel's ring and schedule on a GPU against stage 1 and
FlashInfer in the same run: GPU time by CUDA-graph replay (the contenders in turns), TFLOP/s, and
each variant's output against stage 1's.

    python scripts/sweep_gluon_decode.py [--shapes B,CTX,HEADS ...]
        [--variants KEY_TILE,BUFFERS,ORDER[,P_BUFFERS[,HEADS_FIRST]] ...] [--splits N]
        [--out FILE.json]

A variant is the kernel's key tile, the number of key tiles in its shared-memory ring, consumer
0's order of a tile's work (``ORDER``: 0 values first, 1 values lag, 2 scores ahead, 3 release
first, 4 scores as they land; ``decode_gluon.ORDER_*``), the number of buffers of P and the
rescale factors (``P_BUFFERS``, 1 where not given) and whether a token's head groups are next to
each other in the grid (``HEADS_FIRST``, 0 where not given). Every
variant runs with the launcher's plan for the step (its split count, its workspace and combine),
only those constexprs changed, so a variant found here is one the launcher can take by
changing the constants in ``decode_gluon``. ``--splits`` replaces the launcher's split count
(its wave rule) for every variant, to time the rule's choice against others. Prints one table, a
row per shape, last.
"""

import argparse
import copy
import json
import os
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.bench import mla_serving_cases as cases  # noqa: E402
from megatron_ext.bench.mla_serving import _attention_sets, interleaved_graph_us  # noqa: E402
from megatron_ext.fusions.direct_launch import PreparedLaunch  # noqa: E402
from megatron_ext.fusions.mla_latent import decode_gluon  # noqa: E402

DEFAULT_SHAPES = [
    "128,1024,32",
    "64,2048,32",
    "64,4096,64",
    "16,8192,64",
    "32,8192,128",
    "96,3072,128",
    "16,16384,128",
    "128,2048,128",
]
DEFAULT_VARIANTS = [
    "32,4,1",
    "32,4,1,1,1",
    "32,4,2,1,1",
    "32,4,2,2,1",
    "64,2,0,1,1",
]
# Tolerance of a variant's output against stage 1's (bf16 outputs of two summation orders).
TOLERANCE = 0.05


# A variant's fields (the kernel's constexprs), and the launch layer's constants that set them.
VARIANT_FIELDS = ("KEY_TILE", "BUFFERS", "ORDER", "P_BUFFERS", "HEADS_FIRST")
PLAN_CONSTANTS = ("KEY_TILE", "NUM_BUFFERS", "ORDER", "P_BUFFERS", "HEADS_FIRST")


def parse_variant(text: str) -> Dict[str, int]:
    """A variant's constexprs from ``KEY_TILE,BUFFERS,ORDER[,P_BUFFERS[,HEADS_FIRST]]``.

    Args:
        text: the variant (P_BUFFERS 1 and HEADS_FIRST 0 where not given).

    Returns:
        Dict[str, int]: the kernel's constexpr names and values.

    Raises:
        ValueError: for anything but 3 to 5 integers.
    """
    try:
        fields = [int(x) for x in text.split(",")]
    except ValueError:
        fields = []
    if not 3 <= len(fields) <= 5:
        raise ValueError(f"a variant is KT,B,ORDER[,PB[,HF]] (3 to 5 integers), got {text!r}")
    values = (*fields, *(1, 0)[len(fields) - 3 :])
    return {
        name: bool(v) if name == "HEADS_FIRST" else v for name, v in zip(VARIANT_FIELDS, values)
    }


def variant_arg(text: str) -> str:
    """``argparse``'s type of a variant option: the text, checked by :func:`parse_variant`.

    Args:
        text: the variant.

    Returns:
        str: ``text``.

    Raises:
        argparse.ArgumentTypeError: for a malformed variant (argparse reports it and exits).
    """
    try:
        parse_variant(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error
    return text


def apply_variant(text: str) -> None:
    """Set the launch layer's constants to a variant's, before anything is planned: the
    launcher's own plan then launches it (its grid, splits and checks as the launcher's).

    Args:
        text: the variant, as :func:`parse_variant` reads it.
    """
    from megatron_ext.fusions.mla_latent import attention_plan

    for constant, value in zip(PLAN_CONSTANTS, parse_variant(text).values()):
        setattr(attention_plan, constant, value)
    attention_plan.SHARED_KEYS_RING = False  # the variant at every head count


def variant_call(
    step: cases.PagedStep, out: torch.Tensor, variant: Optional[str], **extra: Any
) -> Tuple[Callable[..., torch.Tensor], int, Dict[str, Any]]:
    """``call(kv_cache, query, out)`` of the Gluon kernel with the variant's constexprs (the
    launcher's own where ``variant`` is None) and ``extra`` kernel arguments, through a copy of
    the launcher's plan for the step (its grid, splits, workspace and combine); the plan's split
    count; and the launch's arguments.

    Args:
        step: the decode step.
        out: an output of the step's layout.
        variant: the variant's text (:func:`parse_variant`), or None.
        extra: kernel arguments to set as well (the trace script's ``trace_ptr``).

    Returns:
        Tuple[Callable, int, Dict[str, Any]]: the call, the split count and the arguments.
    """
    plan = cases.step_plan(step, out, "gluon")
    launch = plan.stage1
    args = dict(launch.args)
    args.update(parse_variant(variant) if variant else {}, **extra)
    grid = launch.grid
    if args["HEADS_FIRST"] != launch.args["HEADS_FIRST"]:
        grid = (grid[1], grid[0], grid[2])  # head groups and tokens trade axes
    variant_plan = copy.copy(plan)  # the cached plan keeps the launcher's own launch
    # Launched through Triton's JIT (no direct launch bound: host time is not what this times).
    variant_plan.stage1 = PreparedLaunch(
        launch.launches, grid, args, launch.options, tensors=len(launch.names)
    )

    def call(kv_cache: torch.Tensor, query: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        variant_plan(query, kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths, out)
        return out

    return call, plan.workspace[0][1] if plan.workspace else 1, args


def _row(shape: Tuple[int, int, int], variants: Sequence[str]) -> Dict:
    batch, context, heads = shape
    step = cases.build_step(cases.decode_requests(batch, context), heads, device="cuda")
    nbytes = cases.step_bytes(step.requests, heads)["minimum"]
    flops = cases.step_flops(step.requests, heads)
    sets = _attention_sets(step, nbytes)
    row: Dict = {"shape": list(shape), "flops": flops, "times": {}, "diffs": {}, "errors": {}}
    stage1, _ = cases.planned_attention(step, sets[0][2], "stage1")
    for cache, query, out in sets:
        stage1(cache, query, out)
    torch.cuda.synchronize()
    reference = sets[0][2].clone()
    contenders = {"stage1": (stage1, sets)}
    ok, version = cases.flashinfer_available()
    if ok:
        try:
            peer = cases.FlashInferMLA(step, heads, cases.SOFTMAX_SCALE, False)
            fi_sets = [peer.inputs(cache, query) for cache, query, _ in sets]
            peer.run(*fi_sets[0])
            torch.cuda.synchronize()
            row["diffs"]["flashinfer"] = (
                (fi_sets[0][-1].float() - reference.float()).abs().max().item()
            )
            contenders["flashinfer"] = (peer.run, fi_sets)
        except Exception as error:  # the row goes on without the peer
            row["errors"]["flashinfer"] = f"{type(error).__name__}: {error}"[:200]
    for variant in variants:
        name = "gluon " + variant
        try:
            call, splits, _ = variant_call(step, sets[0][2], variant)
            out = torch.empty_like(reference)
            call(sets[0][0], sets[0][1], out)
            torch.cuda.synchronize()
            row["splits"] = splits
            row["diffs"][name] = (out.float() - reference.float()).abs().max().item()
            contenders[name] = (call, sets)
        except Exception as error:
            row["errors"][name] = f"{type(error).__name__}: {error}"[:300]
    try:
        timed = interleaved_graph_us(contenders, quick=True)
        row["times"] = {name: t["gpu_us"] for name, t in timed.items()}
    except Exception as error:
        row["errors"]["timing"] = f"{type(error).__name__}: {error}"[:300]
    del sets, contenders
    torch.cuda.empty_cache()
    return row


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    parser.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS)
    parser.add_argument("--splits", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.splits is not None and args.splits < 1:
        parser.error(f"--splits must be >= 1, got {args.splits}")
    for variant in args.variants:
        try:
            parse_variant(variant)
        except ValueError as error:
            parser.error(str(error))
    if not torch.cuda.is_available() or decode_gluon.GLUON_DECODE_LAUNCHES is None:
        print("the sweep needs a GPU and a Triton with Gluon")
        return 2
    if args.splits is not None:
        from megatron_ext.fusions.mla_latent import attention_plan

        attention_plan.wave_num_kv_splits = lambda *_, **__: args.splits
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    variants = args.variants
    rows: List[Dict] = []
    for shape in shapes:
        row = _row(shape, variants)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    names = ["stage1", "flashinfer"] + ["gluon " + v for v in variants]
    splits = f", {args.splits} splits" if args.splits else ""
    print(
        f"\n{torch.cuda.get_device_name()}, GPU us per call (CUDA-graph replay), bf16, page 64"
        + splits
    )
    print("shape (B x ctx, heads)  " + "  ".join(f"{n:>14}" for n in names) + "  best/FI  TF/s")
    for row in rows:
        times = row["times"]
        cells = []
        for name in names:
            t = times.get(name)
            bad = row["diffs"].get(name, 0.0) > TOLERANCE
            cells.append(f"{t:>13.1f}{'!' if bad else ' '}" if t else f"{'-':>14}")
        gluon = {n: t for n, t in times.items() if n.startswith("gluon")}
        best = min(gluon, key=gluon.get) if gluon else None
        ratio = (
            f"{gluon[best] / times['flashinfer']:.2f}" if best and "flashinfer" in times else "-"
        )
        tflops = f"{row['flops'] / gluon[best] / 1e6:.0f}" if best else "-"
        b, c, h = row["shape"]
        print(f"{b:>4} x {c:>5}, {h:>3}        " + "  ".join(cells) + f"  {ratio:>7}  {tflops:>4}")
        for name, error in row["errors"].items():
            print(f"    {name}: {error}")
    print("(! : output differs from stage 1's by more than the bf16 tolerance)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
