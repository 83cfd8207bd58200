# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""What megatron-core's MLA module needs in place of Transformer Engine's names when TE is absent
(mirrors ``megatron.core.extensions.transformer_engine``).

megatron-core 0.16's MLA module imports ``TELinear`` from
``megatron.core.extensions.transformer_engine``, which without TE builds it on a ``MagicMock``
(0.19's MLA module sets it to None instead). Its constructor then calls
``isinstance(linear_proj, TELinear)``, which raises for a mock. :class:`AbsentTELinear` is what
the ``te_free_mla`` patch (:data:`megatron_ext.patches.PATCHES`) puts there: a class nothing is an
instance of, the answer TE's absence means.
"""

from typing import Any

__all__ = ["AbsentTELinear", "is_mock_te_linear"]


class AbsentTELinear:
    """Stands in for ``TELinear`` in megatron-core 0.16's MLA module when Transformer Engine is
    absent: no module is an instance of it."""


def is_mock_te_linear(te_linear: Any) -> bool:
    """Whether the MLA module's ``TELinear`` is megatron-core's mock rather than a class.

    Args:
        te_linear: the ``TELinear`` global of megatron-core's MLA module.

    Returns:
        bool: True for megatron-core's stand-in without TE (0.16); False for TE's class or None.
    """
    return te_linear is not None and not isinstance(te_linear, type)
