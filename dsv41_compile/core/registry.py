"""A process-wide table of extensions (model families, op rules, transitions) that refuses a
second entry under a key: a registration that silently replaced an earlier one would change
every later compile without a word."""

from __future__ import annotations

import hashlib
import marshal
from collections.abc import Hashable, Iterable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

__all__ = ["Registry", "code_fingerprint"]

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

    def fingerprint(self) -> str:
        """`code_fingerprint` of the entries, keys included: what a compile's cache key
        takes from this table."""
        return code_fingerprint(self._entries.items())

    @contextmanager
    def restored(self) -> Iterator[None]:
        """Within the block, registrations are undone at its end (tests, worked examples)."""
        saved = dict(self._entries)
        try:
            yield
        finally:
            self._entries = saved


def code_fingerprint(values: Iterable[object]) -> str:
    """A hash of `values` (nested in tuples): a function by its module and qualified name, and
    by its code where it lives outside this package (whose source the host cache hashes
    already: `runtime.host_cache`); anything else by its repr. A rule registered, removed or
    rewritten at run time (a user's, a test's) changes it; a closure's captured values do
    not."""
    digest = hashlib.sha256()
    stack = list(values)[::-1]
    while stack:
        value = stack.pop()
        if isinstance(value, tuple):
            stack.extend(reversed(value))
            continue
        code = getattr(value, "__code__", None)
        if code is None:
            digest.update(repr(value).encode())
            continue
        module = getattr(value, "__module__", None) or ""
        digest.update(f"{module}.{getattr(value, '__qualname__', '')}".encode())
        if module.split(".")[0] != __name__.split(".")[0]:
            digest.update(marshal.dumps(code))
    return digest.hexdigest()
