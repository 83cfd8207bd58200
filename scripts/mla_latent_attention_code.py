# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Print the code shape of the MLA paged latent-cache kernels as the installed Triton compiles
them for sm_90, without a GPU: registers, spills, shared memory and tensor-core instructions.

    python scripts/mla_latent_attention_code.py [--launch decode prefill ...] [--heads 16]
        [--num-warps 8] [--num-stages 3] [--block-n 64] [--page-tiles on|off] [--splits 4]
        [--ptxas-options "..."]
        [--dump DIR]

The launches mirror ``mla_paged_latent_attention``'s launcher
(megatron_ext/fusions/mla_latent/attention_plan.py) on an H200 (132 SMs), bf16, 128 heads
(``--heads``: 16 is a tensor-parallel-8 shard), page size 64, 4096-row block tables:

* ``decode``: one token per request (``max_query_len=1``), 64 requests: ``BLOCK_Q=1``,
  ``BLOCK_H`` from ``head_tile`` (64 at 128 heads, 16 at 16 heads or in fp32), ``BLOCK_N=32``
  (64 at 32 heads), the launcher's split count.
* ``decode-split``: the same tile with ``--splits`` kv splits (fewer requests), and the
  ``_combine_splits_kernel`` launch (``combine``) that follows it.
* ``prefill``: a 2048-token chunk (``max_query_len=2048``): ``BLOCK_Q=4``, ``BLOCK_H=16``,
  ``BLOCK_N=32``, 8 warps.
* ``append``: the key RoPE + paged cache append (``fused_mla_rope_cache_append``), int64 indices.
* ``gluon``: the warp-specialized decode kernel (``decode_gluon``, Triton >= 3.7) in the decode
  launch's place, with ``--splits`` kv splits (1: it writes the output itself).

