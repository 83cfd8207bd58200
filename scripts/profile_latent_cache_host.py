# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Where the host time of the paged latent-cache kernels goes, call by call, on a GPU.

    python scripts/profile_latent_cache_host.py [--batch 1 16 128] [--context 4096] [--heads 16 128]
        [--append-tokens 1 64] [--calls 500] [--top 12]

For each decode step (``--batch`` requests of ``--context`` rows, bf16, page size 64) it times
``mla_paged_latent_attention`` as the benchmark's host column does (calls issued without a
synchronisation, the median of 5 rounds), says whether the launches went through the compiled
kernels' C launchers (``KernelLaunches``) and how many launch keys each stage holds, then runs the
same calls under ``cProfile`` and prints the functions with the most own time. The same for
``fused_mla_rope_cache_append`` at ``--append-tokens``. The profile's per-call times are inflated
by the profiler itself; compare rows with each other, not with the timed column. Needs a CUDA GPU
(under the interpreter the kernels' own Python would dominate).
"""

import argparse
import cProfile
import io
import pstats
import sys
from typing import Callable

import torch

from megatron_ext.bench import mla_serving_cases as cases
from megatron_ext.bench.rope import interleaved_host_us
from megatron_ext.fusions import direct_launch, mla_latent

ROUNDS = 5


def host_us(call: Callable[[], object]) -> float:
    """Host microseconds per call, measured as the benchmarks' host column is
    (:func:`megatron_ext.bench.rope.interleaved_host_us`: calls issued without a synchronisation,
    the median of ``ROUNDS`` rounds)."""
    return interleaved_host_us({"call": call}, ROUNDS, torch.cuda.synchronize)["call"]["host_us"]


def profile(call: Callable[[], object], calls: int, top: int) -> str:
    """The ``cProfile`` table of ``calls`` calls, the ``top`` functions by own time.

    Args:
        call: the call.
        calls: how many calls to profile.
        top: rows to print.

    Returns:
        str: the table.
    """
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def launch_state(*launches: direct_launch.KernelLaunches) -> str:
    """Per launch object: its kernel, its launch keys and how many launch directly."""
    parts = []
    for launches_of in launches:
        bound = list(launches_of.launches.values())
        name = getattr(launches_of.kernel, "__name__", str(launches_of.kernel))
        parts.append(f"{name}: {len(bound)} keys, {sum(bool(b) for b in bound)} direct")
    return "; ".join(parts)


def main(argv=None) -> int:
    """Parse the arguments, time and profile the calls, print the results."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 16, 128])
    parser.add_argument("--context", nargs="+", type=int, default=[4096])
    parser.add_argument("--heads", nargs="+", type=int, default=[16, 128])
    parser.add_argument("--append-tokens", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--calls", type=int, default=500, help="calls profiled per row")
    parser.add_argument("--top", type=int, default=12, help="profile rows per call")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU: this profiles the host path of GPU launches", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    print(f"direct launch verified on {device}: {direct_launch.verified(device)}")
    for heads in args.heads:
        for batch in args.batch:
            for context in args.context:
                step = cases.build_step(cases.decode_requests(batch, context), heads)
                out = torch.empty_like(step.query[..., : step.latent])

                def attend(step=step, out=out):
                    return cases.paged_attention(step, step.kv_cache, step.query, out)

                us = host_us(attend)
                state = launch_state(mla_latent.STAGE1_LAUNCHES, mla_latent.COMBINE_LAUNCHES)
                print(
                    f"\n== attention, batch {batch}, context {context}, {heads} heads: "
                    f"{us:.1f} us host per call ({state})"
                )
                print(profile(attend, args.calls, args.top))
    for tokens in args.append_tokens:
        step = cases.build_append(tokens)

        def append(step=step):
            cases.fused_append(step, step.kv_latent, step.k_pos_emb)

        us = host_us(append)
        print(
            f"\n== RoPE + append, {tokens} tokens: {us:.1f} us host per call "
            f"({launch_state(mla_latent.APPEND_LAUNCHES)})"
        )
        print(profile(append, args.calls, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
