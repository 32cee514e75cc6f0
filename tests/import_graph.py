"""treeserve's import graph, read from the source (no module is imported): every module under
src/treeserve, the treeserve modules each one imports (at the top or inside functions, absolute or
relative), and what each reaches transitively. Shared by tests/test_layering.py and
tests/test_step_data.py, so that a new module is covered without being named anywhere."""
from __future__ import annotations

import ast
from collections import deque
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "treeserve"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((SRC / PACKAGE).rglob("*.py"))}


def _import_nodes(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def imported_modules(path: Path, known: set[str], own: str) -> set[str]:
    """Every treeserve module the file imports, at top level or inside functions. `from pkg import
    name` counts as importing the submodule pkg.name where that is a module, else pkg itself."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in _import_nodes(path):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        else:
            base = _absolute(node, own, is_package)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m == PACKAGE or m.startswith(PACKAGE + ".")}


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of what the file imports from outside treeserve (`torch`, `fastapi`, ...)."""
    names = set()
    for node in _import_nodes(path):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif not node.level and node.module:
            names.add(node.module.split(".")[0])
    return names - {PACKAGE}


def _absolute(node: ast.ImportFrom, own: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    package = own.split(".") if is_package else own.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


@cache
def direct_imports() -> dict[str, frozenset[str]]:
    """Module -> the treeserve modules its source names in an import statement."""
    modules = source_modules()
    known = set(modules)
    return {name: frozenset(imported_modules(path, known, name)) for name, path in modules.items()}


def enclosing_packages(module: str) -> list[str]:
    """`treeserve.gateway.chat.routes` -> treeserve, treeserve.gateway, treeserve.gateway.chat:
    Python runs each one's __init__ before the module itself."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@cache
def import_graph() -> dict[str, frozenset[str]]:
    """Module -> what importing it runs first: its imports and its enclosing packages (an __init__
    that imports something counts for every module under it). The root package runs before every
    treeserve module, so what its __init__ imports counts for all of them; the root itself (the
    public facade, whose names load on first use) counts only where a module imports it by name."""
    direct = direct_imports()
    root_runs = direct.get(PACKAGE, frozenset())
    return {module: imports | frozenset(enclosing_packages(module)[1:]) | (root_runs - {module})
            for module, imports in direct.items()}


def reached(module: str, graph: dict[str, frozenset[str]] | None = None) -> dict[str, str]:
    """Every module `module` reaches through imports, each mapped to the module that imports it on
    one shortest chain (breadth first), so that `path_to` can name the way there."""
    graph = import_graph() if graph is None else graph
    via: dict[str, str] = {}
    queue = deque([module])
    while queue:
        current = queue.popleft()
        for target in sorted(graph.get(current, ())):
            if target != module and target not in via:
                via[target] = current
                queue.append(target)
    return via


def path_to(via: dict[str, str], start: str, target: str) -> list[str]:
    """The modules from `start` to `target` along the imports `reached` recorded."""
    steps = [target]
    while steps[-1] != start:
        steps.append(via[steps[-1]])
    return steps[::-1]


def chain(via: dict[str, str], start: str, target: str) -> str:
    return " -> ".join(path_to(via, start, target))
