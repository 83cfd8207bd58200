# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Print the float arithmetic of megatron-core's MLA RoPE kernels as the installed Triton compiles
them for sm_90, without a GPU (the PTX behind docs/perf_notes/mcore_rope_triton_pairing.md).

    python scripts/mla_rope_ptx.py [--kernel q_bwd] [--dtype bf16] [--table-dtype T] [--block-h 1]

Each printed line is one PTX float instruction (mul, neg, sub, add, fma) with the kernel source
line it comes from; run it under two Tritons and compare.
"""

import argparse
import re
import warnings

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.autotuner import Autotuner, Heuristics

KERNELS = {
    "q_fwd": "rotary_fwd_q_kernel",
    "q_bwd": "rotary_bwd_q_kernel",
    "kv_fwd": "rotary_fwd_kv_kernel",
    "kv_bwd": "rotary_bwd_kv_kernel",
}
POINTERS = {"Q", "DO", "KV", "K_POS_EMB", "O_KEY", "O_VALUE", "dK", "dV", "dKV", "dEMB"}
FLOAT_OP = re.compile(
    r"^\s*((?:fma\.rn|mul|neg|sub|add)(?:\.rn)?\.(?:f32|f16|bf16)(?:x2)?)\s+(.*);"
)


def ptx(kernel: str, dtype: str, table_dtype: str, block_h: int) -> str:
    """The PTX of one megatron-core kernel for sbhd input, 128 heads, emb_dim 64."""
    from megatron.core.fusions import fused_mla_yarn_rope_apply

    fn = getattr(fused_mla_yarn_rope_apply, KERNELS[kernel])
    while isinstance(fn, (Autotuner, Heuristics)):
        fn = fn.fn
    constants = dict(emb_dim=64, head_num=128, k_dim=128, v_dim=128, BLOCK_H=block_h)
    constants.update(cu_seqlens_q=None, cu_seqlens_kv=None)
    constants = {k: v for k, v in constants.items() if k in fn.arg_names}
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in ("COS", "SIN"):
            signature[name] = "*" + table_dtype
        elif name in POINTERS:
            signature[name] = "*" + dtype
        else:
            signature[name] = "i32"
    src = ASTSource(fn=fn, signature=signature, constexprs=constants)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def main() -> None:
    """Parse the arguments and print the float instructions."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", choices=sorted(KERNELS), default="q_bwd")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--table-dtype", choices=("bf16", "fp16", "fp32"), default=None)
    parser.add_argument("--block-h", type=int, default=1)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    text = ptx(args.kernel, args.dtype, args.table_dtype or args.dtype, args.block_h)
    print(
        f"triton {triton.__version__}, megatron-core {KERNELS[args.kernel]}, BLOCK_H={args.block_h}"
    )
    line = None
    for raw in text.splitlines():
        loc = re.match(r"\s*\.loc\s+\d+\s+(\d+)", raw)
        if loc:
            line = loc.group(1)
            continue
        op = FLOAT_OP.match(raw)
        if op:
            print(f"  source line {line}: {op.group(1)} {op.group(2)}")


if __name__ == "__main__":
    main()
