#!/usr/bin/env python
# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Host time per call of the public kernel entry points in two source trees, alternated in one
run on a GPU: the check that a change of the launch path costs no host time.

    git archive REV megatron_ext | tar -x -C /tmp/old
    python scripts/compare_host_time.py --old /tmp/old [--new .] [--rounds 3] [--in-process]

Each round runs one measuring process per tree, old then new (all pinned to one CPU, ``--cpu``),
each with its tree first on ``PYTHONPATH``; a process times the RoPE drop-ins
(``scripts/compare_rope_host_time.py``'s calls) and the paged latent attention and the RoPE +
append at decode sizes, through import paths every
revision has (``megatron_ext.fusions.fused_mla_yarn_rope_apply``,
``megatron_ext.fusions.mla_paged_latent_attention``,
``megatron_ext.fusions.fused_mla_rope_cache_append``). Prints a table of each call's fastest host
time (each process's fastest round, the fastest process's), new / old, and the worst row;
exits 2 without a GPU.

``--in-process`` loads both trees in one process instead (the old tree's package copied under
another name) and alternates the two trees' rounds call by call: a difference between processes
(where their memory landed, which core's caches they warmed) then weighs on neither.
"""

import argparse
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

SCRIPTS = Path(__file__).resolve().parent
# (batch, context, heads) of the latent-cache calls: decode, as an engine makes them per layer.
DECODE_SHAPES = ((1, 4096, 16), (64, 4096, 16), (64, 4096, 128))


def _rope_host():
    """``compare_rope_host_time.py`` as a module (it is a script, not a package member)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "rope_host", SCRIPTS / "compare_rope_host_time.py"
    )
    rope_host = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rope_host)
    return rope_host


