"""The layer rule of docs/ARCHITECTURE.md, checked on the source: a module imports only from its own
layer or the layers below it, nothing in src/ (nor benchmarks/, scripts/) imports treeserve.testing,
and no modules import each other in a circle. Imports inside functions count like top-level ones.

Modules are classified by the package they live in, so a new module in a known package is covered
without touching this file; a new top-level package or module must be given a layer here.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "treeserve"

# Bottom to top; a module may import from its own layer and every layer before it.
LAYERS = [
    ("errors and process lifecycle", ["errors", "lifecycle", "ports"]),
    ("settings and results", ["config", "sampling_params", "outputs"]),
    ("model", ["model"]),
    ("engine", ["engine"]),
    ("entrypoints", ["entrypoints"]),
    ("runtime", ["runtime"]),
    ("package facade", [""]),  # treeserve/__init__.py re-exports LLM, Runtime, SamplingParams, ...
    ("search", ["search"]),
    ("applications", ["server", "gateway", "bench", "tasks"]),
    ("cli", ["cli", "cli_*"]),
    ("testing", ["testing"]),  # test support: imported by tests only
]
# Stricter than the layer order: the gateway talks to servers over their APIs only.
NEVER_IMPORTS = {"gateway": {"model", "engine", "entrypoints", "runtime"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def top_part(module: str) -> str:
    """`treeserve.engine.scheduler` -> `engine`; `treeserve.cli_search` -> `cli_search`; `treeserve` -> ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(module: str) -> int:
    part = top_part(module)
    for rank, (_, members) in enumerate(LAYERS):
        if any(part == m or (m.endswith("*") and part.startswith(m[:-1])) for m in members):
            return rank
    raise LookupError(f"{module}: in no layer; give '{part}' a layer in tests/test_layering.py")


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def imported_modules(path: Path, known: set[str], own: str) -> set[str]:
    """Every treeserve module the file imports, at top level or inside functions. `from pkg import
    name` counts as importing the submodule pkg.name where that is a module, else pkg itself."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, own, is_package)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


def _absolute(node: ast.ImportFrom, own: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = own.split(".") if is_package else own.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    modules = source_modules()
    known = set(modules)
    return {name: imported_modules(path, known, name) for name, path in modules.items()}


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    problems = []
    for module, imports in sorted(graph.items()):
        for target in sorted(imports):
            if top_part(target) == "testing" and top_part(module) != "testing":
                problems.append(f"{module} imports {target}: only tests may import treeserve.testing")
            elif layer_of(target) > layer_of(module):
                problems.append(f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} "
                                f"({LAYERS[layer_of(target)][0]}), a higher layer")
            elif top_part(target) in NEVER_IMPORTS.get(top_part(module), ()):
                problems.append(f"{module} imports {target}: {top_part(module)} never imports {top_part(target)}")
    return problems


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, or a module importing itself (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or node in graph.get(node, ()):
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_every_module_has_a_layer():
    unplaced = []
    for module in source_modules():
        try:
            layer_of(module)
        except LookupError as exc:
            unplaced.append(str(exc))
    assert not unplaced, "\n".join(unplaced)


def test_modules_import_only_their_own_layer_and_below():
    problems = layering_violations(import_graph())
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    cycles = import_cycles(import_graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("folder", ["benchmarks", "scripts"])
def test_scripts_do_not_import_the_testing_package(folder):
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / folder).rglob("*.py"))
                 if any(top_part(m) == "testing" for m in imported_modules(p, set(), "__main__"))]
    assert not offenders, f"only tests may import treeserve.testing: {', '.join(offenders)}"


def test_the_checker_sees_function_level_imports_relative_imports_and_cycles(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("from .tree import Step\n\ndef late():\n    from treeserve.server import app\n")
    found = imported_modules(source, {"treeserve.search.tree"}, "treeserve.search.probe")
    assert found == {"treeserve.search.tree", "treeserve.server"}
    graph = {"treeserve.search.probe": found, "treeserve.search.tree": set(), "treeserve.server": set()}
    assert layering_violations(graph) == ["treeserve.search.probe (search) imports treeserve.server "
                                          "(applications), a higher layer"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("treeserve.engine.engine_loop") == layer_of("treeserve.engine.scheduler")
