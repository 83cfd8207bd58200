# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Benchmark: per-step bookkeeping of dynamic inference, megatron-core vs static active slices,
and decode throughput through megatron-core's engine.

    python -m megatron_ext.bench inference [--out DIR] [--quick] [--max-requests 256 1024]
        [--sampling greedy top_k] [--engine-requests 256 1024]

Bookkeeping rows: each configuration fills a dynamic inference context with ``max_requests``
decoding requests and runs decode steps through the controller's real step method, with a
synthetic model in place of the network (``megatron_ext.testing.synthetic``). Per step it
measures, with the model forward and megatron-core's ``update_requests`` (the same code in every
variant) timed separately:

* ``bookkeeping``: context initialisation plus sampling bookkeeping, i.e. everything in the step
  except the forward and ``update_requests``: host (wall) time and GPU time (CUDA events);
* ``region``: host time of the sampling region (graph replay, or the eager kernels);
* the number of device-to-host synchronisations per step, counted with
  ``torch.cuda.set_sync_debug_mode`` in a separate, untimed pass.

Variants: ``stock`` (megatron-core's context and controller), ``ext-eager`` (this package's,
region not graphed: on 0.16 the region runs eagerly; on 0.19 the step samples with
megatron-core's own sampler, so it has no region time) and ``ext-graphed`` (region replayed
from a CUDA graph). The variants of a
configuration are measured interleaved in one process: after the warm-up, ``--repeats`` rounds
of ``--steps`` steps per variant, the variants stepping in turn, one step each (the order rotating
from step to step). Each row reports the median of its per-round medians and their min-max. A
speedup pairs step ``i`` of stock with step ``i`` of the variant (run back to back): a round's
ratio is the median of its paired bookkeeping-time ratios, and the speedup is the geometric mean
of the rounds' ratios with its 95% bootstrap interval (:mod:`megatron_ext.bench.stats`).

Engine rows: megatron-core's ``DynamicInferenceEngine`` with the small GPT of the inference
functional case (``megatron_ext.testing.small_gpt``; plain-torch paged-KV attention, since
flash-attn is not required), ``N`` concurrent greedy requests, extension off and on: decode
tokens per second (median decode step of a batch), off and on alternating for
``--engine-repeats`` rounds after one discarded warm-up batch each. The off/on ratio is the
geometric mean of the paired per-round ratios, with its 95% bootstrap interval
(:mod:`megatron_ext.bench.stats`); the summary says whether the interval's half-width is within
3%.

Static MLA rows (:mod:`megatron_ext.bench.static_inference`): greedy generation of a small MLA
GPT under megatron-core's static-batching inference, the MLA RoPE flag off and on: prefill and
per-token decode time.

The pieces: :mod:`~megatron_ext.bench.inference_bookkeeping` (the bookkeeping rows, timed by
:mod:`~megatron_ext.bench.inference_probe`), :mod:`~megatron_ext.bench.inference_engine` (the
engine rows), :mod:`~megatron_ext.bench.stats` (ratios and intervals),
:mod:`~megatron_ext.bench.inference_tables` and :mod:`~megatron_ext.bench.inference_verdicts`
(what is printed); this module holds the command line.

