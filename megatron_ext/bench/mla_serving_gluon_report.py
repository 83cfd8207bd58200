# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What the MLA serving benchmark prints and decides about the warp-specialized decode kernel
(Gluon): its GPU time beside stage 1's and FlashInfer's on the same decode step, its
TFLOP/s, and whether it meets its targets. Pure functions of the measured rows (fake timings in
the tests)."""

from typing import Any, Dict, List, Optional

# The kernel's targets: at 32 to 128 heads, batches of at least GLUON_MIN_BATCH and contexts of
# at least GLUON_MIN_CONTEXT, decode GPU time at most FlashInfer's, and at 128 heads at least
# GLUON_TARGET_TFLOPS of real FLOPs.
GLUON_MIN_HEADS = 32
GLUON_MIN_BATCH = 16
GLUON_MIN_CONTEXT = 2048
GLUON_TARGET_TFLOPS = 500.0

__all__ = ["decode_flops", "gluon_table", "gluon_verdicts"]


def decode_flops(row: Dict[str, Any], latent: int = 512, rope: int = 64) -> float:
    """Real FLOPs of a decode row: per token, head and attended row a (latent + rope) score and
    a latent-wide value product, 2 FLOPs per multiply-add."""
    return 2.0 * row["batch"] * row["heads"] * row["context"] * (2 * latent + rope)


def _gluon_us(row: Dict[str, Any]) -> Optional[float]:
    entry = row.get("gluon")
    return entry.get("gpu_us") if isinstance(entry, dict) else None


def _stage1_us(row: Dict[str, Any]) -> float:
    # Rows that timed the kernel time stage 1 through its own plan; an older row's "ours" was it.
    return row.get("stage1", row["ours"])["gpu_us"]


def _fi_us(row: Dict[str, Any]) -> Optional[float]:
    fi = row.get("flashinfer")
    return fi.get("gpu_us") if isinstance(fi, dict) else None


def _in_region(row: Dict[str, Any]) -> bool:
    return (
        row["heads"] >= GLUON_MIN_HEADS
        and row["batch"] >= GLUON_MIN_BATCH
        and row["context"] >= GLUON_MIN_CONTEXT
    )


def gluon_table(decode: List[Dict[str, Any]]) -> List[str]:
    """The decode rows' Gluon columns (none where no row timed it or said why not).

    Args:
        decode: the decode rows.

    Returns:
        List[str]: the table's lines.
    """
    rows = [r for r in decode if "gluon" in r]
    if not rows:
        return []
    lines = [
        "=== table: decode attention, the warp-specialized kernel (Gluon) beside stage 1 and "
        "FlashInfer, GPU time (us); TF/s: real FLOPs; host and eager: Gluon's host "
        "time per call and its time per call run eagerly; x FI: Gluon / FlashInfer; diff: max "
        "|Gluon - stage 1|",
        f"{'batch':>5} {'ctx':>6} {'heads':>5} | {'stage 1':>9} | {'Gluon':>9} {'splits':>6} "
        f"{'TF/s':>6} {'host':>6} {'eager':>8} | {'FI':>9} {'x FI':>6} {'diff':>8}",
    ]
    for r in rows:
        entry = r["gluon"]
        head = f"{r['batch']:>5} {r['context']:>6} {r['heads']:>5} | {_stage1_us(r):9.1f} |"
        us = _gluon_us(r)
        if us is None:
            lines.append(f"{head} not run: {entry.get('refused', 'no timing')}")
            continue
        fi = _fi_us(r)
        ratio = f"{us / fi:5.2f}x" if fi else "     -"
        lines.append(
            f"{head} {us:9.1f} {entry['splits']:>6} {decode_flops(r) / us / 1e6:6.0f} "
            f"{entry['host_us']:6.1f} {entry['eager_us']:8.1f} | "
            f"{fi if fi else float('nan'):9.1f} {ratio} "
            f"{entry['max_abs_diff_vs_stage1']:8.2e}"
        )
    return lines


def gluon_verdicts(decode: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    """The kernel's targets over the decode rows that timed it.

    Args:
        decode: the decode rows.

    Returns:
        List[Dict[str, str]]: ``target``, ``status`` and ``worst``, as the other verdicts.
    """
    if not any("gluon" in r for r in decode):
        return []
    region = [r for r in decode if _in_region(r)]
    peer = (
        f"Gluon decode GPU time at most FlashInfer's at {GLUON_MIN_HEADS}-128 heads, batch >= "
        f"{GLUON_MIN_BATCH}, context >= {GLUON_MIN_CONTEXT}"
    )
    rate = f"Gluon decode >= {GLUON_TARGET_TFLOPS:.0f} TFLOP/s at 128 heads in that region"
    timed = [r for r in region if _gluon_us(r) is not None]
    if not timed:
        why = next(
            (r["gluon"]["refused"] for r in decode if "refused" in r.get("gluon", {})),
            "no row in the region",
        )
        status = {"status": f"not measured: {why}", "worst": ""}
        return [{"target": peer, **status}, {"target": rate, **status}]
    out = []
    with_fi = [r for r in timed if _fi_us(r)]
    if with_fi:
        worst = max(with_fi, key=lambda r: _gluon_us(r) / _fi_us(r))
        ratio = _gluon_us(worst) / _fi_us(worst)
        status = "met" if ratio <= 1.0 else f"missed by {100 * (ratio - 1):.1f}% (Gluon slower)"
        out.append({"target": peer, "status": status, "worst": _label(worst, f"{ratio:.2f}x")})
    else:
        out.append({"target": peer, "status": "not measured: FlashInfer", "worst": ""})
    wide = [r for r in timed if r["heads"] >= 128]
    if wide:
        worst = min(wide, key=lambda r: decode_flops(r) / _gluon_us(r))
        tflops = decode_flops(worst) / _gluon_us(worst) / 1e6
        status = (
            "met"
            if tflops >= GLUON_TARGET_TFLOPS
            else f"missed by {GLUON_TARGET_TFLOPS - tflops:.0f} TFLOP/s"
        )
        out.append({"target": rate, "status": status, "worst": _label(worst, f"{tflops:.0f}")})
    else:
        out.append({"target": rate, "status": "not measured: no 128-head row", "worst": ""})
    return out


def _label(row: Dict[str, Any], value: str) -> str:
    return f"batch {row['batch']}, context {row['context']}, {row['heads']} heads: {value}"
