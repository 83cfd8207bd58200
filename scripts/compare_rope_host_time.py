# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Host time per call of the public MLA RoPE drop-ins, for comparing two source trees.

Run once per tree, alternating, each in its own process (the tree first on PYTHONPATH):

    PYTHONPATH=OLD_TREE python scripts/compare_rope_host_time.py old
    PYTHONPATH=NEW_TREE python scripts/compare_rope_host_time.py new

Prints one JSON line: the tree label and, per call, the fastest of 60 rounds of the host time of
20 calls issued without a synchronisation (us per call; 5 for forward + backward), each round
synchronised after. bf16, DeepSeek-V3 head sizes. Needs a CUDA GPU.
"""

import importlib
import json
import sys
import time
from typing import Callable, Dict, Tuple

import torch

QK, EMB, V = 128, 64, 128
SHAPES = ((4096, 1, 128), (1, 64, 128), (16384, 1, 16))


def tables(rows: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """cos/sin ``[rows, 1, 1, EMB]`` in bf16 on the GPU."""
    inv = 1.0 / (10000.0 ** (torch.arange(0, EMB, 2, dtype=torch.float64) / EMB))
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv[None, :]
    angles = torch.cat([angles, angles], -1)[:, None, None, :]
    return angles.cos().bfloat16().cuda(), angles.sin().bfloat16().cuda()


def host_us(fn: Callable[[], None], calls: int = 20, rounds: int = 60) -> float:
    """Fastest of ``rounds`` rounds of ``calls`` calls issued without a synchronisation, in host
    us per call.

    A round is short and synchronised after, so the GPU's queue never fills and backs the host
    up (a long round of a GPU-heavy call measured the GPU); the fastest round is the one no other
    process or interrupt slowed, which is what two trees' code can be compared by.
    """
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return min(times)


def shape_calls(
    s: int, b: int, h: int, package: str = "megatron_ext"
) -> Dict[str, Tuple[Callable[[], None], int]]:
    """Each drop-in's call at one query shape ``[s, b, h, 192]`` and the calls per timed round,
    from ``package`` (a tree's ``megatron_ext``, possibly under another name)."""
    rope = importlib.import_module(f"{package}.fusions.fused_mla_yarn_rope_apply")
    cos, sin = tables(s)
    q = torch.randn(s, b, h, QK + EMB, device="cuda").bfloat16()
    leaf = torch.randn(s, b, h, QK + EMB, device="cuda").bfloat16().requires_grad_()
    grad = torch.randn_like(leaf)
    kv = torch.randn(s, b, h, QK + V, device="cuda").bfloat16()
    emb = torch.randn(s, b, 1, EMB, device="cuda").bfloat16()

    def forward_backward():
        rope.fused_apply_mla_rope_for_q(leaf * 1, cos, sin, QK, EMB).backward(grad)

    name = f"{s}x{b}x{h}"
    return {
        f"q fwd {name}": (lambda: rope.fused_apply_mla_rope_for_q(q, cos, sin, QK, EMB), 20),
        f"q fwd+bwd {name}": (forward_backward, 5),
        f"kv fwd {name}": (
            lambda: rope.fused_apply_mla_rope_for_kv(kv, emb, cos, sin, EMB, QK, V),
            20,
        ),
    }


def time_shape(s: int, b: int, h: int) -> Dict[str, float]:
    """Host us per call of each drop-in at one query shape ``[s, b, h, 192]``."""
    return {name: host_us(fn, calls=calls) for name, (fn, calls) in shape_calls(s, b, h).items()}


def main(label: str) -> Dict[str, object]:
    """Time each call at each shape; returns {"tree": label, call: us, ...}."""
    results: Dict[str, object] = {"tree": label}
    for shape in SHAPES:
        results.update(time_shape(*shape))
    return results


if __name__ == "__main__":
    out = main(sys.argv[1] if len(sys.argv) > 1 else "tree")
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}))
