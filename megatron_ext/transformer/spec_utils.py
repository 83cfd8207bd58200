# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Walking megatron-core module specs (mirrors ``megatron.core.transformer.spec_utils``)."""

import dataclasses
from typing import Any, Iterator

from megatron.core.transformer.spec_utils import ModuleSpec

__all__ = ["iter_module_specs"]


def iter_module_specs(obj: Any) -> Iterator[ModuleSpec]:
    """Every distinct ``ModuleSpec`` reachable from ``obj`` (dataclass fields, lists, tuples).

    Args:
        obj: a spec, or any object holding specs.

    Yields:
        ModuleSpec: each one once, parents before their submodules.
    """
    seen = set()
    stack = [obj]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, ModuleSpec):
            yield node
            stack.append(node.submodules)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            stack.extend(reversed([getattr(node, f.name, None) for f in dataclasses.fields(node)]))
        elif isinstance(node, (list, tuple)):
            stack.extend(reversed(node))
