"""Imports run one way (docs/architecture.md, "The tree"): the import graph of the package has
no cycle, and `make lint`'s contracts (import-linter, pyproject.toml) name an upward import."""

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


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True
    )


def test_lint_names_an_upward_import_and_passes_without_it(tmp_path):
    shutil.copytree(
        PACKAGE, tmp_path / "dsv41_compile", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    kept = _lint(tmp_path)
    assert kept.returncode == 0, kept.stdout
    meta = tmp_path / "dsv41_compile" / "core" / "meta.py"
    lines = meta.read_text().splitlines()
    meta.write_text("\n".join([*lines, "from dsv41_compile.backend import dsv41_sp  # noqa"]))
    broken = _lint(tmp_path)
    assert broken.returncode == 1
    assert "compiler layers: a module imports only from the layers below its own" in broken.stdout
    assert f"dsv41_compile.core.meta -> dsv41_compile.backend (l.{len(lines) + 1})" in broken.stdout
