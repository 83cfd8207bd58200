# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""A/B of the MLA paged latent attention on a GPU: this checkout's kernels against another
revision's, in one process, bit for bit and by CUDA-graph replay time.

    git archive REV megatron_ext/fusions/mla_latent | tar -x -C /tmp/old
    python scripts/compare_latent_attention.py --old /tmp/old/megatron_ext/fusions/mla_latent
        [--quick] [--shapes B,CTX,HEADS ...] [--page-tiles-everywhere] [--out FILE.json]

A revision from before the package: ``--old`` a copy of its module
(``git show REV:megatron_ext/fusions/mla_paged_latent_attention.py > /tmp/old_attention.py``).

The other revision's package (or module) is imported beside this one (its own Triton kernels and
launch plans; the rest of megatron_ext is this checkout's, so the two must share its imports).
For each decode shape (bf16, page size 64, the benchmark's cache contents, ``python -m
megatron_ext.bench mla-serving``) it times both by graph replay with inputs rotated over copies
larger than the L2, times this checkout's stage 1 and split combine alone, and compares the
outputs bitwise.
``--page-tiles-everywhere`` adds a third column: this checkout with the one-block-id key tiles
forced on for every tile (``page_tiles``), to see what the launcher's rule leaves out. Prints a
table and exits 1 if any output bit moved (the row names whose), 2 without a GPU.
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import triton

from megatron_ext.bench import mla_serving_cases as cases
from megatron_ext.bench.mla_serving import _attention_sets, graph_us
from megatron_ext.bench.rope import _copy_ceiling
from megatron_ext.fusions import mla_latent as new
from megatron_ext.fusions.mla_latent import attention_plan

_LAUNCHER_PAGE_TILES = new.page_tiles
PACKAGE = new.__name__

FULL_SHAPES = [
    (batch, context, heads)
    for heads in (16, 128)
    for batch in (1, 16, 64, 128)
    for context in (1024, 4096, 32768)
]
QUICK_SHAPES = [
    (1, 4096, 16),
    (16, 4096, 16),
    (64, 4096, 16),
    (128, 32768, 16),
    (16, 4096, 128),
    (64, 4096, 128),
]


