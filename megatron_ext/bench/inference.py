# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Benchmark: per-step bookkeeping of dynamic inference, megatron-core vs static active slices.

    python -m megatron_ext.bench inference [--out DIR] [--quick] [--max-requests 256 1024]

Each configuration fills a dynamic inference context with ``max_requests`` decoding requests and
runs decode steps through the controller's real step method, with a synthetic model in place of
the network (megatron_ext.inference.synthetic). Per step it measures, with the model forward and
megatron-core's ``update_requests`` (the same code in every variant) timed separately:

* ``bookkeeping``: context initialisation plus sampling bookkeeping, i.e. everything in the step
  except the forward and ``update_requests``: host (wall) time and GPU time (CUDA events);
* the number of device-to-host synchronisations per step, counted with
  ``torch.cuda.set_sync_debug_mode`` in a separate, untimed pass, split into the graph-safe
  region, the rest of the bookkeeping, and ``update_requests``.

Variants: ``stock`` (megatron-core's context and controller), ``ext-eager`` (this package's,
region run eagerly) and ``ext-graphed`` (region replayed from a CUDA graph). Without a GPU the
benchmark says so and runs a small CPU sanity pass: extension and megatron-core must generate the
same tokens through megatron-core's engine.
"""

import argparse
import json
import os
import statistics
import time
import warnings
from typing import Any, Dict, List, Optional

import torch

VARIANTS = ("stock", "ext-eager", "ext-graphed")


def _parse(argv: Optional[List[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.bench inference")
    parser.add_argument("--out", default=None, help="directory for bench_inference.json")
    parser.add_argument("--quick", action="store_true", help="fewer steps, greedy only")
    parser.add_argument("--max-requests", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps")
    parser.add_argument("--warmup", type=int, default=None, help="untimed decode steps first")
    parser.add_argument(
        "--sampling",
        nargs="+",
        default=None,
        choices=["greedy", "top_k"],
        help="request sampling parameters (default: greedy and top_k; greedy with --quick)",
    )
    return parser.parse_args(argv)


class _StepProbe:
    """Wraps the pieces of a controller step to time and count them."""

    def __init__(self, controller: Any, cuda: bool) -> None:
        self.controller = controller
        self.context = controller.inference_wrapped_model.inference_context
        self.cuda = cuda
        self.marks: Dict[str, float] = {}
        self.events: Dict[str, Any] = {}
        self.sync_log: Optional[List[Any]] = None
        self.sync_marks: Dict[str, int] = {}
        self._wrap(controller, "_dynamic_step_forward_logits", "forward")
        self._wrap(self.context, "update_requests", "update")
        if hasattr(controller, "graph_safe_step"):
            self._wrap(controller, "run_graph_safe_step", "region")
            self._wrap(controller, "_capture", "capture")

    def _mark(self, name: str) -> None:
        self.marks[name] = time.perf_counter()
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.events[name] = event
        if self.sync_log is not None:
            self.sync_marks[name] = len(self.sync_log)

    def _wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr)

        def wrapped(*args: Any, **kwargs: Any):
            self._mark(f"{label}_start")
            try:
                return original(*args, **kwargs)
            finally:
                self._mark(f"{label}_end")

        setattr(owner, attr, wrapped)

    def run_step(self) -> Dict[str, float]:
        """One controller step; host and GPU milliseconds of its parts."""
        self.marks, self.events, self.sync_marks = {}, {}, {}
        self._mark("start")
        result = self.controller.generate_output_tokens_dynamic_batch()
        self._mark("end")
        if result is None:
            raise RuntimeError("the benchmark context ran out of active requests")
        m = self.marks
        host = {
            "step_host_ms": (m["end"] - m["start"]) * 1e3,
            "forward_host_ms": (m["forward_end"] - m["forward_start"]) * 1e3,
            "update_host_ms": (m["update_end"] - m["update_start"]) * 1e3,
        }
        host["bookkeeping_host_ms"] = (
            host["step_host_ms"] - host["forward_host_ms"] - host["update_host_ms"]
        )
        if self.cuda:
            torch.cuda.synchronize()
            e = self.events

            def gap(a: str, b: str) -> float:
                return e[a].elapsed_time(e[b])

            host["bookkeeping_gpu_ms"] = gap("start", "forward_start") + gap(
                "forward_end", "update_start"
            )
            host["update_gpu_ms"] = gap("update_start", "update_end")
        return host

    def count_syncs(self) -> Dict[str, int]:
        """One step under sync debug mode; synchronisations per part of the step."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.sync_log = caught
            torch.cuda.set_sync_debug_mode("warn")
            try:
                self.run_step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
                self.sync_log = None
        syncs = [i for i, w in enumerate(caught) if "synchroniz" in str(w.message)]
        marks = self.sync_marks

        def between(a: str, b: str) -> int:
            if a not in marks or b not in marks:
                return 0
            return sum(marks[a] <= i < marks[b] for i in syncs)

        update = between("update_start", "update_end")
        forward = between("forward_start", "forward_end")
        region = between("region_start", "region_end")
        return {
            "syncs_total": len(syncs),
            "syncs_update_requests": update,
            "syncs_forward": forward,
            "syncs_region": region,
            "syncs_bookkeeping": between("start", "end") - update - forward,
        }


