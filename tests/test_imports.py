"""Imports run one way (docs/architecture.md, "The tree"): the import graph of the package has
no cycle, and `make lint`'s contracts (import-linter, pyproject.toml) name an upward import and
a generic module that imports the model family; its type check (mypy) names a type error. Each
is planted in a copy of the package, which lints clean before the plant."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dsv41_compile"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
MYPY = Path(sys.executable).with_name("mypy")


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> nx.DiGraph:
    """Module -> the package's modules it imports, from the sources: every import statement,
    at the top, in a function or under TYPE_CHECKING."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                imported = known(target)
                if imported is not None and imported != name:
                    graph.add_edge(name, imported)
    return graph


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 50  # the sources were read
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, f"import cycles: {[' -> '.join([*c, c[0]]) for c in cycles[:5]]}"


def _run(tool: Path, tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(tool), *args], cwd=tree, env=env, capture_output=True, text=True, check=False
    )


def _copy(tmp_path: Path) -> Path:
    """A copy of the package and its lint settings (and mypy's cache, where `make lint` left
    one, so that the copy is checked in seconds)."""
    shutil.copytree(
        PACKAGE, tmp_path / "dsv41_compile", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    if (ROOT / ".mypy_cache").is_dir():
        shutil.copytree(ROOT / ".mypy_cache", tmp_path / ".mypy_cache")
    return tmp_path


def _plant(module: Path, line: str) -> int:
    """Appends `line` to `module`; returns its line number."""
    lines = module.read_text().splitlines()
    module.write_text("\n".join([*lines, line]) + "\n")
    return len(lines) + 1


def test_lint_names_an_upward_import_and_passes_without_it(tmp_path):
    tree = _copy(tmp_path)
    kept = _run(LINT_IMPORTS, tree, "--no-cache")
    assert kept.returncode == 0, kept.stdout
    at = _plant(tree / "dsv41_compile/core/meta.py", "from dsv41_compile.backend import dsv41_sp")
    broken = _run(LINT_IMPORTS, tree, "--no-cache")
    assert broken.returncode == 1
    assert "compiler layers: a module imports only from the layers below its own" in broken.stdout
    assert f"dsv41_compile.core.meta -> dsv41_compile.backend (l.{at})" in broken.stdout


def test_lint_names_a_generic_module_that_imports_the_family(tmp_path):
    # spmd sits above nothing of the family in the layers: only the family contract forbids it
    tree = _copy(tmp_path)
    at = _plant(
        tree / "dsv41_compile/spmd/rules/registry.py",
        "from dsv41_compile.deepseek_v41.plan import deepseek_v41_plan",
    )
    broken = _run(LINT_IMPORTS, tree, "--no-cache")
    assert broken.returncode == 1
    assert "generic code imports no model family" in broken.stdout
    assert (
        f"dsv41_compile.spmd.rules.registry -> dsv41_compile.deepseek_v41.plan (l.{at})"
        in broken.stdout
    )


def test_the_type_check_names_a_type_error_and_passes_without_it(tmp_path):
    tree = _copy(tmp_path)
    kept = _run(MYPY, tree)
    assert kept.returncode == 0, kept.stdout
    module = tree / "dsv41_compile/core/meta.py"
    at = _plant(module, 'def planted() -> int:\n    return "an int"')
    broken = _run(MYPY, tree)
    assert broken.returncode == 1
    assert f"dsv41_compile/core/meta.py:{at + 1}: error: Incompatible return value type" in (
        broken.stdout
    )
