# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Run the fused top-k candidate draw on small shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python tests/unit_tests/fusions/sanitize_top_k_sampling.py
    compute-sanitizer --tool racecheck --error-exitcode 1 \\
        python tests/unit_tests/fusions/sanitize_top_k_sampling.py

Candidate counts from 1 to megatron_ext's largest (4096), powers of two and not, bf16, fp16 and
fp32, rows that are views into wider tensors (a row stride above the candidate count), through the
JIT and the direct launch. PyTorch's caching allocator is disabled so that every tensor is its own
allocation and an out-of-bounds access is one memcheck can see. Exits non-zero if a token differs
from a float64 race wherever two candidates' races are not within rounding of each other.
"""

import os
import sys

# Before torch initialises CUDA: one cudaMalloc per tensor, no slack shared with neighbours.
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

from megatron_ext.fusions.fused_top_k_sampling import sample_top_k_candidates  # noqa: E402

CAPS = (1, 2, 5, 32, 50, 256, 1000, 4096)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _case(rows: int, cap: int, dtype: torch.dtype, seed: int, wide: bool):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, 2 * cap + 3, generator=gen) * 3).to(dtype)
    values, indices = torch.topk(logits, cap, dim=-1)
    noise = torch.empty(rows, cap).exponential_(1.0, generator=gen)
    if wide:
        # Row strides above the candidate count: the kernel must read only each row's cap.
        values = torch.cat([values, values[:, :3]], 1)[:, :cap]
        indices = torch.cat([indices, indices[:, :3]], 1)[:, :cap]
        noise = torch.cat([noise, noise[:, :3]], 1)[:, :cap]
    temperature = torch.rand(rows, generator=gen) + 0.1
    top_k = torch.randint(0, cap + 3, (rows,), generator=gen, dtype=torch.int32)
    return values, indices, temperature, top_k, noise


def _check(values, indices, temperature, top_k, noise, tokens) -> bool:
    v = values.double()
    k = top_k.long().clamp(1, v.shape[1])
    kth = v.gather(1, (k - 1).unsqueeze(1))
    scores = (v / temperature.double().unsqueeze(1)).masked_fill(v < kth, float("-inf"))
    race = scores.softmax(-1) / noise.double().clamp(min=torch.finfo(torch.float32).tiny)
    expected = indices.gather(1, race.argmax(-1, keepdim=True)).squeeze(1)
    if v.shape[1] == 1:
        return torch.equal(tokens, expected)
    best = race.topk(2, dim=-1).values
    clear = (best[:, 0] - best[:, 1]) / best[:, 0] > 1e-4
    return bool(torch.equal(tokens[clear], expected[clear]))


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    failures = checks = 0
    for cap in CAPS:
        for dtype in DTYPES:
            for wide in (False, True):
                for launch in ("jit", "direct"):
                    rows = 17
                    case = _case(rows, cap, dtype, seed=cap * 7 + len(str(dtype)), wide=wide)
                    tokens = sample_top_k_candidates(*(t.cuda() for t in case))
                    torch.cuda.synchronize()
                    checks += 1
                    if not _check(*case, tokens.cpu()):
                        failures += 1
                        print(f"BAD cap={cap} {dtype} wide={wide} {launch}")
    print(f"{checks} checks, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
