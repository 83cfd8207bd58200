# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Full cos/sin tables of a rotary embedding, shared read-only by every thread that uses it.

megatron-core's ``get_cached_cos_sin`` rebuilds its one cached table in place whenever a call
asks for another length or dtype, which threads or tasks sharing a module would race on. The
tables here are computed once per (embedding, rows, dtype, device) under a lock and never changed
afterwards.
"""

import threading
import weakref
from typing import Any, Dict, Tuple

import torch

__all__ = ["cos_sin_table"]

_TABLES: "weakref.WeakKeyDictionary[Any, Dict[Tuple, Tuple[torch.Tensor, torch.Tensor]]]" = (
    weakref.WeakKeyDictionary()
)
_TABLES_LOCK = threading.Lock()


def cos_sin_table(
    rotary: Any, rows: int, dtype: torch.dtype, device: torch.device
) -> Tuple[torch.Tensor, torch.Tensor]:
    """The cos/sin tables megatron-core's ``get_cached_cos_sin(rows, dtype=dtype)`` returns (the
    same expression over the same ``forward``), without touching the module's cache.

    The first call for a key computes the tables (not graph-safe: make it before capture); later
    calls only look them up.

    Args:
        rotary: a megatron-core ``YarnRotaryEmbedding``.
        rows: positions the tables cover.
        dtype: the tables' dtype.
        device: the tables' device.

    Returns:
        Tuple[torch.Tensor, torch.Tensor]: ``[rows, 1, 1, emb_dim]`` cos and sin, mscale folded in.
    """
    key = (rows, dtype, torch.device(device))
    with _TABLES_LOCK:
        tables = _TABLES.setdefault(rotary, {})
        if key not in tables:
            emb, mscale = rotary.forward(rows, 0, False)
            tables[key] = (
                (emb.cos() * mscale).to(dtype).contiguous(),
                (emb.sin() * mscale).to(dtype).contiguous(),
            )
        return tables[key]
