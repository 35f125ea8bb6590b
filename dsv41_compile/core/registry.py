"""A process-wide table of extensions (model families, op rules, transitions) that refuses a
second entry under a key: a registration that silently replaced an earlier one would change
every later compile without a word."""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

__all__ = ["Registry"]

V = TypeVar("V")


class Registry(Generic[V]):
    """Entries in registration order, one per key."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._entries: dict[Hashable, V] = {}

    def add(self, key: Hashable, value: V) -> V:
        """Register `value` under `key`; a ValueError if `key` has an entry already."""
        if key in self._entries:
            raise ValueError(
                f"a {self.what} is registered for {key!r} already; remove it first "
                f"(a second registration would replace it for every later compile)"
            )
        self._entries[key] = value
        return value

    def remove(self, key: Hashable) -> V:
        return self._entries.pop(key)

    def get(self, key: Hashable) -> V | None:
        return self._entries.get(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def values(self) -> list[V]:
        """The entries, in registration order."""
        return list(self._entries.values())

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Within the block, registrations are undone at its end (tests, worked examples)."""
        saved = dict(self._entries)
        try:
            yield
        finally:
            self._entries = saved
