# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Where the host time of the MHA form's side-by-side calls goes, on a GPU.

    python scripts/profile_mha_overlap_host.py [--heads 16 128] [--cases "512 on 1024" ...]
        [--calls 200] [--top 15]

With its calls side by side (``overlap=True``) an eager MHA-form call took 55-80 us more host
time than in order on an H100 (the fork and join 10 of them), which is why
``MEGATRON_EXT_MLA_MHA_OVERLAP`` is off by default.
Per chunk step (one request of ``cached`` rows and ``new`` tokens, bf16, the bench's backend), this
times host and eager us per call, the calls interleaved, of:

* ``in order``: ``mla_paged_mha_attention(overlap=False)``;
* ``side by side``: ``overlap=True``;
* ``no hand-over``: the same with the side results' ``record_stream`` left out (measurement only:
  here every side result is read on the current stream before the next fork, so its memory is not
  reused early);
* ``fork/join``: :func:`~megatron_ext.fusions.side_stream.side_by_side` of two empty parts, the
  streams' own cost;
* ``fresh events``: the same fork and join as torch's ``wait_stream`` and stream context do it
  (a new event per edge), which ``side_by_side`` did before it kept its events (measurement
  only: what the kept events save);

and the parts of the in-order call, each alone on the step's own plan (``--parts``):

* ``checks+plan``: the call's checks and its kept plan and weights' lookups (no launch);
* ``decompress``: the rows' gather and the two decompression GEMMs;
* ``attend``: the plan's attention calls on the decompressed keys and values (the backend's
  entries, their views, copies and kept groups);
