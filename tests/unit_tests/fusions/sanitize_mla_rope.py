# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Run each MLA RoPE kernel once on small shapes, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 \\
        python -m tests.unit_tests.fusions.sanitize_mla_rope
    compute-sanitizer --tool racecheck --error-exitcode 1 \\
        python -m tests.unit_tests.fusions.sanitize_mla_rope --quick

(from the repository root).

Covers the query forward and backward, in place and into a new tensor (sbhd, thd with CUDA-graph
padding rows, thd with context parallelism, position ids; inverse and remove_interleaving) and the
key/value forward and backward, in bf16 and fp32, with head counts that are not multiples of the
head block (5 and 129) at pinned configs. PyTorch's caching allocator is disabled so that every
tensor is its own allocation and an out-of-bounds access is one memcheck can see. Exits non-zero if
any output differs from the exact model of the kernels' arithmetic
(tests/unit_tests/fusions/mla_rope_testlib).
"""

import os
import sys

# Before torch initialises CUDA: one cudaMalloc per tensor, no slack shared with neighbours.
os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import torch  # noqa: E402

from megatron_ext.fusions import fused_mla_yarn_rope_apply as rope  # noqa: E402
from tests.unit_tests.fusions.mla_rope_testlib import (  # noqa: E402
    bits,
    kv_backward_reference,
    kv_forward_reference,
    make_case,
    make_tables,
    q_backward_reference,
    q_forward_reference,
    randn,
)

CONFIGS = [rope.KernelConfig(4, 1), rope.KernelConfig(128, 4)]


def _check(name: str, actual: torch.Tensor, expected: torch.Tensor) -> bool:
    ok = torch.equal(bits(actual), bits(expected))
    print(f"{'ok ' if ok else 'BAD'} {name}")
    return ok


# (name, function, whether it rotates its input in place): the query kernels.
_QUERY_CALLS = (
    ("fwd", rope.mla_rope_q_fwd_, True),
    ("bwd", rope.mla_rope_q_bwd_, True),
    ("bwd copying", rope.mla_rope_q_bwd, False),
)


def _query(layout: str, heads: int, dtype: torch.dtype, config: rope.KernelConfig) -> bool:
    g = torch.Generator().manual_seed(heads)
    case = make_case(layout, heads, "cuda", qk_head_dim=32, emb_dim=64, generator=g)
    t = randn(case.lead + (heads, 96), dtype, "cuda", g)
    cos, sin = make_tables(case.table_rows, 64, dtype, "cuda", generator=g)
    ok = True
    for inverse, remove_interleaving in ((False, False), (True, True)):
        for call, fn, in_place in _QUERY_CALLS:
            ref = q_forward_reference if call == "fwd" else q_backward_reference
            with rope.pinned_kernel_config(config.block_h, config.num_warps):
                out = fn(
                    t.clone() if in_place else t,
                    cos,
                    sin,
                    case.qk_head_dim,
                    case.emb_dim,
                    case.cu_seqlens,
                    case.cp_rank,
                    case.cp_size,
                    inverse=inverse,
                    remove_interleaving=remove_interleaving,
                    position_ids=case.position_ids,
                )
            expected = ref(case, t, cos, sin, inverse, remove_interleaving, exact_model=True)
            name = (
                f"q {call} {layout} heads={heads} {dtype} {config} inverse={inverse} "
                f"remove_interleaving={remove_interleaving}"
            )
            ok &= _check(name, out.view(case.rows, heads, -1), expected)
    return ok


def _key_value(layout: str, heads: int, dtype: torch.dtype, config: rope.KernelConfig) -> bool:
    g = torch.Generator().manual_seed(heads + 1)
    case = make_case(layout, heads, "cuda", qk_head_dim=32, emb_dim=64, generator=g)
    k_dim, v_dim = 32, 24
    kv = randn(case.lead + (heads, k_dim + v_dim), dtype, "cuda", g)
    emb = randn(case.lead + (1, 64), dtype, "cuda", g)
    cos, sin = make_tables(case.table_rows, 64, dtype, "cuda", generator=g)
    common = (64, k_dim, v_dim, case.cu_seqlens, case.cp_rank, case.cp_size)
    with rope.pinned_kernel_config(config.block_h, config.num_warps):
        key, value = rope.mla_rope_kv_fwd(kv, emb, cos, sin, *common)
        d_kv, d_emb = rope.mla_rope_kv_bwd(key, value, cos, sin, *common)
    mk, mv = kv_forward_reference(case, kv, emb, cos, sin, k_dim, exact_model=True)
    m_dkv, m_demb = kv_backward_reference(case, key, value, cos, sin, k_dim, exact_model=True)
    name = f"{layout} heads={heads} {dtype} {config}"
    ok = _check(f"kv fwd key {name}", key.view(case.rows, heads, -1), mk)
    ok &= _check(f"kv fwd value {name}", value.view(case.rows, heads, -1), mv)
    ok &= _check(f"kv bwd d_kv {name}", d_kv.view(case.rows, heads, -1), m_dkv)
    ok &= _check(f"kv bwd d_emb {name}", d_emb.view(case.rows, -1), m_demb)
    return ok


def main(argv=None) -> int:
    """Run every kernel; return 0 if all outputs matched, 1 otherwise (2 without a GPU).

    ``--quick`` runs bf16 at one config only (for the slower racecheck tool).
    """
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("tests.unit_tests.fusions.sanitize_mla_rope needs a CUDA GPU")
        return 2
    ok = True
    for dtype in (torch.bfloat16,) if quick else (torch.bfloat16, torch.float32):
        for config in CONFIGS[1:] if quick else CONFIGS:
            for heads in (5, 129):
                for layout in ("sbhd", "thd_pad", "thd_cp2", "thd_pos"):
                    ok &= _query(layout, heads, dtype, config)
                ok &= _key_value("sbhd", heads, dtype, config)
                ok &= _key_value("thd_pad", heads, dtype, config)
    torch.cuda.synchronize()
    print("all outputs match" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
