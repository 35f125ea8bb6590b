"""Model families the backend knows, each with its `core.adapter.ModelAdapter`."""

from __future__ import annotations

from collections.abc import Iterable

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.core.registry import Registry
from dsv41_compile.models.deepseek_v41.adapter import DEEPSEEK_V41

__all__ = [
    "REGISTRY",
    "adapter_for",
    "adapters",
    "layouts",
    "register_adapter",
    "unregister_adapter",
]

REGISTRY: Registry[ModelAdapter] = Registry("model family")
"""The registered families by name (`ModelAdapter.name`), besides the built-in ones."""


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Add a model family; it is asked before the ones registered earlier and the built-in
    ones. A family of the same name must be unregistered first (a ValueError otherwise)."""
    if adapter.name == DEEPSEEK_V41.name:
        raise ValueError(f"{adapter.name!r} is the name of a built-in model family")
    return REGISTRY.add(adapter.name, adapter)


def unregister_adapter(adapter: ModelAdapter) -> None:
    REGISTRY.remove(adapter.name)


def adapters() -> list[ModelAdapter]:
    return [*reversed(REGISTRY.values()), DEEPSEEK_V41]


def layouts() -> tuple[str, ...]:
    """Every layout some known model family has (`ModelAdapter.layouts`), in order."""
    return tuple(dict.fromkeys(layout for adapter in adapters() for layout in adapter.layouts))


def adapter_for(
    param_fqns: Iterable[str], inputs: Iterable[str], layout: str | None = None
) -> ModelAdapter:
    """The adapter of the family a graph with these parameters and inputs belongs to, checked
    to have `layout`."""
    fqns, names = list(param_fqns), list(inputs)
    known = adapters()
    for adapter in known:
        if adapter.matches(fqns, names):
            if layout is not None and layout not in adapter.layouts:
                raise ValueError(
                    f"layout={layout!r} is not a layout of the {adapter.name} model family; "
                    f"choose one of {adapter.layouts}"
                )
            return adapter
    families = ", ".join(f"{a.name} (inputs {', '.join(a.token_inputs)}, ...)" for a in known)
    raise ValueError(
        f"dsv41_sp does not know this graph: its inputs are {sorted(set(names))}. The model "
        f"families it shards are: {families}. If this is a piece of such a model, Dynamo split "
        "the model at a graph break: compile with torch.compile(..., fullgraph=True) to see "
        "where, and remove the break. Otherwise add an adapter for your model family "
        "(docs/architecture.md)"
    )
