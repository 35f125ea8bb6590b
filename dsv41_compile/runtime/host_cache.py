"""What the ranks of one host share when they compile: a directory beside inductor's cache, and
host-wide locks in it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock

__all__ = ["cache_dir", "host_lock"]


def cache_dir() -> Path:
    """`<inductor's cache directory>/dsv41_compile` (TORCHINDUCTOR_CACHE_DIR moves both)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir

    path = Path(inductor_cache_dir()) / "dsv41_compile"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def host_lock(name: str) -> Iterator[None]:
    """Hold the host-wide lock `name` (one process of the host at a time)."""
    with FileLock(str(cache_dir() / f"{name}.lock")):
        yield
