"""The layer rule of docs/ARCHITECTURE.md, checked on the source: what a module reaches through its
imports (transitively: its imports, theirs, and every enclosing package's __init__) lies in its own
layer or the layers below it, never in a package its own package must not import; the gateway and
the wire package never reach PyTorch; nothing in src/ (nor benchmarks/, scripts/) imports
treeserve.testing; no modules import each other in a circle. Imports inside functions count like
top-level ones.

A module's layer is that of the package it lives in (the first part of its name under treeserve),
so a new module in a known package is covered without touching this file; which modules load
PyTorch is read from the source. A new top-level package or module must be given a layer here.
"""
from __future__ import annotations

import json
import subprocess
import sys
from functools import cache

import pytest

from import_graph import (ROOT, direct_imports, import_graph, imported_modules, path_to, reached, source_modules,
                          third_party_imports)

# Bottom to top; a module may import from its own layer and every layer before it.
LAYERS = [
    ("errors, process lifecycle, JSON lines, tool-call arguments, template roles, argparse types",
     ["errors", "lifecycle", "ports", "jsonl", "tool_arguments", "template_roles", "arg_types"]),
    ("settings and results", ["config", "sampling_params", "inputs", "outputs", "speculative_config"]),
    ("model", ["model"]),
    ("engine", ["engine"]),
    ("entrypoints", ["entrypoints"]),
    ("runtime", ["runtime"]),
    ("package facade", [""]),  # treeserve/__init__.py re-exports LLM, Runtime, SamplingParams, ...
    ("search", ["search"]),
    # What server and gateway both speak (error bodies, request models, broker messages, drain,
    # OpenAPI). It needs only the bottom two layers, but sits right under its users so that nothing
    # on the engine's road can import HTTP; NEVER_IMPORTS keeps it off the engine's side.
    ("wire", ["wire"]),
    ("applications", ["server", "gateway", "bench", "tasks"]),
    ("cli", ["cli", "cli_*"]),
    ("testing", ["testing"]),  # test support: imported by tests only
]
ENGINE_SIDE = {"model", "engine", "entrypoints", "runtime", "search"}
# Stricter than the layer order. The gateway talks to servers over their APIs only; server and
# gateway share the wire package and never import each other; the wire package is below both and
# off the engine's side. "" is the package facade, whose names load the engine on first use.
NEVER_IMPORTS = {
    "gateway": ENGINE_SIDE | {"server", ""},
    "server": {"gateway"},
    "wire": ENGINE_SIDE | {""},
}
# Packages that never load PyTorch: no module they reach imports it (read from the source).
TORCH_FREE = {"gateway", "wire"}
TORCH = "torch"


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


@cache
def torch_modules() -> frozenset[str]:
    return frozenset(m for m, path in source_modules().items() if TORCH in third_party_imports(path))


def broken_rule(module: str, target: str, loads_torch: frozenset[str] = frozenset()) -> str | None:
    """Why `module` may not reach `target`, or None."""
    own, other = top_part(module), top_part(target)
    if other == "testing" and own != "testing":
        return "only tests may import treeserve.testing"
    if layer_of(target) > layer_of(module):
        return f"{LAYERS[layer_of(target)][0]} is a higher layer than {LAYERS[layer_of(module)][0]}"
    if other in NEVER_IMPORTS.get(own, ()):
        return f"{own} never imports {other or 'the package facade'}"
    if own in TORCH_FREE and target in loads_torch:
        return f"{own} never loads PyTorch, and {target} imports it"
    return None


def layering_violations(graph: dict[str, set[str]] | None = None,
                        loads_torch: frozenset[str] | None = None) -> list[str]:
    """Every import that lets a module reach what it may not, once: the first step on the chain of
    imports to a module it may not reach, and the rule it breaks, with one such chain when the
    module importing is not itself the one bound by the rule."""
    graph = import_graph() if graph is None else graph
    loads_torch = torch_modules() if loads_torch is None else loads_torch
    found: dict[tuple[str, str, str], list[list[str]]] = {}
    for module in sorted(graph):
        via = reached(module, graph)
        for target in sorted(via):
            steps = path_to(via, module, target)
            for i in range(1, len(steps)):
                why = broken_rule(module, steps[i], loads_torch)
                if why:
                    found.setdefault((steps[i - 1], steps[i], why), []).append(steps[:i + 1])
                    break
    return [f"{source} imports {target}: {why}" + ("" if any(len(c) == 2 for c in chains) else
                                                    f" ({' -> '.join(chains[0])})")
            for (source, target, why), chains in sorted(found.items())]


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


