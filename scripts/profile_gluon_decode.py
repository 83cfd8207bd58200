# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Profile one launch of the warp-specialized decode kernel with Nsight Compute: where its time
goes (tensor pipe, shared memory, warp stalls), on one decode step of the serving benchmark.

    python scripts/profile_gluon_decode.py [--shape B CTX HEADS] [--out DIR]
        [--variant KEY_TILE,BUFFERS,ORDER[,P_BUFFERS[,HEADS_FIRST]]]

Runs ``ncu --set full`` on the Gluon kernel of one step (built as ``bench mla-serving`` builds
it: bf16, page 64, shuffled pages; the launcher's plan and split count), keeps the report
(``DIR/gluon.ncu-rep``, ``DIR/raw.csv``, ``DIR/details.txt``, ``DIR/sass.csv``) and prints the
figures that decide what bounds the kernel: duration, SM and memory throughput, the tensor pipe's
and shared memory's shares of their peaks, L2 hit rate, the bytes read from DRAM against the
step's cache bytes (at more than 64 heads a token's head groups are programs of their own that
read the same key tiles: a ratio near 2 says the second reads them from memory, not from L2), the
warp-stall reasons by share, and the SASS instructions that took the most stall samples.
``--launch-only`` is the launch ncu profiles (it compiles first, outside the profile).
``--variant`` profiles the kernel with another ring, order or program order (as
``scripts/sweep_gluon_decode.py`` names them) in the launcher's place.
"""

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The sweep's variant parser, wherever this file is run or imported from.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

DRAM_READ = "dram__bytes_read.sum"
# Raw metrics printed: those whose names start with one of these (ncu's "full" set; which of
# them a release reports varies).
METRICS = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op",
    "sm__inst_executed_pipe_tensor",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared",
    "lts__t_sector_hit_rate.pct",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    DRAM_READ,
)
# ncu's byte units, in bytes.
_BYTE_UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "Tbyte": 1e12}
# Warp-stall reasons, per issued instruction.
STALL = ("smsp__average_warps_issue_stalled_", "_per_issue_active.ratio")
# The source page's column of a SASS instruction's stall samples (every warp state sampled at it).
SAMPLES = "Warp Stall Sampling (All Samples)"


def launch(shape: Sequence[int], variant: str = None) -> None:
    """One Gluon launch of the step (a first run of this compiles it into Triton's cache)."""
    import torch

    from megatron_ext.bench import mla_serving_cases as cases

    if variant:
        from sweep_gluon_decode import apply_variant

        apply_variant(variant)

    batch, context, heads = shape
    step = cases.build_step(cases.decode_requests(batch, context), heads, device="cuda")
    out = torch.empty_like(step.query[..., : step.latent])
    call, splits = cases.planned_attention(step, out, "gluon")
    call(step.kv_cache, step.query, out)
    torch.cuda.synchronize()
    print(f"batch {batch}, context {context}, heads {heads}: {splits} split(s)", flush=True)


def read_raw(path: str) -> Dict[str, str]:
    """The last kernel's metrics in ncu's ``--page raw --csv`` export: name -> "value unit".

    Args:
        path: the CSV file (a header row, a units row, a row per kernel).

    Returns:
        Dict[str, str]: each metric's value and unit.
    """
    with open(path) as f:
        rows: List[List[str]] = list(csv.reader(f))
    header, units, values = rows[0], rows[1], rows[-1]
    return {h: f"{v} {u}".strip() for h, u, v in zip(header, units, values)}


def byte_count(value: str) -> Optional[float]:
    """A byte metric's ``"value unit"`` (as :func:`read_raw` gives it) in bytes, None if it is
    not one."""
    parts = value.replace(",", "").split()
    if len(parts) != 2 or parts[1] not in _BYTE_UNITS:
        return None
    try:
        return float(parts[0]) * _BYTE_UNITS[parts[1]]
    except ValueError:
        return None


def summary(raw: Dict[str, str], cache_bytes: Optional[int] = None) -> List[str]:
    """The lines printed for a kernel's metrics: the chosen metrics, the DRAM bytes read against
    the step's cache bytes, then the warp-stall reasons by their share of the stalls (the eight
    largest).

    Args:
        raw: :func:`read_raw`'s metrics.
        cache_bytes: the bytes of the cache rows the step attends (each once), or None.

    Returns:
        List[str]: the lines.
    """
    lines = [f"  {name:75} {value}" for name, value in raw.items() if name.startswith(METRICS)]
    if cache_bytes:
        read = byte_count(raw.get(DRAM_READ, ""))
        ratio = "not reported" if read is None else f"{read / cache_bytes:.2f}"
        lines.append(f"  {'DRAM bytes read / the cache bytes the step attends':75} {ratio}")
    stalls = {}
    for name, value in raw.items():
        if name.startswith(STALL[0]) and name.endswith(STALL[1]):
            try:
                stalls[name[len(STALL[0]) : -len(STALL[1])]] = float(value.split()[0])
            except (ValueError, IndexError):
                continue
    total = sum(stalls.values()) or 1.0
    lines.append("  warp stalls (share of stalled cycles):")
    for reason, value in sorted(stalls.items(), key=lambda kv: -kv[1])[:8]:
        lines.append(f"    {reason:40} {100 * value / total:5.1f}%")
    return lines


def hot_instructions(path: str, count: int = 25) -> List[str]:
    """The SASS instructions that took the most stall samples, in ncu's ``--page source
    --print-source sass --csv`` export: which instruction each partition waits at (a consumer's
    ``WARPGROUP.DEPBAR``, a barrier, an exponential's result), where the summary gives one share
    for the whole kernel.

    Args:
        path: the CSV file (a header row, a row per instruction; columns vary by release).
        count: how many instructions to print.

    Returns:
        List[str]: a line per instruction (address, share of all samples, source), or one line
        saying the export has no sample column.
    """
    with open(path) as f:
        rows = [row for row in csv.reader(f) if row]
    header = next((i for i, row in enumerate(rows) if SAMPLES in row), None)
    if header is None:
        return [f"  no '{SAMPLES}' column in {os.path.basename(path)}"]
    names = rows[header]
    col, src = names.index(SAMPLES), names.index("Source") if "Source" in names else None
    addr = names.index("Address") if "Address" in names else None
    hot = []
    for row in rows[header + 1 :]:
        try:
            samples = float(row[col].replace(",", ""))
        except (ValueError, IndexError):
            continue  # a units row or a kernel's separator
        hot.append(
            (samples, row[addr] if addr is not None else "", row[src] if src is not None else "")
        )
    total = sum(h[0] for h in hot) or 1.0
    lines = [f"  hottest SASS instructions (share of {int(total)} stall samples):"]
    for samples, address, source in sorted(hot, key=lambda h: -h[0])[:count]:
        lines.append(f"    {address:>8} {100 * samples / total:5.1f}%  {source.strip()[:90]}")
    return lines


def main(argv: Sequence[str] = None) -> int:
    from sweep_gluon_decode import variant_arg  # torch and the package: not before a run

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", nargs=3, type=int, default=[128, 2048, 128])
    parser.add_argument("--out", default=None)
    parser.add_argument("--variant", type=variant_arg, default=None)
    parser.add_argument("--launch-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.launch_only:
        launch(args.shape, args.variant)
        return 0
    if shutil.which("ncu") is None:
        print("Nsight Compute's ncu is not on PATH")
        return 2
    out = args.out or tempfile.mkdtemp(prefix="gluon-ncu-")
    os.makedirs(out, exist_ok=True)
    report = os.path.join(out, "gluon")
    me = [sys.executable, os.path.abspath(__file__), "--launch-only", "--shape"]
    me += [str(x) for x in args.shape] + (["--variant", args.variant] if args.variant else [])
    subprocess.run(me, check=True)  # compiles outside the profile
    ncu = ["ncu", "-k", "regex:_gluon_decode_kernel", "-c", "1", "--set", "full"]
    subprocess.run(ncu + ["-f", "-o", report] + me, check=True)
    with open(os.path.join(out, "raw.csv"), "w") as f:
        subprocess.run(["ncu", "-i", report + ".ncu-rep", "--page", "raw", "--csv"], stdout=f)
    with open(os.path.join(out, "details.txt"), "w") as f:
        subprocess.run(["ncu", "-i", report + ".ncu-rep", "--page", "details"], stdout=f)
    with open(os.path.join(out, "sass.csv"), "w") as f:
        page = ["--page", "source", "--print-source", "sass", "--csv"]
        subprocess.run(["ncu", "-i", report + ".ncu-rep"] + page, stdout=f)
    raw = read_raw(os.path.join(out, "raw.csv"))
    shape = " x ".join(map(str, args.shape))
    label = args.variant or "as launched"
    print(f"\nGluon decode kernel {label}, batch x context x heads: {shape}")
    from megatron_ext.bench import mla_serving_cases as cases

    batch, context, heads = args.shape
    cache_bytes = cases.step_bytes(cases.decode_requests(batch, context), heads)["cache"]
    print("\n".join(summary(raw, cache_bytes)))
    print("\n".join(hot_instructions(os.path.join(out, "sass.csv"))))
    print(f"report: {report}.ncu-rep")
    return 0


if __name__ == "__main__":
    sys.exit(main())
