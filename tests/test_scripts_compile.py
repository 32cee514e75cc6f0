"""Benchmarks and scripts are not imported by the other tests; at least they must compile."""
import ast
import py_compile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py")])


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_compiles(path):
    py_compile.compile(str(path), doraise=True)


def test_there_is_something_to_check():
    assert len(FILES) >= 5


def _module_file(module: str, importer: Path) -> Path | None:
    """The source of a treeserve module, or of a benchmark or script beside `importer`; None for others."""
    if module.startswith("treeserve"):
        base = ROOT / "src" / Path(*module.split("."))
    elif (importer.parent / f"{module}.py").exists():
        base = importer.parent / module
    else:
        return None
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _top_level_names(path: Path) -> set[str] | None:
    """What `from MODULE import NAME` can take from a module's source; None where a module-level
    `__getattr__` makes names lazily (treeserve's facade)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for target in targets for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):  # a guarded import or definition: read it whole
            names.update(n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
            names.update((a.asname or a.name) for n in ast.walk(node) if isinstance(n, ast.ImportFrom) for a in n.names)
    return None if "__getattr__" in names else names


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_name_imported_from_treeserve_or_a_sibling_exists(path):
    """A benchmark's `from treeserve.x import y` (or `from gpu import y`) names something that module
    defines: a rename elsewhere left `gpu_profile.py` and `tp_step_transport.py` failing at start."""
    missing = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom) or node.level or node.module is None:
            continue
        source = _module_file(node.module, path)
        if source is None:
            continue
        if not source.exists():
            missing.append(node.module)
            continue
        defined = _top_level_names(source)
        if defined is None:
            continue
        submodules = {p.stem for p in source.parent.glob("*.py")} | {p.name for p in source.parent.iterdir() if p.is_dir()} \
            if source.name == "__init__.py" else set()
        missing += [f"{node.module}.{a.name}" for a in node.names if a.name not in defined | submodules]
    assert not missing, f"{path.name} imports names that do not exist: {missing}"
