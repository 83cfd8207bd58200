# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Sweep the decode launch of the MLA paged latent attention on a GPU: tile, warps, stages and
split count, each timed by CUDA-graph replay against the copy ceiling of the same run.

    python scripts/sweep_latent_attention.py [--shapes B,CTX,HEADS ...] [--block-n 32 64]
        [--block-h 16 64] [--warps 4 8 16] [--stages 2 3] [--splits default 1x 2x ...]
        [--page-tiles rule on off] [--jobs 12] [--out FILE.json]

Every launch goes through the launcher's own plan (``LatentAttentionPlan``) with the tile given
explicitly, so a setting found here is one the launcher can choose. Splits: ``default`` is the
launcher's count, ``Nx`` N times the count that gives one program per SM, an integer that count.
Each setting's output is checked against the launcher's (max abs difference, bf16); a setting whose
check fails is reported and not ranked. Triton compiles every setting first, in ``--jobs`` processes
sharing the Triton cache (the timing process then loads the compiled kernels), so a sweep of many
settings takes seconds per setting, not a compile each. Prints one table per shape, best first.
"""

import argparse
import functools
import itertools
import json
import math
import multiprocessing
import os
import sys
import time
from typing import List, Sequence, Tuple

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_ext.bench import mla_serving_cases as cases  # noqa: E402
from megatron_ext.bench.mla_serving import _attention_sets, graph_us  # noqa: E402
from megatron_ext.bench.rope import _copy_ceiling  # noqa: E402
from megatron_ext.fusions import mla_latent as mla  # noqa: E402
from megatron_ext.fusions.launch_math import cdiv  # noqa: E402
from megatron_ext.fusions.mla_latent import attention_plan  # noqa: E402

DEFAULT_SHAPES = ["16,4096,16", "64,4096,16", "128,4096,16", "64,32768,16", "64,4096,128"]
# block_h, block_n, warps, stages, splits spec, page tiles (rule/on/off)
Setting = Tuple[int, int, int, int, str, str]
_RULE_PAGE_TILES = mla.page_tiles


def _parse_shape(text: str) -> Tuple[int, int, int]:
    batch, context, heads = (int(x) for x in text.split(","))
    return batch, context, heads


def _splits(spec: str, batch: int, context: int, heads: int, block_h: int, warps: int) -> int:
    tiles = batch * cdiv(heads, block_h)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if spec == "default":
        return mla.default_num_kv_splits(
            batch,
            cdiv(heads, block_h),
            cdiv(context, cases.BLOCK_SIZE) * cases.BLOCK_SIZE,
            torch.device("cuda"),
            num_warps=warps,
        )
    if spec.endswith("x"):
        return max(1, min(mla.MAX_KV_SPLITS, round(float(spec[:-1]) * sms / tiles)))
    return max(1, min(mla.MAX_KV_SPLITS, int(spec)))


def _page_tiles_rule(spec: str):
    if spec == "rule":
        return _RULE_PAGE_TILES
    on = spec == "on"
    # The addressing needs tiles that divide pages, whatever the spec.
    return lambda block_size, tile: on and block_size % tile.block_n == 0


def _run(step: cases.PagedStep, setting: Setting, splits: int, kv_cache, query, out) -> None:
    block_h, block_n, warps, stages, _, page_spec = setting
    args = (query, kv_cache, step.block_table, step.cu_query_lengths, step.kv_lengths)
    # The plan reads the rule from its module when it is built, so the setting's rule is put
    # there for the plan's construction only.
    attention_plan.page_tiles = _page_tiles_rule(page_spec)
    try:
        plan = mla.LatentAttentionPlan(
            *args,
            cases.SOFTMAX_SCALE,
            out,
            latent_dim=step.latent,
            tile=mla.TileShape(1, block_h, block_n, warps),
            num_kv_splits=splits,
            num_stages=stages,
        )
    finally:
        attention_plan.page_tiles = _RULE_PAGE_TILES
    plan(*args, out)


def _compile(job: Tuple[Tuple[int, int, int], List[Setting]]) -> List[str]:
    """Compile each setting of one shape (a small batch of the same context and heads: the same
    specialisation); returns the errors."""
    (batch, context, heads), settings = job
    step = cases.build_step(cases.decode_requests(min(batch, 2), context), heads, device="cuda")
    out = torch.empty_like(step.query[..., : step.latent])
    errors = []
    for setting in settings:
        try:
            splits = _splits(setting[4], batch, context, heads, setting[0], setting[2])
            _run(step, setting, splits, step.kv_cache, step.query, out)
        except Exception as error:  # reported by the timing pass
            errors.append(f"{setting}: {type(error).__name__}: {str(error)[:200]}")
    torch.cuda.synchronize()
    return errors


def _settings(args, heads: int) -> List[Setting]:
    out = []
    for block_h, block_n, warps, stages, split, page in itertools.product(
        args.block_h, args.block_n, args.warps, args.stages, args.splits, args.page_tiles
    ):
        if block_h > max(16, 1 << (heads - 1).bit_length()):
            continue  # wider than the heads: the same as a narrower tile, with idle rows
        if block_h * cases.LATENT > 128 * 32 * warps:
            continue  # more than 128 accumulator registers per thread: spills
        out.append((block_h, block_n, warps, stages, split, page))
    return out


def main(argv: Sequence[str] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES)
    parser.add_argument("--block-h", nargs="+", type=int, default=[16, 32, 64])
    parser.add_argument("--block-n", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--stages", nargs="+", type=int, default=[2, 3])
    parser.add_argument("--splits", nargs="+", default=["default", "1x", "2x", "3x"])
    parser.add_argument("--page-tiles", nargs="+", default=["rule"], choices=["rule", "on", "off"])
    parser.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the sweep needs a GPU")
        return 2
    shapes = [_parse_shape(s) for s in args.shapes]
    t0 = time.time()
    jobs = []
    for shape in shapes:
        settings = _settings(args, shape[2])
        per = max(1, math.ceil(len(settings) / max(1, args.jobs // len(shapes))))
        jobs += [(shape, settings[i : i + per]) for i in range(0, len(settings), per)]
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        for errors in pool.imap_unordered(_compile, jobs):
            for error in errors:
                print("compile:", error)
    print(
        f"compiled {sum(len(j[1]) for j in jobs)} settings in {time.time() - t0:.0f} s", flush=True
    )
    ceiling = _copy_ceiling(False)
    print(f"copy ceiling {ceiling['tb_per_s']:.2f} TB/s")
    results = []
    for batch, context, heads in shapes:
        step = cases.build_step(cases.decode_requests(batch, context), heads, device="cuda")
        nbytes = cases.step_bytes(step.requests, heads)["minimum"]
        sets = _attention_sets(step, nbytes)
        reference = cases.paged_attention(step, *sets[0]).clone()
        rows = []
        for setting in _settings(args, heads):
            splits = _splits(setting[4], batch, context, heads, setting[0], setting[2])
            row = {
                "shape": [batch, context, heads],
                "block_h": setting[0],
                "block_n": setting[1],
                "warps": setting[2],
                "stages": setting[3],
                "splits_spec": setting[4],
                "splits": splits,
                "page_tiles": setting[5],
            }
            try:
                for s in sets[:2]:
                    _run(step, setting, splits, *s)
                torch.cuda.synchronize()
                row["diff"] = (sets[0][2].float() - reference.float()).abs().max().item()
                row.update(
                    graph_us(functools.partial(_run, step, setting, splits), sets, quick=True)
                )
                row["pct_ceiling"] = (
                    100 * nbytes / (row["gpu_us"] * 1e-6) / (ceiling["tb_per_s"] * 1e12)
                )
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            rows.append(row)
        del sets, step
        torch.cuda.empty_cache()
        ok = [r for r in rows if "gpu_us" in r and r["diff"] < 0.05]
        ok.sort(key=lambda r: r["gpu_us"])
        print(f"\n=== b{batch} ctx {context} heads {heads} ({nbytes / 1e6:.1f} MB)")
        print(" block_h block_n warps stages splits(spec)   pages      gpu us  %ceil      diff")
        for r in ok:
            print(
                f" {r['block_h']:7} {r['block_n']:7} {r['warps']:5} {r['stages']:6} "
                f"{r['splits']:3} ({r['splits_spec']:>7}) {r['page_tiles']:>5} {r['gpu_us']:10.1f} "
                f"{r['pct_ceiling']:5.1f}% {r['diff']:9.2e}"
            )
        for r in rows:
            if r not in ok:
                print(
                    "  not ranked:",
                    {
                        k: r.get(k)
                        for k in (
                            "block_h",
                            "block_n",
                            "warps",
                            "stages",
                            "splits",
                            "page_tiles",
                            "diff",
                            "error",
                        )
                    },
                )
        results += rows
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"ceiling": ceiling, "rows": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