def _calls(package: str = "megatron_ext") -> Dict[str, Tuple[Callable[[], None], int]]:
    """Every timed call of ``package`` (a tree's ``megatron_ext``, possibly renamed) and its calls
    per round: the latent attention and the RoPE + append (bf16, page size 64), the RoPE
    drop-ins."""
    import importlib

    import torch

    append_module = importlib.import_module(f"{package}.fusions.fused_mla_rope_cache_append")
    attention_module = importlib.import_module(f"{package}.fusions.mla_paged_latent_attention")
    rope_host = _rope_host()
    calls = {}
    for batch, context, heads in DECODE_SHAPES:
        pages = context // 64
        cache = torch.randn(batch * pages, 64, 576, device="cuda").bfloat16()
        table = torch.arange(batch * pages, device="cuda", dtype=torch.int32).view(batch, pages)
        cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        lengths = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        query = torch.randn(batch, heads, 576, device="cuda").bfloat16()
        out = torch.empty(batch, heads, 512, device="cuda").bfloat16()
        attend = functools.partial(
            attention_module.mla_paged_latent_attention,
            query,
            cache,
            table,
            cu,
            lengths,
            0.1,
            max_query_len=1,
            out=out,
        )
        calls[f"attention {batch}x{context}x{heads}"] = (attend, 20)
    cos, sin = rope_host.tables(4096)
    for tokens in (1, 64):
        latent = torch.randn(tokens, 1, 512, device="cuda").bfloat16()
        k_pe = torch.randn(tokens, 1, 64, device="cuda").bfloat16()
        cache = torch.randn(tokens // 64 + 2, 64, 576, device="cuda").bfloat16()
        rows = torch.arange(tokens, device="cuda")
        positions = rows % 4096
        append = functools.partial(
            append_module.fused_mla_rope_cache_append,
            latent,
            k_pe,
            cos,
            sin,
            positions,
            cache,
            rows // 64,
            rows % 64,
        )
        calls[f"rope+append {tokens}"] = (append, 20)
    for shape in rope_host.SHAPES:
        calls.update(rope_host.shape_calls(*shape, package=package))
    return calls


def _latent_calls() -> Dict[str, float]:
    """Host us per call of every timed call of this process's ``megatron_ext``."""
    rope_host = _rope_host()
    return {name: rope_host.host_us(fn, calls=n) for name, (fn, n) in _calls().items()}


def renamed_copy(tree: Path, name: str, into: Path) -> Path:
    """A copy of ``tree``'s ``megatron_ext`` as package ``name`` under ``into`` (every import of
    it renamed), so that two trees' code loads in one process."""
    target = into / name
    shutil.copytree(tree / "megatron_ext", target)
    pattern = re.compile(r"\bmegatron_ext\b")
    for path in target.rglob("*.py"):
        path.write_text(pattern.sub(name, path.read_text()))
    return target


def interleaved(
    new: Dict[str, Tuple[Callable[[], None], int]],
    old: Dict[str, Tuple[Callable[[], None], int]],
    rounds: int = 60,
) -> Dict[str, Dict[str, float]]:
    """Per call, the fastest round of each tree, their rounds alternated (new, old, new, ...)
    so that whatever slows the process slows both alike.

    Returns:
        Dict[str, Dict[str, float]]: ``{"new": {call: us}, "old": {call: us}}``.
    """
    import torch

    rope_host = _rope_host()
    best: Dict[str, Dict[str, float]] = {"new": {}, "old": {}}
    for call in new:
        if call not in old:
            continue
        pair = {"new": new[call], "old": old[call]}
        for fn, n in pair.values():
            rope_host.host_us(fn, calls=n, rounds=1)  # warm up (and compile) both
        times = {"new": [], "old": []}
        for _ in range(rounds):
            for tree, (fn, n) in pair.items():
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                times[tree].append((time.perf_counter() - start) / n * 1e6)
                torch.cuda.synchronize()
        for tree in best:
            best[tree][call] = min(times[tree])
    return best


# Rounds of one tree whose values differ by more than this share of their median: the machine
# was not quiet (another process on its CPUs or GPU), and the row's ratio is not a measurement.
NOISY_SPREAD = 0.10


def _spread(values: Sequence[float]) -> float:
    """(largest - smallest) / median of one tree's per-round values (0 for one round)."""
    return (max(values) - min(values)) / statistics.median(values)


def summarise(
    runs: Dict[str, List[Dict[str, float]]], paired: bool = False
) -> List[Dict[str, object]]:
    """Per call: the fastest host us of each tree over its runs, new / old, and how far the
    rounds disagree.

    Args:
        runs: ``{"old": [measurements per round], "new": [...]}``, each a {call: us} dict.
        paired: the trees' rounds were taken together (``--in-process``: alternated call by
            call), so a round's new / old is a measurement of its own, and the spread is that of
            the rounds' ratios (a burst that slows both trees alike cancels in each); otherwise
            the spread is the larger of the two trees' :func:`_spread`.

    Returns:
        List[Dict[str, object]]: rows of ``call``, ``old``, ``new``, ``ratio`` and ``spread``, in
        the order the calls were measured.
    """
    rows = []
    for call in runs["new"][0]:
        olds = [run[call] for run in runs["old"] if call in run]
        news = [run[call] for run in runs["new"]]
        old, new = min(olds), min(news)
        if paired:
            spread = _spread([n / o for n, o in zip(news, olds)])
        else:
            spread = max(_spread(olds), _spread(news))
        rows.append({"call": call, "old": old, "new": new, "ratio": new / old, "spread": spread})
    return rows


def print_table(rows: Sequence[Dict[str, object]]) -> None:
    """The table (a row whose rounds disagree by more than :data:`NOISY_SPREAD` marked), then
    the worst row (the largest new / old)."""
    width = max(len(str(row["call"])) for row in rows)
    print(f"{'call':<{width}} | old us | new us | new/old | rounds differ by")
    for row in rows:
        noisy = "  (noisy: rerun on a quiet machine)" if row["spread"] > NOISY_SPREAD else ""
        print(
            f"{row['call']:<{width}} | {row['old']:6.1f} | {row['new']:6.1f} | "
            f"{row['ratio']:7.2f} | {row['spread']:.0%}{noisy}"
        )
    worst = max(rows, key=lambda row: row["ratio"])
    print(f"worst row: {worst['call']}: new / old = {worst['ratio']:.2f}")
    noisy = sum(row["spread"] > NOISY_SPREAD for row in rows)
    if noisy:
        limit = f"{NOISY_SPREAD:.0%}"
        print(f"{noisy} of {len(rows)} rows noisy: their rounds differ by more than {limit}")


def _measure(tree: Path, cpu: int) -> Dict[str, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p)
    # Every measuring process on the same CPU: a process moved between cores (or started on a
    # busier one) was the largest difference between rounds.
    proc = subprocess.run(
        [sys.executable, __file__, "--measure"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if cpu >= 0 else None,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    """Alternate the two trees' measuring processes; print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", type=Path, help="the other revision's tree (holds megatron_ext)")
    parser.add_argument("--new", type=Path, default=SCRIPTS.parent, help="default: this checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cpu",
        type=int,
        default=max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else -1,
        help="the CPU every measuring process is pinned to (default: the last this process may "
        "use; -1: not pinned)",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="load both trees in this process (the old one renamed) and alternate their rounds "
        "call by call; each of --rounds repeats is one measurement of every call",
    )
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: host time per call of GPU launches needs one", file=sys.stderr)
        return 2
    if args.measure:
        print(json.dumps(_latent_calls()))
        return 0
    if args.old is None:
        parser.error("--old is required")
    runs: Dict[str, List[Dict[str, float]]] = {"old": [], "new": []}
    if args.in_process:
        if args.cpu >= 0 and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {args.cpu})
        with tempfile.TemporaryDirectory() as scratch:
            renamed_copy(args.old.resolve(), "megatron_ext_old", Path(scratch))
            sys.path.insert(0, scratch)
            sys.path.insert(0, str(args.new.resolve()))
            new_calls, old_calls = _calls("megatron_ext"), _calls("megatron_ext_old")
            for _ in range(args.rounds):
                best = interleaved(new_calls, old_calls)
                for tree in runs:
                    runs[tree].append(best[tree])
    else:
        for _ in range(args.rounds):
            for name in ("old", "new"):
                runs[name].append(_measure(getattr(args, name).resolve(), args.cpu))
    # What else loaded the CPUs while the rounds ran (host time is CPU time).
    load = os.getloadavg()[0]
    print(f"load average over the last minute: {load:.1f} on {os.cpu_count()} CPUs")
    print_table(summarise(runs, paired=args.in_process))
    return 0


if __name__ == "__main__":
    sys.exit(main())
