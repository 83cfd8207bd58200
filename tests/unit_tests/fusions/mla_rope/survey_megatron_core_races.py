# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Survey: do megatron-core's MLA RoPE kernels give the same bits on every launch?

    python -m tests.unit_tests.fusions.mla_rope.survey_megatron_core_races \\
        [--launches N] [--num-warps 4 [8 ...]] [--quick] [--out DIR]
    python -m tests.unit_tests.fusions.mla_rope.survey_megatron_core_races --summarize DIR

(from the repository root).

Relaunches each of megatron-core's four kernels (query forward and backward, key/value forward and
backward) N times at every BLOCK_H of its autotuner whose output is defined for the head count
(mask-correct), in bf16, fp16 and fp32, on several shapes: the in-place query kernels on a fresh
copy of one input each time. It prints a table of differing launches / launches per kernel, dtype,
num_warps and BLOCK_H (shapes summed) and writes the records to DIR/megatron-core_survey.json
(DIR defaults to MEGATRON_EXT_REPORT_DIR; nothing is written when neither is set). These are
observations: the exit status is 0 whatever they show. Its autotuner launches every config with 4
warps; other warp counts show how the race depends on the layout.

``--summarize DIR`` prints the tables of the reports in DIR (these and the GPU tests' in
test_kernels.py) and writes them in full to DIR/tables.md.
"""

import argparse
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from tests.unit_tests.fusions.mla_rope import mla_rope_relaunch as rl
from tests.unit_tests.fusions.mla_rope_testlib import (
    MCORE_BLOCK_HS,
    MCORE_NUM_WARPS,
    megatron_core_mask_correct,
)

# (heads, seq_len, batch) per kernel. 128 heads is DeepSeek-V3, 16 a tensor-parallel shard of it,
# 40 a head count most blocks do not divide; 64 tokens is a decode batch, 512 a prefill chunk.
SHAPES: Dict[str, List[Tuple[int, int, int]]] = {
    "q_fwd": [(128, 64, 1), (128, 512, 1), (16, 64, 1), (40, 64, 1)],
    "q_bwd": [(128, 64, 1), (128, 512, 1), (16, 64, 1), (40, 64, 1)],
    "kv_fwd": [(128, 64, 1), (16, 512, 1), (40, 64, 1)],
    # The backward unrolls its loop over head blocks; 128 heads at BLOCK_H=1 takes ~10 s to compile.
    "kv_bwd": [(16, 64, 1), (32, 512, 1)],
}
QUICK_SHAPES = {kernel: shapes[:1] for kernel, shapes in SHAPES.items()}
DTYPE_NAMES = ("bf16", "fp16", "fp32")


def survey(
    kernels: Sequence[str],
    dtypes: Sequence[str],
    shapes: Dict[str, Sequence[Tuple[int, int, int]]],
    num_warps: Sequence[int],
    launches: int,
    device,
    dims: Optional[rl.Dims] = None,
) -> List[rl.Relaunch]:
    """Relaunch megatron-core's kernels at every mask-correct BLOCK_H; one record per config.

    Args:
        kernels: among 'q_fwd', 'q_bwd', 'kv_fwd', 'kv_bwd'.
        dtypes: among 'bf16', 'fp16', 'fp32'.
        shapes: (heads, seq_len, batch) per kernel.
        num_warps: warp counts to launch each BLOCK_H with.
        launches: launches per config and shape.
        device: 'cuda' (or 'cpu' for the Triton interpreter).
        dims: per-head sizes (default: DeepSeek-V3's).

    Returns:
        List[Relaunch]: the records.
    """
    dims = dims or rl.Dims()
    jobs = []
    for kernel in kernels:
        for dtype in dtypes:
            for heads, seq_len, batch in shapes.get(kernel, ()):
                inp = rl.make_inputs(kernel, heads, dtype, device, seq_len, batch, dims, seed=heads)
                for block_h in MCORE_BLOCK_HS:
                    if megatron_core_mask_correct(heads, block_h):
                        jobs.extend((inp, block_h, w) for w in num_warps)
    rl.compile_megatron_core(jobs)
    records = []
    for inp, block_h, warps in jobs:
        launch = rl.megatron_core(inp, block_h, warps)
        _, differing = rl.relaunch(inp, launch, launches)
        records.append(
            rl.Relaunch(
                rl.MCORE,
                inp.kernel,
                inp.dtype,
                inp.shape,
                block_h,
                warps,
                launches,
                int(differing),
            )
        )
    return records


def summarize(directory) -> str:
    """The summary table of every report in ``directory`` and the per-config table of
    megatron-core's; both tables in full (megatron_ext's per config too) go to
    ``directory/tables.md``."""
    records = rl.load_reports(directory)
    if not records:
        return f"no relaunch reports in {directory}"
    summary = [
        "Launches whose bits differ from the first launch's, per kernel and dtype "
        "(configs as BLOCK_H/num_warps):",
        "",
        rl.summary_table(records),
        "",
    ]
    per_config = "Per config (differing launches / launches, shapes summed):"
    mcore = [r for r in records if r.impl == rl.MCORE]
    text = "\n".join(summary + [f"{rl.MCORE}: {per_config}", "", rl.config_table(mcore)])
    full = "\n".join(summary + [per_config, "", rl.config_table(records)])
    (Path(directory) / "tables.md").write_text(full + "\n", encoding="utf-8")
    return text if mcore else "\n".join(summary)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--launches", type=int, default=100, help="launches per config and shape")
    parser.add_argument("--num-warps", type=int, nargs="+", default=[MCORE_NUM_WARPS])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPE_NAMES), choices=DTYPE_NAMES)
    parser.add_argument("--kernels", nargs="+", default=list(rl.KERNELS), choices=rl.KERNELS)
    parser.add_argument("--quick", action="store_true", help="one shape per kernel")
    parser.add_argument("--out", help="report folder (default: $MEGATRON_EXT_REPORT_DIR)")
    parser.add_argument("--summarize", metavar="DIR", help="print the tables of DIR's reports")
    args = parser.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: the survey measures GPU launches", file=sys.stderr)
        return 2
    records = survey(
        args.kernels,
        args.dtypes,
        QUICK_SHAPES if args.quick else SHAPES,
        args.num_warps,
        args.launches,
        "cuda",
    )
    rl.report(f"{rl.MCORE}_survey", records, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