def _fill_decode(stack: Any, max_requests: int, steps: int, sampling: str, seed: int) -> None:
    """Add max_requests requests and run their prefill, leaving every one decoding."""
    from megatron.core.inference.inference_request import DynamicInferenceRequest
    from megatron.core.inference.sampling_params import SamplingParams

    context = stack.context
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(seed)
    params = dict(num_tokens_to_generate=steps + 64, termination_id=-1)
    params.update(dict(top_k=1) if sampling == "greedy" else dict(top_k=50, temperature=0.8))
    for request_id in range(max_requests):
        prompt = torch.randint(0, stack.logits_fn.vocab_size - 1, (4,), generator=gen).to(device)
        context.add_request(
            DynamicInferenceRequest(
                request_id=request_id,
                prompt_tokens=prompt,
                sampling_params=SamplingParams(**params),
            )
        )
    stack.controller.generate_output_tokens_dynamic_batch()  # the prefill step
    if context.get_active_request_count() != max_requests or not context.is_decode_only():
        raise RuntimeError("benchmark set-up did not reach an all-decode batch")


def _run_config(
    variant: str, max_requests: int, sampling: str, args: argparse.Namespace, cuda: bool
) -> Dict[str, Any]:
    from megatron_ext.inference.synthetic import build_synthetic_stack

    steps, warmup = args.steps, args.warmup
    extension = variant != "stock"
    controller_kwargs = dict(cuda_graph_sampling=variant == "ext-graphed") if extension else None
    block = 64
    blocks_per_request = (4 + warmup + steps + 8) // block + 2
    stack = build_synthetic_stack(
        extension=extension,
        max_requests=max_requests,
        # Room for the all-prefill set-up step (4 prompt tokens per request).
        max_tokens=4 * max_requests // 64 * 64 + 128,
        max_sequence_length=4 + warmup + steps + 128,
        block_size_tokens=block,
        num_blocks=max_requests * blocks_per_request + 8,
        vocab_size=args.vocab_size,
        params_dtype=torch.bfloat16 if cuda else torch.float32,
        controller_kwargs=controller_kwargs,
    )
    _fill_decode(stack, max_requests, warmup + steps + 2, sampling, seed=0)
    probe = _StepProbe(stack.controller, cuda)
    for _ in range(warmup):
        probe.run_step()
    samples = [probe.run_step() for _ in range(steps)]
    syncs = probe.count_syncs() if cuda else {}
    row: Dict[str, Any] = {
        "variant": variant,
        "max_requests": max_requests,
        "sampling": sampling,
        "steps": steps,
    }
    for key in samples[0]:
        row[key] = statistics.median(s[key] for s in samples)
    row.update(syncs)
    if extension:
        row["cuda_graphs"] = len(getattr(stack.controller, "_graphs", {}))
    return row


def _cpu_sanity(args: argparse.Namespace) -> Dict[str, Any]:
    """Extension and megatron-core generate the same tokens through the engine (CPU)."""
    import random

    from megatron.core.inference.sampling_params import SamplingParams

    from megatron_ext.inference.synthetic import build_engine, build_synthetic_stack, run_engine

    rng = random.Random(0)
    requests = []
    for _ in range(24):
        prompt = [rng.randrange(63) for _ in range(rng.randint(1, 40))]
        params = SamplingParams(
            num_tokens_to_generate=rng.randint(1, 30), termination_id=rng.randrange(64), top_k=1
        )
        requests.append((prompt, params))
    outputs = {}
    for extension in (False, True):
        stack = build_synthetic_stack(
            extension=extension,
            max_requests=16,
            max_tokens=64,
            num_blocks=24,
            num_paused_blocks=4,
            vocab_size=64,
            block_size_tokens=8,
            max_sequence_length=128,
        )
        outputs[extension] = run_engine(build_engine(stack), requests)
    identical = outputs[False][0] == outputs[True][0]
    return {
        "identical_outputs": identical,
        "requests": len(requests),
        "engine_steps": outputs[True][1]["steps"],
        "max_paused": outputs[True][1]["max_paused"],
    }


