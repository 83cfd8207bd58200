# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA serving kernels at the memory limit: megatron_ext's paged latent attention and fused key
RoPE + cache append against the copy ceiling, FlashInfer's MLA attention and megatron-core's
unfused path.

    python -m megatron_ext.bench mla-serving [--quick] [--out DIR]
        [--rows decode prefill rope_append] [--batch ...] [--context ...] [--heads ...]
        [--served-shapes] [--shape B C H ...]

On a GPU, in bf16, over megatron-core's paged latent cache ([blocks, 64, 512 + 64], one row per
token shared by the heads; pages shuffled so that no request's are contiguous):

* ``decode``: :func:`~megatron_ext.fusions.mla_latent.attention.mla_paged_latent_attention`
  for batch {1, 16, 64, 128, 256} x context {1k, 4k, 16k, 32k} x heads {16, 32, 64, 128}
  (``--quick``: batch {1, 64, 128} x context {4k, 32k} x heads {16, 128}); ``--served-shapes``
  and ``--shape B C H`` run those steps instead
  (:data:`~megatron_ext.bench.mla_serving_cases.SERVED_DECODE_SHAPES`: the batches and contexts
  each head count is served at). Bytes: the minimum a call must move, each attended cache row
  once plus the query and the output (:func:`~megatron_ext.bench.mla_serving_cases.step_bytes`);
  the kernel reads the rows once per tile of 16 heads, which the L2 may or may not absorb, so the
  share of the copy ceiling is that of the minimum.
* ``prefill``: prefill, chunked-prefill and mixed steps
  (:data:`~megatron_ext.bench.mla_serving_cases.PREFILL_CASES`: prefills of 2 x 1536 to 8k tokens,
  chunks of 1k-2k behind 2k-32k cached rows, 8 or 63 decodes beside a 512-token chunk;
  ``--quick``: three of them) at 16 and 128 heads, TFLOP/s of the attended (causal) pairs against
  a bf16 ``torch.matmul`` of 8192^3 measured in the same run. Ours in each form
  (:mod:`~megatron_ext.bench.mla_serving_forms`): the absorbed kernel; the MHA form
  (:func:`~megatron_ext.fusions.mla_latent.mha_form.mla_paged_mha_attention`, decompression
  included, with the backend the dynamic path picks); the cost model's split where it mixes the
  two; the cost model's pick against FlashInfer and against the absorbed form.
* ``rope_append``: megatron_ext's ``fused_mla_rope_cache_append``
  (:mod:`megatron_ext.fusions.mla_latent.rope_cache_append`) against megatron-core's path as its
  ``MLASelfAttention`` runs it: its own ``DynamicInferenceContext.apply_rotary_emb_key`` (yarn
  frequencies from its ``YarnRotaryEmbedding``, decode-only branch up to 256 tokens),
  ``torch.cat`` and ``append_key_value_cache`` (indexed assignment), called unbound on the
  tensors they read; 1 to 4096 tokens; the written rows compared bitwise.
* FlashInfer's ``BatchMLAPagedAttentionWrapper`` on copies of the same cache contents (its run
  takes the 512 and 64 parts apart), planned outside the timing, output compared with ours,
  where ``import flashinfer`` works; otherwise each row says so and the verdicts say the peer
  was not measured.

