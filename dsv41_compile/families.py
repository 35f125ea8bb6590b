"""The model families the backend knows, each with its `core.adapter.ModelAdapter`.

A family is a plug-in: a distribution declares its adapter in the entry-point group
`dsv41_compile.families` (the built-in DeepSeek V4.1 family in this package's pyproject.toml:
`deepseek_v41 = "dsv41_compile.deepseek_v41.adapter:DEEPSEEK_V41"`), and the registry loads
every declared family the first time it is asked (`adapters`, `list_families`,
`register_adapter`). `register_adapter` also adds a family at run time (a test's, a script's).
Generic code reaches a family only through this registry, never by importing it."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from importlib.metadata import entry_points
from typing import TypeVar

from dsv41_compile.core.adapter import ModelAdapter
from dsv41_compile.core.registry import Registry
from dsv41_compile.options import BackendOptions

__all__ = [
    "REGISTRY",
    "adapter_for",
    "adapters",
    "layouts",
    "list_families",
    "load_entry_points",
    "options_for",
    "register_adapter",
    "unregister_adapter",
]

REGISTRY: Registry[ModelAdapter] = Registry("model family")
"""The registered families by name (`ModelAdapter.name`)."""

ENTRY_POINTS = "dsv41_compile.families"
"""The entry-point group a distribution declares its model families in: each entry a
`ModelAdapter` instance."""

_UNREGISTERED: set[str] = set()
"""Declared families a caller took out (`unregister_adapter`): not put back."""

_Adapter = TypeVar("_Adapter", bound=ModelAdapter)


@functools.cache
def _declared() -> tuple[ModelAdapter, ...]:
    """The families the entry points declare, in the order the environment lists them; loaded
    once per process (a failure is not kept: the next question tries again)."""
    found = []
    for point in entry_points(group=ENTRY_POINTS):
        try:
            adapter = point.load()
        except Exception as error:
            raise ValueError(
                f"the model family {point.name!r} declared in the entry points "
                f"{ENTRY_POINTS!r} ({point.value}) failed to load: {error}. Reinstall the "
                "distribution that declares it, or uninstall it"
            ) from error
        if not isinstance(adapter, ModelAdapter):
            raise ValueError(
                f"the entry point {point.name!r} in {ENTRY_POINTS!r} ({point.value}) is a "
                f"{type(adapter).__name__}, not a ModelAdapter instance"
            )
        found.append(adapter)
    return tuple(found)


def load_entry_points() -> None:
    """Register every family declared in the entry-point group `dsv41_compile.families` that is
    not registered: one registered by hand under its name is left as it is, one a caller
    unregistered stays out."""
    for adapter in _declared():
        if adapter.name not in REGISTRY and adapter.name not in _UNREGISTERED:
            REGISTRY.add(adapter.name, adapter)


def register_adapter(adapter: _Adapter) -> _Adapter:
    """Add a model family; it is asked before the ones registered earlier (the declared
    families are loaded first). A family of the same name must be unregistered first (a
    ValueError otherwise)."""
    load_entry_points()
    REGISTRY.add(adapter.name, adapter)
    _UNREGISTERED.discard(adapter.name)
    return adapter


def unregister_adapter(adapter: ModelAdapter) -> None:
    REGISTRY.remove(adapter.name)
    _UNREGISTERED.add(adapter.name)


def adapters() -> list[ModelAdapter]:
    """The registered families, the latest first (the order `adapter_for` asks them in)."""
    load_entry_points()
    return list(reversed(REGISTRY.values()))


def list_families() -> list[str]:
    """The names of the families the backend knows, declared and registered, in the order
    `adapter_for` asks them."""
    return [adapter.name for adapter in adapters()]


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
    if not known:
        raise ValueError(
            "dsv41_sp knows no model family: no distribution declares one in the entry-point "
            f"group {ENTRY_POINTS!r} and none was registered. Install the package (`pip install "
            "-e .` in a source tree: its pyproject.toml declares DeepSeek V4.1) or register "
            "an adapter with dsv41_compile.families.register_adapter"
        )
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
