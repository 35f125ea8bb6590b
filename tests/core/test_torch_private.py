"""One module holds every private torch API the package uses (`core.torch_private`), checked
against the pinned torch: a torch upgrade that moves a name fails here, by name."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from dsv41_compile.core import torch_private

PACKAGE = Path(torch_private.__file__).resolve().parents[1]
ALLOWED = {
    PACKAGE / "core" / "torch_private.py": "every private name",
    PACKAGE / "testing" / "torch_shims.py": "torch's own test helpers (never the library's)",
}
DOCUMENTED = {"_check", "_check_is_size"}
"""`torch._check*`: documented in torch's reference despite the underscore."""


def _private(dotted: str) -> bool:
    parts = dotted.split(".")
    return (
        parts[0] == "torch"
        and "ops" not in parts[:2]
        and any(
            p.startswith("_") and not p.startswith("__") and p not in DOCUMENTED for p in parts[1:]
        )
    )


def _dotted(node: ast.AST) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(names)]) if isinstance(node, ast.Name) else None


def private_uses(path: Path) -> list[str]:
    uses = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            uses += [f"l.{node.lineno}: import {a.name}" for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and _private(node.module or ""):
            uses.append(f"l.{node.lineno}: from {node.module}")
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            dotted = _dotted(node)
            if (
                dotted
                and _private(dotted)
                and not isinstance(getattr(node, "parent", None), ast.Attribute)
            ):
                uses.append(f"l.{node.lineno}: {dotted}")
    return uses


def test_private_torch_is_used_in_one_module():
    found = {
        str(path.relative_to(PACKAGE)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in ALLOWED and (uses := private_uses(path))
    }
    assert not found, f"private torch API outside core/torch_private.py: {found}"
    assert private_uses(PACKAGE / "core" / "torch_private.py")  # the scan sees them


def test_the_pinned_torch_has_every_name():
    assert torch.__version__.split("+")[0] == torch_private.CHECKED_WITH
    for name in torch_private.__all__:
        assert getattr(torch_private, name) is not None, name
    propagator = torch_private.sharding_propagator()
    assert callable(propagator.propagate_op_sharding_non_cached)
    tables = {"op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules"}
    assert tables <= set(dir(propagator))
    assert torch_private.recompile_limit() > 1
    assert torch_private.inductor_cache_dir()
