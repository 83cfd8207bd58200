# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What the MLA serving benchmark prints and decides about the prefill rows' two forms: ours in
the absorbed form, in the MHA form and in the cost model's split, against FlashInfer's MLA
wrapper on the same step. Pure functions of the measured rows (fake timings in the tests)."""

from typing import Any, Dict, List, Optional

# The prefill targets: in the form the cost model picks, prefill and chunked-prefill attention
# (decompression included) at least this much faster than FlashInfer's MLA wrapper ...
PREFILL_TARGET_SPEEDUP = 1.3
PREFILL_TARGET_MIN_TOKENS = 2048  # ... on steps of at least this many new tokens;
# mixed steps (decodes beside a chunk) at least FlashInfer's speed; and never slower than the
# absorbed form on any row (what the cost model is for).

__all__ = ["chosen_us", "forms_table", "forms_verdicts", "is_mixed"]


def is_mixed(row: Dict[str, Any]) -> bool:
    """Whether a prefill row's step holds decodes (one new token) beside longer requests."""
    news = [new for _, new in row["requests"]]
    return min(news) == 1 < max(news)


def _us(row: Dict[str, Any], name: str) -> Optional[float]:
    if name == "ours":
        return row["ours"]["gpu_us"]
    entry = row["forms"].get(name)
    return entry.get("gpu_us") if isinstance(entry, dict) else None


def _eager_us(row: Dict[str, Any], name: str) -> Optional[float]:
    entry = row["ours"] if name == "ours" else row["forms"].get(name)
    return entry.get("eager_us") if isinstance(entry, dict) else None


def chosen_us(row: Dict[str, Any]) -> Optional[float]:
    """GPU time of the contender the cost model picks for the row (None if it did not run)."""
    return _us(row, row["forms"]["chosen"])


def _fi_us(row: Dict[str, Any]) -> Optional[float]:
    fi = row.get("flashinfer")
    return fi.get("gpu_us") if isinstance(fi, dict) else None


def _cell(value: Optional[float], spec: str, width: int) -> str:
    return format(value, spec) if value is not None else "-".rjust(width)


def forms_table(rows: List[Dict[str, Any]]) -> List[str]:
    """The prefill rows' forms side by side: GPU us, the MHA form's TFLOP/s (its own FLOPs:
    decompression GEMM included) and difference from ours, the cost model's pick, its eager
    time per call, and its GPU time against FlashInfer's and against the absorbed form (nothing
    without rows)."""
    if not rows:
        return []
    backends = sorted({str(r["forms"].get("backend")) for r in rows})
    calls = "side by side" if any(r["forms"].get("overlap_calls") for r in rows) else "in order"
    lines = [
        f"=== table: prefill forms (MHA-form backend: {', '.join(backends)}; a chunk's calls "
        f"{calls}, MEGATRON_EXT_MLA_MHA_OVERLAP); absorbed = the "
        "attention kernel alone (W_UK/W_UV left out, ours and FlashInfer's), MHA = gather + "
        "decompression GEMM + dense attention (it runs in eager steps: its GPU time queued behind "
        "a GPU sleep, the host ahead as in an engine step); split = the leading requests "
        "absorbed, on a side stream beside the MHA part as the dynamic path runs it (serial: "
        "the split, else mha where its calls overlap, with its parts and the MHA form's calls in "
        "order), at = how many "
        "(* where that is not the cost model's split); "
        "pick = the cost model's choice, eager = its time per call run eagerly, the host's "
        "included",
        f"{'step':>50} {'heads':>5} | {'absorbed':>9} {'mha':>9} {'TFLOP/s':>8} {'rel diff':>8} "
        f"{'split':>9} {'serial':>9} {'at':>6} | {'pick':>8} {'eager':>9} {'FI':>9} {'pick/FI':>7} "
        f"{'pick/abs':>8} {'fastest':>8}",
    ]
    for r in rows:
        forms = r["forms"]
        mha = forms.get("mha") if isinstance(forms.get("mha"), dict) else {}
        pick, fi, absorbed = chosen_us(r), _fi_us(r), r["ours"]["gpu_us"]
        timed = {n: _us(r, n) for n in ("ours", "mha", "split")}
        fastest = min((t, n) for n, t in timed.items() if t is not None)[1]
        split = forms.get("split") if isinstance(forms.get("split"), dict) else {}
        timed_at = split.get("split", forms["model_split"])
        mark = "*" if timed_at != forms["model_split"] else " "
        at = f"{timed_at:>2}/{forms['requests']:<2}{mark}"
        lines.append(
            f"{r['case']:>50} {r['heads']:>5} | {absorbed:9.1f} {_cell(_us(r, 'mha'), '9.1f', 9)} "
            f"{_cell(mha.get('tflops'), '8.1f', 8)} {_cell(mha.get('max_rel_diff'), '8.1e', 8)} "
            f"{_cell(_us(r, 'split'), '9.1f', 9)} {_cell(_us(r, 'serial'), '9.1f', 9)} {at} | "
            f"{forms['chosen']:>8} {_cell(_eager_us(r, forms['chosen']), '9.1f', 9)} "
            f"{_cell(fi, '9.1f', 9)} "
            f"{_cell(pick / fi if pick and fi else None, '6.2f', 6)}x "
            f"{_cell(pick / absorbed if pick else None, '7.2f', 7)}x {fastest:>8}"
        )
        for name in ("mha", "split", "serial"):
            error = forms.get(name, {}).get("error") if isinstance(forms.get(name), dict) else None
            if error:
                lines.append(f"{'':>50} {name}: {error}")
        if "error" in forms:
            lines.append(f"{'':>50} MHA form: {forms['error']}")
    return lines


