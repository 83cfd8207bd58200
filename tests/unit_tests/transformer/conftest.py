# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""Fixtures for tests that build megatron-core attention modules."""

from typing import Dict, List

import mla_rope_reference
import pytest
import torch


@pytest.fixture
def cpu_current_device(monkeypatch):
    """Keep megatron's RoPE tables on the CPU, beside the CPU modules of the tests that use this.

    megatron's rotary embeddings put their tables on ``torch.cuda.current_device()`` (on a CUDA
    machine too, whatever the module's device), so that call answers ``"cpu"`` on any machine.
    """
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")


@pytest.fixture
def rope_spies(monkeypatch) -> Dict[str, List[str]]:
    """Record which RoPE functions run; both sides compute with the plain-torch reference.

    megatron_ext's kernels (what the flag's patch installs) are replaced by a double (so tests do
    not depend on Triton running here), and megatron-core's MLA module globals by a second one.

    Returns:
        dict: ``{"ext": [...], "mcore": [...]}``, the names of the functions called, in order.
    """
    calls: Dict[str, List[str]] = {"ext": [], "mcore": []}

    def spy(tag: str, name: str, fn):
        def wrapper(*args, **kwargs):
            calls[tag].append(name)
            return fn(*args, **kwargs)

        return wrapper

    from megatron.core.transformer import multi_latent_attention as mcore_mla

    from megatron_ext.fusions import fused_mla_yarn_rope_apply as ext_rope

    monkeypatch.setattr(
        ext_rope, "fused_apply_mla_rope_for_q", spy("ext", "q", mla_rope_reference.rope_q)
    )
    monkeypatch.setattr(
        ext_rope, "fused_apply_mla_rope_for_kv", spy("ext", "kv", mla_rope_reference.rope_kv)
    )

    monkeypatch.setattr(
        mcore_mla, "fused_apply_mla_rope_for_q", spy("mcore", "q", mla_rope_reference.rope_q)
    )
    monkeypatch.setattr(
        mcore_mla, "fused_apply_mla_rope_for_kv", spy("mcore", "kv", mla_rope_reference.rope_kv)
    )
    return calls