``--num-warps``, ``--num-stages``, ``--block-n`` and ``--page-tiles`` (``page_tiles``: one
block id per key tile) override the launcher's choice for the attention kernel, to see which
settings change the code. Registers and spills come from the ptxas
log of the compile, shared memory from the kernel's metadata, the instruction counts from its
PTX (``wgmma``: ``wgmma.mma_async``; ``mma``: ``mma.sync``; ``cp.async``: asynchronous global to
shared copies; ``tma``: ``cp.async.bulk``; ``ld.b16`` and ``st.b16``: scalar 2-byte global loads
and stores, the sign of an unvectorised cache tile or row; the append's two are its RoPE
halves). ``K bufs`` and ``in flight`` come from the TTGIR: the key tile's shared-memory buffers
and the copy groups the key loop leaves outstanding while a tile's dots run (0: every key load is
waited for first, so loads and compute never overlap). Run it under two Tritons and compare.
``--dump DIR`` writes each kernel's TTGIR, PTX and ptxas log there.
"""

import argparse
import contextlib
import io
import os
import re
import tempfile
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

try:  # Triton >= 3.7 (the gluon launch)
    from triton.experimental.gluon._runtime import GluonASTSource
except ImportError:
    GluonASTSource = None

from megatron_ext.fusions import mla_latent as mla
from megatron_ext.fusions.launch_math import cdiv, next_power_of_2
from megatron_ext.fusions.mla_latent import decode_gluon

TARGET = GPUTarget("cuda", 90, 32)
SMS = 132  # H200
SHARED_MEMORY = 227 * 1024  # H200: shared memory a block may opt into
HEADS = 128  # the default of --heads
LATENT_DIM = 512
ROPE_DIM = 64
PAGE = 64
MAX_BLOCKS = 4096 // PAGE
# Arguments the kernels' JIT leaves unspecialised (no divisibility hint).
RUNTIME_SIZES = {
    "num_tokens",
    "num_heads",
    "num_requests",
    "num_blocks",
    "max_blocks",
    "num_positions",
}
KERNELS = {
    "attention": mla.STAGE1_LAUNCHES.kernel,
    "combine": mla.COMBINE_LAUNCHES.kernel,
    "append": mla.APPEND_LAUNCHES.kernel,
}
if decode_gluon.GLUON_DECODE_LAUNCHES is not None:
    KERNELS["gluon"] = decode_gluon.GLUON_DECODE_LAUNCHES.kernel
DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}


@dataclass
class Launch:
    """One kernel launch: its kernel, constexprs and compile options.

    Args:
        name: the launch's label in the table.
        kernel: ``attention`` or ``combine``.
        constexprs: the kernel's constexpr arguments.
        pointers: pointer arguments and their element types.
        num_warps: warps per program.
        num_stages: software-pipelining stages.
    """

    name: str
    kernel: str
    constexprs: Dict[str, object]
    pointers: Dict[str, str]
    num_warps: int
    num_stages: int


def attention_launch(
    name: str,
    dtype: str,
    tokens: int,
    requests: int,
    max_query_len: int,
    splits: Optional[int],
    heads: int = HEADS,
) -> Launch:
    """The launcher's stage-1 launch for one batch shape (its tile, warps and split count, from
    the launcher's own functions).

    Args:
        name: the launch's label.
        dtype: ``bf16``, ``fp16`` or ``fp32``, of the query, cache and output.
        tokens: new tokens of the step.
        requests: requests of the step.
        max_query_len: the static bound on new tokens per request.
        splits: the kv split count; None computes the launcher's default on an H200.
        heads: query heads of the launch (16: a tensor-parallel-8 shard of DeepSeek-V3's 128).

    Returns:
        Launch: the launch.
    """
    fp32 = dtype == "fp32"
    tile = mla.tile_shape(tokens, heads, LATENT_DIM, max_query_len, fp32)
    block_q, block_h, block_n, warps = tile
    if splits is None:
        splits = mla.default_num_kv_splits(
            cdiv(tokens, block_q),
            cdiv(heads, block_h),
            MAX_BLOCKS * PAGE,
            None,
            target_programs=SMS * (2 if warps <= 4 else 1),
        )
    constexprs = dict(
        LATENT_DIM=LATENT_DIM,
        ROPE_DIM=ROPE_DIM,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_SIZE=PAGE,
        NUM_SPLITS=splits,
        SEQ_BLOCK=mla.SEQ_BLOCK,
        DOT_PRECISION="ieee" if fp32 else "tf32",
        PAGE_TILES=mla.page_tiles(PAGE, tile),
        WIDE_ROWS=False,
        LARGE_SCALE=False,
        Q_ROPE_COL=LATENT_DIM,
    )
    return Launch(
        name,
        "attention",
        constexprs,
        attention_pointers(dtype, splits),
        warps,
        mla.pipeline_stages(SHARED_MEMORY),
    )


def attention_pointers(dtype: str, splits: int) -> Dict[str, str]:
    """The element types of an attention kernel's pointers (stage 1's or the Gluon kernel's):
    the output's dtype with one split, the fp32 workspace with several."""
    out = dtype if splits == 1 else "fp32"
    return dict(
        q_ptr=dtype,
        q_rope_ptr=dtype,
        cache_ptr=dtype,
        block_table_ptr="i32",
        cu_q_ptr="i32",
        kv_len_ptr="i32",
        out_ptr=out,
        lse_ptr=out,
    )


def combine_launch(name: str, dtype: str, splits: int, heads: int = HEADS) -> Launch:
    """The launcher's stage-2 launch after ``splits`` kv splits.

    Args:
        name: the launch's label.
        dtype: the output's dtype.
        splits: the kv split count.
        heads: query heads of the launch.

    Returns:
        Launch: the launch (4 warps and Triton's default stages, as the launcher leaves them).
    """
    block_h, block_d = mla.combine_tile(heads, LATENT_DIM, splits)
    constexprs = dict(BLOCK_H=block_h, BLOCK_D=block_d, NUM_SPLITS=splits)
    pointers = dict(partial_ptr="fp32", lse_ptr="fp32", cu_q_ptr="i32", out_ptr=dtype)
    return Launch(name, "combine", constexprs, pointers, 4, 3)


def append_launch(name: str, dtype: str) -> Launch:
    """The key RoPE + paged cache append's launch (``fused_mla_rope_cache_append``).

    Args:
        name: the launch's label.
        dtype: the latent, k_pe, tables' and cache's dtype.

    Returns:
        Launch: the launch (4 warps, FMA contraction off, as the launcher sets them).
    """
    constexprs = dict(
        LATENT_DIM=LATENT_DIM,
        ROPE_DIM=ROPE_DIM,
        BLOCK_LATENT=next_power_of_2(LATENT_DIM),
        BLOCK_T=mla.TOKENS_PER_PROGRAM,
    )
    pointers = dict(
        latent_ptr=dtype,
        k_pe_ptr=dtype,
        cos_ptr=dtype,
        sin_ptr=dtype,
        positions_ptr="i64",
        block_idx_ptr="i64",
        block_offset_ptr="i64",
        cache_ptr=dtype,
    )
    return Launch(name, "append", constexprs, pointers, 4, 3)


def gluon_launch(
    name: str,
    dtype: str,
    splits: int,
    *,
    block_size: int = PAGE,
    two_operands: bool = False,
    large_scale: bool = False,
    key_tile: int = decode_gluon.KEY_TILE,
    buffers: int = decode_gluon.NUM_BUFFERS,
    order: int = decode_gluon.ORDER,
    p_buffers: int = decode_gluon.P_BUFFERS,
    heads_first: bool = decode_gluon.HEADS_FIRST,
    trace: bool = False,
) -> Launch:
    """The warp-specialized decode kernel's launch (one token and 64 heads a program).

    Args:
        name: the launch's label.
        dtype: ``bf16`` or ``fp16``, of the query and cache (the output's, or fp32 with splits).
        splits: the kv split count.
        block_size: the cache's block size.
        two_operands: the query's RoPE part as its own operand.
        large_scale: the raw-unit logits of a scale past ``LARGE_SCALE_LOG2``.
        key_tile: keys per tile (the launcher's by default).
        buffers: key tiles in the ring (the launcher's by default).
        order: consumer 0's order of a tile's MMAs and softmax (``decode_gluon.ORDER_*``; the
            launcher's by default).
        p_buffers: buffers of P and the rescale factors (the launcher's by default).
        heads_first: a token's head groups next to each other in the grid (the launcher's
            order by default).
        trace: with the kernel's timeline (an int64 pointer); compiled out by default, as in
            every launch of the plan.

    Returns:
        Launch: the launch (4 warps: the default partition; the kernel adds two warpgroups).
    """
    constexprs = dict(
        BLOCK_SIZE=block_size,
        LATENT_DIM=LATENT_DIM,
        ROPE_DIM=ROPE_DIM,
        Q_ROPE_COL=0 if two_operands else LATENT_DIM,
        NUM_SPLITS=splits,
        SEQ_BLOCK=mla.SEQ_BLOCK,
        LARGE_SCALE=large_scale,
        KEY_TILE=key_tile,
        BUFFERS=buffers,
        ORDER=order,
        P_BUFFERS=p_buffers,
        HEADS_FIRST=heads_first,
    )
    pointers = attention_pointers(dtype, splits)
    if trace:
        pointers["trace_ptr"] = "i64"
    else:
        constexprs["trace_ptr"] = None
    return Launch(name, "gluon", constexprs, pointers, 4, 1)


def compile_launch(launch: Launch, ptxas_options: Optional[str]) -> Dict[str, str]:
    """Compile one launch for sm_90 and return its TTGIR, PTX and ptxas log.

    Every integer argument but the per-step sizes gets the divisibility-by-16 hint the JIT gives
    the launcher's strides and page size; every pointer gets it too (torch allocations).

    Args:
        launch: the launch.
        ptxas_options: extra ptxas options (Triton's ``ptx_options``), or None.

    Returns:
        Dict[str, str]: ``ttgir``, ``ptx``, ``log`` (the ptxas ``-v`` output) and ``shared``
        (bytes of shared memory, as text).
    """
    fn = KERNELS[launch.kernel]
    signature: Dict[str, str] = {}
    attrs = {}
    for index, name in enumerate(fn.arg_names):
        if name in launch.constexprs:
            signature[name] = "constexpr"
        elif name in launch.pointers:
            signature[name] = "*" + launch.pointers[name]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name == "scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name not in RUNTIME_SIZES:
                attrs[(index,)] = [["tt.divisibility", 16]]
    source = GluonASTSource if launch.kernel == "gluon" else ASTSource
    src = source(fn=fn, signature=signature, constexprs=launch.constexprs, attrs=attrs)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    if launch.kernel == "append":
        options["enable_fp_fusion"] = False
    if ptxas_options:
        options["ptx_options"] = ptxas_options
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(src, target=TARGET, options=options)
    return {
        "ttgir": compiled.asm["ttgir"],
        "ptx": compiled.asm["ptx"],
        "log": log.getvalue(),
        "shared": str(compiled.metadata.shared),
    }


def count(pattern: str, text: str) -> int:
    """Occurrences of the regular expression ``pattern`` at the start of a PTX instruction.

    Args:
        pattern: the instruction's regular expression.
        text: the PTX.

    Returns:
        int: the count.
    """
    return len(re.findall(r"^\s*(?:@%p\d+\s+)?" + pattern, text, flags=re.MULTILINE))


def key_loop_pipelining(launch: Launch, ttgir: str) -> Tuple[str, str]:
    """How the attention kernel's key loop stages its key tiles, from the TTGIR.

    Args:
        launch: the launch.
        ttgir: its TTGIR.

    Returns:
        Tuple[str, str]: the key tile's shared-memory buffers (the leading dimension of its
        allocation) and the copy groups the key loop leaves in flight when it waits before a
        tile's dots (the ``num`` of its ``async_wait``; 0: every copy is waited for, so no key
        load overlaps compute). ``-`` for the combine kernel or when the TTGIR has neither.
    """
    if launch.kernel != "attention":
        return "-", "-"
    tile = f"{launch.constexprs['BLOCK_N']}x{LATENT_DIM}x"
    buffers = re.findall(r"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x" + tile, ttgir)
    dots = [m.start() for m in re.finditer(r"\b(?:tt\.dot|ttng\.warp_group_dot)\b", ttgir)]
    if not dots:
        return ",".join(buffers) or "-", "-"
    # The wait nearest before the first dot of the key loop.
    wait = None
    for m in re.finditer(r"async_wait[^\n]*\{num = (\d+)", ttgir[: dots[0]]):
        wait = m.group(1)
    return ",".join(buffers) or "-", wait or "-"


def summary(launch: Launch, code: Dict[str, str]) -> Dict[str, str]:
    """One table row for a compiled launch.

    Args:
        launch: the launch.
        code: what :func:`compile_launch` returned.

    Returns:
        Dict[str, str]: the row's columns.
    """
    buffers, in_flight = key_loop_pipelining(launch, code["ttgir"])
    regs = re.search(r"Used (\d+) registers", code["log"])
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", code["log"])
    ptx = code["ptx"]
    c = launch.constexprs
    return {
        "launch": launch.name,
        "kernel": launch.kernel,
        "Q/H/N/S": "/".join(str(c.get(k, "-")) for k in ("BLOCK_Q", "BLOCK_H", "BLOCK_N"))
        + f"/{c.get('NUM_SPLITS', '-')}",
        "warps": str(launch.num_warps),
        "stages": str(launch.num_stages),
        "regs": regs.group(1) if regs else "?",
        "spill st/ld": f"{spills.group(1)}/{spills.group(2)}" if spills else "?",
        "smem": code["shared"],
        "wgmma": str(count(r"wgmma\.mma_async", ptx)),
        "mma": str(count(r"mma\.sync", ptx)),
        "cp.async": str(count(r"cp\.async\.(?:ca|cg)", ptx)),
        "tma": str(count(r"cp\.async\.bulk", ptx)),
        "ld.b16": str(count(r"ld\.global[\w.:]*\.b16\s", ptx)),
        "st.b16": str(count(r"st\.global[\w.:]*\.b16\s", ptx)),
        "K bufs": buffers,
        "in flight": in_flight,
    }


def print_table(rows: List[Dict[str, str]]) -> None:
    """Print rows as an aligned text table.

    Args:
        rows: the rows, each with the same columns.
    """
    columns = list(rows[0])
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in columns}
    print("  ".join(k.ljust(widths[k]) for k in columns).rstrip())
    for row in rows:
        print("  ".join(row[k].ljust(widths[k]) for k in columns).rstrip())