def _shown(problems: list[str], most: int = 40) -> str:
    more = f"\n... and {len(problems) - most} more" if len(problems) > most else ""
    return "\n".join(problems[:most]) + more


def test_every_module_has_a_layer():
    unplaced = []
    for module in source_modules():
        try:
            layer_of(module)
        except LookupError as exc:
            unplaced.append(str(exc))
    assert not unplaced, "\n".join(unplaced)


def test_every_layer_names_a_package_of_the_tree():
    parts = {top_part(m) for m in source_modules()}
    stale = [m for _, members in LAYERS for m in members
             if not any(p == m or (m.endswith("*") and p.startswith(m[:-1])) for p in parts)]
    assert not stale, f"tests/test_layering.py names packages the tree does not have: {stale}"


def test_modules_reach_only_their_own_layer_and_below():
    problems = layering_violations()
    assert not problems, _shown(problems)


def test_the_torch_check_knows_which_modules_load_pytorch():
    assert {"treeserve.engine.model_runner", "treeserve.model.layers"} <= torch_modules()
    assert not any(top_part(m) in TORCH_FREE for m in torch_modules())


def test_no_import_cycles():
    cycles = import_cycles(direct_imports())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("folder", ["benchmarks", "scripts"])
def test_scripts_do_not_import_the_testing_package(folder):
    offenders = [str(p.relative_to(ROOT)) for p in sorted((ROOT / folder).rglob("*.py"))
                 if any(top_part(m) == "testing" for m in imported_modules(p, set(), "__main__"))]
    assert not offenders, f"only tests may import treeserve.testing: {', '.join(offenders)}"


# Run by Alembic (Store.migrate), not importable by itself: it reads the migration's context.
ALEMBIC_SCRIPTS = {"treeserve.gateway.migrations.env"}
_IMPORT_ALL = """
import importlib, json, sys, tempfile
from pathlib import Path
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
from treeserve.gateway.store import Store
with tempfile.TemporaryDirectory() as folder:
    store = Store(f"sqlite:///{Path(folder) / 'gateway.db'}")
    store.migrate()
    store.close()
print(json.dumps(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "treeserve.")))))
"""


def test_importing_every_gateway_and_wire_module_never_imports_torch_nor_the_server():
    """In a fresh interpreter, as `treeserve gateway` starts: every module of the gateway and of the
    wire package, and the gateway's migrations as Alembic runs them."""
    names = sorted(m for m in source_modules() if top_part(m) in TORCH_FREE and m not in ALEMBIC_SCRIPTS)
    assert "treeserve.gateway.app" in names and "treeserve.wire.chat_completions" in names
    done = subprocess.run([sys.executable, "-c", _IMPORT_ALL, json.dumps(names)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert set(names) <= set(loaded)
    assert not [m for m in loaded if m == "torch" or m.startswith("torch.")], "the gateway imported PyTorch"
    assert not [m for m in loaded if top_part(m) in NEVER_IMPORTS["gateway"] - {""}], loaded


def test_the_checker_follows_imports_transitively_and_sees_function_level_relative_imports_and_cycles(tmp_path):
    source = tmp_path / "probe.py"
    source.write_text("from .tree import Step\n\ndef late():\n    from treeserve.server import app\n")
    found = imported_modules(source, {"treeserve.search.tree"}, "treeserve.search.probe")
    assert found == {"treeserve.search.tree", "treeserve.server"}
    graph = {"treeserve.search.probe": found, "treeserve.search.tree": set(), "treeserve.server": set()}
    assert layering_violations(graph, frozenset()) == [
        "treeserve.search.probe imports treeserve.server: applications is a higher layer than search"]
    # two steps away: the gateway through a same-layer package that imports the engine
    graph = {"treeserve.gateway.app": {"treeserve.bench.offline"}, "treeserve.bench.offline": {"treeserve.engine.x"},
             "treeserve.engine.x": set()}
    assert layering_violations(graph, frozenset({"treeserve.engine.x"})) == [
        "treeserve.bench.offline imports treeserve.engine.x: gateway never imports engine "
        "(treeserve.gateway.app -> treeserve.bench.offline -> treeserve.engine.x)"]
    graph = {"treeserve.wire.errors": {"treeserve.config"}, "treeserve.config": set()}
    assert layering_violations(graph, frozenset({"treeserve.config"})) == [
        "treeserve.wire.errors imports treeserve.config: wire never loads PyTorch, and treeserve.config imports it"]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("treeserve.engine.engine_loop") == layer_of("treeserve.engine.scheduler")