Each call: GPU time (a CUDA graph of N calls, / N: the median of its replays, each behind an L2
flush, in rounds in which a row's contenders take turns, the first rotating), eager
time (100 calls back to back and a sync, per call) and host time (the same without the sync),
the eager and host figures the median of rounds that alternate the contenders. The copy ceiling
(a large ``copy_``, read + write) is measured in the same run. Printed last: a table per section,
the verdicts against the project's targets (decode >= 80% of the ceiling at context >= 4k and batch
>= 16, and at least FlashInfer's speed there; RoPE+append >= 85% of the ceiling from 1024 tokens
and >= 3x megatron-core at 1-256 tokens; prefill and chunked prefill of >= 2k tokens in the cost
model's form >= 1.3x FlashInfer's speed, mixed steps at least its speed, the pick never slower
than the absorbed form; no eager row behind FlashInfer by more than its launch cost, a prefill
row in the cost model's form) with the worst rows named. The MHA form sizes its tensors from host
lengths, so it runs only in the steps megatron-core does not capture: its GPU time is taken with
its calls queued behind a GPU sleep (the host ahead, as in an engine step), its eager time per
call beside it. Writes ``mla_serving.json`` and ``mla_serving.png`` (where matplotlib is
installed) to ``--out``. A row that fails is reported (traceback, ``failed_rows``) and the others
still run; the exit status is then 1.

Without a GPU it says so and checks the two kernels in the Triton interpreter instead (fp32):
the attention against a float64 reference on a small decode and a small mixed step, the fused
append bitwise against megatron-core's unfused path.
"""

import argparse
import functools
import json
import math
import os
import platform
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from megatron_ext.bench import mla_serving_cases as cases
from megatron_ext.bench import mla_serving_forms as forms_lib
from megatron_ext.bench.mla_serving_report import pct_of_ceiling, plot_decode, tables, verdicts
from megatron_ext.bench.rope import _copy_ceiling, _do_bench_us, interleaved_host_us
from megatron_ext.fusions.mla_latent import mha_form
from megatron_ext.transformer import mla_prefill
from megatron_ext.transformer.mla_prefill import backend_for

__all__ = ["main", "parse_args"]

SECTIONS = ("decode", "prefill", "rope_append")
# A CUDA graph holds at least this many calls, and one call per input copy.
MIN_GRAPH_CALLS = 10
# Where one call's inputs are smaller, calls rotate over copies of them that together exceed this
# (about five times the H200's L2), at most MAX_COPIES.
ROTATE_BYTES = 256 << 20
MAX_COPIES = 64
HOST_ROUNDS = 5
QUICK_HOST_ROUNDS = 3
# Where the timed rows run (the tests run the same code on the CPU, in fp32, with fake timings).
DEVICE = "cuda"
DTYPE = torch.bfloat16
# The MHA form's timed contenders (eager only: the form sizes its tensors from host lengths).
FORM_CONTENDERS = ("mha", "split", "serial")
# The MHA form's backend, None for the dynamic path's own choice (the tests set "torch").
MHA_BACKEND: Optional[str] = None


def _sync() -> None:
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.synchronize()


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    """The benchmark's command line.

    Args:
        argv: the arguments (None: sys.argv).

    Returns:
        argparse.Namespace: ``out``, ``quick``, ``rows``, ``batch``, ``context``, ``heads``,
        ``cases``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.bench mla-serving",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=None, help="directory for mla_serving.json and the plot")
    parser.add_argument(
        "--quick", action="store_true", help="fewer decode rows and rounds (about a minute)"
    )
    parser.add_argument(
        "--rows",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="which sections to run (default: all three)",
    )
    parser.add_argument("--batch", nargs="+", type=int, help="decode batches (overrides the grid)")
    parser.add_argument(
        "--context", nargs="+", type=int, help="decode contexts in tokens (overrides the grid)"
    )
    parser.add_argument("--heads", nargs="+", type=int, help="decode and prefill head counts")
    parser.add_argument(
        "--cases",
        nargs="+",
        metavar="WORDS",
        help="only the prefill cases whose name holds one of these (e.g. 'mixed' 'chunk 1k')",
    )
    parser.add_argument(
        "--served-shapes",
        action="store_true",
        help="decode rows at the batches and contexts each head count is served at, not the grid",
    )
    parser.add_argument(
        "--shape",
        nargs=3,
        type=int,
        action="append",
        metavar=("B", "C", "H"),
        help="a decode row of batch B, context C, H heads (repeatable; replaces the grid)",
    )
    args = parser.parse_args(argv)
    for name in ("batch", "context", "heads"):
        values = getattr(args, name)
        if values is not None and min(values) < 1:
            parser.error(f"--{name} values must be >= 1, got {values}")
    for shape in args.shape or ():
        if min(shape) < 1:
            parser.error(f"--shape values must be >= 1, got {shape}")
    for words in args.cases or ():
        if not any(words in case for case in cases.PREFILL_CASES):
            parser.error(f"--cases {words!r} names no prefill case: {list(cases.PREFILL_CASES)}")
    grid = [name for name in ("batch", "context") if getattr(args, name) is not None]
    if grid and (args.shape or args.served_shapes):
        parser.error(f"--{grid[0]} sets the grid; --shape and --served-shapes replace it")
    return args


def decode_grid(args: argparse.Namespace) -> List[Tuple[int, int, int]]:
    """(batch, context, heads) of the decode rows, in the order they run: the ``--shape`` rows
    and the served shapes (those of ``--heads`` where given) where asked for, else the grid."""
    shapes = [tuple(shape) for shape in args.shape or ()]
    if args.served_shapes:
        shapes += [s for s in cases.SERVED_DECODE_SHAPES if not args.heads or s[2] in args.heads]
    if shapes:
        return shapes
    batches = args.batch or (cases.QUICK_DECODE_BATCHES if args.quick else cases.DECODE_BATCHES)
    contexts = args.context or (
        cases.QUICK_DECODE_CONTEXTS if args.quick else cases.DECODE_CONTEXTS
    )
    heads = args.heads or (cases.QUICK_DECODE_HEADS if args.quick else cases.DECODE_HEADS)
    return [(b, c, h) for h in heads for b in batches for c in contexts]


def copies_for(nbytes: int) -> int:
    """How many copies of one call's inputs to rotate over (1 when one call exceeds the L2)."""
    return max(1, min(MAX_COPIES, math.ceil(ROTATE_BYTES / max(nbytes, 1))))


def graph_us(
    call: Callable[..., Any], sets: Sequence[tuple], quick: bool, graph: bool = True
) -> Dict[str, Any]:
    """GPU us per call: do_bench of a CUDA graph of ``max(MIN_GRAPH_CALLS, len(sets))`` calls,
    call ``i`` on ``sets[i % len(sets)]``, divided by the number of calls. Where ``graph`` is
    False (a call that only runs eagerly, as the MHA form, which sizes its tensors from host
    lengths) the same calls are queued behind a GPU sleep and timed there (:func:`queued_us`).
    Should the capture fail, or the host not get ahead of the sleep (a call that synchronises),
    they are timed eagerly. The method says which.

    Args:
        call: the call, taking one set's tensors.
        sets: the input sets (already warmed up: the first call of a shape compiles).
        quick: fewer do_bench repetitions.
        graph: capture the calls in a CUDA graph.

    Returns:
        Dict[str, Any]: ``gpu_us``, ``gpu_method`` ("graph", or the eager method and why).
    """
    run_all, calls = _calls_of(call, sets)
    torch.cuda.synchronize()
    if not graph:
        try:
            us = queued_us(lambda i: call(*sets[i % len(sets)]), calls, quick)
            return {"gpu_us": us, "gpu_method": QUEUED_METHOD}
        except RuntimeError as error:  # the host could not get ahead: time eagerly, say so
            torch.cuda.synchronize()
            return _eager_us(run_all, calls, quick, str(error))
    cuda_graph, failed = _capture(run_all)
    if cuda_graph is None:  # a capture that failed: time eagerly instead, say so
        return _eager_us(run_all, calls, quick, f"CUDA-graph capture failed: {failed}")
    us = _do_bench_us(cuda_graph.replay, quick) / calls
    del cuda_graph
    return {"gpu_us": us, "gpu_method": "graph"}


def _calls_of(call: Callable[..., Any], sets: Sequence[tuple]) -> Tuple[Callable[[], None], int]:
    """(a function making ``max(MIN_GRAPH_CALLS, len(sets))`` calls, call ``i`` on
    ``sets[i % len(sets)]``; that number of calls)."""
    calls = max(MIN_GRAPH_CALLS, len(sets))

    def run_all() -> None:
        for i in range(calls):
            call(*sets[i % len(sets)])

    return run_all, calls


def _eager_us(run_all: Callable[[], None], calls: int, quick: bool, why: str) -> Dict[str, Any]:
    """``run_all``'s calls timed eagerly by do_bench, per call, and why they were."""
    method = f"eager do_bench ({why})"
    return {"gpu_us": _do_bench_us(run_all, quick) / calls, "gpu_method": method[:300]}


def _capture(run_all: Callable[[], None]) -> Tuple[Optional[Any], str]:
    """(a CUDA graph of ``run_all``, "") or (None, why the capture failed)."""
    try:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            run_all()
    except Exception as error:
        torch.cuda.synchronize()
        return None, f"{type(error).__name__}: {error}"
    return cuda_graph, ""


# Rounds of turns in :func:`interleaved_graph_us`, and the GPU time each turn takes at least.
TURN_ROUNDS = 15
QUICK_TURN_ROUNDS = 6
TURN_US = 2000.0


def interleaved_graph_us(
    contenders: Dict[str, Tuple[Callable[..., Any], Sequence[tuple]]],
    quick: bool,
    eager_only: Sequence[str] = (),
) -> Dict[str, Dict[str, Any]]:
    """GPU us per call of each contender, their CUDA graphs replayed in turns.

    A compute-bound kernel's time depends on where it runs among the others: timed alone first in
    a row (after the row's set-up left the GPU idle) a 128-head decode took 5-7% less time on an
    H100 than timed last, which is as large as the gaps being measured. So each contender's graph
    (as :func:`graph_us` captures it) is replayed in rounds in which the contenders take turns,
    the first rotating, each replay behind an L2 flush as ``do_bench``'s are, and its time is the
    median of its replays. Contenders in ``eager_only`` are timed alone by :func:`graph_us`, and
    any whose capture fails eagerly, as it would; the method says which.

    Args:
        contenders: name -> (the call, its input sets, already warmed up).
        quick: fewer rounds.
        eager_only: contenders not captured in a CUDA graph.

    Returns:
        Dict[str, Dict[str, Any]]: name -> ``gpu_us``, ``gpu_method``, in ``contenders``' order.
    """
    out: Dict[str, Dict[str, Any]] = {}
    graphs: Dict[str, Tuple[Any, int]] = {}
    torch.cuda.synchronize()
    for name, (call, sets) in contenders.items():
        if name in eager_only:
            out[name] = graph_us(call, sets, quick, graph=False)
            continue
        run_all, calls = _calls_of(call, sets)
        cuda_graph, failed = _capture(run_all)
        if cuda_graph is None:
            out[name] = _eager_us(run_all, calls, quick, f"CUDA-graph capture failed: {failed}")
        else:
            graphs[name] = (cuda_graph, calls)
    if graphs:
        replays = _replays_in_turns(
            {name: g.replay for name, (g, _) in graphs.items()},
            QUICK_TURN_ROUNDS if quick else TURN_ROUNDS,
        )
        for name, (_, calls) in graphs.items():
            out[name] = {"gpu_us": replays[name] / calls, "gpu_method": "graph"}
    return {name: out[name] for name in contenders}


def _replays_in_turns(replays: Dict[str, Callable[[], None]], rounds: int) -> Dict[str, float]:
    """Median us of each replay over ``rounds`` rounds of turns (the first rotating), each turn
    at least :data:`TURN_US` of one contender's replays."""
    flush = torch.empty(ROTATE_BYTES // 4, dtype=torch.int32, device="cuda")
    reps = {}
    for name, replay in replays.items():  # warm up, and size each turn
        begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        replay()
        begin.record()
        replay()
        end.record()
        torch.cuda.synchronize()
        reps[name] = max(1, min(100, math.ceil(TURN_US / max(begin.elapsed_time(end) * 1e3, 1.0))))
    names = list(replays)
    samples: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        first = r % len(names)
        events = []
        for name in names[first:] + names[:first]:
            for _ in range(reps[name]):
                flush.zero_()
                begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                begin.record()
                replays[name]()
                end.record()
                events.append((name, begin, end))
        torch.cuda.synchronize()
        for name, begin, end in events:
            samples[name].append(begin.elapsed_time(end) * 1e3)
    return {name: float(np.median(times)) for name, times in samples.items()}


QUEUED_METHOD = "queued behind a GPU sleep (the host ahead, as in an engine step)"


def queued_us(call: Callable[[int], None], calls: int, quick: bool) -> float:
    """GPU us per call with the host ahead of the GPU: a round of calls is queued behind a GPU
    sleep long enough for the host to issue them, and timed between events around them (the
    median of the rounds). This is a call's GPU time where it cannot be captured in a CUDA graph
    (the MHA form runs in eager steps), as in an engine step whose other GPU work lets the host
    run ahead; its eager time (host-bound where the host is slower) is reported beside it.

    A round holds ``calls`` calls, or fewer: the host blocks once the GPU's launch queue is full
    (about a thousand pending launches), so a round of calls of many launches is halved until
    the host issues it all behind the sleep.

    Args:
        call: call ``i`` of a round (warmed up: plans built, kernels compiled).
        calls: calls in a full round.
        quick: fewer rounds.

    Returns:
        float: GPU us per call.

    Raises:
        RuntimeError: where the host could not get ahead of one call even behind a sleep 16
            times its measured time (a call that waits for the GPU).
    """
    start = time.perf_counter()
    for i in range(calls):
        call(i)
    torch.cuda.synchronize()
    per_call = (time.perf_counter() - start) / calls
    n, stretch = calls, 1
    times = []
    while len(times) < (5 if quick else 15):
        # Twice the host's time at 2 GHz, or more (a slower clock sleeps longer).
        cycles = stretch * (int(2 * n * per_call * 2e9) + 1_000_000)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)
        begin.record()
        for i in range(n):
            call(i)
        end.record()
        ahead = not begin.query()  # still asleep when the host was done
        torch.cuda.synchronize()
        if ahead:
            times.append(begin.elapsed_time(end) * 1e3 / n)
        elif n > 1:
            n //= 2
        elif stretch < 16:
            stretch *= 2
        else:
            raise RuntimeError(
                "queued timing failed: the host did not get ahead of the GPU behind a sleep"
            )
    return float(np.median(times))


def _free() -> None:
    """Give the last row's caches back before the next row allocates its own."""
    if torch.device(DEVICE).type == "cuda":
        torch.cuda.empty_cache()


def _host_rounds(quick: bool) -> int:
    return QUICK_HOST_ROUNDS if quick else HOST_ROUNDS


def _timed(
    contenders: Dict[str, Tuple[Callable[..., Any], Sequence[tuple]]],
    quick: bool,
    eager_only: Sequence[str] = (),
) -> Dict[str, Dict[str, Any]]:
    """GPU, eager and host time of each contender (call, input sets); those in ``eager_only``
    are not captured in a CUDA graph."""
    out = interleaved_graph_us(contenders, quick, eager_only)
    first = {name: (lambda c=call, s=sets[0]: c(*s)) for name, (call, sets) in contenders.items()}
    host = interleaved_host_us(first, _host_rounds(quick), _sync)
    for name, times in host.items():
        out[name].update(host_us=times["host_us"], eager_us=times["eager_us"])
    return out


def _attention_sets(step: cases.PagedStep, nbytes: int) -> List[tuple]:
    """(cache, query, out) input sets of one step: the step's own and copies."""
    sets = [(step.kv_cache, step.query, torch.empty_like(step.query[..., : step.latent]))]
    for _ in range(copies_for(nbytes) - 1):
        sets.append((step.kv_cache.clone(), step.query.clone(), torch.empty_like(sets[0][2])))
    return sets


_FLASHINFER_PLANNED: List[bool] = []


def _flashinfer_row(
    step: cases.PagedStep, heads: int, sets: List[tuple], ours_out: torch.Tensor, quick: bool
) -> Tuple[Dict[str, Any], Optional[Tuple[Callable[..., Any], List[tuple]]]]:
    """FlashInfer planned on the step: (what the row reports, the contender to time or None)."""
    if not _FLASHINFER_PLANNED:
        # Its first plan compiles its MLA module with nvcc unless a prebuilt one is installed.
        print("    FlashInfer: first plan (may JIT-compile for minutes)", flush=True)
        _FLASHINFER_PLANNED.append(True)
    try:
        peer = cases.FlashInferMLA(step, heads, cases.SOFTMAX_SCALE, step.max_query_len > 1)
        fi_sets = [peer.inputs(cache, query) for cache, query, _ in sets]
        peer.run(*fi_sets[0])
        _sync()
    except Exception as error:  # reported in the row: the benchmark goes on without the peer
        return {"error": f"failed: {type(error).__name__}: {error}"[:300]}, None
    diff = (fi_sets[0][-1].float() - ours_out.float()).abs().max().item()
    return {"max_abs_diff": diff}, (peer.run, fi_sets)


def _gluon_contenders(
    step: cases.PagedStep, sets: List[tuple]
) -> Tuple[Dict[str, Any], Dict[str, Tuple[Callable[..., Any], List[tuple]]]]:
    """The warp-specialized decode kernel and stage 1 on the step, each through its own plan
    (whichever the public entry takes, "ours" above): what the row reports, and the contenders
    to time (none where the Gluon kernel does not take the step: the report says why)."""
    from megatron_ext.fusions.mla_latent import gluon_decode_refusal

    refusal = gluon_decode_refusal(
        step.query, step.kv_cache, step.latent, step.max_query_len, enabled=True
    )
    if refusal is not None:
        return {"refused": refusal}, {}
    contenders, outs, splits = {}, {}, {}
    for kernel in ("stage1", "gluon"):
        call, splits[kernel] = cases.planned_attention(step, sets[0][2], kernel)
        outs[kernel] = torch.empty_like(sets[0][2])
        # Compiles outside any capture; the step's own set last, the outputs compared.
        for cache, query, _ in reversed(sets[:2]):
            call(cache, query, outs[kernel])
        contenders[kernel] = (call, sets)
    _sync()
    diff = (outs["gluon"].float() - outs["stage1"].float()).abs().max().item()
    return {"splits": splits["gluon"], "max_abs_diff_vs_stage1": diff}, contenders


def attention_row(
    requests: List[Tuple[int, int]],
    heads: int,
    quick: bool,
    flashinfer: bool,
    forms: bool = False,
    gluon: bool = False,
) -> Dict[str, Any]:
    """Time one attention step: ours, and FlashInfer's where ``flashinfer``; with ``forms``,
    ours in the MHA form too (:func:`_mha_contenders`); with ``gluon``, the warp-specialized
    decode kernel and stage 1 beside ours (whatever the switch says: the benchmark is what
    decides it)."""

    step = cases.build_step(
        requests, heads, dtype=DTYPE, device=DEVICE, seed=len(requests) * 131 + heads
    )
    mha = forms_lib.mha_step(step, heads, seed=heads, backend=mha_backend()) if forms else None
    nbytes = cases.step_bytes(requests, heads)
    sets = _attention_sets(step, nbytes["minimum"])

    ours = functools.partial(cases.paged_attention, step)
    for s in sets[:2]:  # the first call of a shape compiles: never inside a capture
        ours(*s)
    _sync()
    contenders = {"ours": (ours, sets)}
    fi_report: Any = "not installed"
    if flashinfer:
        fi_report, contender = _flashinfer_row(step, heads, sets, sets[0][2], quick)
        if contender is not None:
            contenders["flashinfer"] = contender
    forms_report: Dict[str, Any] = {}
    if mha is not None:
        forms_report, extra = _mha_contenders(step, mha, heads, sets)
        contenders.update(extra)
    gluon_report: Dict[str, Any] = {}
    if gluon:
        gluon_report, extra = _gluon_contenders(step, sets)
        contenders.update(extra)
    times = _timed(contenders, quick, eager_only=FORM_CONTENDERS)
    if "flashinfer" in times:
        fi_report.update(times["flashinfer"])
    row = {"heads": heads, "bytes": nbytes, "ours": times["ours"], "flashinfer": fi_report}
    if gluon:
        row["gluon"] = {**gluon_report, **times.get("gluon", {})}
        if "stage1" in times:
            row["stage1"] = times["stage1"]
    if mha is not None:
        for name in FORM_CONTENDERS:
            if name in times:
                forms_report[name].update(times[name])
        row["forms"] = forms_report
    return row


def mha_backend() -> Optional[str]:
    """The MHA form's backend where the rows run: the dynamic path's own choice
    (:func:`~megatron_ext.transformer.mla_prefill.backend_for`), or :data:`MHA_BACKEND`."""
    if MHA_BACKEND is not None:
        return MHA_BACKEND
    head_dim = mha_form.flash_head_dim(forms_lib.QK_HEAD + cases.ROPE, forms_lib.V_HEAD)
    return backend_for(torch.device(DEVICE), DTYPE, head_dim=head_dim)


def _mha_contenders(
    step: cases.PagedStep, mha: "forms_lib.MhaStep", heads: int, sets: List[tuple]
) -> Tuple[Dict[str, Any], Dict[str, Tuple[Callable[..., Any], List[tuple]]]]:
    """The MHA-form contenders of a step (what the row reports, the contenders to time):
    ``mha``, every request in the MHA form; ``split``, the cost model's split where it mixes
    the forms (the leading requests absorbed), else the leading decodes absorbed where the step
    has some; ``serial``, the split (else ``mha`` where its calls overlap) with everything in
    order on one stream. Each
    output is compared with ours (run on ``sets[0]`` already) through W_UV, relative to its
    largest value."""
    backend = mha_backend()
    report: Dict[str, Any] = {
        "backend": backend,
        "model_split": mha.split,
        "requests": mha.requests,
        "overlap_calls": mla_prefill.OVERLAP_CALLS,
    }
    if backend is None:
        report["error"] = "no MHA-form backend runs here (cuDNN attention or Transformer Engine)"
        return report, {}
    splits = {"mha": 0}
    # The cost model's split where it mixes the forms; else, where the step leads with
    # decodes, the decodes absorbed and the rest in the MHA form (timed beside the model's pick).
    decodes = int(np.argmax(mha.query_lengths != 1)) if (mha.query_lengths != 1).any() else 0
    split_at = mha.split if 0 < mha.split < mha.requests else decodes
    if 0 < split_at < mha.requests:
        # The split as the dynamic path runs it (the parts on two streams).
        splits["split"] = split_at
    if "split" in splits or mla_prefill.OVERLAP_CALLS:
        # The split (else the MHA form alone) with its parts and the MHA form's calls in order;
        # elsewhere that is ``mha`` itself, not timed twice.
        splits["serial"] = splits.get("split", 0)
    reference = mha.value_projection(sets[0][2])
    form_sets = [(cache, query, mha.query, out) for cache, query, out in sets[:1]]
    form_sets += [(cache, query, mha.query.clone(), out) for cache, query, out in sets[1:]]
    contenders = {}
    for name, split in splits.items():
        call = functools.partial(
            forms_lib.run_split, step, mha, backend, split, overlap=name != "serial"
        )
        entry: Dict[str, Any] = {"split": split, "backend": backend}
        try:
            out = call(*form_sets[0])
            call(*form_sets[min(1, len(form_sets) - 1)])  # cuDNN plans the shape on first use
            _sync()
        except Exception as error:  # reported in the row: the others still run
            entry["error"] = f"failed: {type(error).__name__}: {error}"[:300]
        else:
            # The MHA part's tokens: those after this contender's split (not the model's).
            expected = reference[int(mha.query_lengths[:split].sum()) :]
            scale = float(expected.abs().max()) or 1.0
            entry["max_rel_diff"] = float((out.float() - expected).abs().max()) / scale
            entry["flops"] = forms_lib.mha_flops(mha, heads, step.latent, step.rope, split)
            contenders[name] = (call, form_sets)
        report[name] = entry
    return report, contenders


def decode_row(
    batch: int, context: int, heads: int, ceiling: Dict[str, float], quick: bool, flashinfer: bool
) -> Dict[str, Any]:
    """One decode row: ``batch`` requests of ``context`` rows each."""
    from megatron_ext.fusions.mla_latent import default_num_kv_splits, tile_shape

    row = attention_row(cases.decode_requests(batch, context), heads, quick, flashinfer, gluon=True)
    blocks = -(-context // cases.BLOCK_SIZE)
    warps = tile_shape(batch, heads, cases.LATENT, 1, DTYPE == torch.float32).num_warps
    splits = default_num_kv_splits(
        batch,
        row["bytes"]["head_tiles"],
        blocks * cases.BLOCK_SIZE,
        torch.device(DEVICE),
        num_warps=warps,
    )
    row.update(section="decode", batch=batch, context=context, splits=splits)
    row["ours_pct_ceiling"] = pct_of_ceiling(
        row["bytes"]["minimum"], row["ours"]["gpu_us"], ceiling["tb_per_s"]
    )
    return row


def prefill_row(
    case: str,
    requests: List[Tuple[int, int]],
    heads: int,
    peak: Dict[str, float],
    quick: bool,
    flashinfer: bool,
) -> Dict[str, Any]:
    """One chunked-prefill or mixed row, ours in both forms (:func:`chosen_form`)."""
    row = attention_row(requests, heads, quick, flashinfer, forms=True)
    flops = cases.step_flops(requests, heads)
    tflops = flops / row["ours"]["gpu_us"] / 1e6
    row.update(
        section="prefill",
        case=case,
        requests=[list(r) for r in requests],
        tokens=sum(new for _, new in requests),
        flops=flops,
        ours_tflops=tflops,
        ours_pct_peak=100 * tflops / peak["tflops"],
    )
    for name in FORM_CONTENDERS:
        entry = row["forms"].get(name)
        if isinstance(entry, dict) and "gpu_us" in entry:
            entry["tflops"] = entry["flops"] / entry["gpu_us"] / 1e6
    row["forms"]["chosen"] = chosen_form(row["forms"])
    return row


def chosen_form(forms: Dict[str, Any]) -> str:
    """The contender that is the dynamic path's cost-model choice for the step (with
    ``MEGATRON_EXT_MLA_MHA_FORM=auto``): ``ours`` (absorbed), ``mha`` or ``split``."""
    if forms.get("backend") is None or forms["model_split"] == forms["requests"]:
        return "ours"
    return "mha" if forms["model_split"] == 0 else "split"


def append_row(tokens: int, ceiling: Dict[str, float], quick: bool) -> Dict[str, Any]:
    """Time one step's key RoPE + append: megatron-core's path and ours."""
    step = cases.build_append(tokens, dtype=DTYPE, device=DEVICE, seed=tokens)
    nbytes = cases.append_bytes(tokens, index_bytes=step.positions.element_size())
    sets = [(step.kv_latent, step.k_pos_emb)]
    sets += [
        (step.kv_latent.clone(), step.k_pos_emb.clone()) for _ in range(copies_for(nbytes) - 1)
    ]
    # The rows each path writes, from the same cache and inputs, before any timing (outside
    # decode-only steps megatron-core rotates its input in place).
    theirs_buffer, ours_buffer = step.memory_buffer.clone(), step.memory_buffer.clone()
    cases.megatron_core_append(step, sets[0][0], sets[0][1].clone(), theirs_buffer)
    cases.fused_append(step, *sets[0], ours_buffer)
    bits_equal = torch.equal(theirs_buffer.view(torch.uint8), ours_buffer.view(torch.uint8))
    # The copy ceiling at this size: a copy moving the same bytes (half read, half written), timed
    # the same way; at a few MB a single kernel's latency, not bandwidth, bounds it.
    half = max(1, nbytes // 2)
    copies = [
        tuple(torch.empty(half, dtype=torch.uint8, device=DEVICE) for _ in range(2))
        for _ in range(len(sets))
    ]
    contenders = {
        "mcore": (functools.partial(cases.megatron_core_append, step), sets),
        "ours": (functools.partial(cases.fused_append, step), sets),
        "copy": (_copy_into, copies),
    }
    times = _timed(contenders, quick)
    mc, ours = times["mcore"], times["ours"]
    return {
        "section": "rope_append",
        "tokens": tokens,
        "decode_only": step.decode_only,
        "bytes": nbytes,
        "mcore": mc,
        "ours": ours,
        "gpu_speedup": mc["gpu_us"] / ours["gpu_us"],
        "eager_speedup": mc["eager_us"] / ours["eager_us"],
        "ours_pct_ceiling": pct_of_ceiling(nbytes, ours["gpu_us"], ceiling["tb_per_s"]),
        "mcore_pct_ceiling": pct_of_ceiling(nbytes, mc["gpu_us"], ceiling["tb_per_s"]),
        "copy": times["copy"],
        "copy_pct_ceiling": pct_of_ceiling(nbytes, times["copy"]["gpu_us"], ceiling["tb_per_s"]),
        "bits_equal": bits_equal,
    }


def _copy_into(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


def _progress(row: Dict[str, Any]) -> str:
    """One row's line as it finishes: ours, and beside it every contender timed in the row (a run
    cut short still shows each finished row's comparison, not only the last table)."""
    ours = row["ours"]["gpu_us"]
    if row["section"] == "rope_append":
        return f"ours {ours:.2f} us, megatron-core {row['mcore']['gpu_us']:.2f} us"
    if row["section"] == "decode":
        line = f"ours {ours:.1f} us, {row['ours_pct_ceiling']:.1f}% of the copy ceiling"
    else:
        line = f"ours {ours:.1f} us, {row['ours_tflops']:.1f} TFLOP/s"
    gluon = row.get("gluon")
    if isinstance(gluon, dict) and "gpu_us" in gluon:
        line += f"; Gluon {gluon['gpu_us']:.1f} us"
    peer = row.get("flashinfer")
    if isinstance(peer, dict) and "gpu_us" in peer:
        line += (
            f"; FlashInfer {peer['gpu_us']:.1f} us (ours / FlashInfer {ours / peer['gpu_us']:.2f}x)"
        )
    elif isinstance(peer, dict) and "error" in peer:
        line += f"; FlashInfer {peer['error'][:80]}"
    for name in FORM_CONTENDERS:
        entry = row.get("forms", {}).get(name)
        if isinstance(entry, dict) and "gpu_us" in entry:
            line += f"; {name} form {entry['gpu_us']:.1f} us"
    return line


def row_jobs(
    args: argparse.Namespace,
    ceiling: Dict[str, float],
    peak: Dict[str, float],
    flashinfer: bool,
) -> List[Tuple[str, Callable[[], Dict[str, Any]]]]:
    """(label, the function that measures it) of every row of the sections asked for."""
    jobs: List[Tuple[str, Callable[[], Dict[str, Any]]]] = []
    quick = args.quick
    if "decode" in args.rows:
        for b, c, h in decode_grid(args):
            label = f"decode: batch {b}, context {c}, {h} heads"
            jobs.append((label, functools.partial(decode_row, b, c, h, ceiling, quick, flashinfer)))
    if "prefill" in args.rows:
        for case, requests in cases.PREFILL_CASES.items():
            if quick and case not in cases.QUICK_PREFILL_CASES:
                continue
            if args.cases and not any(words in case for words in args.cases):
                continue
            for h in args.heads or cases.PREFILL_HEADS:
                make = functools.partial(prefill_row, case, requests, h, peak, quick, flashinfer)
                jobs.append((f"prefill: {case}, {h} heads", make))
    if "rope_append" in args.rows:
        for tokens in cases.APPEND_TOKENS:
            make = functools.partial(append_row, tokens, ceiling, quick)
            jobs.append((f"rope_append: {tokens} tokens", make))
    return jobs


def run_rows(
    jobs: List[Tuple[str, Callable[[], Dict[str, Any]]]], failed: List[Dict[str, str]]
) -> List[Dict[str, Any]]:
    """Measure each row in turn, printing progress; a row that raises is recorded in ``failed``
    (with its traceback printed) and the others still run. Each row's tensors are freed before
    the next row allocates its own."""
    rows = []
    for i, (label, make) in enumerate(jobs):
        print(f"[{i + 1}/{len(jobs)}] {label}", flush=True)
        try:
            row = make()
        except Exception as error:  # reported in the tables and the exit status
            traceback.print_exc(file=sys.stdout)
            failed.append({"row": label, "error": f"{type(error).__name__}: {error}"[:500]})
            print(f"    FAILED: {failed[-1]['error']}", flush=True)
        else:
            print(f"    {_progress(row)}", flush=True)
            rows.append(row)
        _free()
    return rows


def matmul_peak(quick: bool) -> Dict[str, float]:
    """Dense bf16 TFLOP/s of a torch.matmul of 8192^3."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = _do_bench_us(lambda: torch.matmul(a, b), quick)
    return {"n": n, "us": us, "tflops": 2 * n**3 / us / 1e6}


def _versions() -> Dict[str, str]:
    import triton

    from megatron_ext import MEGATRON_CORE_VERSION

    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "megatron_core": str(MEGATRON_CORE_VERSION),
        "python": platform.python_version(),
    }


def bench_gpu(args: argparse.Namespace) -> int:
    """Run the sections asked for, print the tables last, write the JSON and the plot."""
    available, fi_version = cases.flashinfer_available()
    flashinfer = f"flashinfer {fi_version}" if available else f"not installed ({fi_version})"
    print(f"FlashInfer: {flashinfer}", flush=True)
    ceiling = _copy_ceiling(args.quick)
    print(f"copy ceiling: {ceiling['tb_per_s']:.3f} TB/s", flush=True)
    peak = matmul_peak(args.quick)
    print(f"bf16 matmul peak: {peak['tflops']:.0f} TFLOP/s", flush=True)
    failed: List[Dict[str, str]] = []
    rows = run_rows(row_jobs(args, ceiling, peak, available), failed)
    result: Dict[str, Any] = {
        "benchmark": "mla_serving",
        **_versions(),
        "dtype": "bf16",
        "block_size": cases.BLOCK_SIZE,
        "flashinfer": flashinfer,
        "copy_ceiling": ceiling,
        "matmul_peak": peak,
        "quick": args.quick,
        "rows": rows,
        "failed_rows": failed,
    }
    result["verdicts"] = verdicts(result)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "mla_serving.json"), "w") as f:
            json.dump(result, f, indent=2)
        try:
            plotted = plot_decode(result, os.path.join(args.out, "mla_serving.png"))
        except Exception as error:  # the tables matter more than the plot
            print(f"no plot: {type(error).__name__}: {error}")
        else:
            if plotted is None and any(r["section"] == "decode" for r in rows):
                print("no plot: matplotlib is not installed")
    print(tables(result))
    return 1 if failed else 0


def check_interpreted() -> int:
    """No GPU: both kernels in the Triton interpreter (fp32) on small shapes.

    Returns:
        int: 0 if both agree with their references.
    """
    failures = 0
    small = dict(latent=32, rope=16, block_size=16, dtype=torch.float32, device="cpu")
    steps = {
        "decode": [(40, 1), (16, 1), (69, 1)],
        "mixed (chunked prefill + decode)": [(20, 12), (33, 1)],
    }
    for name, requests in steps.items():
        step = cases.build_step(requests, 4, seed=7, **small)
        out = torch.empty_like(step.query[..., : step.latent])
        cases.paged_attention(step, step.kv_cache, step.query, out)
        err = (out.double() - cases.attention_reference(step, cases.SOFTMAX_SCALE)).abs().max()
        ok = err.item() <= 1e-5
        failures += not ok
        print(
            f"interpreter fp32, attention, {name} step (4 heads, latent 32 + rope 16, shuffled "
            f"pages of 16): max |ours - float64 reference| = {err.item():.2e} "
            f"({'within' if ok else 'MISMATCH: beyond'} 1e-5)"
        )
    step = cases.build_append(
        12, latent=32, rope=16, positions=64, block_size=16, dtype=torch.float32, device="cpu"
    )
    theirs, ours = step.memory_buffer.clone(), step.memory_buffer.clone()
    cases.megatron_core_append(step, step.kv_latent, step.k_pos_emb.clone(), theirs)
    cases.fused_append(step, step.kv_latent, step.k_pos_emb, ours)
    equal = torch.equal(theirs, ours)
    failures += not equal
    print(
        "interpreter fp32, key RoPE + append (12 tokens): megatron_ext's fused kernel vs "
        "megatron-core's apply_rotary_emb_key + torch.cat + indexed assignment: "
        + ("bitwise equal" if equal else "MISMATCH")
    )
    available, version = cases.flashinfer_available()
    print(
        "FlashInfer: "
        + (f"{version} importable; it needs a GPU" if available else f"not installed ({version})")
    )
    return 1 if failures else 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark (see the module docstring).

    Args:
        argv: command-line arguments (``--help``).

    Returns:
        int: 0 on success; 1 if the no-GPU check found a mismatch.
    """
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "No CUDA GPU: the MLA serving benchmark needs one, so no timings. Checking the paged "
            "latent attention and the fused RoPE + append in the Triton interpreter instead."
        )
        return check_interpreted()
    return bench_gpu(args)


if __name__ == "__main__":
    raise SystemExit(main())