def main() -> None:
    """Parse the arguments, compile the launches and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    launches = ("decode", "decode-split", "combine", "prefill", "append", "gluon")
    parser.add_argument("--launch", nargs="+", choices=launches, default=list(launches[:-1]))
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--heads", type=int, default=HEADS, help="query heads (16: a TP-8 shard)")
    parser.add_argument("--splits", type=int, default=4, help="kv splits of decode-split")
    parser.add_argument("--num-warps", type=int, default=None, help="override (attention)")
    parser.add_argument("--num-stages", type=int, default=None, help="override (attention)")
    parser.add_argument("--block-n", type=int, default=None, help="override BLOCK_N")
    parser.add_argument(
        "--page-tiles",
        choices=("on", "off"),
        default=None,
        help="force stage 1's one-block-id key tiles on or off (default: the launcher's choice)",
    )
    parser.add_argument("--ptxas-options", default=None, help="extra ptxas options")
    parser.add_argument("--dump", default=None, help="folder for TTGIR, PTX and ptxas logs")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")

    made = {
        "decode": lambda: attention_launch("decode", args.dtype, 64, 64, 1, None, args.heads),
        "decode-split": lambda: attention_launch(
            "decode-split", args.dtype, 8, 8, 1, max(2, args.splits), args.heads
        ),
        "combine": lambda: combine_launch("combine", args.dtype, max(2, args.splits), args.heads),
        "prefill": lambda: attention_launch("prefill", args.dtype, 2048, 1, 2048, None, args.heads),
        "append": lambda: append_launch("append", args.dtype),
        "gluon": lambda: gluon_launch("gluon", args.dtype, args.splits),
    }
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        knobs.cache.dir = cache
        for name in args.launch:
            launch = made[name]()
            if launch.kernel == "attention":
                if args.num_warps is not None:
                    launch.num_warps = args.num_warps
                if args.num_stages is not None:
                    launch.num_stages = args.num_stages
                if args.block_n is not None:
                    launch.constexprs["BLOCK_N"] = args.block_n
                c = launch.constexprs
                tile = mla.TileShape(c["BLOCK_Q"], c["BLOCK_H"], c["BLOCK_N"], launch.num_warps)
                c["PAGE_TILES"] = (
                    mla.page_tiles(PAGE, tile)
                    if args.page_tiles is None
                    else args.page_tiles == "on"
                )
            code = compile_launch(launch, args.ptxas_options)
            rows.append(summary(launch, code))
            if args.dump:
                os.makedirs(args.dump, exist_ok=True)
                for ext in ("ttgir", "ptx", "log"):
                    with open(os.path.join(args.dump, f"{name}.{ext}"), "w") as f:
                        f.write(code[ext])
    print(f"triton {triton.__version__}, sm_90, {args.dtype}, {args.heads} heads")
    print_table(rows)


if __name__ == "__main__":
    main()
