# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Print the file-by-file call path of ``fused_apply_mla_rope_for_q``: a first and a cached call.

    python scripts/trace_rope_call_path.py [--requires-grad] [--device cuda] [--json]

A profile hook (``sys.setprofile``) records which file's Python runs at each call and return.
Only megatron_ext's own files count, the Triton kernels (``fusions/mla_rope/kernels.py``, which
the interpreter runs as Python) excepted; torch, Triton and the standard library are skipped, so
a move is a change from one project file to another. The first call is of a shape not seen
before, after one call of another shape (the kernel kind and dtypes, and Triton's and the
gradient check's one-time set-up, are known by then); the cached call repeats it.

Without a GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` is set before
Triton is imported), which is what the unit test bounding the path runs.
"""

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Dict, List

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "megatron_ext"
# Not part of the call path: the interpreter runs the kernels' bodies as Python.
KERNELS = PACKAGE / "fusions" / "mla_rope" / "kernels.py"


def _project_file(filename: str):
    """``filename`` relative to the package, or None for a file outside it (or the kernels)."""
    try:
        path = Path(filename).resolve()
    except (OSError, ValueError):
        return None
    if path == KERNELS or PACKAGE not in path.parents:
        return None
    return path.relative_to(PACKAGE).as_posix()


def trace(call) -> List[str]:
    """Run ``call()`` under a profile hook; the project files its Python ran in, in order, each
    run of consecutive events in one file counted once."""
    path: List[str] = []
    known: Dict[str, object] = {}

    def hook(frame, event, arg):
        if event == "call":
            code = frame.f_code
        elif event == "return" and frame.f_back is not None:
            code = frame.f_back.f_code
        else:
            return
        name = code.co_filename
        if name not in known:
            known[name] = _project_file(name)
        where = known[name]
        if where is not None and (not path or path[-1] != where):
            path.append(where)

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return path


def call_paths(device: str, requires_grad: bool) -> Dict[str, List[str]]:
    """The call paths of a first and a cached call of the query RoPE on ``device``.

    Args:
        device: ``"cpu"`` (Triton's interpreter) or ``"cuda"``.
        requires_grad: whether the query requires grad (the autograd path) or not (inference).

    Returns:
        dict: ``{"first": [...], "cached": [...]}``, the project files in the order entered.
    """
    import torch

    from megatron_ext.fusions.fused_mla_yarn_rope_apply import (
        fused_apply_mla_rope_for_q,
        pinned_kernel_config,
    )

    heads, qk_head_dim, emb_dim, rows = 3, 8, 16, 64
    cos = torch.randn(rows, 1, 1, emb_dim, device=device)
    sin = torch.randn(rows, 1, 1, emb_dim, device=device)

    def query(seq_len: int) -> torch.Tensor:
        t = torch.randn(seq_len, 2, heads, qk_head_dim + emb_dim, device=device)
        return t.requires_grad_() if requires_grad else t

    def call(t):
        return lambda: fused_apply_mla_rope_for_q(t, cos, sin, qk_head_dim, emb_dim)

    # A pinned config: the path, not the autotuner's timing loop, is what is traced on a GPU too.
    with pinned_kernel_config(4, 1):
        call(query(4))()  # the kind, dtypes and one-time set-up seen, with another shape
        first = trace(call(query(5)))
        cached = trace(call(query(5)))
    return {"first": first, "cached": cached}


def summary(path: List[str]) -> Dict[str, object]:
    """The files entered (in order of first entry), their count and the moves between files."""
    files = list(dict.fromkeys(path))
    return {"path": path, "files": files, "file_count": len(files), "moves": max(len(path) - 1, 0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--requires-grad", action="store_true", help="trace the autograd path")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    device = args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and "triton" in sys.modules:
        raise SystemExit("Triton was imported before TRITON_INTERPRET could be set")
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    result = {name: summary(path) for name, path in call_paths(device, args.requires_grad).items()}
    if args.json:
        print(json.dumps(result))
        return
    mode = "requires grad" if args.requires_grad else "no grad"
    for name, info in result.items():
        print(
            f"{name} call ({device}, {mode}): {info['file_count']} project files, "
            f"{info['moves']} moves"
        )
        for step, where in enumerate(info["path"]):
            print(f"  {step:2d}  megatron_ext/{where}")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
