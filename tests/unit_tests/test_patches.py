# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""The declared patches of megatron-core: applied and undone exactly, by one mechanism."""

import ast
import itertools
import pathlib
import subprocess
import sys
import textwrap
from typing import List, Optional, Set, Tuple

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


# Each switch is called with an MLA config the flag can act on.
_SWITCHES = {
    "apply mla": lambda config: apply_megatron_ext(mla_rope_contiguous_load=True, config=config),
    "apply slices": lambda _: apply_megatron_ext(inference_static_active_slices=True),
    "patch specs": lambda _: patch_megatron_core_gpt_specs(),
    "unpatch specs": lambda _: unpatch_megatron_core_gpt_specs(),
    "enable slices": lambda _: megatron_ext.inference.enable_static_active_slices(),
    "disable slices": lambda _: megatron_ext.inference.disable_static_active_slices(),
    "undo": lambda _: undo_megatron_ext(),
}


@pytest.mark.parametrize("order", list(itertools.permutations(_SWITCHES, 3)))
def test_undo_is_exact_in_any_order(order, make_mla_config):
    before, config = _snapshot(), make_mla_config()
    for step in order:
        _SWITCHES[step](config)
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


def test_undo_refuses_to_remove_a_replacement_it_did_not_put():
    """A patch put on top of megatron_ext's (a profiler's, another plugin's) is not clobbered:
    undo names the attribute and changes nothing until that patch is gone."""
    from megatron.core.models.gpt import gpt_layer_specs as mcore_specs

    mine = patches.resolve_targets(patches.MLA_ROPE_CONTIGUOUS_LOAD)
    patch_megatron_core_gpt_specs()
    ours = mcore_specs.MLASelfAttention

    class Theirs(ours):
        pass

    mcore_specs.MLASelfAttention = Theirs
    try:
        with pytest.raises(patches.PatchConflictError, match=r"MLASelfAttention is no longer"):
            unpatch_megatron_core_gpt_specs()
        assert patches.is_applied(patches.MLA_ROPE_CONTIGUOUS_LOAD)
        assert mcore_specs.MLASelfAttention is Theirs
        # Nothing else was restored either: every other target still holds megatron_ext's object.
        for owner, name, make, _why in mine:
            if not (owner is mcore_specs and name == "MLASelfAttention"):
                assert getattr(owner, name) is make(None), name
    finally:
        mcore_specs.MLASelfAttention = ours
    assert unpatch_megatron_core_gpt_specs() is None
    assert not patches.is_applied(patches.MLA_ROPE_CONTIGUOUS_LOAD)


def test_declared_entries_name_objects_except_where_the_module_may_be_missing():
    """Go-to-definition and import arrows reach every target and replacement: a dotted name only
    for a module some releases lack (an optional target) or one imported on apply (the inference
    constructors, see the module docstring)."""
    for extension, entries in patches.PATCHES.items():
        for entry in entries:
            if isinstance(entry, patches.SpecConstantsPatch):
                assert entry.optional, entry
                continue
            if isinstance(entry.target, str):
                assert entry.optional, f"{extension}: {entry.target} is not optional"
            if isinstance(entry.replacement, str):
                assert extension == patches.INFERENCE_STATIC_ACTIVE_SLICES, entry
                assert entry.replacement.startswith("megatron_ext.inference."), entry
            assert entry.when is None or callable(entry.when)


def test_unknown_extension_is_refused():
    for fn in (patches.apply_patches, patches.undo_patches, patches.is_applied):
        with pytest.raises(KeyError, match="unknown megatron_ext extension"):
            fn("no_such_flag")


# ----------------------------------------------------------------------------------------------
# Writes to megatron-core anywhere else in the package


def _is_megatron_core_module(name: str) -> bool:
    return name in ("megatron", "megatron.core") or name.startswith("megatron.core.")


def _root(node: ast.AST) -> Tuple[Optional[str], int]:
    """The name an expression is reached from, and how many attributes lie between the two."""
    depth = 0
    while True:
        if isinstance(node, ast.Attribute):
            node, depth = node.value, depth + 1
        elif isinstance(node, ast.Subscript):
            node = node.value
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "vars", "type")
            and node.args
        ):
            node = node.args[0]
        else:
            return (node.id if isinstance(node, ast.Name) else None), depth


