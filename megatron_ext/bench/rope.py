# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""MLA query RoPE: megatron-core's two-load Triton kernels against megatron_ext's contiguous ones.

    python -m megatron_ext.bench rope [--out DIR] [--quick]

On a GPU, for DeepSeek-V3's query ([tokens, 1, 128, 192], RoPE on the last 64 elements) in bf16
and fp32, it times the in-place forward and backward kernels of both packages in one process,
each autotuned for each shape, with ``triton.testing.do_bench`` medians (which flush the L2
cache before each run) of one launch replayed from a CUDA graph (so that Python launch overhead
stays out of the timing), rotating over input copies that together exceed the L2. It also
measures the device's copy bandwidth (``torch`` ``copy_``, bytes read plus written) and reports
each kernel's bytes (the RoPE part read and written once) over its time, as TB/s and as a share
of that copy ceiling, the speedup, and whether both kernels produced the same bits. Writes
``rope.json`` and ``rope.png`` (if matplotlib is importable) to ``--out``.

Without a GPU it says so and checks the kernels against megatron-core's in the Triton
interpreter on small shapes instead.
"""

import argparse
import json
import math
import os
import platform
from typing import Callable, Dict, List, Optional, Tuple

import torch

SHAPES = [(4096, 1, 128, 192), (16384, 1, 128, 192), (1, 1, 128, 192), (64, 1, 128, 192)]
QK_HEAD_DIM, EMB_DIM = 128, 64
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Inputs smaller than this are rotated over several buffers: larger than the H200's L2 (~50 MB).
_ROTATE_BYTES = 256 << 20


def _tables(rows: int, dtype: torch.dtype, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """YaRN-style cos/sin ([rows, 1, 1, emb]); a rotation, so repeated in-place runs stay finite."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, EMB_DIM, 2, dtype=torch.float64) / EMB_DIM))
    angles = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, None, :]
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def _rope_bytes(shape, dtype) -> int:
    s, b, h, _ = shape
    return 2 * s * b * h * EMB_DIM * torch.empty((), dtype=dtype).element_size()


def _median_us(fn: Callable[[], None], quick: bool) -> float:
    import triton

    ms = triton.testing.do_bench(
        fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median"
    )
    return ms * 1e3


def _copy_ceiling(quick: bool) -> Dict[str, float]:
    """Copy bandwidth (read + write) of a large device-to-device copy_, in TB/s."""
    n = (256 if quick else 1024) << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = _median_us(lambda: dst.copy_(src), quick)
    return {"bytes": 2 * n, "us": us, "tb_per_s": 2 * n / us / 1e6}


