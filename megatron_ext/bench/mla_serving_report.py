# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What the MLA serving benchmark prints and decides: its tables, the verdicts against the serving
kernels' targets, the worst rows, and the plot. Pure functions of the measured rows (fake timings
in the tests)."""

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from megatron_ext.bench.mla_serving_forms_report import forms_table, forms_verdicts
from megatron_ext.bench.mla_serving_gluon_report import gluon_table, gluon_verdicts

# The serving kernels' targets: decode attention reads the cache near the copy ceiling where a
# step is memory-bound, at or above FlashInfer's speed there; the key RoPE + cache append is
# memory-bound from a prefill's size on and well ahead of megatron-core's unfused path at decode.
DECODE_TARGET_PCT = 80.0  # decode attention, share of the copy ceiling ...
TARGET_MIN_CONTEXT = 4096  # ... at contexts of at least this many tokens
TARGET_MIN_BATCH = 16  # ... and batches of at least this many requests
APPEND_TARGET_PCT = 85.0  # RoPE + append, share of the copy ceiling ...
APPEND_TARGET_MIN_TOKENS = 1024  # ... from this many tokens on
APPEND_TARGET_SPEEDUP = 3.0  # RoPE + append against megatron-core's unfused path ...
APPEND_SPEEDUP_MAX_TOKENS = 256  # ... at decode batch sizes (up to this many tokens)

__all__ = ["pct_of_ceiling", "plot_decode", "tables", "verdicts"]


def pct_of_ceiling(nbytes: float, us: float, tb_per_s: float) -> float:
    """Achieved bandwidth (``nbytes`` in ``us`` microseconds) as a percentage of ``tb_per_s``."""
    return 100.0 * nbytes / (us * tb_per_s * 1e6)


def in_decode_target(row: Dict[str, Any]) -> bool:
    """Whether a decode row is in the targets' region (long contexts, batched)."""
    return row["context"] >= TARGET_MIN_CONTEXT and row["batch"] >= TARGET_MIN_BATCH


def _fi_measured(row: Dict[str, Any]) -> bool:
    fi = row.get("flashinfer")
    return isinstance(fi, dict) and "gpu_us" in fi


def decode_label(row: Dict[str, Any]) -> str:
    return f"batch {row['batch']}, context {row['context']}, {row['heads']} heads"


def _row_label(row: Dict[str, Any]) -> str:
    if row["section"] == "decode":
        return "decode " + decode_label(row)
    if row["section"] == "prefill":
        return f"{row['case']}, {row['heads']} heads"
    return f"RoPE+append {row['tokens']} tokens"


def _missed(value: float, target: float, unit: str) -> str:
    return f"missed by {target - value:.1f}{unit}"


def _peer_missing(flashinfer: str) -> str:
    """Why a FlashInfer comparison has no row: not installed, or it failed where it ran."""
    if flashinfer.startswith("not installed"):
        return f"not measured: FlashInfer {flashinfer}"
    return f"not measured: {flashinfer} failed in these rows (the table says why)"


def _decode_verdicts(decode: List[Dict[str, Any]], flashinfer: str) -> List[Dict[str, str]]:
    region = [r for r in decode if in_decode_target(r)]
    target = (
        f"decode attention >= {DECODE_TARGET_PCT:.0f}% of the copy ceiling at context >= "
        f"{TARGET_MIN_CONTEXT} and batch >= {TARGET_MIN_BATCH}"
    )
    peer = "decode attention at least FlashInfer's speed (GPU time) in every row of that region"
    if not region:
        none = {"status": "not measured: no decode row in the region", "worst": ""}
        return [{"target": target, **none}, {"target": peer, **none}]
    worst = min(region, key=lambda r: r["ours_pct_ceiling"])
    pct = worst["ours_pct_ceiling"]
    out = [
        {
            "target": target,
            "status": (
                "met" if pct >= DECODE_TARGET_PCT else _missed(pct, DECODE_TARGET_PCT, " points")
            ),
            "worst": f"{decode_label(worst)}: {pct:.1f}%",
        }
    ]
    measured = [r for r in region if _fi_measured(r)]
    if not measured:
        out.append({"target": peer, "status": _peer_missing(flashinfer), "worst": ""})
        return out
    slowest = max(measured, key=lambda r: r["ours"]["gpu_us"] / r["flashinfer"]["gpu_us"])
    ratio = slowest["ours"]["gpu_us"] / slowest["flashinfer"]["gpu_us"]
    status = "met" if ratio <= 1.0 else f"missed by {100 * (ratio - 1):.1f}% (ours slower)"
    if len(measured) < len(region):
        status += f"; FlashInfer measured in {len(measured)} of {len(region)} rows"
    out.append(
        {
            "target": peer,
            "status": status,
            "worst": f"{decode_label(slowest)}: ours {ratio:.2f}x FlashInfer's GPU time",
        }
    )
    return out