def _megatron_core_names(tree: ast.AST) -> Set[str]:
    """Names a file binds to megatron-core objects: its imports from megatron.core, and names
    assigned from those (aliases, ``getattr``) or from ``importlib.import_module`` of one."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_megatron_core_module(alias.name):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and _is_megatron_core_module(node.module or ""):
            names.update(alias.asname or alias.name for alias in node.names)
    assignments = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
    ]
    grew = True
    while grew:
        grew = False
        for node in assignments:
            value = node.value
            imported = (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Attribute)
                and value.func.attr == "import_module"
                and value.args
                and isinstance(value.args[0], ast.Constant)
                and _is_megatron_core_module(str(value.args[0].value))
            )
            if (imported or _root(value)[0] in names) and node.targets[0].id not in names:
                names.add(node.targets[0].id)
                grew = True
    return names


# A method's own object, and an autograd Function's context: state the code owns.
_OWN = ("self", "cls", "ctx")


def _written_objects(node: ast.AST) -> List[ast.AST]:
    """The objects whose attributes ``node`` assigns or deletes (``x.a =``, ``del x.a``,
    ``x.a +=``, ``vars(x)[k] =``, ``x.__dict__[k] =``, ``setattr(x, ...)``, ``delattr(x, ...)``,
    ``object.__setattr__(x, ...)``)."""
    targets: List[ast.AST] = []
    if isinstance(node, (ast.Assign, ast.Delete)):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    flat: List[ast.AST] = []
    for target in targets:
        flat += list(target.elts) if isinstance(target, (ast.Tuple, ast.List)) else [target]
    written = []
    for target in flat:
        if isinstance(target, ast.Attribute):
            written.append(target.value)
        elif isinstance(target, ast.Subscript) and (
            (isinstance(target.value, ast.Attribute) and target.value.attr == "__dict__")
            or (
                isinstance(target.value, ast.Call)
                and isinstance(target.value.func, ast.Name)
                and target.value.func.id == "vars"
            )
        ):
            written.append(target.value)
    if isinstance(node, ast.Call) and node.args:
        func = node.func
        if (isinstance(func, ast.Name) and func.id in ("setattr", "delattr")) or (
            isinstance(func, ast.Attribute) and func.attr in ("__setattr__", "__delattr__")
        ):
            written.append(node.args[0])
    return written


def megatron_core_writes(source: str) -> List[str]:
    """Every write in ``source`` to an object megatron_ext does not own there, as ``line: code``.

    Counted: a write to a megatron-core module or class (any name bound to a megatron-core
    object, and anything reached from it), to an object handed in as an argument (the caller's:
    a megatron-core module's submodule, a controller), or to an attribute's attribute of
    ``self`` (a submodule, not the object itself). Not counted: a line that says, in a comment
    starting ``# not megatron-core state:``, which data object it writes and why (a request's
    status, set as megatron-core's own engine sets it), so each such write is declared where a
    reviewer reads it.

    Args:
        source: a Python file's text.

    Returns:
        List[str]: the writes, in file order.
    """
    tree = ast.parse(source)
    core = _megatron_core_names(tree)
    found = []

    def visit(node: ast.AST, arguments: Set[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            spec = node.args
            named = spec.posonlyargs + spec.args + spec.kwonlyargs
            named += [a for a in (spec.vararg, spec.kwarg) if a is not None]
            arguments = {a.arg for a in named} - set(_OWN)
        for obj in _written_objects(node):
            root, depth = _root(obj)
            if root in core or root in arguments or (root in _OWN and depth >= 1):
                found.append((node.lineno, ast.unparse(node).splitlines()[0]))
        for child in ast.iter_child_nodes(node):
            visit(child, arguments)

    visit(tree, set())
    lines = source.splitlines()
    declared = {i + 1 for i, text in enumerate(lines) if "# not megatron-core state:" in text}
    return [f"{line}: {code}" for line, code in sorted(found) if line not in declared]


def test_the_write_scan_sees_every_kind_of_write():
    source = textwrap.dedent("""
        import importlib
        import megatron.core.transformer.multi_latent_attention
        from megatron.core.inference.contexts import dynamic_context as ctx_module
        from megatron.core.transformer.spec_utils import ModuleSpec

        alias = ctx_module.DynamicInferenceContext
        loaded = importlib.import_module("megatron.core.utils")
        megatron.core.transformer.multi_latent_attention.TELinear = None
        ModuleSpec.extra = 1
        del alias.__init__
        setattr(loaded, "x", 1)
        delattr(ctx_module, "y")
        object.__setattr__(ModuleSpec, "z", 2)
        vars(alias)["w"] = 3

        def hook(rotary_pos_emb, owner, request):
            rotary_pos_emb.get_cached_cos_sin = len
            setattr(owner, "step", len)
            request.status = 1  # not megatron-core state: the caller's request
            request.other = 2  # an undeclared write to an argument still counts

        class Mine:
            def __init__(self):
                self.mine = 1
                self.child.attr = 2
                local = Mine()
                local.value = 3
        """)
    writes = [w.split(":", 1)[1].strip() for w in megatron_core_writes(source)]
    assert writes == [
        "megatron.core.transformer.multi_latent_attention.TELinear = None",
        "ModuleSpec.extra = 1",
        "del alias.__init__",
        "setattr(loaded, 'x', 1)",
        "delattr(ctx_module, 'y')",
        "object.__setattr__(ModuleSpec, 'z', 2)",
        "vars(alias)['w'] = 3",
        "rotary_pos_emb.get_cached_cos_sin = len",
        "setattr(owner, 'step', len)",
        "request.other = 2",
        "self.child.attr = 2",
    ]


def test_only_this_module_writes_to_megatron_core():
    """No other runtime module writes to megatron-core's modules, classes or the objects it is
    handed: every such change is a declared patch, applied and undone here."""
    root = pathlib.Path(patches.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path == pathlib.Path(patches.__file__):
            continue
        for write in megatron_core_writes(path.read_text(encoding="utf-8")):
            offenders.append(f"{path.relative_to(root)}:{write}")
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