def _same_size_copy(nbytes: int, quick: bool) -> float:
    """copy_ of nbytes / 2 bytes (nbytes moved), timed like the kernels; in us."""
    half = max(nbytes // 2, 1)
    src = torch.empty(half, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    return _median_us(lambda: dst.copy_(src), quick)


def _time_rotated(run, base: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, quick: bool):
    """do_bench median of one launch replayed from a CUDA graph, over rotating input copies.

    Replaying a captured launch keeps the Python launch path (argument checks, the autotuner's
    dispatch: tens of microseconds) out of the timed region, which do_bench's L2 flush alone does
    not hide for short kernels. Copies of small inputs rotate so that they exceed the L2.
    """
    count = max(1, math.ceil(_ROTATE_BYTES / max(base.numel() * base.element_size(), 1)))
    buffers = [base.clone() for _ in range(min(count, 64))]
    graphs = []
    for x in buffers:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run(x, cos, sin)
        graphs.append(graph)
    state = [0]

    def replay() -> None:
        state[0] = (state[0] + 1) % len(graphs)
        graphs[state[0]].replay()

    return _median_us(replay, quick)


def _mcore_launcher(backward: bool):
    """megatron-core's autotuned in-place query kernel, called as its autograd function does."""
    import triton
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mc

    kernel = mc.rotary_bwd_q_kernel if backward else mc.rotary_fwd_q_kernel

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        s, b, h, d = x.shape
        flat = x.view(s * b, h, d)
        grid = lambda meta: (s * b, triton.cdiv(h, meta["BLOCK_H"]))  # noqa: E731
        kernel[grid](
            flat,
            cos,
            sin,
            QK_HEAD_DIM,
            EMB_DIM,
            h,
            b,
            None,
            None,
            flat.stride(0),
            flat.stride(1),
            0,
            1,
        )

    return kernel, run


def _ours_launcher(backward: bool):
    """megatron_ext's autotuned in-place query kernel through its launcher (the argument checks
    run when the graph is captured, not when it is replayed)."""
    from megatron_ext.fusions import fused_mla_yarn_rope_apply as ours

    fn = ours.mla_rope_q_bwd_ if backward else ours.mla_rope_q_fwd_

    def run(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        fn(x, cos, sin, QK_HEAD_DIM, EMB_DIM)

    return ours, run


def _clear_tuning(kernel) -> None:
    if hasattr(kernel, "clear_autotune_cache"):  # megatron_ext's module
        kernel.clear_autotune_cache()
    else:  # a triton.autotune kernel
        kernel.cache.clear()


def _best_config(kernel) -> str:
    if hasattr(kernel, "autotuned_configs"):
        chosen = list(kernel.autotuned_configs().values())
        return ",".join(f"BLOCK_H={c.block_h},w={c.num_warps}" for c in chosen) or "?"
    best = getattr(kernel, "best_config", None)
    if best is None:
        return "?"
    return f"BLOCK_H={best.kwargs.get('BLOCK_H')},w={best.num_warps}"


def _bench_gpu(args) -> int:
    quick = args.quick
    dtypes = ["bf16"] if quick else list(DTYPES)
    shapes = SHAPES[:1] + SHAPES[2:] if quick else SHAPES
    ceiling = _copy_ceiling(quick)
    print(f"copy ceiling: {ceiling['tb_per_s']:.3f} TB/s ({ceiling['bytes'] / 1e9:.1f} GB copied)")
    rows = []
    all_equal = True
    for dname in dtypes:
        dtype = DTYPES[dname]
        for shape in shapes:
            nbytes = _rope_bytes(shape, dtype)
            cos, sin = _tables(shape[0], dtype, "cuda")
            gen = torch.Generator(device="cuda").manual_seed(0)
            base = torch.randn(shape, device="cuda", generator=gen, dtype=torch.float32).to(dtype)
            copy_us = _same_size_copy(nbytes, quick)
            for backward in (False, True):
                times, configs = {}, {}
                outs = {}
                for name, make in (("mcore", _mcore_launcher), ("ours", _ours_launcher)):
                    kernel, run = make(backward)
                    _clear_tuning(kernel)  # autotune for this shape, not the previous one
                    out = base.clone()
                    run(out, cos, sin)  # the first call autotunes (restoring its input)
                    torch.cuda.synchronize()
                    outs[name] = out
                    configs[name] = _best_config(kernel)
                    times[name] = _time_rotated(run, base, cos, sin, quick)
                equal = torch.equal(
                    outs["mcore"].view(torch.int16 if dtype != torch.float32 else torch.int32),
                    outs["ours"].view(torch.int16 if dtype != torch.float32 else torch.int32),
                )
                all_equal &= equal
                floor_us = nbytes / (ceiling["tb_per_s"] * 1e6)
                row = {
                    "shape": list(shape),
                    "dtype": dname,
                    "direction": "bwd" if backward else "fwd",
                    "bytes": nbytes,
                    "mcore_us": times["mcore"],
                    "mcore_config": configs["mcore"],
                    "ours_us": times["ours"],
                    "ours_config": configs["ours"],
                    "floor_us": floor_us,
                    "same_size_copy_us": copy_us,
                    "ours_tb_per_s": nbytes / times["ours"] / 1e6,
                    "mcore_tb_per_s": nbytes / times["mcore"] / 1e6,
                    "ours_pct_ceiling": 100 * floor_us / times["ours"],
                    "mcore_pct_ceiling": 100 * floor_us / times["mcore"],
                    "speedup": times["mcore"] / times["ours"],
                    "bitwise_equal": equal,
                }
                rows.append(row)
                print(
                    f"{str(shape):20s} {dname} {row['direction']}: mcore {times['mcore']:.1f} us "
                    f"({configs['mcore']}), ours {times['ours']:.1f} us ({configs['ours']}), "
                    f"equal={equal}",
                    flush=True,
                )
            del base, cos, sin
            torch.cuda.empty_cache()
    result = {
        "benchmark": "mla_rope_q",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "copy_ceiling": ceiling,
        "timing": (
            "triton.testing.do_bench median (L2 flushed before each run) of one launch replayed "
            "from a CUDA graph, rotating over input copies"
        ),
        "rows": rows,
    }
    _write_outputs(args.out, result)
    _print_table(result)
    return 0 if all_equal else 1


def _write_outputs(out: Optional[str], result: Dict) -> None:
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "rope.json"), "w") as f:
        json.dump(result, f, indent=2)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no rope.png written (pip install matplotlib)")
        return
    rows = result["rows"]
    labels = [f"{r['shape'][0]}\n{r['dtype']} {r['direction']}" for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(max(8, 0.9 * len(rows)), 4.5))
    width = 0.4
    ax.bar(
        [x - width / 2 for x in xs],
        [r["mcore_pct_ceiling"] for r in rows],
        width,
        label="megatron-core (two loads / two stores)",
    )
    ax.bar(
        [x + width / 2 for x in xs],
        [r["ours_pct_ceiling"] for r in rows],
        width,
        label="megatron_ext (contiguous)",
    )
    ax.axhline(100, color="k", linewidth=0.8, linestyle="--")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("% of copy ceiling (RoPE bytes / time)")
    ax.set_title(f"MLA query RoPE, [tokens, 1, 128, 192], {result['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "rope.png"), dpi=120)
    plt.close(fig)


def _print_table(result: Dict) -> None:
    print(
        "=== table: MLA query RoPE (do_bench medians; % of the copy ceiling "
        f"{result['copy_ceiling']['tb_per_s']:.2f} TB/s)"
    )
    head = (
        f"{'shape':>20} {'dtype':>5} {'dir':>3} {'mcore us':>9} {'ours us':>8} "
        f"{'floor us':>8} {'TB/s':>5} {'%ceil':>6} {'mcore %':>7} {'speedup':>7} {'bitwise':>7}"
    )
    print(head)
    for r in result["rows"]:
        print(
            f"{str(tuple(r['shape'])):>20} {r['dtype']:>5} {r['direction']:>3} "
            f"{r['mcore_us']:9.1f} {r['ours_us']:8.1f} {r['floor_us']:8.1f} "
            f"{r['ours_tb_per_s']:5.2f} {r['ours_pct_ceiling']:5.1f}% "
            f"{r['mcore_pct_ceiling']:6.1f}% "
            f"{r['speedup']:6.2f}x {'yes' if r['bitwise_equal'] else 'NO':>7}"
        )


def _check_interpreted() -> int:
    """Small-shape agreement with megatron-core's kernels in the Triton interpreter (no GPU)."""
    os.environ.setdefault("TRITON_INTERPRET", "1")
    from megatron.core.fusions import fused_mla_yarn_rope_apply as mc

    from megatron_ext.fusions import fused_mla_yarn_rope_apply as ours

    torch.manual_seed(0)
    failures = 0
    for dtype in (torch.float32, torch.float16):
        s, b, h, qk, emb = 4, 2, 4, 8, 16
        x = torch.randn(s, b, h, qk + emb).to(dtype)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, emb, 2, dtype=torch.float64) / emb))
        angles = torch.arange(s, dtype=torch.float64)[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], -1)[:, None, None, :]
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        for backward in (False, True):
            kernel = mc.rotary_bwd_q_kernel if backward else mc.rotary_fwd_q_kernel
            theirs = x.clone().view(s * b, h, -1)
            kernel.fn[(s * b, h // 2)](
                theirs,
                cos,
                sin,
                qk,
                emb,
                h,
                b,
                None,
                None,
                theirs.stride(0),
                theirs.stride(1),
                0,
                1,
                BLOCK_H=2,
            )
            mine = x.clone()
            with ours.pinned_kernel_config(2, 1):
                (ours.mla_rope_q_bwd_ if backward else ours.mla_rope_q_fwd_)(
                    mine, cos, sin, qk, emb
                )
            err = (mine.view_as(theirs).double() - theirs.double()).abs().max().item()
            # Interpreted, megatron-core rounds each product; ours fuses one: a few ulp apart.
            ok = err <= 4 * torch.finfo(dtype).eps * max(1.0, theirs.abs().max().item())
            failures += not ok
            print(
                f"interpreter {dtype} {'bwd' if backward else 'fwd'}: max |ours - megatron-core| "
                f"= {err:.3g} ({'ok' if ok else 'MISMATCH'})"
            )
    return 1 if failures else 0


def main(argv: Optional[List[str]] = None) -> int:
    """Run the benchmark.

    Args:
        argv: command-line arguments (``--out DIR``, ``--quick``).

    Returns:
        int: 0 on success; 1 if outputs differed in their bits or the interpreter check failed.
    """
    parser = argparse.ArgumentParser(
        prog="python -m megatron_ext.bench rope",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=None, help="directory for rope.json and rope.png")
    parser.add_argument("--quick", action="store_true", help="bf16 only, fewer repetitions")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "No CUDA GPU: the RoPE benchmark needs one, so no timings. Checking the kernels "
            "against megatron-core's in the Triton interpreter on small shapes instead."
        )
        return _check_interpreted()
    return _bench_gpu(args)


if __name__ == "__main__":
    raise SystemExit(main())