def load_module(path: str) -> ModuleType:
    """Import another revision's latent attention beside this checkout's.

    Args:
        path: a copy of the ``megatron_ext/fusions/mla_latent`` package directory or, from a
            revision before the package, of ``mla_paged_latent_attention.py``.

    Returns:
        ModuleType: the other revision's package or module (its ``mla_paged_latent_attention``).
    """
    if Path(path).is_file():
        spec = importlib.util.spec_from_file_location("other_mla_paged_latent_attention", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    return _load_package_copy(Path(path))


def _package_modules() -> Dict[str, ModuleType]:
    return {n: m for n, m in sys.modules.items() if n == PACKAGE or n.startswith(PACKAGE + ".")}


def _load_package_copy(directory: Path) -> ModuleType:
    """The package copy in ``directory``, imported under the package's own name (its modules
    import each other by absolute name) while this checkout's modules are set aside; they are
    put back afterwards, and the copy keeps its own."""
    own = _package_modules()
    for name in own:
        del sys.modules[name]
    try:
        spec = importlib.util.spec_from_file_location(
            PACKAGE, directory / "__init__.py", submodule_search_locations=[str(directory)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
    finally:
        for name in _package_modules():
            del sys.modules[name]
        sys.modules.update(own)
    return module


def _page_tiles_at_any_warps(block_size: int, tile: "new.TileShape") -> bool:
    """The launcher's rule as for a 4-warp tile: one block id wherever key tiles fill pages."""
    return _LAUNCHER_PAGE_TILES(block_size, tile._replace(num_warps=4))


def compare_shape(
    old: ModuleType, batch: int, context: int, heads: int, quick: bool, page_tiles: bool
) -> Dict[str, Any]:
    """One decode shape: GPU us per call of each variant, the stages alone, bits equal or not.

    Args:
        old: the other revision's module.
        batch, context, heads: the decode step (``batch`` requests of ``context`` cached rows).
        quick: fewer timing repetitions.
        page_tiles: also time this checkout with one-block-id tiles forced on everywhere.

    Returns:
        Dict[str, Any]: the row (``old_us``, ``new_us``, ``stage1_us``, ``combine_us``,
        ``page_tiles_us``, ``bits_equal``, ``moved``: the variants whose bits differ from old's).
    """
    requests = cases.decode_requests(batch, context)
    step = cases.build_step(
        requests, heads, dtype=torch.bfloat16, device="cuda", seed=batch + heads
    )
    nbytes = cases.step_bytes(requests, heads)["minimum"]
    sets = _attention_sets(step, nbytes)

    def caller(module: ModuleType):
        def call(cache, query, out):
            return module.mla_paged_latent_attention(
                query,
                cache,
                step.block_table,
                step.cu_query_lengths,
                step.kv_lengths,
                cases.SOFTMAX_SCALE,
                rope_dim=step.rope,
                max_query_len=1,
                out=out,
            )

        return call

    def timed(module: ModuleType) -> Tuple[float, torch.Tensor]:
        call = caller(module)
        for s in sets[:2]:  # the first call of a shape compiles: never inside a capture
            call(*s)
        torch.cuda.synchronize()
        out = sets[0][2].clone()
        return graph_us(call, sets, quick)["gpu_us"], out

    row: Dict[str, Any] = dict(batch=batch, context=context, heads=heads, bytes=nbytes)
    row["old_us"], old_out = timed(old)
    new.ATTENTION_PLANS.clear()
    row["new_us"], new_out = timed(new)
    (plan,) = new.ATTENTION_PLANS.plans()
    outs = {"new": new_out}
    if plan.workspace is not None:
        partial_shape, lse_shape = plan.workspace
        partial = torch.empty(partial_shape, dtype=torch.float32, device="cuda")
        lse = torch.empty(lse_shape, dtype=torch.float32, device="cuda")

        def stage1(cache, query, out):
            # One query operand: the kernel reads its RoPE part through the same tensor.
            plan.stage1(
                query,
                query,
                cache,
                step.block_table,
                step.cu_query_lengths,
                step.kv_lengths,
                partial,
                lse,
            )

        def combine(cache, query, out):
            plan.combine(partial, lse, step.cu_query_lengths, out)

        row["stage1_us"] = graph_us(stage1, sets, quick)["gpu_us"]
        row["combine_us"] = graph_us(combine, sets, quick)["gpu_us"]
    if page_tiles:
        # The plan reads the rule from its module when it is built.
        attention_plan.page_tiles = _page_tiles_at_any_warps
        new.ATTENTION_PLANS.clear()
        try:
            row["page_tiles_us"], outs["page tiles everywhere"] = timed(new)
        finally:
            attention_plan.page_tiles = _LAUNCHER_PAGE_TILES
            new.ATTENTION_PLANS.clear()
    moved = [
        name
        for name, out in outs.items()
        if not torch.equal(out.view(torch.int16), old_out.view(torch.int16))
    ]
    row.update(bits_equal=not moved, moved=moved)
    return row


def _cell(value: Optional[float], width: int = 9) -> str:
    return f"{value:{width}.1f}" if value is not None else " " * (width - 1) + "-"


def print_table(rows: List[Dict[str, Any]], ceiling_tb_s: float) -> None:
    """One line per shape: times, speedup, % of the copy ceiling, bits."""
    print(
        "batch    ctx heads |    old us    new us  speedup |  stage 1  combine | %ceil old  new"
        " | page tiles us | bits"
    )
    for r in rows:
        pct = [100 * r["bytes"] / r[k] / 1e6 / ceiling_tb_s for k in ("old_us", "new_us")]
        bits = "equal" if r["bits_equal"] else "MOVED against old: " + ", ".join(r["moved"])
        print(
            f"{r['batch']:5d} {r['context']:6d} {r['heads']:5d} | {r['old_us']:9.1f} "
            f"{r['new_us']:9.1f} {r['old_us'] / r['new_us']:7.2f}x | "
            f"{_cell(r.get('stage1_us'), 8)} {_cell(r.get('combine_us'), 8)} | "
            f"{pct[0]:8.1f} {pct[1]:5.1f} | {_cell(r.get('page_tiles_us'), 13)} | {bits}"
        )


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--old", required=True, help="the other revision's package directory (or module file)"
    )
    parser.add_argument("--shapes", nargs="+", default=None, help="B,CTX,HEADS decode shapes")
    parser.add_argument("--quick", action="store_true", help="six shapes, fewer repetitions")
    parser.add_argument("--page-tiles-everywhere", action="store_true")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("compare_latent_attention: needs a CUDA GPU (no CUDA GPU here)", file=sys.stderr)
        return 2
    if args.shapes:
        shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes]
    else:
        shapes = QUICK_SHAPES if args.quick else FULL_SHAPES
    old = load_module(args.old)
    ceiling = _copy_ceiling(args.quick)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
        f"copy ceiling {ceiling['tb_per_s']:.2f} TB/s; bf16, page size {cases.BLOCK_SIZE}"
    )
    rows = []
    for batch, context, heads in shapes:
        rows.append(
            compare_shape(old, batch, context, heads, args.quick, args.page_tiles_everywhere)
        )
        torch.cuda.empty_cache()
    print_table(rows, ceiling["tb_per_s"])
    moved = [r for r in rows if not r["bits_equal"]]
    worst = max(rows, key=lambda r: r["new_us"] / r["old_us"])
    print(
        f"worst row: batch {worst['batch']}, context {worst['context']}, {worst['heads']} heads: "
        f"new / old = {worst['new_us'] / worst['old_us']:.2f}; bits moved in {len(moved)} rows"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(ceiling=ceiling, rows=rows), f, indent=1)
    return 1 if moved else 0


if __name__ == "__main__":
    sys.exit(main())
