"""Model families the backend knows, each with its `core.adapter.ModelAdapter`."""

from __future__ import annotations

from collections.abc import Iterable

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.models.deepseek_v41.adapter import DEEPSEEK_V41

__all__ = ["adapter_for", "adapters", "layouts", "register_adapter", "unregister_adapter"]

_REGISTERED: list[ModelAdapter] = []


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Add a model family; it is asked before the ones registered earlier and the built-in
    ones."""
    _REGISTERED.insert(0, adapter)
    return adapter


def unregister_adapter(adapter: ModelAdapter) -> None:
    _REGISTERED.remove(adapter)


def adapters() -> list[ModelAdapter]:
    return [*_REGISTERED, DEEPSEEK_V41]


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
