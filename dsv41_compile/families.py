"""The model families the backend knows, each with its `core.adapter.ModelAdapter`.

A family registers its adapter with `register_adapter`, the built-in one included
(`dsv41_compile.deepseek_v41` registers DeepSeek V4.1 when the package is imported). Generic
code reaches a family only through this registry, never by importing it."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TypeVar

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.core.registry import Registry
from dsv41_compile.options import BackendOptions

__all__ = [
    "REGISTRY",
    "adapter_for",
    "adapters",
    "layouts",
    "options_for",
    "register_adapter",
    "unregister_adapter",
]

REGISTRY: Registry[ModelAdapter] = Registry("model family")
"""The registered families by name (`ModelAdapter.name`)."""

_Adapter = TypeVar("_Adapter", bound=ModelAdapter)


def register_adapter(adapter: _Adapter) -> _Adapter:
    """Add a model family; it is asked before the ones registered earlier. A family of the
    same name must be unregistered first (a ValueError otherwise)."""
    REGISTRY.add(adapter.name, adapter)
    return adapter


def unregister_adapter(adapter: ModelAdapter) -> None:
    REGISTRY.remove(adapter.name)


def adapters() -> list[ModelAdapter]:
    """The registered families, the latest first (the order `adapter_for` asks them in)."""
    return list(reversed(REGISTRY.values()))


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


def options_for(options: BackendOptions, adapter: ModelAdapter) -> BackendOptions:
    """`options` with the family's own options (`options.family`, as given) made the instance
    of `adapter.options` they are; a ValueError for a name that is neither a generic option nor
    the family's, naming the family that has it, if one does."""
    family = options.family
    if isinstance(family, adapter.options):
        return options
    given = dict(family.items())
    unknown = sorted(set(given) - set(adapter.options.names()))
    if unknown:
        owners = {
            name: [a.name for a in adapters() if a is not adapter and name in a.options.names()]
            for name in unknown
        }
        elsewhere = "".join(
            f"; {name!r} is an option of the {' and '.join(o)} model family, not of {adapter.name}"
            for name, o in owners.items()
            if o
        )
        own = list(adapter.options.names())
        raise ValueError(
            f"unknown dsv41_sp option(s) {unknown}{elsewhere}. The options are "
            f"{sorted(BackendOptions.names())}, and the {adapter.name} model family's "
            f"{own or '(none)'}"
        )
    return dataclasses.replace(options, family=adapter.options.from_items(given.items()))
