# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Relaunch an MLA RoPE kernel many times and count the launches whose output bits differ.

A kernel whose threads read addresses that other threads of the same program write, with nothing
ordering the two (megatron-core's in-place query backward, see docs/perf_notes/mcore_rope_races.md),
can give different bits from launch to launch on the same input. :func:`relaunch` launches one
kernel ``launches`` times, the in-place ones each time on a fresh copy of one input, compares every
output with the first launch's on the device and returns the count without a host sync, so a
caller can measure many configs and sync once per config.

Used by test_kernels.py (megatron_ext's kernels at every config; megatron-core's race) and by
survey_megatron_core_races.py (megatron-core's kernels at every config its autotuner can pick).
Reports go to the folder in ``MEGATRON_EXT_REPORT_DIR`` when it is set.
"""

import json
import os
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from megatron_ext.fusions.fused_mla_yarn_rope_apply import (
    KernelConfig,
    mla_rope_kv_bwd,
    mla_rope_kv_fwd,
    mla_rope_q_bwd,
    mla_rope_q_bwd_,
    mla_rope_q_fwd_,
    pinned_kernel_config,
)
from tests.unit_tests.fusions.mla_rope_testlib import (
    DTYPES,
    Case,
    bits,
    make_case,
    make_tables,
    parallel_compile,
    randn,
    run_mcore_kv_bwd,
    run_mcore_kv_fwd,
    run_mcore_q,
)

REPORT_DIR_ENV = "MEGATRON_EXT_REPORT_DIR"
# The kernels megatron-core has too (its counterparts are relaunched and surveyed as well).
KERNELS = ("q_fwd", "q_bwd", "kv_fwd", "kv_bwd")
# megatron_ext's kernels without a megatron-core counterpart: the query backward into a new tensor.
OURS_ONLY = ("q_bwd_copy",)
# The kernels that rotate their input in place: the ones that can race with themselves.
IN_PLACE = ("q_fwd", "q_bwd")
OURS = "megatron_ext"
MCORE = "megatron-core"


@dataclass(frozen=True)
class Dims:
    """Per-head sizes: DeepSeek-V3's by default."""

    qk_head_dim: int = 128
    emb_dim: int = 64
    k_dim: int = 128
    v_dim: int = 128


@dataclass
class Inputs:
    """One kernel's inputs: ``tensors`` is (q,) for the query kernels, (kv, k_pos_emb) for the
    key/value forward and (dkey, dvalue) for the key/value backward."""

    kernel: str
    dtype: str
    case: Case
    dims: Dims
    tensors: Tuple[torch.Tensor, ...]
    cos: torch.Tensor
    sin: torch.Tensor

    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(self.tensors[0].shape)


def make_inputs(
    kernel: str,
    heads: int,
    dtype: str,
    device,
    seq_len: int = 64,
    batch: int = 2,
    dims: Dims = Dims(),
    seed: int = 0,
) -> Inputs:
    """sbhd inputs of one kernel from a fixed seed; cos/sin in the same dtype."""
    g = torch.Generator().manual_seed(seed)
    case = make_case("sbhd", heads, device, dims.qk_head_dim, dims.emb_dim, seq_len, batch, g)
    lead = (seq_len, batch)
    dt = DTYPES[dtype]
    if kernel in IN_PLACE + OURS_ONLY:
        tensors = (randn(lead + (heads, dims.qk_head_dim + dims.emb_dim), dt, device, g),)
    elif kernel == "kv_fwd":
        tensors = (
            randn(lead + (heads, dims.k_dim + dims.v_dim), dt, device, g),
            randn(lead + (1, dims.emb_dim), dt, device, g),
        )
    elif kernel == "kv_bwd":
        tensors = (
            randn(lead + (heads, dims.k_dim + dims.emb_dim), dt, device, g),
            randn(lead + (heads, dims.v_dim), dt, device, g),
        )
    else:
        raise ValueError(f"kernel must be one of {KERNELS + OURS_ONLY}, got {kernel!r}")
    cos, sin = make_tables(case.table_rows, dims.emb_dim, dt, device, generator=g)
    return Inputs(kernel, dtype, case, dims, tensors, cos, sin)


def ours(inputs: Inputs) -> Callable:
    """megatron_ext's kernel through its public launcher, at the config pinned by the caller.

    Returns ``launch(x)`` (in place on x) for the query kernels, ``launch() -> outputs`` otherwise.
    """
    d, cos, sin = inputs.dims, inputs.cos, inputs.sin
    if inputs.kernel in IN_PLACE:
        fn = mla_rope_q_fwd_ if inputs.kernel == "q_fwd" else mla_rope_q_bwd_
        return lambda x: fn(x, cos, sin, d.qk_head_dim, d.emb_dim)
    if inputs.kernel == "q_bwd_copy":
        (g,) = inputs.tensors
        return lambda: (mla_rope_q_bwd(g, cos, sin, d.qk_head_dim, d.emb_dim),)
    a, b = inputs.tensors
    fn = mla_rope_kv_fwd if inputs.kernel == "kv_fwd" else mla_rope_kv_bwd
    return lambda: fn(a, b, cos, sin, d.emb_dim, d.k_dim, d.v_dim)


def megatron_core(inputs: Inputs, block_h: int, num_warps: int, warmup: bool = False) -> Callable:
    """megatron-core's kernel at one BLOCK_H and num_warps, its autotuner bypassed.

    Only for mask-correct configs (mla_rope_testlib.megatron_core_mask_correct): elsewhere it
    writes past its outputs. With ``warmup`` the callable only compiles.
    """
    case, d, cos, sin = inputs.case, inputs.dims, inputs.cos, inputs.sin
    config = dict(warmup=warmup, num_warps=num_warps)
    if inputs.kernel in IN_PLACE:
        backward = inputs.kernel == "q_bwd"
        return lambda x: run_mcore_q(backward, case, x, cos, sin, block_h, **config)
    a, b = inputs.tensors
    fn = run_mcore_kv_fwd if inputs.kernel == "kv_fwd" else run_mcore_kv_bwd
    return lambda: fn(case, a, b, cos, sin, d.k_dim, d.v_dim, block_h, **config)


def count_differing(outputs: torch.Tensor) -> torch.Tensor:
    """How many of ``outputs[1:]`` differ in any bit from ``outputs[0]`` (a 0-dim device tensor)."""
    flat = bits(outputs).reshape(outputs.shape[0], -1)
    return (flat != flat[:1]).any(dim=1).sum()


def relaunch(
    inputs: Inputs, launch: Callable, launches: int
) -> Tuple[Tuple[torch.Tensor, ...], torch.Tensor]:
    """Launch a kernel ``launches`` times and count the launches whose bits differ from the first.

    In-place kernels run each time on a fresh copy of the input; the others on the same inputs,
    each launch into new outputs. Nothing here syncs with the host.

    Args:
        inputs: the kernel's inputs (:func:`make_inputs`).
        launch: from :func:`ours` or :func:`megatron_core`.
        launches: how many times to launch (>= 2).

    Returns:
        (the first launch's outputs, the count of differing launches as a 0-dim int64 tensor).
    """
    if launches < 2:
        raise ValueError(f"launches must be >= 2, got {launches}")
    if inputs.kernel in IN_PLACE:
        x = inputs.tensors[0]
        copies = x.unsqueeze(0).repeat(launches, *([1] * x.dim()))
        for i in range(launches):
            launch(copies[i])
        return (copies[0],), count_differing(copies)
    first = tuple(launch())
    first_bits = [bits(t) for t in first]
    count = torch.zeros((), dtype=torch.int64, device=first[0].device)
    for _ in range(launches - 1):
        differ = torch.zeros((), dtype=torch.bool, device=count.device)
        for out, ref in zip(launch(), first_bits):
            differ |= (bits(out) != ref).any()
        count += differ
    return first, count


def same_bits(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """Whether two output tuples hold the same bits (a 0-dim device bool, no host sync)."""
    equal = torch.ones((), dtype=torch.bool, device=a[0].device)
    for x, y in zip(a, b):
        equal &= (bits(x) == bits(y)).all()
    return equal


def compile_ours(inputs: Inputs, configs: Sequence[KernelConfig], threads: int = 8) -> None:
    """Launch megatron_ext's kernel once at each config on several threads, so that Triton compiles
    the variants in parallel (it compiles inside the launch, mostly outside the GIL).

    One variant per config serves every head count (the head count is a runtime argument). The
    first launch runs on this thread: it creates Triton's per-device kernel caches, which two
    threads must not create at once. Nothing to compile in the Triton interpreter.
    """
    if not configs or inputs.tensors[0].device.type != "cuda":
        return
    launch = ours(inputs)

    def once(config: KernelConfig) -> None:
        # Each thread pins its own config: the pin is a context variable, per thread.
        with pinned_kernel_config(config.block_h, config.num_warps):
            if inputs.kernel in IN_PLACE:
                launch(inputs.tensors[0][:1].clone())  # one token: same strides, same variant
            else:
                launch()

    once(configs[0])
    with ThreadPoolExecutor(max(1, min(threads, os.cpu_count() or 1))) as pool:
        futures = [pool.submit(once, config) for config in configs[1:]]
    for config, future in zip(configs[1:], futures):
        if future.exception() is not None:
            # Only a head start: the relaunch launches this config again and raises there.
            warnings.warn(
                f"compiling {inputs.kernel} at {config} failed: {future.exception()!r}",
                stacklevel=2,
            )
    torch.cuda.synchronize()


def compile_megatron_core(jobs: Iterable[Tuple[Inputs, int, int]]) -> None:
    """Compile megatron-core's kernels for (inputs, BLOCK_H, num_warps) jobs in parallel, without
    launching them. Nothing to compile in the Triton interpreter."""
    jobs = [job for job in jobs if job[0].tensors[0].device.type == "cuda"]
    with parallel_compile():
        for inputs, block_h, num_warps in jobs:
            launch = megatron_core(inputs, block_h, num_warps, warmup=True)
            if inputs.kernel in IN_PLACE:
                launch(inputs.tensors[0])
            else:
                launch()


# --------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Relaunch:
    """One measurement: a kernel at one config on one input, relaunched ``launches`` times."""

    impl: str  # megatron_ext or megatron-core
    kernel: str  # one of KERNELS or OURS_ONLY
    dtype: str  # bf16, fp16, fp32
    shape: Tuple[int, ...]  # of the kernel's first input
    block_h: int
    num_warps: int
    launches: int
    differing: int  # launches whose output differs in any bit from the first launch's
    # megatron_ext only: whether the first launch equals the first config's (same input).
    equals_first_config: Optional[bool] = None


def _config_rows(records: Sequence[Relaunch]) -> List[str]:
    """One row per (impl, kernel, dtype, num_warps); one 'differing/launches' column per BLOCK_H,
    summed over the shapes."""
    block_hs = sorted({r.block_h for r in records})
    cells: Dict[tuple, Dict[int, List[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for r in records:
        cell = cells[(r.impl, r.kernel, r.dtype, r.num_warps)][r.block_h]
        cell[0] += r.differing
        cell[1] += r.launches
    head = "| impl | kernel | dtype | warps | " + " | ".join(f"BLOCK_H {b}" for b in block_hs)
    rows = [head + " |", "|" + " --- |" * (4 + len(block_hs))]
    for key in sorted(cells):
        row = cells[key]
        values = [f"{row[b][0]}/{row[b][1]}" if b in row else "-" for b in block_hs]
        rows.append("| " + " | ".join([*map(str, key), *values]) + " |")
    return rows


def config_table(records: Sequence[Relaunch]) -> str:
    """Markdown: differing launches / launches per config (BLOCK_H x num_warps), shapes summed."""
    shapes = sorted({r.shape for r in records})
    note = "shapes: " + ", ".join("x".join(map(str, s)) for s in shapes)
    return "\n".join([note, ""] + _config_rows(records))


def summary_table(records: Sequence[Relaunch]) -> str:
    """Markdown: one row per (impl, kernel, dtype): configs, launches, differing launches, and
    the configs (BLOCK_H/num_warps) where any launch differed."""
    groups: Dict[tuple, List[Relaunch]] = defaultdict(list)
    for r in records:
        groups[(r.impl, r.kernel, r.dtype)].append(r)
    rows = [
        "| impl | kernel | dtype | configs | shapes | launches | differing launches | "
        "configs with a differing launch | configs unlike the first |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key in sorted(groups):
        rs = groups[key]
        configs = sorted({(r.block_h, r.num_warps) for r in rs})
        racy = sorted({(r.block_h, r.num_warps) for r in rs if r.differing})
        unlike = sorted({(r.block_h, r.num_warps) for r in rs if r.equals_first_config is False})
        rows.append(
            "| "
            + " | ".join(
                [
                    *key,
                    str(len(configs)),
                    str(len({r.shape for r in rs})),
                    str(sum(r.launches for r in rs)),
                    str(sum(r.differing for r in rs)),
                    ", ".join(f"{b}/{w}" for b, w in racy) or "none",
                    ", ".join(f"{b}/{w}" for b, w in unlike) or "none",
                ]
            )
            + " |"
        )
    return "\n".join(rows)


def report(name: str, records: Sequence[Relaunch], directory=None) -> Optional[Path]:
    """Print the tables (pytest shows them with -rA or -s) and write the records to
    ``<directory>/<name>.json``, ``directory`` defaulting to ``MEGATRON_EXT_REPORT_DIR`` (nothing
    is written when neither is set). Returns the path written, if any."""
    print(f"\n== relaunch report {name}\n{summary_table(records)}\n\n{config_table(records)}")
    directory = directory or os.environ.get(REPORT_DIR_ENV)
    if not directory:
        return None
    path = Path(directory) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(r) for r in records], indent=1) + "\n", encoding="utf-8")
    return path


def load_reports(directory) -> List[Relaunch]:
    """Every record of the ``*.json`` reports in ``directory``."""
    records = []
    for path in sorted(Path(directory).glob("*.json")):
        for item in json.loads(path.read_text(encoding="utf-8")):
            item["shape"] = tuple(item["shape"])
            records.append(Relaunch(**item))
    return records