def _label(row: Dict[str, Any]) -> str:
    return f"{row['case']}, {row['heads']} heads"


def forms_verdicts(rows: List[Dict[str, Any]], flashinfer: str) -> List[Dict[str, str]]:
    """The prefill targets above: met, missed by how much (the worst row named), or not
    measured.

    Args:
        rows: the prefill rows.
        flashinfer: FlashInfer's status text.

    Returns:
        List[Dict[str, str]]: ``target``, ``status``, ``worst``.
    """
    out = []
    groups = (
        (
            f"prefill/chunked-prefill steps of >= {PREFILL_TARGET_MIN_TOKENS} tokens, the cost "
            f"model's form: >= {PREFILL_TARGET_SPEEDUP}x FlashInfer's speed (GPU time)",
            [r for r in rows if not is_mixed(r) and r["tokens"] >= PREFILL_TARGET_MIN_TOKENS],
            PREFILL_TARGET_SPEEDUP,
        ),
        (
            "mixed steps, the cost model's form: at least FlashInfer's speed (GPU time)",
            [r for r in rows if is_mixed(r)],
            1.0,
        ),
    )
    for target, group, speedup in groups:
        measured = [r for r in group if _fi_us(r) and chosen_us(r)]
        if not measured:
            why = (
                "no row"
                if not group
                else f"FlashInfer or the chosen form did not run ({flashinfer})"
            )
            out.append({"target": target, "status": f"not measured: {why}", "worst": ""})
            continue
        worst = min(measured, key=lambda r: _fi_us(r) / chosen_us(r))
        achieved = _fi_us(worst) / chosen_us(worst)
        status = "met" if achieved >= speedup else f"missed by {speedup - achieved:.2f}x"
        detail = f"{_label(worst)}: {achieved:.2f}x ({worst['forms']['chosen']})"
        out.append({"target": target, "status": status, "worst": detail})
    target = "the cost model's form never slower than the absorbed form (GPU time), every row"
    measured = [r for r in rows if chosen_us(r)]
    if not measured:
        out.append({"target": target, "status": "not measured: no row", "worst": ""})
        return out
    worst = max(measured, key=lambda r: chosen_us(r) / r["ours"]["gpu_us"])
    ratio = chosen_us(worst) / worst["ours"]["gpu_us"]
    status = "met" if ratio <= 1.0 else f"missed by {100 * (ratio - 1):.1f}%"
    detail = f"{_label(worst)}: {worst['forms']['chosen']} at {ratio:.2f}x the absorbed time"
    out.append({"target": target, "status": status, "worst": detail})
    return out