def _served(row: Dict[str, Any]) -> Tuple[float, str]:
    """Eager us per call of what the engine runs for the row, and its label: on a prefill row
    whose forms were timed, the cost model's pick (its absorbed kernel alone is not served)."""
    forms = row.get("forms") or {}
    chosen = forms.get(forms.get("chosen", "ours"))
    if isinstance(chosen, dict) and "eager_us" in chosen:
        return chosen["eager_us"], f"{_row_label(row)} ({forms['chosen']})"
    return row["ours"]["eager_us"], _row_label(row)


def _eager_verdict(rows: List[Dict[str, Any]], flashinfer: str) -> Dict[str, str]:
    target = (
        "no eager row behind FlashInfer by more than its launch cost (FlashInfer's host time per "
        "run() call in the same row; a prefill row: the cost model's form)"
    )
    measured = [r for r in rows if r["section"] in ("decode", "prefill") and _fi_measured(r)]
    if not measured:
        return {"target": target, "status": _peer_missing(flashinfer), "worst": ""}

    def gap(r):
        return _served(r)[0] - r["flashinfer"]["eager_us"]

    gap_row = max(measured, key=gap)
    worst = max(measured, key=lambda r: gap(r) - r["flashinfer"]["host_us"])
    over = gap(worst) - worst["flashinfer"]["host_us"]
    status = "met" if over <= 0 else f"missed by {over:.1f} us ({_served(worst)[1]})"
    return {
        "target": target,
        "status": status,
        "worst": (
            f"largest eager gap: {_served(gap_row)[1]}: ours {gap(gap_row):+.1f} us per call "
            f"against FlashInfer (its launch cost {gap_row['flashinfer']['host_us']:.1f} us)"
        ),
    }


