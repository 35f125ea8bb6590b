"""Model families the backend knows, each with its `core.adapter.ModelAdapter`."""

from __future__ import annotations

from collections.abc import Iterable

from dsv41_compile.core.adapter import ModelAdapter

__all__ = ["adapter_for", "adapters", "register_adapter"]

_REGISTERED: list[ModelAdapter] = []


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Add a model family; it is asked before the built-in ones."""
    _REGISTERED.append(adapter)
    return adapter


def adapters() -> list[ModelAdapter]:
    from dsv41_compile.models.deepseek_v41.adapter import DEEPSEEK_V41

    return [*_REGISTERED, DEEPSEEK_V41]


def adapter_for(param_fqns: Iterable[str], inputs: Iterable[str]) -> ModelAdapter:
    """The adapter of the family a graph with these parameters and inputs belongs to."""
    fqns, names = list(param_fqns), list(inputs)
    known = adapters()
    for adapter in known:
        if adapter.matches(fqns, names):
            return adapter
    families = ", ".join(f"{a.name} (inputs {', '.join(a.token_inputs)}, ...)" for a in known)
    raise ValueError(
        f"dsv41_sp does not know this graph: its inputs are {sorted(set(names))}. The model "
        f"families it shards are: {families}. If this is a piece of such a model, Dynamo split "
        "the model at a graph break: compile with torch.compile(..., fullgraph=True) to see "
        "where, and remove the break. Otherwise add an adapter for your model family "
        "(docs/architecture.md)"
    )
