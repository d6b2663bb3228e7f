"""The package's import graph, computed from the source (ast, nothing imported).

Rules (docs/design.md, "Layers"): dependencies point one way, errors -> config -> metadata ->
ops -> parallel/comm -> impl -> backend -> integrations/launch/testing; no cycle; no import of
the package inside a function (lazy imports are for optional device packages only:
torch_npu, flash_attn, vllm). Each rule is also run on a planted violation so that it can fail.
``python tests/test_architecture.py`` prints the graph (module -> internal imports).
"""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

import cp_attention

PACKAGE = "cp_attention"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE
# Layer of each top-level part of the package; a module may import its own layer or lower ones.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "mathutils", "envs"),
    ("config",),
    ("metadata",),
    ("ops",),
    ("parallel", "comm", "debug", "costmodel"),
    ("impl",),
    ("backend",),
    ("integrations", "launch", "testing", "__init__"),
)
LAYER_OF = {part: level for level, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path, root: Path) -> str:
    """cp_attention/ops/__init__.py -> cp_attention.ops; cp_attention/ops/cpu.py -> ...ops.cpu"""
    parts = (root.name,) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             modules: set[str]) -> list[str]:
    """Modules of the package (or outside it) that an import statement loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    source = _absolute(node, module, is_package)
    out = []
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        out.append(sub if sub in modules else source)  # `from pkg import submodule`
    return out


def _function_level(tree: ast.Module) -> set[int]:
    """ids of the import nodes that sit inside a function body."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            inside |= {id(n) for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return inside


def import_graph(root: Path = ROOT) -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """({module: internal modules it imports at load time}, [(module, internal module it
    imports inside a function)]). Lazy imports of other packages (torch_npu, flash_attn, vllm,
    logging) are not collected."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    modules = set(files)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    lazy: list[tuple[str, str]] = []
    prefix = root.name
    for module, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        in_function = _function_level(tree)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _targets(node, module, path.name == "__init__.py", modules):
                internal = target == prefix or target.startswith(prefix + ".")
                if internal and id(node) in in_function:
                    lazy.append((module, target))
                elif internal and target != module:
                    graph[module].add(target)
    return graph, lazy


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None (iterative DFS, white/grey/black)."""
    state = {node: 0 for node in graph}
    for start in sorted(graph):
        if state[start]:
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
                path.pop()
            elif state.get(child, 0) == 1:
                return path[path.index(child):] + [child]
            elif state.get(child, 0) == 0 and child in graph:
                state[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
                path.append(child)
    return None


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYER_OF["__init__" if len(parts) == 1 else parts[1]]


def layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Edges that point up the layer order."""
    return sorted((a, b) for a, targets in graph.items() for b in targets if layer(b) > layer(a))


# -- the package --------------------------------------------------------------------------
def test_every_module_has_a_layer():
    graph, _ = import_graph()
    assert len(graph) > 30
    for module in graph:
        layer(module)  # KeyError names a top-level part missing from LAYERS


def test_no_cycle():
    graph, _ = import_graph()
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_dependencies_point_down_the_layers():
    graph, _ = import_graph()
    assert layer_violations(graph) == []


def test_no_package_import_inside_functions():
    _, lazy = import_graph()
    assert lazy == [], f"package imports inside functions: {lazy}"


def test_bottom_layers_import_nothing_above_them():
    graph, _ = import_graph()
    assert graph["cp_attention.errors"] == set() and graph["cp_attention.mathutils"] == set()
    metadata = {m: t for m, t in graph.items() if m.startswith("cp_attention.metadata")}
    assert metadata and all(layer(t) <= layer("cp_attention.metadata") for ts in metadata.values()
                            for t in ts)
    assert not any("parallel" in t for ts in metadata.values() for t in ts)


def test_public_names_import_from_the_top():
    expected = {"CPConfig", "CPRanks", "CPGroups", "AttentionMetadata", "MetadataBuilder",
                "BaseAttentionImpl", "CPAttentionImpl", "CPAttentionBackend",
                "StepSpec", "AttentionState", "StepError", "AttentionLayerError", "OpsInputError",
                "StepMismatchError", "KernelFallbackError"}
    assert expected <= set(cp_attention.__all__)
    assert all(getattr(cp_attention, name) is not None for name in cp_attention.__all__)
    assert issubclass(cp_attention.StepError, ValueError)


def test_the_forward_has_no_hooks():
    """A layer's forward is BaseAttentionImpl's list of steps: the step modules call no other
    impl module and CPAttentionImpl overrides no method but __init__ (docs/design.md)."""
    graph, _ = import_graph()
    for step_module in ("cp_attention.impl.self_part", "cp_attention.impl.context"):
        assert not {m for m in graph[step_module] if m.startswith("cp_attention.impl")}
    overridden = [name for name, value in vars(cp_attention.CPAttentionImpl).items()
                  if callable(value) and name != "__init__"]
    assert overridden == []


# -- the rules can fail -------------------------------------------------------------------
def test_find_cycle_and_layers_on_synthetic_graphs():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]
    up = {"cp_attention.config": {"cp_attention.impl.base"}, "cp_attention.impl.base": set()}
    assert layer_violations(up) == [("cp_attention.config", "cp_attention.impl.base")]


@pytest.fixture()
def planted(tmp_path):
    """A copy of the package to plant violations in."""
    copy = tmp_path / PACKAGE
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    return copy


def test_a_planted_cycle_is_found(planted):
    config = planted / "config.py"
    config.write_text(config.read_text() + "\nfrom cp_attention.impl.base import BaseAttentionImpl\n")
    graph, _ = import_graph(planted)
    cycle = find_cycle(graph)
    assert cycle is not None and "cp_attention.config" in cycle
    assert ("cp_attention.config", "cp_attention.impl.base") in layer_violations(graph)


def test_a_planted_function_import_is_found(planted):
    ops = planted / "ops" / "merge.py"
    ops.write_text(ops.read_text() + "\n\ndef late():\n    from cp_attention.comm import Communicator\n"
                   "    import torch_npu\n    return Communicator, torch_npu\n")
    _, lazy = import_graph(planted)
    assert lazy == [("cp_attention.ops.merge", "cp_attention.comm")]


def test_relative_and_package_imports_resolve(planted):
    impl = planted / "impl" / "cp.py"
    impl.write_text(impl.read_text() + "\nfrom ..backend import CPAttentionBackend\n"
                    "from cp_attention import debug\n")
    graph, _ = import_graph(planted)
    assert {"cp_attention.backend", "cp_attention.debug"} <= graph["cp_attention.impl.cp"]
    assert ("cp_attention.impl.cp", "cp_attention.backend") in layer_violations(graph)


if __name__ == "__main__":
    for name, targets in sorted(import_graph()[0].items()):
        short = sorted(t.removeprefix("cp_attention.") for t in targets)
        print(f"{name.removeprefix('cp_attention.') or 'cp_attention'} -> {', '.join(short) or '-'}")