Without a GPU the run is a correctness check, not a benchmark: extension and megatron-core must
generate the same tokens through megatron-core's engine, and the bookkeeping configurations run
(with the ``--max-requests`` and ``--sampling`` given) to check that they work; no timing or
speedup is printed.
"""

import argparse
import itertools
import json
import os
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch

from megatron_ext.bench.inference_bookkeeping import VARIANTS, run_config
from megatron_ext.bench.inference_engine import (
    ENGINE_MODELS,
    engine_key,
    engine_outputs_match,
    engine_ratio,
    engine_rows,
)
from megatron_ext.bench.inference_tables import print_tables, ratio_text
from megatron_ext.bench.inference_verdicts import summarize
from megatron_ext.bench.static_inference import run_static_mla

__all__ = ["main", "parse_args"]


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.bench inference")
    parser.add_argument("--out", default=None, help="directory for bench_inference.json")
    parser.add_argument("--quick", action="store_true", help="fewer steps, greedy only")
    parser.add_argument(
        "--max-requests",
        type=int,
        nargs="*",
        default=None,
        help="decoding requests per bookkeeping configuration (default: 256 1024 on a GPU, 32 on "
        "the CPU correctness check; give no value to skip the bookkeeping rows)",
    )
    parser.add_argument("--vocab-size", type=int, default=None, help="default 32000 (GPU), 1024")
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed decode steps per variant per round (default 15 on a GPU, 2 on the CPU check)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="interleaved rounds per configuration (default 7 on a GPU, 2 on the CPU check)",
    )
    parser.add_argument("--warmup", type=int, default=None, help="untimed decode steps first")
    parser.add_argument(
        "--engine-repeats",
        type=int,
        default=None,
        help="interleaved off/on rounds of the engine rows (default 12; 4 with --quick); the "
        "ratio's 95%% interval narrows with more",
    )
    parser.add_argument(
        "--sampling",
        nargs="+",
        default=None,
        choices=["greedy", "top_k"],
        help="request sampling parameters (default: greedy and top_k; greedy with --quick or "
        "on the CPU correctness check)",
    )
    parser.add_argument(
        "--engine-requests",
        type=int,
        nargs="*",
        default=None,
        help="concurrent requests of the engine rows (default: 256 1024 on a GPU; none on CPU; "
        "give no value to skip them)",
    )
    parser.add_argument(
        "--engine-models",
        nargs="+",
        default=None,
        choices=sorted(ENGINE_MODELS),
        help="models of the engine rows (default: small 1b; small with --quick)",
    )
    parser.add_argument(
        "--engine-schedules",
        nargs="+",
        default=None,
        choices=["legacy", "async"],
        help="megatron-core 0.19's async_sched_mode of the engine rows (default: legacy and async "
        "on 0.19; 0.16 has legacy only)",
    )
    parser.add_argument(
        "--engine-control",
        action="store_true",
        help="also run every engine configuration with both engines megatron-core's own (an A/A "
        "control): its interval is the noise floor of the method at that configuration",
    )
    parser.add_argument(
        "--static-mla-batches",
        type=int,
        nargs="*",
        default=None,
        help="batch sizes of the static-batching MLA generation section, RoPE flag off/on "
        "(default: 1 16 on a GPU; none on CPU; give no value to skip it)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "engine_repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error("--warmup must be >= 0")
    for name in ("max_requests", "engine_requests", "static_mla_batches"):
        values = getattr(args, name) or []
        if any(v < 1 for v in values):
            parser.error(f"--{name.replace('_', '-')} values must be >= 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark (on a GPU) or the correctness check (without one).

    Args:
        argv: command-line arguments (see ``--help``).

    Returns:
        int: 0 on success, 1 if a check failed.
    """
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if args.steps is None:
        args.steps = 15 if cuda else 2
    args.block_steps = args.steps
    if args.repeats is None:
        args.repeats = (3 if args.quick else 7) if cuda else 2
    if args.engine_repeats is None:
        args.engine_repeats = 4 if args.quick else 12
    if args.warmup is None:
        args.warmup = (5 if args.quick else 20) if cuda else 1
    if args.sampling is None:
        args.sampling = ["greedy"] if args.quick or not cuda else ["greedy", "top_k"]
    if args.engine_models is None:
        args.engine_models = ["small"] if args.quick else ["small", "1b"]
    if args.max_requests is None:
        args.max_requests = [256, 1024] if cuda else [32]
    if args.vocab_size is None:
        args.vocab_size = 32000 if cuda else 1024
    if args.engine_requests is None:
        args.engine_requests = [256, 1024] if cuda else []
    if args.static_mla_batches is None:
        args.static_mla_batches = [1, 16] if cuda else []
    from megatron_ext.inference.contexts.static_slices_context_base import (
        UPSTREAM_HAS_ACTIVE_SLICES,
    )

    if args.engine_schedules is None:
        args.engine_schedules = ["legacy", "async"] if UPSTREAM_HAS_ACTIVE_SLICES else ["legacy"]
    if not UPSTREAM_HAS_ACTIVE_SLICES and args.engine_schedules != ["legacy"]:
        print(
            "inference benchmark: megatron-core 0.16 has one schedule; --engine-schedules "
            f"{' '.join(args.engine_schedules)} refused",
            file=sys.stderr,
        )
        return 2
    if (args.engine_requests or args.static_mla_batches) and not cuda:
        print(
            "inference benchmark: --engine-requests and --static-mla-batches need a CUDA GPU "
            "(their models' runs are GPU benchmarks); refused",
            file=sys.stderr,
        )
        return 2

    from megatron.core import package_info

    from megatron_ext.testing.synthetic import cpu_torch_compat

    report: Dict[str, Any] = {
        "cuda": cuda,
        "device": torch.cuda.get_device_name() if cuda else None,
        "megatron_core": package_info.__version__,
        "torch": torch.__version__,
        "rows": [],
        "engine_rows": [],
        "engine_control_rows": [],
    }
    controls = (False, True) if args.engine_control else (False,)
    variants = VARIANTS if cuda else ("stock", "ext-eager")
    with cpu_torch_compat():
        if not cuda:
            print(
                "inference benchmark: no CUDA GPU. This is a correctness check, not a benchmark: "
                "no timing or speedup is reported."
            )
            report["cpu_sanity"] = engine_outputs_match(args)
        for max_requests in args.max_requests:
            for sampling in args.sampling:
                report["rows"] += run_config(max_requests, sampling, args, cuda, variants)
        for model_name in args.engine_models:
            models: Dict[str, Tuple[Any, Any]] = {}
            configurations = itertools.product(
                args.sampling, args.engine_requests, args.engine_schedules, controls
            )
            for sampling, requests, schedule, control in configurations:
                rows = engine_rows(requests, model_name, sampling, schedule, args, models, control)
                report["engine_control_rows" if control else "engine_rows"] += rows
                # A run cut short by a time limit keeps what it finished.
                key = engine_key(rows[-1])
                off, on = rows
                print(
                    f"engine {'control ' if control else ''}row done: {' '.join(map(str, key))}: "
                    f"{ratio_text(engine_ratio(rows, key))}; decode tokens/s off/on "
                    f"{off['decode_tokens_per_s']:.0f} / {on['decode_tokens_per_s']:.0f}, "
                    f"step ms {off['median_decode_step_ms']:.2f} / "
                    f"{on['median_decode_step_ms']:.2f}",
                    flush=True,
                )
    if args.static_mla_batches:
        report["static_mla_rows"] = run_static_mla(
            args.static_mla_batches, prompt=256, new_tokens=32, rounds=2 if args.quick else 5
        )

    summary, failed = summarize(report)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_inference.json"), "w") as f:
            json.dump(report, f, indent=2)
    for line in summary:
        print(line)
    print_tables(report, args)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
