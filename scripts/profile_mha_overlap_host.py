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

then profiles ``side by side`` and ``in order`` under ``cProfile`` (functions by own time). The
profiles' times are inflated by the profiler: compare their rows with each other. Prints a table
last. Needs a CUDA GPU.
"""

import argparse
import contextlib
import os
import sys
from typing import Callable, Dict, Iterator, List, Tuple

import torch

from megatron_ext.bench import mla_serving_cases as cases
from megatron_ext.bench import mla_serving_forms as forms
from megatron_ext.bench.mla_serving import mha_backend
from megatron_ext.bench.rope import interleaved_host_us
from megatron_ext.fusions import side_stream
from megatron_ext.fusions.mla_latent.mha_form import mla_paged_mha_attention

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


def variants(step: cases.PagedStep, mha: forms.MhaStep, backend: str) -> Dict[str, Callable]:
    """The timed calls of one step."""
    device = step.query.device

    def attention(overlap: bool) -> torch.Tensor:
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


def main(argv=None) -> int:
    """Parse the arguments, time and profile the calls, print the table last."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="+", type=int, default=[16, 128])
    parser.add_argument("--cases", nargs="+", type=parse_case, default=None)
    parser.add_argument("--calls", type=int, default=200, help="calls profiled per variant")
    parser.add_argument("--top", type=int, default=15, help="profile rows per variant")
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
            for name in ("side by side", "in order"):
                print(f"\n== {label}, {heads} heads, {name} ({backend}):")
                print(profile(calls[name], args.calls, args.top))
    names = ("in order", "side by side", "no hand-over", "fork/join", "fresh events")
    print(f"=== host | eager us per call (MHA-form backend {backend}, bf16)")
    print(f"{'step':>14} {'heads':>5} | " + " | ".join(f"{n:>21}" for n in names))
    for label, heads, times in rows:
        cells = [f"{times[n]['host_us']:9.1f} | {times[n]['eager_us']:9.1f}" for n in names]
        print(f"{label:>14} {heads:>5} | " + " | ".join(f"{c:>21}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