def _table(rows: List[Dict[str, Any]]) -> str:
    header = (
        f"{'max_req':>7} {'sampling':>8} {'variant':>12} {'bk host us':>11} {'bk gpu us':>10} "
        f"{'upd host us':>11} {'syncs bk/region/upd':>20} {'graphs':>6} {'speedup':>8}"
    )
    lines = [header, "-" * len(header)]
    stock = {
        (r["max_requests"], r["sampling"]): r["bookkeeping_host_ms"]
        for r in rows
        if r["variant"] == "stock"
    }
    for r in rows:
        base = stock.get((r["max_requests"], r["sampling"]))
        speedup = f"{base / r['bookkeeping_host_ms']:.2f}x" if base else "-"
        syncs = (
            f"{r.get('syncs_bookkeeping', '-')}/{r.get('syncs_region', '-')}/"
            f"{r.get('syncs_update_requests', '-')}"
        )
        gpu = r.get("bookkeeping_gpu_ms")
        lines.append(
            f"{r['max_requests']:>7} {r['sampling']:>8} {r['variant']:>12} "
            f"{r['bookkeeping_host_ms'] * 1e3:>11.1f} "
            f"{(gpu * 1e3 if gpu is not None else float('nan')):>10.1f} "
            f"{r['update_host_ms'] * 1e3:>11.1f} {syncs:>20} "
            f"{r.get('cuda_graphs', '-'):>6} {speedup:>8}"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark.

    Args:
        argv: command-line arguments (see ``--help``).

    Returns:
        int: 0 on success, 1 if a check failed.
    """
    args = _parse(argv)
    cuda = torch.cuda.is_available()
    if args.steps is None:
        args.steps = 20 if args.quick else 100
    if args.warmup is None:
        args.warmup = 5 if args.quick else 20
    if args.sampling is None:
        args.sampling = ["greedy"] if args.quick else ["greedy", "top_k"]

    from megatron_ext.inference.synthetic import cpu_torch_compat

    report: Dict[str, Any] = {"cuda": cuda, "device": None, "rows": []}
    with cpu_torch_compat():
        if not cuda:
            print("inference benchmark: no CUDA GPU; timings are skipped. CPU sanity pass:")
            sanity = _cpu_sanity(args)
            report["cpu_sanity"] = sanity
            args.max_requests, args.steps, args.warmup = [32], 5, 2
            args.vocab_size = min(args.vocab_size, 1024)
            args.sampling = ["greedy"]
        else:
            report["device"] = torch.cuda.get_device_name()
        for max_requests in args.max_requests:
            for sampling in args.sampling:
                for variant in VARIANTS:
                    if variant == "ext-graphed" and not cuda:
                        continue
                    report["rows"].append(_run_config(variant, max_requests, sampling, args, cuda))

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_inference.json"), "w") as f:
            json.dump(report, f, indent=2)
    failed = False
    if not cuda:
        print(json.dumps(report["cpu_sanity"]))
        failed = not report["cpu_sanity"]["identical_outputs"]
        print("(CPU host times below are a sanity check, not a benchmark.)")
    else:
        for row in report["rows"]:
            if row["variant"] != "stock" and row.get("syncs_region", 0) != 0:
                print(f"FAIL: {row['variant']} synchronised inside the graph-safe region")
                failed = True
    if cuda:
        for row in report["rows"]:
            if row["variant"] != "ext-graphed":
                continue
            base = next(
                r["bookkeeping_host_ms"]
                for r in report["rows"]
                if r["variant"] == "stock"
                and (r["max_requests"], r["sampling"]) == (row["max_requests"], row["sampling"])
            )
            speedup = base / row["bookkeeping_host_ms"]
            verdict = "meets" if speedup >= 2.0 else "misses"
            print(
                f"ext-graphed at {row['max_requests']} {row['sampling']} requests: {speedup:.2f}x "
                f"stock bookkeeping ({verdict} the 2x target); "
                f"{row.get('syncs_region', '?')} syncs in the graph-safe region"
            )
    print(
        "=== table: dynamic-inference bookkeeping per decode step (medians; bk = context "
        "initialisation + sampling bookkeeping, i.e. the step minus the forward and "
        "update_requests; syncs = device-to-host synchronisations per step; speedup = stock / "
        "variant bk host time)"
    )
    print(_table(report["rows"]))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
