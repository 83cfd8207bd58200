# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The declared patches of megatron-core: applied and undone exactly, by one mechanism."""

import itertools
import subprocess
import sys

import pytest

import megatron_ext.inference
from megatron_ext import patches
from megatron_ext.arguments import applied_megatron_ext, apply_megatron_ext, undo_megatron_ext
from megatron_ext.models.gpt.gpt_layer_specs import (
    patch_megatron_core_gpt_specs,
    unpatch_megatron_core_gpt_specs,
)

_FLAGS = (patches.MLA_ROPE_CONTIGUOUS_LOAD, patches.INFERENCE_STATIC_ACTIVE_SLICES)


def _snapshot():
    """Every declared target's current object (and whether its owner has it as its own)."""
    out = {}
    for extension in patches.EXTENSIONS:
        for owner, name, _make, _why in patches.resolve_targets(extension):
            own = name in getattr(owner, "__dict__", {})
            out[(id(owner), name)] = (owner, name, getattr(owner, name), own)
    return out


def _assert_same(before, after):
    assert before.keys() == after.keys()
    for key, (owner, name, obj, own) in before.items():
        _, _, now, now_own = after[key]
        assert now is obj, f"{owner!r}.{name} is not the object it was"
        assert now_own == own, f"{owner!r}.{name}: own attribute {own} -> {now_own}"


@pytest.fixture(autouse=True)
def _clean():
    undo_megatron_ext()
    yield
    undo_megatron_ext()


def test_every_declared_target_resolves_and_is_replaced_while_applied():
    before = _snapshot()
    assert before, "nothing declared resolves on this release"
    for extension in _FLAGS:
        targets = patches.resolve_targets(extension)
        assert targets, f"{extension}: no target on this release"
        patches.apply_patches(extension)
        for owner, name, _make, _why in targets:
            assert getattr(owner, name) is not before[(id(owner), name)][2], (extension, name)
        reported = patches.applied_extensions()[extension]
        assert len(reported) == len(targets)
    undo_megatron_ext()
    _assert_same(before, _snapshot())


_SWITCHES = {
    "apply mla": lambda: apply_megatron_ext(mla_rope_contiguous_load=True, config=_mla_config()),
    "apply slices": lambda: apply_megatron_ext(inference_static_active_slices=True),
    "patch specs": patch_megatron_core_gpt_specs,
    "unpatch specs": unpatch_megatron_core_gpt_specs,
    "enable slices": megatron_ext.inference.enable_static_active_slices,
    "disable slices": megatron_ext.inference.disable_static_active_slices,
    "undo": undo_megatron_ext,
}


def _mla_config():
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=4,
        rope_type="yarn",
        apply_rope_fusion=True,
    )


@pytest.mark.parametrize("order", list(itertools.permutations(_SWITCHES, 3)))
def test_undo_is_exact_in_any_order(order):
    before = _snapshot()
    for step in order:
        _SWITCHES[step]()
        state = applied_megatron_ext()
        assert state["mla_rope_contiguous_load"] == patches.is_applied(_FLAGS[0])
        assert state["inference_static_active_slices"] == patches.is_applied(_FLAGS[1])
    undo_megatron_ext()
    assert not any(applied_megatron_ext().values())
    _assert_same(before, _snapshot())


def test_apply_is_all_or_nothing(monkeypatch):
    """A replacement that fails after the others were put in takes them all back out."""
    before = _snapshot()
    # divmod(original) raises TypeError: the last patch fails after the others are applied.
    broken = patches.PATCHES[patches.MLA_ROPE_CONTIGUOUS_LOAD] + (
        patches.Patch(
            "megatron.core.utils", "is_te_min_version", "builtins:divmod", "t", wraps=True
        ),
    )
    monkeypatch.setitem(patches.PATCHES, patches.MLA_ROPE_CONTIGUOUS_LOAD, broken)
    with pytest.raises(TypeError, match="divmod"):
        patches.apply_patches(patches.MLA_ROPE_CONTIGUOUS_LOAD)
    assert not patches.is_applied(patches.MLA_ROPE_CONTIGUOUS_LOAD)
    monkeypatch.undo()
    _assert_same(before, _snapshot())


def test_a_missing_target_is_refused_before_anything_is_patched(monkeypatch):
    broken = patches.PATCHES[patches.MLA_ROPE_CONTIGUOUS_LOAD] + (
        patches.Patch("megatron.core.utils", "no_such_attribute", "builtins:len", "test"),
    )
    monkeypatch.setitem(patches.PATCHES, patches.MLA_ROPE_CONTIGUOUS_LOAD, broken)
    with pytest.raises(AttributeError, match="has no such attribute"):
        patches.apply_patches(patches.MLA_ROPE_CONTIGUOUS_LOAD)
    assert not patches.is_applied(patches.MLA_ROPE_CONTIGUOUS_LOAD)


def test_unknown_extension_is_refused():
    for fn in (patches.apply_patches, patches.undo_patches, patches.is_applied):
        with pytest.raises(KeyError, match="unknown megatron_ext extension"):
            fn("no_such_flag")


def test_only_this_module_writes_to_megatron_core():
    """No other runtime module assigns attributes of megatron-core's modules or classes."""
    import pathlib
    import re

    root = pathlib.Path(patches.__file__).parent
    writes = re.compile(r"^\s*(setattr\(\s*(mcore|_mcore)|(mcore|_mcore)\w*\.\w+\s*=[^=])")
    offenders = []
    for path in root.rglob("*.py"):
        if path.name == "patches.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if writes.search(line):
                offenders.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offenders


def test_import_is_light():
    """``import megatron_ext`` checks the megatron-core version without importing it or torch."""
    code = (
        "import sys, megatron_ext; "
        "heavy = sorted(m for m in sys.modules if m.startswith(('megatron.', 'torch', 'triton'))); "
        "print(megatron_ext.MEGATRON_CORE_VERSION, len(heavy), heavy[:5])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out[1] == "0", out
    from megatron.core import package_info

    # A source checkout's megatron-core appends "+<git hash>"; the release is what is checked.
    assert out[0] == package_info.__version__.split("+")[0]