def _append_verdicts(append: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    out = []
    target = (
        f"RoPE+append >= {APPEND_TARGET_PCT:.0f}% of the copy ceiling at >= "
        f"{APPEND_TARGET_MIN_TOKENS} tokens"
    )
    large = [r for r in append if r["tokens"] >= APPEND_TARGET_MIN_TOKENS]
    if large:
        worst = min(large, key=lambda r: r["ours_pct_ceiling"])
        pct = worst["ours_pct_ceiling"]
        status = "met" if pct >= APPEND_TARGET_PCT else _missed(pct, APPEND_TARGET_PCT, " points")
        detail = f"{worst['tokens']} tokens: {pct:.1f}%"
        if "copy_pct_ceiling" in worst:
            detail += f" (a copy of the same bytes: {worst['copy_pct_ceiling']:.1f}%)"
        out.append({"target": target, "status": status, "worst": detail})
    else:
        out.append({"target": target, "status": "not measured: no row", "worst": ""})
    target = (
        f"RoPE+append >= {APPEND_TARGET_SPEEDUP:.0f}x megatron-core's unfused path (GPU time) at "
        f"1-{APPEND_SPEEDUP_MAX_TOKENS} tokens"
    )
    small = [r for r in append if r["tokens"] <= APPEND_SPEEDUP_MAX_TOKENS]
    if small:
        worst = min(small, key=lambda r: r["gpu_speedup"])
        eager = min(small, key=lambda r: r["eager_speedup"])
        speedup = worst["gpu_speedup"]
        status = (
            "met"
            if speedup >= APPEND_TARGET_SPEEDUP
            else f"missed by {APPEND_TARGET_SPEEDUP - speedup:.2f}x"
        )
        out.append(
            {
                "target": target,
                "status": status,
                "worst": (
                    f"{worst['tokens']} tokens: {speedup:.2f}x (eager, for reference: lowest "
                    f"{eager['eager_speedup']:.2f}x at {eager['tokens']} tokens)"
                ),
            }
        )
    else:
        out.append({"target": target, "status": "not measured: no row", "worst": ""})
    return out


def verdicts(result: Dict[str, Any]) -> List[Dict[str, str]]:
    """Each target above that these rows decide: met, missed by how much, or not measured.

    Args:
        result: the benchmark's result (``rows``; ``flashinfer``: its status text).

    Returns:
        List[Dict[str, str]]: ``target``, ``status`` (starts with "met", "missed" or
        "not measured") and ``worst`` (the row that decides it).
    """
    rows = result["rows"]
    flashinfer = result.get("flashinfer", "not installed")
    out = []
    sections = {r["section"] for r in rows}
    if "decode" in sections:
        decode = [r for r in rows if r["section"] == "decode"]
        out += _decode_verdicts(decode, flashinfer) + gluon_verdicts(decode)
    if sections & {"decode", "prefill"}:
        out.append(_eager_verdict(rows, flashinfer))
    prefill = [r for r in rows if r["section"] == "prefill" and "forms" in r]
    if prefill:
        out += forms_verdicts(prefill, flashinfer)
    if "rope_append" in sections:
        out += _append_verdicts([r for r in rows if r["section"] == "rope_append"])
    return out


def _us(timing: Optional[Dict[str, Any]], key: str) -> str:
    if not isinstance(timing, dict) or key not in timing:
        return "-"
    return f"{timing[key]:.1f}"


def _fi_cells(row: Dict[str, Any], share: Callable[[float], str]) -> str:
    """FlashInfer's cells of a row; ``share`` formats its GPU time as the section's measure."""
    fi = row.get("flashinfer")
    if not _fi_measured(row):
        text = fi.get("error", "not measured") if isinstance(fi, dict) else str(fi)
        return f"FlashInfer: {text}"
    ratio = row["ours"]["gpu_us"] / fi["gpu_us"]
    return (
        f"{fi['gpu_us']:9.1f} {share(fi['gpu_us'])} {fi['eager_us']:8.1f} {fi['host_us']:6.1f} "
        f"{ratio:6.2f}x {fi['max_abs_diff']:8.2e}"
    )


def _decode_table(rows: List[Dict[str, Any]], tb_per_s: float) -> List[str]:
    lines = [
        "=== table: decode attention (bf16, page size 64, shuffled pages), megatron_ext vs "
        f"FlashInfer; copy ceiling {tb_per_s:.2f} TB/s (same run)",
        "MB: the minimum bytes (each attended cache row once + query + output); %ceil: MB / gpu "
        "time against the ceiling; kern%: the same with the rows counted once per head tile "
        "(up to 64 heads) as the kernel reads them (over 100: the L2 served repeats); x: ours / "
        "FlashInfer GPU time (< 1: ours faster); diff: max |ours - FlashInfer|",
        f"{'batch':>5} {'ctx':>6} {'heads':>5} {'MB':>8} {'splits':>6} | {'gpu us':>9} "
        f"{'%ceil':>6} {'kern%':>7} {'eager':>8} {'host':>6} | {'FI gpu':>9} {'%ceil':>6} "
        f"{'eager':>8} {'host':>6} {'x':>7} {'diff':>8}",
    ]
    for r in rows:
        nbytes = r["bytes"]["minimum"]
        mark = "*" if in_decode_target(r) else " "
        kernel = pct_of_ceiling(r["bytes"]["kernel"], r["ours"]["gpu_us"], tb_per_s)
        lines.append(
            f"{r['batch']:>5} {r['context']:>6} {r['heads']:>5} {nbytes / 1e6:8.1f} "
            f"{r.get('splits', '-'):>6} | {r['ours']['gpu_us']:9.1f} "
            f"{r['ours_pct_ceiling']:5.1f}%{mark}{kernel:6.1f}% {_us(r['ours'], 'eager_us'):>8} "
            f"{_us(r['ours'], 'host_us'):>6} | "
            f"{_fi_cells(r, lambda us, n=nbytes: f'{pct_of_ceiling(n, us, tb_per_s):5.1f}%')}"
        )
    lines.append(
        f"(* the targets' region: context >= {TARGET_MIN_CONTEXT}, batch >= {TARGET_MIN_BATCH})"
    )
    return lines


def _prefill_table(rows: List[Dict[str, Any]], peak: float) -> List[str]:
    lines = [
        f"=== table: chunked prefill / mixed steps (bf16, causal); dense bf16 peak {peak:.0f} "
        "TFLOP/s (torch.matmul 8192^3, same run)",
        "TFLOP/s: attended (causal) pairs x heads x 2 x (576 + 512) / gpu time; %peak against the "
        "matmul peak",
        f"{'step':>50} {'heads':>5} {'tokens':>6} {'GFLOP':>7} | {'gpu us':>9} {'TFLOP/s':>8} "
        f"{'%peak':>6} {'eager':>8} {'host':>6} | {'FI gpu':>9} {'TFLOP/s':>8} {'eager':>8} "
        f"{'host':>6} {'x':>7} {'diff':>8}",
    ]
    for r in rows:
        flops = r["flops"]
        lines.append(
            f"{r['case']:>50} {r['heads']:>5} {r['tokens']:>6} {flops / 1e9:7.1f} | "
            f"{r['ours']['gpu_us']:9.1f} {r['ours_tflops']:8.1f} {r['ours_pct_peak']:5.1f}% "
            f"{_us(r['ours'], 'eager_us'):>8} {_us(r['ours'], 'host_us'):>6} | "
            + _fi_cells(r, lambda us, f=flops: f"{f / us / 1e6:8.1f}")
        )
    return lines


def _append_table(rows: List[Dict[str, Any]], tb_per_s: float) -> List[str]:
    lines = [
        "=== table: key RoPE + paged cache append (bf16, one kv head, 512 + 64): megatron_ext's "
        "fused kernel vs megatron-core's unfused path (apply_rotary_emb_key + torch.cat + indexed "
        f"assignment); copy ceiling {tb_per_s:.2f} TB/s",
        "KB: latent, k_pe, cos/sin rows, 3 indices read + cache rows written; speedups = "
        "megatron-core / ours; copy: a copy moving the same bytes, timed the same way (the "
        "ceiling at this size); bits: the written cache rows bitwise equal",
        f"{'tokens':>6} {'step':>7} {'KB':>8} | {'gpu mc':>8} {'gpu us':>8} {'x':>6} | "
        f"{'eager mc':>8} {'us':>8} {'x':>6} | {'host mc':>7} {'us':>7} | {'%ceil mc':>8} "
        f"{'us':>6} | {'copy us':>7} {'%ceil':>6} | bits",
    ]
    for r in rows:
        mc, ours = r["mcore"], r["ours"]
        copy = (
            f"{r['copy']['gpu_us']:7.1f} {r['copy_pct_ceiling']:5.1f}%"
            if "copy" in r
            else f"{'-':>7} {'-':>6}"
        )
        lines.append(
            f"{r['tokens']:>6} {'decode' if r['decode_only'] else 'prefill':>7} "
            f"{r['bytes'] / 1e3:8.1f} | {mc['gpu_us']:8.1f} {ours['gpu_us']:8.1f} "
            f"{r['gpu_speedup']:5.2f}x | {mc['eager_us']:8.1f} {ours['eager_us']:8.1f} "
            f"{r['eager_speedup']:5.2f}x | {mc['host_us']:7.1f} {ours['host_us']:7.1f} | "
            f"{r['mcore_pct_ceiling']:7.1f}% {r['ours_pct_ceiling']:5.1f}% | {copy} | "
            f"{'yes' if r['bits_equal'] else 'NO'}"
        )
    return lines


def tables(result: Dict[str, Any]) -> str:
    """The tables of every section measured, the timing method, the verdicts and worst rows."""
    rows = result["rows"]
    tb_per_s = result["copy_ceiling"]["tb_per_s"]
    lines = [
        f"MLA serving kernels on {result['device']}: torch {result['torch']}, triton "
        f"{result['triton']}, megatron-core {result['megatron_core']}; FlashInfer: "
        f"{result['flashinfer']}",
        "gpu: a CUDA graph of N calls, divided by N: the median of its replays, each behind an "
        "L2 flush, a row's contenders taking turns (inputs rotated over copies larger than the L2 "
        "where one call's are smaller); eager: calls issued back to back "
        "with a final sync, per call; host: the same without the sync (launch cost); us",
    ]
    decode = [r for r in rows if r["section"] == "decode"]
    prefill = [r for r in rows if r["section"] == "prefill"]
    append = [r for r in rows if r["section"] == "rope_append"]
    if decode:
        lines += _decode_table(decode, tb_per_s) + gluon_table(decode)
    if prefill:
        lines += _prefill_table(prefill, result["matmul_peak"]["tflops"])
        lines += forms_table([r for r in prefill if "forms" in r])
    if append:
        lines += _append_table(append, tb_per_s)
    methods = sorted(
        {
            r[who]["gpu_method"]
            for r in rows
            for who in ("ours", "mcore", "flashinfer", "gluon")
            if isinstance(r.get(who), dict) and r[who].get("gpu_method", "graph") != "graph"
        }
    )
    for method in methods:
        lines.append(f"note: some gpu times are not from a graph: {method}")
    failed = result.get("failed_rows", [])
    for f in failed:
        lines.append(f"FAILED row: {f['row']}: {f['error']}")
    lines.append("=== verdicts (against the targets)")
    if failed:
        lines.append(f"({len(failed)} rows failed, listed above; the verdicts judge the others)")
    for v in result["verdicts"]:
        worst = f" [worst: {v['worst']}]" if v["worst"] else ""
        lines.append(f"- {v['target']}: {v['status']}{worst}")
    return "\n".join(lines)


def plot_decode(result: Dict[str, Any], path: str) -> Optional[str]:
    """Decode share of the copy ceiling against context, one line per batch and head count
    (FlashInfer's dashed where measured). Returns the file written, or None without matplotlib
    or decode rows."""
    decode = [r for r in result["rows"] if r["section"] == "decode"]
    if not decode:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    heads = sorted({r["heads"] for r in decode})
    fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4.5), squeeze=False)
    tb_per_s = result["copy_ceiling"]["tb_per_s"]
    for ax, h in zip(axes[0], heads):
        for b in sorted({r["batch"] for r in decode if r["heads"] == h}):
            line = sorted(
                (r for r in decode if r["heads"] == h and r["batch"] == b),
                key=lambda r: r["context"],
            )
            contexts = [r["context"] for r in line]
            (drawn,) = ax.plot(
                contexts, [r["ours_pct_ceiling"] for r in line], marker="o", label=f"batch {b}"
            )
            fi = [r for r in line if _fi_measured(r)]
            if fi:
                ax.plot(
                    [r["context"] for r in fi],
                    [
                        pct_of_ceiling(r["bytes"]["minimum"], r["flashinfer"]["gpu_us"], tb_per_s)
                        for r in fi
                    ],
                    linestyle="--",
                    marker="x",
                    color=drawn.get_color(),
                    label=f"batch {b}, FlashInfer",
                )
        ax.axhline(DECODE_TARGET_PCT, color="grey", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("% of the copy ceiling (minimum bytes / GPU time)")
        ax.set_title(f"MLA decode, {h} heads, bf16, page 64")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['device']}: copy ceiling {tb_per_s:.2f} TB/s")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
