# Copyright (c) 2026, megatron_ext contributors. All rights reserved.

"""megatron_ext's imports run one way: no module reaches itself again through what it imports."""

import ast
import pathlib
from typing import Dict, List, Set

import megatron_ext

PACKAGE_ROOT = pathlib.Path(megatron_ext.__file__).parent


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = PACKAGE_ROOT) -> Dict[str, Set[str]]:
    """Module -> the project modules it imports, at module level or inside a function.

    Args:
        root: the package directory.

    Returns:
        Dict[str, Set[str]]: the edges; ``from package import name`` counts as an import of
        ``package.name`` where that is a module, else of ``package``.
    """
    modules = {_module_name(path): path for path in root.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
        graph[name] = edges - {name}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle through each module that lies on a cycle (depth-first search).

    Args:
        graph: module -> imported modules.

    Returns:
        List[List[str]]: each cycle as a path that ends where it starts.
    """
    found, done = [], set()

    def visit(node: str, path: List[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                found.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    return found


def test_cycle_finder():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles():
    assert not cycles(import_graph())


def test_patches_imports_what_it_patches_in_with():
    """The wiring shows in the imports: the declared list imports megatron_ext's replacements."""
    edges = import_graph()["megatron_ext.patches"]
    assert {
        "megatron_ext.fusions.fused_mla_yarn_rope_apply",
        "megatron_ext.transformer.multi_latent_attention",
        "megatron_ext.extensions.transformer_engine",
    } <= edges
    assert not any(e.startswith("megatron_ext.models") for e in edges)


# The ground floor of megatron_ext.fusions: what the kernel modules build on.
FUSIONS_GROUND_FLOOR = (
    "megatron_ext.fusions.tensor_checks",
    "megatron_ext.fusions.launch_plans",
    "megatron_ext.fusions.direct_launch",
    "megatron_ext.fusions.launch_math",
    "megatron_ext.fusions.side_stream",
)


def test_the_fusions_ground_floor_imports_only_the_ground_floor():
    """Shared checks, the launch layer and the side stream import no kernel module and nothing
    of mla_rope."""
    graph = import_graph()
    for module in FUSIONS_GROUND_FLOOR:
        fusions = {m for m in graph[module] if m.startswith("megatron_ext.fusions")}
        assert fusions <= set(FUSIONS_GROUND_FLOOR), (module, sorted(fusions))


MLA_LATENT = "megatron_ext.fusions.mla_latent"
# The package's modules in dependency order: each imports only the ones before it (and the ground
# floor), so a reader follows it top to bottom.
MLA_LATENT_ORDER = (
    "tile_rules",
    "checks",
    "attention_kernels",
    "decode_gluon",
    "attention_plan",
    "attention",
    "rope_cache_append",
    "mha_rows",
    "mha_dense",
    "mha_backends",
    "mha_chunks",
    "mha_merge",
    "mha_gather",
    "mha_plan",
    "mha_weights",
    "mha_form",
)
# The former import paths: shims that re-export the package's names for outside code.
FORMER_LATENT_PATHS = {
    "megatron_ext.fusions.mla_paged_latent_attention",
    "megatron_ext.fusions.fused_mla_rope_cache_append",
    "megatron_ext.fusions.latent_cache_checks",
}


def test_the_latent_cache_package_imports_down_only():
    """mla_latent builds on the ground floor; no module of it imports a later one, the package
    or a former import path, and nothing else in fusions but the shims imports it."""
    graph = import_graph()
    modules = {m for m in graph if m.startswith(MLA_LATENT + ".")}
    assert modules == {f"{MLA_LATENT}.{name}" for name in MLA_LATENT_ORDER}, sorted(modules)
    for i, name in enumerate(MLA_LATENT_ORDER):
        allowed = set(FUSIONS_GROUND_FLOOR) | {f"{MLA_LATENT}.{n}" for n in MLA_LATENT_ORDER[:i]}
        fusions = {m for m in graph[f"{MLA_LATENT}.{name}"] if m.startswith("megatron_ext.fusions")}
        assert fusions <= allowed, (name, sorted(fusions - allowed))
    for module, edges in graph.items():
        outside = module.startswith("megatron_ext.fusions") and not module.startswith(MLA_LATENT)
        if outside and module not in FORMER_LATENT_PATHS:
            assert not any(e.startswith(MLA_LATENT) for e in edges), module


def test_nothing_in_the_project_imports_the_former_latent_cache_paths():
    """The former modules are shims for outside code: megatron_ext imports the package."""
    for module, edges in import_graph().items():
        assert not edges & FORMER_LATENT_PATHS, (module, sorted(edges & FORMER_LATENT_PATHS))
