# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What compute-sanitizer's racecheck reports for the handoff the Gluon decode kernel uses between
warpgroups, on a kernel that does nothing else.

    compute-sanitizer --tool racecheck python scripts/racecheck_mbarrier_handoff.py

One partition stores a row vector to shared memory and signals an mbarrier (Gluon lowers the
arrival to a named barrier of the partition and one thread's ``mbarrier.arrive``, a release); the
other waits on it (an acquire), loads the vector and writes it out, then signals back before the
next round overwrites it, as the decode kernel passes P's rescale factors and row sums. The
output is checked, so a handoff that raced would show as a wrong value. Hazards reported here come
from the pattern itself: racecheck does not order accesses through one thread's arrival.
"""

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

ROWS = 64
ROUNDS = 8


@gluon.jit
def _writer(buf, ready, free, ROWS: gl.constexpr, ROUNDS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    rows = gl.arange(0, ROWS, layout=layout)
    for r in range(ROUNDS):
        mbarrier.wait(free, (r & 1) ^ 1)
        buf.store((rows + r * ROWS).to(gl.float32))
        mbarrier.arrive(ready, count=1)


@gluon.jit
def _reader(buf, ready, free, out_ptr, ROWS: gl.constexpr, ROUNDS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    rows = gl.arange(0, ROWS, layout=layout)
    for r in range(ROUNDS):
        mbarrier.wait(ready, r & 1)
        gl.store(out_ptr + r * ROWS + rows, buf.load(layout))
        mbarrier.arrive(free, count=1)


@gluon.jit
def _handoff_kernel(out_ptr, ROWS: gl.constexpr, ROUNDS: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [ROWS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(ready, count=1)
    mbarrier.init(free, count=1)
    gl.warp_specialize(
        [
            (_writer, (buf, ready, free, ROWS, ROUNDS)),
            (_reader, (buf, ready, free, out_ptr, ROWS, ROUNDS)),
        ],
        [4],
        [128],
    )


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a GPU")
        return 2
    out = torch.full((ROUNDS * ROWS,), -1.0, device="cuda")
    _handoff_kernel[(1,)](out, ROWS, ROUNDS, num_warps=4)
    torch.cuda.synchronize()
    expected = torch.arange(ROUNDS * ROWS, device="cuda", dtype=torch.float32)
    ok = torch.equal(out, expected)
    print("handoff values", "as written" if ok else "WRONG")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