* ``cuDNN bare``: the backend's entry alone on the same tensors, once per call of the plan
  (torch's dense cuDNN op; the ``cudnn-dense`` backend only);
* ``merge``: the merge of the calls' partial results;

then profiles ``side by side`` and ``in order`` under ``cProfile`` (functions by own time). The
profiles' times are inflated by the profiler: compare their rows with each other. Prints the
tables last. Needs a CUDA GPU.
"""

import argparse
import contextlib
import os
import sys
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from megatron_ext import internals
from megatron_ext.bench import mla_serving_cases as cases
from megatron_ext.bench import mla_serving_forms as forms
from megatron_ext.bench.mla_serving import mha_backend
from megatron_ext.bench.rope import interleaved_host_us
from megatron_ext.fusions import side_stream
from megatron_ext.fusions.mla_latent.mha_form import (
    ROW_BUDGET,
    check_mha_call,
    decompressed_keys_values,
    flash_head_dim,
    mla_paged_mha_attention,
    varlen_attention,
)
from megatron_ext.fusions.mla_latent.mha_merge import merge_partials_into
from megatron_ext.fusions.mla_latent.mha_plan import mha_plan
from megatron_ext.fusions.mla_latent.mha_weights import cached_up_projections

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_latent_cache_host import profile  # noqa: E402

ROUNDS = 7
DEFAULT_CASES = ("512 on 1024", "1024 on 3072")


def parse_case(text: str) -> Tuple[int, int]:
    """``"NEW on CACHED"`` -> (cached, new)."""
    parts = text.split()
    if len(parts) != 3 or parts[1] != "on" or not parts[0].isdigit() or not parts[2].isdigit():
        raise argparse.ArgumentTypeError(f"expected 'NEW on CACHED', got {text!r}")
    return int(parts[2]), int(parts[0])


@contextlib.contextmanager
def no_hand_over() -> Iterator[None]:
    """Leave out the side results' ``record_stream`` for the block."""
    kept = side_stream._hand_over
    side_stream._hand_over = lambda value, stream: None
    try:
        yield
    finally:
        side_stream._hand_over = kept


def fresh_events_fork_join(device: torch.device) -> Callable[[], None]:
    """A fork and join of two empty parts on a side stream, a new event per edge."""
    side = torch.cuda.Stream(device)

    def call() -> None:
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            pass
        current.wait_stream(side)

    return call


def mha_attention(
    step: cases.PagedStep, mha: forms.MhaStep, backend: str, overlap: bool = False
) -> torch.Tensor:
    """The step's MHA-form call, as a user makes it."""
    return mla_paged_mha_attention(
        mha.query,
        step.kv_cache,
        step.block_table,
        mha.weight,
        cases.SOFTMAX_SCALE,
        query_lengths=mha.query_lengths,
        kv_lengths=mha.kv_lengths,
        rope_dim=step.rope,
        backend=backend,
        overlap=overlap,
    )


def variants(step: cases.PagedStep, mha: forms.MhaStep, backend: str) -> Dict[str, Callable]:
    """The timed calls of one step."""
    device = step.query.device

    def attention(overlap: bool) -> torch.Tensor:
        return mha_attention(step, mha, backend, overlap)

    def without_hand_over() -> torch.Tensor:
        with no_hand_over():
            return attention(True)

    return {
        "in order": lambda: attention(False),
        "side by side": lambda: attention(True),
        "no hand-over": without_hand_over,
        "fork/join": lambda: side_stream.side_by_side(lambda: None, lambda: None, device),
        "fresh events": fresh_events_fork_join(device),
    }


PARTS = ("checks+plan", "decompress", "attend", "cuDNN bare", "merge")


def parts(step: cases.PagedStep, mha: forms.MhaStep, backend: str) -> Dict[str, Callable]:
    """The in-order call's parts, each alone (a chunk step: one chunk, its calls merged).

    Args:
        step: a chunk step of one request.
        mha: its MHA-form operands.
        backend: the MHA form's backend.

    Returns:
        Dict[str, Callable]: name (:data:`PARTS`; ``cuDNN bare`` only on the ``cudnn-dense``
        backend) -> the part. The first ``merge`` leaves the call's result (in float32) in
        the accumulator it returns; later ones merge the same partials again (timing only).
    """
    query, heads, width = mha.query, mha.query.shape[1], mha.query.shape[2]
    rope, scale = step.rope, cases.SOFTMAX_SCALE
    weight, table, cache = mha.weight, step.block_table, step.kv_cache
    args = (query, cache, table, weight, scale, rope, mha.query_lengths, mha.kv_lengths, backend)

    def checks_and_plan():
        q_lens, kv_lens, _, v_dim = check_mha_call(*args)
        plan = mha_plan(
            q_lens, kv_lens, backend, ROW_BUDGET, cache.shape[1], table.shape[1], query.device
        )
        # The widths the call lays the weights out at (one head size for FlashAttention).
        widths = (flash_head_dim(width, v_dim),) * 2 if backend == "flash" else (width, v_dim)
        up = cached_up_projections(weight, heads, width - rope, rope, *widths)
        return plan, up, v_dim

    plan, up, v_dim = checks_and_plan()
    if len(plan.chunks) != 1 or plan.direct:
        raise ValueError("--parts times a chunk step: one chunk whose calls are merged")
    chunk = plan.chunks[0]
    keys, values = decompressed_keys_values(cache, table, chunk.places, up, heads, rope)

    def attend():
        results = []
        for call in chunk.calls:
            q = query[call.tokens]
            if call.padded != call.count:  # the rows the backend plans for, as the call pads
                q = torch.cat([q, q.new_zeros(call.padded - call.count, heads, width)])
            k, v = keys[call.rows], values[call.rows]
            results.append(
                varlen_attention(
                    backend,
                    q,
                    k,
                    v,
                    call.lengths,
                    call.causal,
                    scale,
                    True,
                    call.offsets,
                    call.ragged,
                )
            )
        return results

    # The backend's entry on one dense batch per call, as the chunk's calls hand it over.
    bare = []
    for call in chunk.calls:
        q = query[call.tokens].unsqueeze(0).transpose(1, 2)
        k, v = (x[call.rows].unsqueeze(0).transpose(1, 2) for x in (keys, values))
        bare.append((q, k, v, call.causal is not None))

    def cudnn_bare():
        for q, k, v, causal in bare:
            internals.cudnn_dense_attention_forward(
                q, k, v, None, True, 0.0, causal, False, scale=scale
            )

    results = attend()
    acc = results[0][0].float()
    acc_lse = results[0][1].clone()

    def merge() -> torch.Tensor:
        for call, (part, part_lse) in zip(chunk.calls[1:], results[1:]):
            merge_partials_into(acc, acc_lse, part, part_lse, call.tokens)
        return acc

    timed = {
        "checks+plan": checks_and_plan,
        "decompress": lambda: decompressed_keys_values(cache, table, chunk.places, up, heads, rope),
        "attend": attend,
        "merge": merge,
    }
    if backend == "cudnn-dense" and internals.cudnn_dense_attention_forward is not None:
        timed["cuDNN bare"] = cudnn_bare
    return timed


def main(argv=None) -> int:
    """Parse the arguments, time and profile the calls, print the table last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="+", type=int, default=[16, 128])
    parser.add_argument("--cases", nargs="+", type=parse_case, default=None)
    parser.add_argument("--calls", type=int, default=200, help="calls profiled per variant")
    parser.add_argument("--top", type=int, default=15, help="profile rows per variant")
    parser.add_argument(
        "--parts", action="store_true", help="also time the in-order call's parts, each alone"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: this profiles the host path of GPU launches", file=sys.stderr)
        return 2
    backend = mha_backend()
    if backend is None:
        print("no MHA-form backend runs here (cuDNN attention or FlashAttention)", file=sys.stderr)
        return 2
    steps = args.cases or [parse_case(c) for c in DEFAULT_CASES]
    rows: List[Tuple[str, int, Dict[str, Dict[str, object]]]] = []
    part_rows: List[Tuple[str, int, Dict[str, Dict[str, object]]]] = []
    for heads in args.heads:
        for cached, new in steps:
            step = cases.build_step([(cached, new)], heads)
            mha = forms.mha_step(step, heads, seed=heads, backend=backend)
            calls = variants(step, mha, backend)
            for call in calls.values():  # plans, cuDNN graphs and streams outside the timing
                call()
            torch.cuda.synchronize()
            times = interleaved_host_us(calls, ROUNDS, torch.cuda.synchronize)
            label = f"{new} on {cached}"
            rows.append((label, heads, times))
            if args.parts:
                timed = parts(step, mha, backend)
                timed["in order"] = calls["in order"]
                for call in timed.values():
                    call()
                torch.cuda.synchronize()
                part_rows.append(
                    (label, heads, interleaved_host_us(timed, ROUNDS, torch.cuda.synchronize))
                )
            for name in ("side by side", "in order"):
                print(f"\n== {label}, {heads} heads, {name} ({backend}):")
                print(profile(calls[name], args.calls, args.top))
    names = ("in order", "side by side", "no hand-over", "fork/join", "fresh events")
    print(f"=== host | eager us per call (MHA-form backend {backend}, bf16)")
    print(f"{'step':>14} {'heads':>5} | " + " | ".join(f"{n:>21}" for n in names))
    for label, heads, times in rows:
        cells = [f"{times[n]['host_us']:9.1f} | {times[n]['eager_us']:9.1f}" for n in names]
        print(f"{label:>14} {heads:>5} | " + " | ".join(f"{c:>21}" for c in cells))
    if part_rows:
        names = ("in order",) + PARTS
        print(f"\n=== the in-order call's parts alone, host | eager us per call ({backend})")
        print(f"{'step':>14} {'heads':>5} | " + " | ".join(f"{n:>21}" for n in names))
        for label, heads, times in part_rows:
            cells = [
                f"{times[n]['host_us']:9.1f} | {times[n]['eager_us']:9.1f}" if n in times else "-"
                for n in names
            ]
            print(f"{label:>14} {heads:>5} | " + " | ".join(f"{c:>21}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
