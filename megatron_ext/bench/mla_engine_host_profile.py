# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Where the host time of the MLA engine benchmark's decode step goes (``--host-profile-steps
N``): N decode steps of an engine under Python's ``cProfile``, each synchronised before and after
as the timed rounds' steps are (the closing synchronisation inside the profile, so that the
profiled time is the step's wall time). Per decode step: the profiled wall time, the self time
(``tottime``) per owner, the package a function's file lies in (``megatron_ext``,
``megatron.core``, ``torch``, ``triton``, else ``python/other``; a C function goes to ``torch`` or
``triton`` where its name says so), which sums to the profiled total; the top functions by self
time; and the top ``megatron_ext`` functions by cumulative time (the plugin's own entry points
with what they call).

Caveats:

* cProfile's overhead (about a microsecond per Python call) inflates Python-heavy code: read the
  owners' shares, not their absolute ms, and compare the profiled step with the timed one.
* A synchronisation's wait for the GPU shows up as self time of the function that synchronises
  (``.item()``, ``.tolist()``, ``.cpu()``, ``synchronize``; :data:`SYNC_METHODS`): that is GPU
  time, not host work. Those functions are listed apart as "waits on the GPU" (their time stays in
  their owner's) and the host work is the profiled total without them. A read-back that cProfile
  cannot name (a blocking ``copy_`` or ``.to("cpu")``) stays in the host work.
* Operators reached through Python syntax (``a + b``, ``t[i] = x``) are C slots cProfile does not
  see: their time is the calling function's self time.
* Only the calling thread is profiled.

:func:`host_breakdown` and :func:`host_profile_lines` are pure functions of a ``pstats`` stats
dict, so the tests check them on made-up and small real profiles; :func:`profile_host_decode_steps`
needs only an engine (and on a GPU, its synchronisation).
"""

import cProfile
import importlib.util
import os
import pstats
import re
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = [
    "OTHER",
    "OWNERS",
    "SYNC_METHODS",
    "TOP_CUMULATIVE",
    "TOP_SELF",
    "function_label",
    "host_breakdown",
    "host_profile_lines",
    "owner_of",
    "package_roots",
    "profile_host_decode_steps",
]

OTHER = "python/other"
# Owners are the packages' module names, so that a package's directory says how far up its
# labels start (megatron.core's files are labelled megatron/core/...).
OWNERS = ("megatron_ext", "megatron.core", "torch", "triton", OTHER)
TOP_SELF = 15
TOP_CUMULATIVE = 10
# torch's C functions that wait for the GPU: a scalar or tensor read back to the host, an explicit
# synchronisation, and nonzero (it reads its count back to size its output).
SYNC_METHODS = frozenset(
    {"item", "tolist", "cpu", "numpy", "nonzero", "synchronize", "_cuda_synchronize"}
)
# The benchmark's own stepping (DynamicUnit, the synchronisation helper): counted in
# megatron_ext's self time (and said apart), left out of its cumulative list, where it would
# head the list with the whole step.
_BENCH_PREFIX = "megatron_ext/bench/"
# "<method 'item' of 'torch._C.TensorBase' objects>", "<built-in method torch._C._cuda_synchronize>"
_C_NAME = re.compile(r"<method '(?P<method>\w+)' of |<built-in method (?:[\w.]*\.)?(?P<fn>\w+)>")

Key = Tuple[str, int, str]


def package_roots() -> Dict[str, str]:
    """The directory of each owner package that is installed (``importlib.util.find_spec``).

    Returns:
        Dict[str, str]: package directory -> owner (one of :data:`OWNERS` but ``python/other``).
    """
    roots = {}
    for owner in OWNERS[:-1]:
        try:
            spec = importlib.util.find_spec(owner)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.submodule_search_locations:
            for location in spec.submodule_search_locations:
                roots[os.path.normpath(location)] = owner
    return roots


def _root_of(path: str, roots: Mapping[str, str]) -> Optional[str]:
    """The longest package directory of ``roots`` that holds ``path`` (a whole path component:
    ``torchvision`` is not ``torch``)."""
    path = os.path.normpath(path)
    held = [root for root in roots if path.startswith(root.rstrip(os.sep) + os.sep)]
    return max(held, key=len) if held else None


def owner_of(key: Key, roots: Mapping[str, str]) -> str:
    """The owner of one profiled function.

    Args:
        key: ``pstats``' ``(file, line, name)``; C functions have file ``"~"``.
        roots: :func:`package_roots`' mapping.

    Returns:
        str: one of :data:`OWNERS`.
    """
    path, _, name = key
    if path == "~":
        # C functions carry no file; their name gives the defining module or type.
        for owner in ("torch", "triton"):
            if owner in name:
                return owner
        return OTHER
    root = _root_of(path, roots)
    return OTHER if root is None else roots[root]


def function_label(key: Key, roots: Mapping[str, str]) -> str:
    """``file:line(name)`` with the file relative to the directory holding its package (or the
    longest ``sys.path`` entry holding it, else its base name); C functions as pstats prints them.

    Args:
        key: ``pstats``' ``(file, line, name)``.
        roots: :func:`package_roots`' mapping.

    Returns:
        str: the label.
    """
    path, line, name = key
    if path == "~" or path.startswith("<"):
        return pstats.func_std_string(key)
    root = _root_of(path, roots)
    if root is not None:
        # megatron.core's files start at megatron/: one directory up per component of the owner.
        base = root
        for _ in roots[root].split("."):
            base = os.path.dirname(base)
    else:
        entries = {os.path.normpath(entry): None for entry in sys.path if entry}
        base = _root_of(path, entries) or os.path.dirname(path)
    return f"{os.path.relpath(os.path.normpath(path), base)}:{line}({name})"


def _by_time(row: Dict[str, Any]) -> Tuple[float, str]:
    return -row["ms_per_step"], row["function"]


def _is_sync(key: Key, owner: str) -> bool:
    match = _C_NAME.match(key[2]) if key[0] == "~" and owner == "torch" else None
    return bool(match) and (match.group("method") or match.group("fn")) in SYNC_METHODS


def host_breakdown(
    stats: Mapping[Key, Sequence[Any]],
    steps: int,
    wall_seconds: float,
    roots: Mapping[str, str],
    top: int = TOP_SELF,
    top_cumulative: int = TOP_CUMULATIVE,
) -> Dict[str, Any]:
    """Aggregate a cProfile of ``steps`` decode steps.

    Args:
        stats: ``pstats.Stats(...).stats``: per ``(file, line, name)``, ``(primitive calls,
            calls, self seconds, cumulative seconds, callers)``.
        steps: decode steps profiled.
        wall_seconds: the steps' wall time under the profiler, summed.
        roots: :func:`package_roots`' mapping.
        top: functions listed by self time.
        top_cumulative: ``megatron_ext`` functions listed by cumulative time.

    Returns:
        Dict[str, Any]: per step: ``wall_ms_per_step``, ``profiled_ms_per_step`` (every self time
        summed), ``owners`` (ms per owner of :data:`OWNERS`, summing to the profiled time),
        ``bench_ms_per_step`` (the benchmark's own stepping, within ``megatron_ext``),
        ``gpu_wait_ms_per_step`` and ``host_ms_per_step`` (the profiled time without it);
        ``waits``, ``top_self`` and ``top_cumulative``: lists of ``owner``, ``function``,
        ``ms_per_step`` and ``calls_per_step``; and ``steps``.

    Raises:
        ValueError: if ``steps`` or ``wall_seconds`` is not positive.
    """
    if steps <= 0 or wall_seconds <= 0:
        raise ValueError(f"steps and wall time must be positive, got {steps}, {wall_seconds}")
    owners = dict.fromkeys(OWNERS, 0.0)
    rows, waits, entries = [], [], []
    bench = 0.0
    for key, (_, calls, self_s, cumulative_s, *_) in stats.items():
        if "_lsprof.Profiler" in key[2]:
            continue  # the profiler's own disable()
        owner, label = owner_of(key, roots), function_label(key, roots)
        owners[owner] += self_s
        row = {
            "owner": owner,
            "function": label,
            "ms_per_step": self_s / steps * 1e3,
            "calls_per_step": calls / steps,
        }
        rows.append(row)
        if _is_sync(key, owner):
            waits.append(row)
        if owner == "megatron_ext" and label.startswith(_BENCH_PREFIX):
            bench += self_s
        elif owner == "megatron_ext":
            entries.append(dict(row, ms_per_step=cumulative_s / steps * 1e3))
    profiled_ms = sum(owners.values()) / steps * 1e3
    wait_ms = sum(r["ms_per_step"] for r in waits)
    return {
        "steps": steps,
        "wall_ms_per_step": wall_seconds / steps * 1e3,
        "profiled_ms_per_step": profiled_ms,
        "owners": {owner: seconds / steps * 1e3 for owner, seconds in owners.items()},
        "bench_ms_per_step": bench / steps * 1e3,
        "gpu_wait_ms_per_step": wait_ms,
        "host_ms_per_step": profiled_ms - wait_ms,
        "waits": sorted(waits, key=_by_time),
        "top_self": sorted(rows, key=_by_time)[:top],
        "top_cumulative": sorted(entries, key=_by_time)[:top_cumulative],
    }


def _calls(calls: float) -> str:
    """Calls per step, without trailing zeros (a call every other step is 0.5)."""
    return f"{calls:.2f}".rstrip("0").rstrip(".") or "0"


def _function_lines(rows: Sequence[Dict[str, Any]], owner: bool) -> List[str]:
    return [
        f"    {r['ms_per_step']:8.3f} ms x{_calls(r['calls_per_step']):<7} "
        + (f"{r['owner']:<13} " if owner else "")
        + r["function"]
        for r in rows
    ]


def host_profile_lines(
    title: str, profile: Dict[str, Any], timed_step_ms: Optional[float] = None
) -> List[str]:
    """The printed host profile: a head line, the owners, the waits on the GPU, then the top
    functions by self time and the top ``megatron_ext`` functions by cumulative time.

    Args:
        title: what was profiled (model, requests, engine).
        profile: :func:`host_breakdown`'s result, or ``{"steps": 0}``.
        timed_step_ms: the timed rounds' step, printed beside the profiled one (cProfile's
            overhead is the difference).

    Returns:
        List[str]: the lines.
    """
    if not profile.get("steps"):
        return [f"host profile per decode step ({title}): no decode step was profiled"]
    timed = f" (timed rounds: {timed_step_ms:.3f} ms)" if timed_step_ms is not None else ""
    profiled = profile["profiled_ms_per_step"]

    def share(ms: float) -> float:
        return ms / profiled if profiled else 0.0

    lines = [
        f"host profile per decode step ({title}, {profile['steps']} steps under cProfile): "
        f"wall {profile['wall_ms_per_step']:.3f} ms{timed}, self time {profiled:.3f} ms: waits "
        f"on the GPU {profile['gpu_wait_ms_per_step']:.3f} ms "
        f"({share(profile['gpu_wait_ms_per_step']):.0%}), host work "
        f"{profile['host_ms_per_step']:.3f} ms ({share(profile['host_ms_per_step']):.0%})",
        "  self time per owner:",
    ]
    for owner, ms in profile["owners"].items():
        note = ""
        if owner == "megatron_ext" and profile["bench_ms_per_step"]:
            note = f" (the benchmark's own stepping {profile['bench_ms_per_step']:.3f} ms)"
        elif owner == "torch" and profile["gpu_wait_ms_per_step"]:
            note = f" (waits on the GPU {profile['gpu_wait_ms_per_step']:.3f} ms)"
        lines.append(f"    {share(ms):6.1%} {ms:8.3f} ms {owner}{note}")
    lines.append("  waits on the GPU (self time of the functions that synchronise):")
    lines += _function_lines(profile["waits"], owner=False) or ["    (none seen)"]
    lines.append(f"  top {len(profile['top_self'])} functions by self time:")
    lines += _function_lines(profile["top_self"], owner=True)
    lines.append(
        f"  top {len(profile['top_cumulative'])} megatron_ext functions by cumulative time "
        "(with what they call):"
    )
    lines += _function_lines(profile["top_cumulative"], owner=False) or ["    (none seen)"]
    return lines


def profile_host_decode_steps(
    unit: Any,
    prompts: Sequence[Sequence[int]],
    steps: int,
    sync: Callable[[], None],
    roots: Optional[Mapping[str, str]] = None,
) -> Dict[str, Any]:
    """Up to ``steps`` decode steps of one engine's batch under ``cProfile``; the rest of the
    batch decoded outside it.

    Args:
        unit: a :class:`~megatron_ext.bench.mla_engine.DynamicUnit` (or anything with its
            ``start``, ``prefill``, ``decode_step``, ``done`` and ``drain``).
        prompts: the batch's prompts.
        steps: decode steps to profile (at most the batch's decode steps).
        sync: waits for the device (``torch.cuda.synchronize`` on a GPU).
        roots: :func:`package_roots`' mapping (found here by default).

    Returns:
        Dict[str, Any]: :func:`host_breakdown`'s result, or ``{"steps": 0}`` when no decode step
        was profiled.
    """
    profiler = cProfile.Profile()
    unit.start(prompts)
    unit.prefill()
    sync()
    done, wall = 0, 0.0
    while done < steps and not unit.done:
        sync()
        began = time.perf_counter()
        profiler.enable()
        unit.decode_step()
        # Inside the profile: the wait for the step's GPU work is part of its wall time, and
        # shows up as the synchronisation's self time (a wait, not host work).
        sync()
        profiler.disable()
        # Every step is counted, a rare one that was not decode-only too, as the kernel
        # breakdown counts them.
        wall += time.perf_counter() - began
        done += 1
    unit.drain()
    if not done:
        return {"steps": 0}
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    return host_breakdown(stats, done, wall, package_roots() if roots is None else roots)
