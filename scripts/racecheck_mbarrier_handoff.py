# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What compute-sanitizer's racecheck reports for the handoff the Gluon decode kernel uses between
warpgroups, on a kernel that does nothing else.

    compute-sanitizer --tool racecheck python scripts/racecheck_mbarrier_handoff.py
        [--mma-rows] [--fence] [--third-partition]

One partition stores a row vector to shared memory and signals an mbarrier (Gluon lowers the
arrival to a named barrier of the partition and one thread's ``mbarrier.arrive``, a release); the
other waits on it (an acquire), loads the vector and writes it out, then signals back before the
next round overwrites it, as the decode kernel passes P's rescale factors and row sums. The
output is checked, so a handoff that raced would show as a wrong value.

In its plain form (a blocked layout, two partitions) racecheck reports no hazard, where it
reports some at the decode kernel's handoff. Each option adds one thing the kernel has, so runs
with and without it tell which one racecheck reports:

* ``--mma-rows``: the vector in the row layout of a warpgroup MMA's accumulator (each row held by
  the four threads of a quad, as the kernel's rescale factors and row sums are);
* ``--fence``: a proxy fence after the store and after the wait (the kernel fences its P and key
  tiles there for the MMAs);
* ``--third-partition``: a third warpgroup that waits on the same barrier and does nothing else
  (the kernel's third partition).
"""

import argparse
import sys
from typing import Optional, Sequence

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier

ROWS = 64
ROUNDS = 8


@gluon.constexpr_function
def _rows_layout(mma_rows):
    """The vector's layout: a blocked one, or the rows of a 64 x 32 accumulator of one warpgroup
    MMA (each row on the four threads of a quad)."""
    if mma_rows:
        acc = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16]
        )
        return gl.SliceLayout(1, acc)
    return gl.BlockedLayout([1], [32], [4], [0])


@gluon.jit
def _writer(
    buf,
    ready,
    free,
    ROWS: gl.constexpr,
    ROUNDS: gl.constexpr,
    MMA_ROWS: gl.constexpr,
    FENCE: gl.constexpr,
):
    layout: gl.constexpr = _rows_layout(MMA_ROWS)
    rows = gl.arange(0, ROWS, layout=layout)
    for r in range(ROUNDS):
        mbarrier.wait(free, (r & 1) ^ 1)
        buf.store((rows + r * ROWS).to(gl.float32))
        if FENCE:
            fence_async_shared()
        mbarrier.arrive(ready, count=1)


@gluon.jit
def _reader(
    buf,
    ready,
    free,
    out_ptr,
    ROWS: gl.constexpr,
    ROUNDS: gl.constexpr,
    MMA_ROWS: gl.constexpr,
    FENCE: gl.constexpr,
):
    layout: gl.constexpr = _rows_layout(MMA_ROWS)
    rows = gl.arange(0, ROWS, layout=layout)
    for r in range(ROUNDS):
        mbarrier.wait(ready, r & 1)
        if FENCE:
            fence_async_shared()
        gl.store(out_ptr + r * ROWS + rows, buf.load(layout))
        mbarrier.arrive(free, count=1)


@gluon.jit
def _idle(ROUNDS: gl.constexpr):
    """A third partition with nothing to do (the decode kernel's third copies and signals on
    barriers of its own)."""
    pass


@gluon.jit
def _handoff_kernel(
    out_ptr,
    ROWS: gl.constexpr,
    ROUNDS: gl.constexpr,
    MMA_ROWS: gl.constexpr,
    FENCE: gl.constexpr,
    THIRD: gl.constexpr,
):
    buf = gl.allocate_shared_memory(gl.float32, [ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(free, count=1)
    if THIRD:
        gl.warp_specialize(
            [
                (_writer, (buf, ready, free, ROWS, ROUNDS, MMA_ROWS, FENCE)),
                (_reader, (buf, ready, free, out_ptr, ROWS, ROUNDS, MMA_ROWS, FENCE)),
                (_idle, (ROUNDS,)),
            ],
            [4, 4],
            [128, 40],
        )
    else:
        gl.warp_specialize(
            [
                (_writer, (buf, ready, free, ROWS, ROUNDS, MMA_ROWS, FENCE)),
                (_reader, (buf, ready, free, out_ptr, ROWS, ROUNDS, MMA_ROWS, FENCE)),
            ],
            [4],
            [128],
        )


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mma-rows", action="store_true", help="the accumulator's row layout")
    parser.add_argument("--fence", action="store_true", help="proxy fences around the handoff")
    parser.add_argument(
        "--third-partition", action="store_true", help="a third warpgroup on the barrier"
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 2
    out = torch.full((ROUNDS * ROWS,), -1.0, device="cuda")
    _handoff_kernel[(1,)](
        out, ROWS, ROUNDS, args.mma_rows, args.fence, args.third_partition, num_warps=4
    )
    torch.cuda.synchronize()
    expected = torch.arange(ROUNDS * ROWS, device="cuda", dtype=torch.float32)
    ok = torch.equal(out, expected)
    form = [name for name in ("mma_rows", "fence", "third_partition") if getattr(args, name)]
    print(f"handoff ({', '.join(form) or 'plain'}) values", "as written" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
